"""The messages of one engine step: what the scheduler sends the runner, and what the runner sends back.

    SchedulerOutput   new requests in full (NewRequestData, with their RequestSampling), running ones as
                      columns of diffs (CachedRequestData), tokens to compute per request, finished and
                      preempted ids whose runner slots are freed
    RunnerOutput      per request that sampled: its new token(s), logprobs, top logprobs, drafts; per
                      request that asked (MoE): the routed experts of the positions that became final

A leaf: this module imports nothing else of the project, nor torch, so `rollout/` (which builds them) and
`runner/` (which reads them) share it without either importing the other. Everything here is plain data (but
an embedding prompt's rows, `NewRequestData.prompt_embeds`, which stay in one process):
`to_dict` / `from_dict` turn a message into JSON-ready values and back, which is how a step reaches the
worker ranks under tensor parallelism. Not here: how requests are chosen (rollout/scheduler.py) or run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestSampling:
    """How the runner samples one request: the device-side part of its SamplingParams, as plain values.

    A new per-request sampling setting is a field here, filled by `SamplingParams.runner_sampling` and read
    into the runner's per-slot arrays by `runner.input_batch.InputBatch.apply`.
    """

    temperature: float  # 0 = greedy
    top_k: int  # 0 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    seed: int  # uint32 seed of this sample's noise
    top_logprobs: int = 0  # top-N (token, logprob) pairs per position; 0 = none
    speculative: bool = True  # may speculate when the engine has a drafter
    return_routed_experts: bool = False  # MoE: report the top-k experts of every position it computes
    lora_slot: int = -1  # the LoRA adapter slot it samples with (runner.lora); -1: the base model


@dataclass(slots=True)
class NewRequestData:
    """A request entering the runner (first time, or again after preemption): everything in full."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSampling
    # an embedding prompt (rollout/prompt_embeds.py): its rows [num_prompt_tokens, hidden], a host torch tensor in
    # the model's dtype, fed instead of the embeddings of the prompt's placeholder token ids; None for a token
    # prompt. Never under tensor parallelism (the engine refuses it there: `to_dict` carries plain values only)
    prompt_embeds: Any = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests already in the runner, as columns (row i is one request): only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step ([] for most)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step, in batch order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # left since the last step (finished or aborted): free their slots
    preempted_req_ids: set[str]  # preempted since the last step: free their slots
    placeholders: dict[str, int] = field(default_factory=dict)  # async: req_id -> index of its placeholder

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def to_dict(self) -> dict:
        """JSON-ready plain values (sets as sorted lists)."""
        assert all(r.prompt_embeds is None for r in self.new_reqs), "prompt embeddings do not cross processes"
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["new_reqs"] = [
            {**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}, "sampling": dataclasses.asdict(r.sampling)}
            for r in self.new_reqs
        ]
        out["cached_reqs"] = {f.name: getattr(self.cached_reqs, f.name) for f in dataclasses.fields(CachedRequestData)}
        out["finished_req_ids"] = sorted(self.finished_req_ids)
        out["preempted_req_ids"] = sorted(self.preempted_req_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SchedulerOutput":
        data = dict(data)
        data["new_reqs"] = [NewRequestData(**{**r, "sampling": RequestSampling(**r["sampling"])}) for r in data["new_reqs"]]
        data["cached_reqs"] = CachedRequestData(**data["cached_reqs"])
        data["finished_req_ids"] = set(data["finished_req_ids"])
        data["preempted_req_ids"] = set(data["preempted_req_ids"])
        return cls(**data)


@dataclass(slots=True)
class RunnerOutput:
    """What the runner returns: for each request that sampled, its new tokens (1, or more when speculating).

    `routed_experts`, for each request that asked (`RequestSampling.return_routed_experts`) and has positions
    whose computation became final this step, whether it sampled or not: (first position, int32 numpy array
    [n, num_moe_layers, top_k]), the experts chosen at positions first .. first + n - 1, from the first position
    not reported yet up to the request's new computed count. A request (re)entering the runner reports from
    position 0 (prefix-cache hits come from the cached blocks); with speculative decoding only accepted
    positions are final. None when no request reports.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    num_draft_tokens: list[int] | None = None  # per sampled request, when speculating
    routed_experts: dict[str, tuple[int, Any]] | None = None  # req_id -> (first position, int32 [n, L_moe, k])
