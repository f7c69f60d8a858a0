"""What the engine returns: one `RequestOutput` per prompt, one `CompletionOutput` per sample.

Field names follow vLLM's, so code written against vLLM's `LLM.generate` reads these unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class CompletionOutput:
    """One sampled completion. All per-token lists have the length of `token_ids`."""

    index: int
    """Which of the prompt's n samples this is."""
    token_ids: list[int]
    logprobs: list[float] | None
    """Logprob of each sampled token under the distribution it was drawn from (see SamplingParams)."""
    finish_reason: str | None
    """"stop" (EOS, a stop token or a stop string), "length" (max_tokens / max_model_len), "abort", or None
    while running."""
    policy_versions: list[int]
    """The engine's policy_version when each token was sampled."""
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_preemptions: int = 0
    spec_decode_stats: dict | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the completion; None for EOS, length or abort."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """All samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache (summed over samples)."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
