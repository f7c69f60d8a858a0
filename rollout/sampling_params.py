"""Per-request sampling parameters.

`SamplingParams` is what a caller passes to `Engine.generate` / `Engine.add_request`. It checks its own
fields (a bad value is a `ValueError` that names the field) and knows nothing about devices or models.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runner.messages import RequestSampling


class RequestOutputKind(enum.IntEnum):
    """Which outputs the engine builds for a request (vLLM's names; rollout/output_processor.py builds them)."""

    CUMULATIVE = 0
    """Every output carries everything so far."""
    DELTA = 1
    """Each output carries only what is new since the request's previous output."""
    FINAL_ONLY = 2
    """One output, once every sample has finished."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    Sampling order (the same on CPU and GPU): logits / temperature -> top-k -> top-p -> min-p, then one
    Gumbel-max draw whose noise is a pure function of (seed, output position, token id). `temperature=0`
    means greedy. The logprob returned for a sampled token is the log-probability under the distribution
    the token was actually drawn from (after temperature and truncation, renormalised); for greedy it is
    the log-softmax of the raw logits.
    """

    n: int = 1
    """Number of completions of this prompt. They share the prompt's KV blocks and differ in their seeds."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th value kept); 0 or -1 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sums to at least top_p; in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times that of the most likely token; in [0, 1]."""
    max_tokens: int = 16
    """Most tokens to generate per completion (also capped by the engine's max_model_len)."""
    min_tokens: int = 0
    """Stop tokens and EOS among the first min_tokens generated tokens do not end the completion."""
    seed: int | None = None
    """Per-request seed: a seeded request yields the same tokens whatever else is in the batch."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion (the stop token is kept in the output)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion once the detokenized output contains one (needs the model's
    tokenizer.json). The token that completes the string is the last one kept in `token_ids` (and
    `logprobs`); `text` ends before the string unless `include_stop_str_in_output`."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of `text`."""
    ignore_eos: bool = False
    """Generate past the model's EOS token(s)."""
    logprobs: bool = True
    """Return the logprob of each sampled token."""
    top_logprobs: int = 0
    """Also return the top-N (token id, logprob) pairs of each position's sampling distribution."""
    skip_special_tokens: bool = True
    """Passed to the tokenizer when detokenizing."""
    speculative: bool = True
    """Let the engine speculate for this request when it has a drafter (outputs are distributed the same
    either way); False always decodes one token per step."""
    cache_salt: str | None = None
    """Prefix-cache salt: a request shares cached KV blocks only with requests of the same salt (None: with
    the unsalted ones), so one tenant cannot detect another's prompts by their cache hits. The n samples of
    one prompt always share their prompt's blocks. Outputs do not depend on it."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What `Engine.step` returns for this request (see RequestOutputKind). `Engine.generate` builds one final
    output and `AsyncEngine.stream` deltas, whatever this says."""
    add_special_tokens: bool = True
    """A text prompt is encoded with the special tokens the tokenizer's post-processor adds (BOS for Llama-style
    tokenizers), as the model's own tokenizer does; False encodes the text alone. Token-id prompts (a chat
    template's among them) are used as given."""
    spaces_between_special_tokens: bool = True
    """With `skip_special_tokens=False`: set each special token in `text` apart from the text around it by one
    space (vLLM's default, transformers' slow tokenizers); False: the tokenizer's plain decode
    (rollout/tokenizer.py says exactly what each gives). No effect while special tokens are skipped."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be 0/-1 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.top_logprobs < 0:
            raise ValueError(f"SamplingParams.top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError(f"SamplingParams.cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}") from None
        for name in ("add_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def runner_sampling(self, seed: int) -> RequestSampling:
        """What the runner needs of these settings for one sample (whose noise seed is `seed`)."""
        return RequestSampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                               seed=seed, top_logprobs=self.top_logprobs, speculative=self.speculative)
