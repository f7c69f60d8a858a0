"""One running sample: its tokens, its progress through the model, its KV blocks and its results.

A prompt with n samples becomes n `Request`s of one `RequestGroup`; sample j's id is
"<request_id>-<j>". The group makes later samples wait until the prompt's full blocks are computed once,
so all n share them through the prefix cache. Pure Python; no tensors (a sample that asked for its routed
experts keeps them in a numpy array, `RoutedExperts`), except an embedding prompt's rows (`RequestGroup.prompt_embeds`,
rollout/prompt_embeds.py), whose positions hold placeholder token ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rollout.detokenizer import StopStrings
    from rollout.loras import LoadedLora
    from rollout.prompt_embeds import PromptEmbeds


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class RoutedExperts:
    """The experts a MoE model routed one sample's positions to: int32 rows [position, num_moe_layers, top_k],
    written by position as the runner reports them (`write`), so a position computed again (after preemption)
    overwrites its row. Grows by doubling."""

    __slots__ = ("rows", "num_rows")

    def __init__(self, num_moe_layers: int, top_k: int, capacity: int) -> None:
        self.rows = np.zeros((max(1, capacity), num_moe_layers, top_k), dtype=np.int32)  # [capacity, L_moe, k]
        self.num_rows = 0  # positions 0 .. num_rows - 1 are reported (by the latest computation)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows of positions start .. start + len(rows) - 1; later positions are stale until reported again."""
        assert start <= self.num_rows, (start, self.num_rows)  # reports are contiguous, or restart lower
        end = start + rows.shape[0]
        if end > self.rows.shape[0]:
            grown = np.zeros((max(end, 2 * self.rows.shape[0]), *self.rows.shape[1:]), dtype=np.int32)
            grown[:start] = self.rows[:start]
            self.rows = grown
        self.rows[start:end] = rows
        self.num_rows = end

    def first(self, n: int) -> np.ndarray:
        """A copy of the rows of positions 0 .. n - 1 (fewer if fewer are reported)."""
        return self.rows[: min(n, self.num_rows)].copy()


@dataclass(eq=False)
class RequestGroup:
    """The n samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # an embedding prompt: one placeholder id per row (outputs report None)
    params: SamplingParams
    prompt_embeds: "PromptEmbeds | None" = None  # the prompt as embedding rows [T, hidden] instead of token ids
    members: list["Request"] = field(default_factory=list)
    prompt_blocks_ready: bool = False  # the prompt's full blocks are computed and cached
    num_finished: int = 0  # members that finished (counted by the scheduler)
    num_running: int = 0  # members RUNNING now (counted by the scheduler, so no per-member scan over the group)
    num_cached_prompt_tokens: int = 0  # members' num_cached_prompt_tokens, summed (kept by the scheduler)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.members)


@dataclass(eq=False)
class Request:
    req_id: str
    group: RequestGroup
    sample_index: int
    seed: int  # uint32 seed of this sample's noise
    max_tokens: int  # effective: min(params.max_tokens, max_model_len - prompt length)
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    token_limit: int = 0  # token count (prompt + output) that ends it by length; set by the scheduler
    num_placeholders: int = 0  # trailing -1 tokens standing for tokens of steps still in flight (async)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    block_keys: list = field(default_factory=list)  # prefix-cache chain keys of full blocks (memo)
    computing_upto: int = 0  # its prompt blocks [num_cached_blocks, computing_upto) count as being computed
    # extra prefix-cache keys, part of the first block's key (so of every block's chain): only requests with
    # equal cache_keys share KV blocks: ("cache_salt", salt) for a salted request, ("lora", name, load id) for one
    # of a LoRA adapter, ("prompt_embeds", sha256) for an embedding prompt
    cache_keys: tuple = ()
    kv_epoch: int = 0  # weight epoch its KV was computed under (blocks of older epochs are not cached)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    spec_stats: dict | None = None
    stop_strings: "StopStrings | None" = None  # when params.stop is set: set by the engine's OutputProcessor, it
    # reads the sample's incrementally decoded text
    stop_reason: int | str | None = None  # the stop token id or string that ended it; None for EOS / length
    routed_experts: RoutedExperts | None = None  # when params.return_routed_experts (set by the engine)
    lora: "LoadedLora | None" = None  # the adapter of params.lora, as loaded when the request was added

    @property
    def lora_slot(self) -> int:
        """The device slot of its adapter; -1 for the base model."""
        return -1 if self.lora is None else self.lora.slot

    def __post_init__(self) -> None:
        params = self.group.params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        self.stop_ids = eos | frozenset(params.stop_token_ids)  # tokens that end the sample (after min_tokens)

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def prompt_embeds(self):
        """The embedding prompt's rows [num_prompt_tokens, hidden] (host, the model's dtype), or None."""
        embeds = self.group.prompt_embeds
        return None if embeds is None else embeds.tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

