"""Persistent per-slot request state of the runner.

Each live request owns one row ("slot", `req_idx`) of preallocated `[max_num_seqs, ...]` arrays for as
long as it is in the runner. The scheduler sends new requests in full and running ones as diffs; this
class applies them. Per-step inputs are gathered from these rows by slot index (`gather`), so nothing is
rebuilt per request per step. Host arrays are numpy; the runner copies the gathered step inputs into its
persistent device buffers in one go.

Embedding prompts (`NewRequestData.prompt_embeds`): a slot keeps its prompt's rows (a host tensor) while the prompt
is being computed, and each step's `StepInputs.embeds` says which of its tokens take which rows instead of their
(placeholder) token's embedding; once a step completes the prompt the slot forgets them (a preempted request
re-enters with them). Steps without such slots do nothing of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runner.messages import SchedulerOutput


# The `RequestSampling` fields the runner keeps per slot: numpy dtype, and the value of an empty slot. A new
# per-request sampling setting is a field of RequestSampling (runner/messages.py), a line here, and what
# reads its array (the step's sampling tensors, runner/model_runner.py `_stage`).
SAMPLING_COLUMNS: dict[str, tuple[type, float]] = {
    "temperature": (np.float32, 1.0),
    "top_k": (np.int64, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "seed": (np.int64, 0),  # uint32 values
    "top_logprobs": (np.int64, 0),
    "lora_slot": (np.int64, -1),  # the adapter slot (-1: none); ModelRunner._stage makes it per-token
}


@dataclass(slots=True)
class StepInputs:
    """Host-side inputs of one step, in batch order (`batch_idx`)."""

    req_ids: list[str]
    slots: np.ndarray  # [B] int64, slot of each batch row
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, KV cache slot of each token
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    logits_indices: np.ndarray  # [R] int64, token index whose logits are sampled (requests that sample)
    sample_rows: np.ndarray  # [R] int64, batch rows that sample
    max_query_len: int
    max_seq_len: int
    embeds: "PromptEmbedRows | None" = None  # tokens fed with embedding-prompt rows; None: every token is looked up


@dataclass(slots=True)
class PromptEmbedRows:
    """The tokens of one step whose input embeddings are embedding-prompt rows rather than token lookups."""

    token_index: np.ndarray  # [E] int64, each such token's index in the step's flat token list
    rows: list[Any]  # host tensors [n_i, hidden] (sum n_i = E), the rows of token_index in order


class InputBatch:
    def __init__(self, *, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        S = max_num_seqs
        self.token_ids = np.zeros((S, max_model_len), dtype=np.int64)  # [S, max_model_len]
        self.num_tokens = np.zeros(S, dtype=np.int64)  # [S]
        self.num_prompt_tokens = np.zeros(S, dtype=np.int64)  # [S]
        self.num_computed_tokens = np.zeros(S, dtype=np.int64)  # [S]
        self.block_table = np.zeros((S, self.max_blocks_per_seq), dtype=np.int32)  # [S, max_blocks]
        self.num_blocks = np.zeros(S, dtype=np.int64)  # [S]
        # one [S] array per per-slot sampling setting, as attributes: self.temperature, self.top_k, ...
        for name, (dtype, empty) in SAMPLING_COLUMNS.items():
            setattr(self, name, np.full(S, empty, dtype=dtype))
        self.slot_epoch = np.zeros(S, dtype=np.int64)  # [S] bumped whenever a slot changes hands
        # [S] MoE routing replay: the slot's first position whose routed experts are not reported yet; -1 for
        # requests that did not ask (runner/model_runner.py gathers them after each step)
        self.routed_from = np.full(S, -1, dtype=np.int64)
        # slot -> its embedding prompt's rows [num_prompt_tokens, hidden] (host tensor), while the prompt is computed
        self.prompt_embeds: dict[int, Any] = {}
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(S - 1, -1, -1))

    # ---- applying the scheduler's diffs ----------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free_slots.append(slot)
                if self.prompt_embeds:
                    self.prompt_embeds.pop(slot, None)
        for new in sched.new_reqs:
            slot = self.free_slots.pop()
            self.slot_of[new.req_id] = slot
            self.slot_epoch[slot] += 1
            n = len(new.token_ids)
            self.token_ids[slot, :n] = new.token_ids
            self.num_tokens[slot] = n
            self.num_prompt_tokens[slot] = new.num_prompt_tokens
            self.num_computed_tokens[slot] = new.num_computed_tokens
            self.num_blocks[slot] = 0
            self._append_blocks(slot, new.block_ids)
            sampling = new.sampling
            for name in SAMPLING_COLUMNS:
                getattr(self, name)[slot] = getattr(sampling, name)
            self.routed_from[slot] = 0 if sampling.return_routed_experts else -1
            if new.prompt_embeds is not None and new.num_computed_tokens < new.num_prompt_tokens:
                assert new.prompt_embeds.shape[0] == new.num_prompt_tokens, (new.req_id, new.prompt_embeds.shape)
                self.prompt_embeds[slot] = new.prompt_embeds
        cached = sched.cached_reqs
        if cached.req_ids:
            slot_of = self.slot_of
            slots = np.fromiter((slot_of[r] for r in cached.req_ids), dtype=np.int64, count=len(cached.req_ids))
            self.num_computed_tokens[slots] = cached.num_computed_tokens
            for i, block_ids in enumerate(cached.new_block_ids):
                if block_ids:
                    self._append_blocks(int(slots[i]), block_ids)

    def _append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = self.num_blocks[slot]
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    # ---- gathering one step's inputs -------------------------------------------------------------
    def gather(self, sched: SchedulerOutput) -> StepInputs:
        req_ids = list(sched.num_scheduled_tokens)
        slots = np.fromiter((self.slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        n_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        start = self.num_computed_tokens[slots]  # [B]
        cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n_sched, out=cu[1:])
        total = int(cu[-1])
        row_of_token = np.repeat(np.arange(len(req_ids)), n_sched)  # [T]
        positions = start[row_of_token] + (np.arange(total) - cu[:-1][row_of_token])  # [T]
        token_slots = slots[row_of_token]
        input_ids = self.token_ids[token_slots, positions]
        blocks = self.block_table[token_slots, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        seq_lens = start + n_sched
        samples = seq_lens >= self.num_tokens[slots]
        sample_rows = np.nonzero(samples)[0]
        embeds = self._prompt_embed_rows(slots, start, n_sched, cu) if self.prompt_embeds else None
        return StepInputs(
            req_ids=req_ids,
            slots=slots,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            logits_indices=cu[1:][sample_rows] - 1,
            sample_rows=sample_rows,
            max_query_len=int(n_sched.max()) if len(req_ids) else 0,
            max_seq_len=int(seq_lens.max()) if len(req_ids) else 0,
            embeds=embeds,
        )

    def _prompt_embed_rows(self, slots: np.ndarray, start: np.ndarray, n_sched: np.ndarray,
                           cu: np.ndarray) -> PromptEmbedRows | None:
        """The embedding-prompt rows of the prompt positions this step computes (batch row b's tokens start at
        cu[b]); a slot whose prompt this step completes forgets its rows."""
        index, rows = [], []
        for slot, embeds in list(self.prompt_embeds.items()):
            hit = np.flatnonzero(slots == slot)
            if hit.size == 0:  # not scheduled this step
                continue
            b = int(hit[0])
            lo = int(start[b])
            hi = min(lo + int(n_sched[b]), embeds.shape[0])
            if lo < hi:
                index.append(np.arange(cu[b], cu[b] + hi - lo, dtype=np.int64))
                rows.append(embeds[lo:hi])
            if hi >= embeds.shape[0]:
                del self.prompt_embeds[slot]
        if not rows:
            return None
        return PromptEmbedRows(token_index=np.concatenate(index), rows=rows)

    def kv_slots(self, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """[sum(ends - starts)] int64: the KV-cache slot of every position in [starts[i], ends[i]) of each
        `slots[i]`, through its block table, concatenated in order."""
        lengths = ends - starts
        row = np.repeat(np.arange(slots.shape[0]), lengths)
        cu = np.zeros(slots.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        positions = starts[row] + (np.arange(int(cu[-1])) - cu[:-1][row])
        blocks = self.block_table[slots[row], positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def truncation_uses(self, slots: np.ndarray, vocab_size: int) -> tuple[bool, bool, bool]:
        """Whether any of these slots samples with (top-k, top-p, min-p)."""
        top_k = self.top_k[slots]
        return (bool(((top_k > 0) & (top_k < vocab_size)).any()), bool((self.top_p[slots] < 1.0).any()),
                bool((self.min_p[slots] > 0.0).any()))

    def append_sampled(self, slots: np.ndarray, tokens: list[list[int]]) -> None:
        """Append each row's sampled tokens to its slot."""
        if all(len(t) == 1 for t in tokens):  # one token per row: vectorised
            self.token_ids[slots, self.num_tokens[slots]] = [t[0] for t in tokens]
            self.num_tokens[slots] += 1
            return
        for slot, toks in zip(slots.tolist(), tokens):
            n = self.num_tokens[slot]
            self.token_ids[slot, n : n + len(toks)] = toks
            self.num_tokens[slot] = n + len(toks)
