"""What the engine returns: one `RequestOutput` per prompt, one `CompletionOutput` per sample.

Field names follow vLLM's, so code written against vLLM's `LLM.generate` reads these unchanged. An output is
cumulative (everything so far) or a delta (only what is new since the prompt's previous output), as the
request's `SamplingParams.output_kind` says; `RequestOutput.add` folds deltas into a cumulative output.
rollout/output_processor.py builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(kw_only=True, slots=True)
class CompletionOutput:
    """One sampled completion (or, in a delta output, what it has new). All per-token lists have the length
    of `token_ids`."""

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
    """The detokenized output (None without a tokenizer): mid-stream, all but a trailing partial character
    and any end that could still begin a stop string; finished, cut before a matched stop string (after it
    with include_stop_str_in_output)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_preemptions: int = 0
    spec_decode_stats: dict | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the completion; None for EOS, length or abort."""
    routed_experts: "np.ndarray | None" = None
    """With `SamplingParams.return_routed_experts` (MoE models): int32 [P + L - 1, num_moe_layers, top_k] for P
    prompt tokens and L = len(token_ids) generated ones: row t holds the top-k experts (in the router's order,
    most probable first) chosen at each MoE layer for input position t, i.e. the prompt and every generated token
    but the last — what a trainer's forward over prompt + completion replays (its row t routes the token at
    position t). Rows of positions served from the prefix cache are those of the computation that filled the
    blocks (so the n samples share the rows of their prompt's full blocks). Cumulative and final outputs carry
    it; a DELTA output carries it only in the sample's last delta (the one with finish_reason), whole (prompt
    rows included), and None before. A sample without a token yet (still computing its prompt, or aborted
    before its first token) has only the rows of the positions computed so far. None when not asked for."""
    lora: str | None = None
    """The LoRA adapter that sampled this completion (`SamplingParams.lora`); None: the base model."""
    lora_versions: list[int] | None = None
    """With an adapter: its version (0 at load, + 1 per push) when each token was sampled, next to
    `policy_versions` (the engine's version, which every push, base or adapter, moves); None without one."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: "CompletionOutput") -> None:
        """Append the next delta of this sample (its per-token lists and text; its latest scalars)."""
        self.token_ids.extend(delta.token_ids)
        self.policy_versions.extend(delta.policy_versions)
        if delta.lora_versions is not None:
            self.lora_versions = self.lora_versions or []
            self.lora_versions.extend(delta.lora_versions)
        self.lora = delta.lora
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            self.top_logprobs = self.top_logprobs or []
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.text is not None:
            self.text = (self.text or "") + delta.text
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.num_preemptions, self.spec_decode_stats = delta.num_preemptions, delta.spec_decode_stats
        if delta.routed_experts is not None:  # a sample's last delta carries them whole
            self.routed_experts = delta.routed_experts


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """All samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    """The prompt's token ids; None for an embedding prompt ({"prompt_embeds": ...}, vLLM's), which has none."""
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache (summed over samples)."""
    finished: bool = False
    """Every sample has finished: the prompt's last output. (A delta output's `outputs` are only the samples
    that changed, so this is not a property of them.)"""

    def add(self, delta: "RequestOutput") -> None:
        """Fold the next delta output of this prompt into this one, which then reads as the cumulative output
        (samples in index order; a sample first seen in `delta` is added)."""
        mine = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = mine.get(d.index)
            if c is None:
                c = mine[d.index] = CompletionOutput(index=d.index, token_ids=[], logprobs=None, finish_reason=None,
                                                     policy_versions=[])
                self.outputs.append(c)
            c.add(d)
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
