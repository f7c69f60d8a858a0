"""CUDA-graph capture of uniform speculative decode steps, and the static-shape step the graphs hold.

A step is uniform when every request of the batch decodes (one uncomputed token, so it samples) and
drafts the same number d of tokens, 0 <= d <= k: every row has exactly d + 1 query tokens. Such a batch of
B rows is padded to the next capture size P (`runner.cuda_graph.capture_sizes`, among those whose
P * (d + 1) tokens fit the step buffers) and run by `static_step(P, d)`, whose shapes depend on (P, d) only:

    h = draft_hidden[sample_slots]           [P, H] each row's drafter state (padding rows: scratch row S)
    d times: LM head, sample_draft,          one token per row, every row active (as the eager `_propose`);
             drafter step                    the draft is written straight into the step's input ids and q
                                             into [P, d, V]; the look-ahead steps' rope positions, context
                                             lengths and KV slots come from one stack of buffer views
    hidden, aux = target(input ids)          [P * (d + 1), H], q_len d + 1, attention grid for max_model_len
    rejection_sample (d > 0) | sampler       output_ids [P, d + 1], num_accepted [P], logprobs [P, d + 1]
    catch-up drafter over every position     next tokens = output_ids (-1 -> 0); draft_hidden[sample_slots] =
                                             its output at the last accepted position

On CUDA, sample_draft and rejection_sample are two and three Triton launches (`rejection_kernel.py`), so besides
the models' own kernels a step launches only a handful of indexing ops (tests/test_spec_decode.py counts
them). Per-(P, d) constants (each row's first token index, the draft counts) are made by the first call,
a warm-up outside any capture.

Every input comes from persistent device buffers: the runner's `StepBuffers` (tokens, positions, KV
slots, query offsets, context lengths, full-width block tables, sampling parameters), where `sample_slots`
holds each row's draft_hidden row, filled with the usual three non-blocking copies. Padded rows are a
request of d + 1 tokens at positions 0..d whose block table is all block 0 and whose KV slots are -1: they
read finite cache entries, write no KV and only touch the scratch state row; their outputs are dropped.
Nothing in the step waits for the device or has a data-dependent shape.

On CUDA (`capture=True`) each (P, d) is captured lazily, the first time a uniform step of that shape
occurs, or up front with `capture_all` (the benchmark does, so no capture falls into a timed run).
Warm-up and capture run over an all-padding batch (so they change no request's KV or drafter state), then
the real step is staged and replayed. All graphs share one memory pool; KV cache sizing counts the largest
one (`probe_bytes`). With capture=False the same function runs eagerly (the CPU tests check it against the
eager runner this way).

Not here (run eagerly by `SpeculativeRunner.execute`): batches whose rows draft different counts (a row
that opted out or is near its length limit, next to drafting rows), prefill chunks, top-N logprobs, and
rows with top-k / top-p / min-p (`processed_logits_ref` makes a host constant, which stream capture does
not allow).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from runner.attention import AttentionMetadata
from runner.cuda_graph import capture, capture_sizes
from runner.input_batch import StepInputs
from runner.sampling_tensors import NO_TRUNCATION
from runner.spec_decode.drafter import rope_for
from runner.spec_decode.rejection import rejection_sample, sample_draft
from runner.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


class SpecDecodeGraphs:
    def __init__(self, spec, capture: bool) -> None:
        r = spec.runner
        self.spec = spec
        self.capture = capture
        """True: capture and replay CUDA graphs; False: run `static_step` eagerly."""
        self.sizes = capture_sizes(r.config.max_num_seqs)
        self.max_tokens = r.buffers.input_ids.shape[0]
        self.scratch_row = r.config.max_num_seqs  # draft_hidden row of padding rows
        self.row_index = torch.arange(self.sizes[-1] + 1, dtype=torch.int64, device=r.device)  # [max P + 1]
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (P, d, lora) -> graph
        self.outputs: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.lora_variants = (True, False) if r.lora is not None else (False,)  # the `lora` keys captured
        self.pool = None
        self.constants: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (P, d) -> _constants
        self.num_steps: Counter[tuple[int, int, bool]] = Counter()
        """Steps run through this path, per (P, d, lora)."""

    def padded_size(self, num_reqs: int, num_drafts: int) -> int | None:
        """The capture size a uniform batch of `num_reqs` rows with `num_drafts` drafts each runs at, or None."""
        return next((s for s in self.sizes if s >= num_reqs and s * (num_drafts + 1) <= self.max_tokens), None)

    def run(self, inputs: StepInputs, num_drafts: int, size: int,
            lora: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One uniform step of B rows padded to `size`: (output_ids [B, d + 1], num_accepted [B],
        logprobs [B, d + 1]) on the device, valid until the next step. `lora`: some row has an adapter (the
        variant whose target forward runs the LoRA hooks; a step with adapter rows must not take lora=False)."""
        assert lora in self.lora_variants, "lora=True needs a runner with LoRA slots"
        key = (size, num_drafts, lora)
        if self.capture and key not in self.graphs:
            self._capture(size, num_drafts, lora)
        self._stage(inputs, num_drafts, size)
        if self.capture:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self.static_step(size, num_drafts, lora)
        self.num_steps[key] += 1
        B = inputs.slots.shape[0]
        return out[0][:B], out[1][:B], out[2][:B]

    def capture_all(self, max_num_reqs: int, draft_counts: list[int]) -> float:
        """Capture now every (P, d) that uniform batches of up to `max_num_reqs` rows drafting d in
        `draft_counts` run at, with LoRA slots in both LoRA variants (otherwise each is captured on first use).
        Returns seconds."""
        assert self.capture
        start = time.perf_counter()
        for d in draft_counts:
            top = self.padded_size(max_num_reqs, d)  # None: the sizes that fit the step buffers
            fits = [s for s in self.sizes if s * (d + 1) <= self.max_tokens and (top is None or s <= top)]
            for size in reversed(fits):  # largest first: the smaller graphs reuse its pool
                for lora in self.lora_variants:
                    if (size, d, lora) not in self.graphs:
                        self._capture(size, d, lora)
        return time.perf_counter() - start

    def probe_bytes(self) -> int:
        """Device bytes the largest graph (max size, k drafts, with LoRA slots the LoRA variant) takes, measured
        by capturing it over the profiling KV cache and releasing it again (for KV cache sizing; the graphs
        share its pool)."""
        d = self.spec.k
        size = max((s for s in self.sizes if s * (d + 1) <= self.max_tokens), default=None)
        if size is None:
            return 0
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.spec.runner.device)[0]
        self._capture(size, d, self.lora_variants[0])
        used = free_before - torch.cuda.mem_get_info(self.spec.runner.device)[0]
        self.release()
        return max(0, used)

    def release(self) -> None:
        """Drop the graphs (they hold the drafter's parameters; a new drafter needs new graphs)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    # ---- inputs ----------------------------------------------------------------------------------------
    def _stage(self, inputs: StepInputs, num_drafts: int, size: int) -> None:
        """Stage the step's rows and the padding rows up to `size`, then upload (three non-blocking copies)."""
        r = self.spec.runner
        r._stage(inputs)
        StepBuffers.put(r.buffers.host.sample_slots, inputs.slots)
        self._fill_padding(inputs.slots.shape[0], size, num_drafts)
        r.buffers.upload(size)

    def _fill_padding(self, start: int, end: int, num_drafts: int) -> None:
        """Make rows [start, end) padding rows of num_drafts + 1 tokens in the host staging."""
        h, K1 = self.spec.runner.buffers.host, num_drafts + 1
        tokens = slice(start * K1, end * K1)
        h.query_start_loc[start : end + 1] = np.arange(start, end + 1) * K1
        h.input_ids[tokens] = 0
        h.positions[tokens] = np.tile(np.arange(K1), end - start)
        h.slot_mapping[tokens] = -1
        h.seq_lens[start:end] = K1
        h.block_tables[start:end] = 0
        self.spec.runner.buffers.pad_sampling(start, end)
        h.sample_slots[start:end] = self.scratch_row
        if self.spec.runner.lora is not None:
            h.lora_idx[tokens] = -1  # padding rows take no adapter

    # ---- the step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def static_step(self, size: int, num_drafts: int,
                    lora: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The uniform step over the first `size` rows of the step buffers (what a graph captures); `lora`: the
        target forward runs the LoRA hooks over the step's per-token slots (the drafter has no adapters).

        Returns (output_ids int64 [P, d + 1] with -1 after each row's last new token, num_accepted int64 [P],
        logprobs f32 [P, d + 1], unspecified after the last new token)."""
        spec, r = self.spec, self.spec.runner
        b, target, drafter = r.buffers, r.model, spec.drafter
        P, d, K1 = size, num_drafts, num_drafts + 1
        T = P * K1
        ids, positions, slots = b.input_ids[:T], b.positions[:T], b.slot_mapping[:T]
        sampling, state = b.sampling(P, NO_TRUNCATION), b.sample_slots[:P]  # views of the step buffers
        meta = self._meta(b.query_start_loc[: P + 1], b.seq_lens[:P], slots, K1)
        row_start, counts = self._constants(P, d)
        if d:
            drafts = ids.view(P, K1)[:, 1:]  # [P, d] the drafts go straight into the step's input ids
            q = torch.empty(P, d, r.model_config.vocab_size, dtype=torch.float32, device=r.device)
            h = spec.draft_hidden[state]  # [P, H]
            if d > 1:  # look-ahead j: rope position, context length and KV slot of the row's token j, each [P]
                grid = positions.view(P, K1), slots.view(P, K1)
                ahead = torch.stack([grid[0][:, : d - 1].T, grid[0][:, 1:d].T, grid[1][:, : d - 1].T])  # [3, d - 1, P]
            for j in range(d):
                sample_draft(target.compute_logits(h), sampling, offset=j, out=(drafts[:, j], q[:, j]))
                if j + 1 < d:  # the drafter reads its own output as h at the positions not verified yet
                    meta_j = self._meta(self.row_index[: P + 1], ahead[1, j], ahead[2, j], 1)
                    h = drafter(target.model.embed_tokens(drafts[:, j]), h, rope_for(target, ahead[0, j], h.dtype), meta_j)
        with r._adapters(T, lora):
            hidden, aux = target.forward_with_aux(ids, positions, meta, drafter.aux_layers)
        logits = target.compute_logits(hidden)  # [T, V]
        if d:
            output_ids, num_accepted, logprobs, _ = rejection_sample(logits.view(P, K1, -1), drafts, q, counts, sampling)
            # the token after each position: right up to each row's stop; after it the drafter's KV is rolled back
            next_ids = output_ids.clamp(min=0).view(T)
            stop = row_start + num_accepted  # [P] flat index of each row's last accepted position
        else:
            tokens, token_logprobs, _ = r.sampler(logits, sampling)
            output_ids, logprobs, num_accepted = tokens[:, None], token_logprobs[:, None], counts
            next_ids, stop = tokens, row_start
        spec.catch_up(next_ids, positions, meta, hidden, aux, stop, state)
        return output_ids, num_accepted, logprobs

    def _constants(self, size: int, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index of each row's first token [P], num_drafts [P]) int64, made once per (P, d) outside
        any capture (the first call is a warm-up)."""
        key = (size, num_drafts)
        if key not in self.constants:
            start = self.row_index[:size] * (num_drafts + 1)
            self.constants[key] = (start, torch.full_like(start, num_drafts))
        return self.constants[key]

    def _meta(self, query_start_loc, seq_lens, slot_mapping, max_query_len: int) -> AttentionMetadata:
        """Metadata over the full-width block tables with the grid sized for max_model_len (static shapes)."""
        r = self.spec.runner
        return AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=r.buffers.block_tables[: seq_lens.shape[0]], slot_mapping=slot_mapping, max_query_len=max_query_len, max_seq_len=r.max_model_len,
            deterministic=r.config.deterministic,
        )

    # ---- capture -------------------------------------------------------------------------------------------
    def _capture(self, size: int, num_drafts: int, lora: bool) -> None:
        """Capture (size, num_drafts, lora) over an all-padding batch. The warm-up runs outside the capture compile
        the kernels; neither they nor the capture touch a request's KV or drafter state."""
        start = time.perf_counter()
        self._fill_padding(0, size, num_drafts)
        self.spec.runner.buffers.upload(size)
        torch.cuda.synchronize()
        graph, out = capture(lambda: self.static_step(size, num_drafts, lora), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        self.graphs[(size, num_drafts, lora)] = graph
        self.outputs[(size, num_drafts, lora)] = out
        logger.info("captured speculative decode graph (batch %d, %d drafts, LoRA %s) in %.2f s", size, num_drafts,
                    lora, time.perf_counter() - start)
