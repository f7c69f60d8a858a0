"""Per-request sampling parameters.

`SamplingParams` is what a caller passes to `Engine.generate` / `Engine.add_request`. It checks its own
fields (a bad value is a `ValueError` that names the field and the rule: a number must be a finite number of
the field's type, and bool is not an integer here) and knows nothing about devices or models (the prompt's
vocabulary and length are checked by the engine).
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from runner.messages import RequestSampling


MAX_CACHE_SALT_CHARS = 256
"""Longest `SamplingParams.cache_salt` (an unbounded salt would let one request make the prefix cache's hashing
arbitrarily slow); a server may bound it lower."""


def _integer(name: str, value, rule: str) -> int:
    """`value` as an int, or a ValueError naming the field and the rule (bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"SamplingParams.{name} must be an integer {rule}, got {value!r}")
    return int(value)


def _finite(name: str, value, rule: str) -> float:
    """`value` as a float, or a ValueError naming the field and the rule (bool, strings, NaN and inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number {rule}, got {value!r}")
    return float(value)


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
    return_routed_experts: bool = False
    """MoE models (routing replay, R3): each completion's `routed_experts` holds the top-k experts the engine's
    router chose at every MoE layer for every position it ran as input (the prompt and every generated token
    but the last), so a trainer's forward can use the rollout's experts. A dense model, or an engine with
    `EngineConfig.enable_return_routed_experts` off, refuses the request."""
    lora: str | None = None
    """The name of a LoRA adapter the engine has loaded (`Engine.load_lora`) to sample with; None: the base
    model. An unknown name is refused when the request is added. Requests of different adapters (and the base)
    share a batch, never prefix-cache blocks; each output records its adapter and the adapter's version per
    token (`CompletionOutput.lora`, `lora_versions`)."""

    def __post_init__(self) -> None:
        self.n = _integer("n", self.n, ">= 1")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n}")
        self.temperature = _finite("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        self.top_k = _integer("top_k", self.top_k, ">= 1, or 0 / -1 (off)")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 1, or 0 / -1 (off), got {self.top_k}")
        self.top_p = _finite("top_p", self.top_p, "in (0, 1]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be a finite number in (0, 1], got {self.top_p}")
        self.min_p = _finite("min_p", self.min_p, "in [0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be a finite number in [0, 1], got {self.min_p}")
        self.max_tokens = _integer("max_tokens", self.max_tokens, ">= 1")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens}")
        self.min_tokens = _integer("min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"SamplingParams.min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self.top_logprobs = _integer("top_logprobs", self.top_logprobs, ">= 0")
        if self.top_logprobs < 0:
            raise ValueError(f"SamplingParams.top_logprobs must be an integer >= 0, got {self.top_logprobs}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, "or None")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be a list of integers >= 0, got {t!r} in it")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"SamplingParams.stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        for name in ("include_stop_str_in_output", "ignore_eos", "logprobs", "skip_special_tokens", "speculative",
                     "add_special_tokens", "spaces_between_special_tokens", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool (true or false), got {getattr(self, name)!r}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                raise ValueError(f"SamplingParams.cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
            if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
                raise ValueError(f"SamplingParams.cache_salt must be at most MAX_CACHE_SALT_CHARS={MAX_CACHE_SALT_CHARS} "
                                 f"characters, got {len(self.cache_salt)}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"SamplingParams.lora must be a non-empty adapter name or None, got {self.lora!r}")
        if isinstance(self.output_kind, bool) or not isinstance(self.output_kind, (RequestOutputKind, int)):
            raise ValueError(f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def runner_sampling(self, seed: int, lora_slot: int = -1) -> RequestSampling:
        """What the runner needs of these settings for one sample (whose noise seed is `seed`; `lora_slot`: the
        device slot of its adapter, -1 for none)."""
        return RequestSampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                               seed=seed, top_logprobs=self.top_logprobs, speculative=self.speculative,
                               return_routed_experts=self.return_routed_experts, lora_slot=lora_slot)
