"""One speculative engine step on the device: draft, verify in one target forward, catch the drafter up.

    execute(sched)                        (ModelRunner.execute hands over after applying the diffs)
      inputs = input_batch.gather()       a drafting row has 1 + d scheduled tokens: its last token and
                                          d look-ahead slots (the scheduler gave it the blocks)
      propose: d draft tokens per row     drafter steps from the slot's saved drafter state; drafts are
                                          written into the device input ids (never to the host)
      hidden, aux = target(inputs)        verifies every row's k + 1 positions at once (q_len = d + 1)
      rejection_sample(...)               accepted drafts + one resampled / bonus token per row
      catch-up: drafter over every token  input (next token, target hidden) at each computed position;
                of the step               saves each sampling slot's state at its last accepted position
      one copy of results to the host     the step's only sync

KV of rejected positions stays in the request's blocks; the scheduler rolls the computed count back
(`RunnerOutput.num_draft_tokens`), so the next step overwrites it. The drafter's own one-layer KV uses
the target's block tables and slot mapping. Drafter KV in prefix-cache blocks shared from another request
is reused as is (its entry at a block's last position may have seen a different next token); that can
only lower acceptance, never change outputs.

Uniform decode steps (every row decodes and drafts the same count, no truncation, no top-N logprobs) take
the static-shape path of `graphs.py` instead: on CUDA a captured graph per padded batch size and draft
count (not with `enforce_eager`), which computes the same tokens as the steps below (on CUDA both sample
drafts and verify batches without truncation or top-N logprobs through the same Triton kernels,
`rejection.py`). Everything else runs eagerly here. Not here: how many tokens to draft (the scheduler and the engine's auto-off controller).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.common import upload
from runner.messages import RunnerOutput, SchedulerOutput
from runner.attention import AttentionMetadata
from runner.spec_decode.drafter import Drafter, load_drafter, new_drafter, rope_for
from runner.spec_decode.graphs import SpecDecodeGraphs
from runner.spec_decode.rejection import rejection_sample, sample_draft


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host index array of the step on `device`, without blocking the host (`kernels.common.upload`)."""
    return upload(torch.from_numpy(np.ascontiguousarray(array)), device)


class SpeculativeRunner:
    def __init__(self, runner) -> None:
        cfg = runner.config.speculative
        assert cfg is not None
        self.runner = runner
        self.k = cfg.num_speculative_tokens
        if cfg.drafter is not None:
            self.drafter: Drafter = load_drafter(cfg.drafter, runner.model_config, runner.dtype, runner.device,
                                                 runner.backend)
            if self.drafter.config.method != cfg.method:
                raise ValueError(f"{cfg.drafter} holds a {self.drafter.config.method!r} drafter, config asks for {cfg.method!r}")
        else:
            self.drafter = new_drafter(cfg.method, runner.model_config, runner.dtype, runner.device, runner.backend,
                                       seed=runner.config.seed)
        self.drafter.eval()
        S, H = runner.config.max_num_seqs, runner.model_config.hidden_size
        # [S + 1, H] drafter state after each slot's last accepted position; row S: graph padding rows' scratch
        self.draft_hidden = torch.zeros(S + 1, H, dtype=runner.dtype, device=runner.device)
        self.enabled = np.zeros(S, dtype=bool)  # [S] the slot's request speculates
        self.graphs: SpecDecodeGraphs | None = None  # uniform decode steps through CUDA graphs (graphs.py)
        if runner.device.type == "cuda" and not runner.config.enforce_eager:
            self.graphs = SpecDecodeGraphs(self, capture=True)

    # ---- KV cache ------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        cfg, r = self.runner.model_config, self.runner
        return 2 * r.block_size * cfg.num_kv_heads * cfg.head_dim * (torch.finfo(r.dtype).bits // 8)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg, r = self.runner.model_config, self.runner
        shape = (num_blocks, r.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = tuple(torch.zeros(shape, dtype=r.dtype, device=r.device) for _ in range(2))
        self.drafter.bind_kv_cache(*self.kv_cache)
        if self.graphs is not None:  # captured against the old caches
            self.graphs.release()

    def free_kv_cache(self) -> None:
        """Drop the drafter's KV cache and the graphs captured against it (`allocate_kv_cache` restores)."""
        self.kv_cache = (None, None)
        self.drafter.bind_kv_cache(*self.kv_cache)
        if self.graphs is not None:
            self.graphs.release()

    def replace_drafter(self, drafter: Drafter) -> None:
        """Serve `drafter` from the next step on (it takes over the existing drafter KV cache)."""
        drafter.bind_kv_cache(*self.kv_cache)
        self.drafter = drafter.eval()
        if self.graphs is not None:
            self.graphs.release()

    # ---- one step ------------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        r, ib, b = self.runner, self.runner.input_batch, self.runner.buffers
        target, dev = r.model, r.device
        for new in sched.new_reqs:
            self.enabled[ib.slot_of[new.req_id]] = new.sampling.speculative
        inputs = ib.gather(sched)
        routed = r.routed_plan(inputs)  # MoE routing replay: the rows to report, cut to the accepted ones in _finish
        T = inputs.input_ids.shape[0]
        cu = inputs.query_start_loc.astype(np.int64)  # [B + 1]
        rows = inputs.sample_rows  # [R] batch rows that sample
        R = rows.shape[0]
        slots_r = inputs.slots[rows]  # [R]
        n_sched = cu[1:] - cu[:-1]  # [B]
        num_drafts = n_sched[rows] - (ib.num_tokens[slots_r] - ib.num_computed_tokens[slots_r])  # [R]
        assert (num_drafts >= 0).all() and self.enabled[slots_r[num_drafts > 0]].all()
        K = int(num_drafts.max()) if R else 0
        top_n = int(ib.top_logprobs[slots_r].max()) if R else 0
        uses = ib.truncation_uses(slots_r, r.model_config.vocab_size)
        uses_lora = r.uses_lora(inputs)

        size = self._graph_size(inputs, n_sched, num_drafts, K, top_n, uses)
        if size is not None:
            output_ids, num_accepted, logprobs = self.graphs.run(inputs, K, size, uses_lora)
            if routed is not None:
                r.routed_launch(routed, final=False)
            return self._finish(inputs, output_ids, num_accepted, logprobs, None, num_drafts, routed)

        meta = r.prepare(inputs)
        if K > 0:
            drafts, q = self._propose(inputs, num_drafts, R, K)  # [R, K], [R, K, V]
            d_rows, d_j = np.nonzero(np.arange(K)[None, :] < num_drafts[:, None])
            flat = _upload(cu[rows[d_rows]] + 1 + d_j, dev)
            b.input_ids[flat] = drafts[_upload(d_rows, dev), _upload(d_j, dev)]

        with r._adapters(T, uses_lora):  # the target verifies with each row's adapter; the drafter has none
            hidden, aux = target.forward_with_aux(b.input_ids[:T], b.positions[:T], meta, self.drafter.aux_layers)
        if routed is not None:
            r.routed_launch(routed, final=False)

        last = cu[rows + 1] - 1  # [R] flat index of each sampling row's last token
        if R:
            sampling = b.sampling(R, uses, top_n)
            if K == 0:
                tokens, logprobs, top = r.sampler(target.compute_logits(hidden[b.logits_indices[:R]]), sampling)
                output_ids, logprobs = tokens[:, None], logprobs[:, None]  # [R, 1]
                num_accepted = torch.zeros(R, dtype=torch.int64, device=dev)
                top = None if top is None else (top[0][:, None], top[1][:, None])
            else:
                idx = np.minimum((last - num_drafts)[:, None] + np.arange(K + 1)[None, :], last[:, None])  # [R, K + 1]
                logits = target.compute_logits(hidden[_upload(idx.reshape(-1), dev)])
                output_ids, num_accepted, logprobs, top = rejection_sample(
                    logits.view(R, K + 1, -1), drafts, q, _upload(num_drafts, dev), sampling,
                )
        pending = np.setdiff1d(np.arange(cu.shape[0] - 1), rows)  # rows still prefilling
        prompt_next = None
        if pending.shape[0]:
            known = ib.token_ids[inputs.slots[pending], inputs.seq_lens[pending].astype(np.int64)]  # next prompt token
            prompt_next = (_upload(cu[pending + 1] - 1, dev), _upload(known, dev))
        ids = b.input_ids[:T]
        if R == 0:
            self.catch_up(self.next_tokens(ids, prompt_next=prompt_next), b.positions[:T], meta, hidden, aux)
            return RunnerOutput(req_ids=[], sampled_token_ids=[],
                                routed_experts=None if routed is None else r.routed_finish(routed, routed.ends))
        stop = _upload(last - num_drafts, dev) + num_accepted  # [R] flat index of each row's last accepted position
        next_ids = self.next_tokens(ids, stop, output_ids.gather(1, num_accepted[:, None])[:, 0], prompt_next)
        self.catch_up(next_ids, b.positions[:T], meta, hidden, aux, stop, _upload(slots_r, dev))
        return self._finish(inputs, output_ids, num_accepted, logprobs, top, num_drafts, routed)

    def _graph_size(self, inputs, n_sched, num_drafts, K, top_n, uses) -> int | None:
        """The padded size when this step takes the static-shape path (`graphs.py`), else None: every row
        decodes and drafts K tokens, no top-N logprobs, no truncation, and a capture size fits."""
        if self.graphs is None or top_n > 0 or any(uses):
            return None
        B = inputs.slots.shape[0]
        if num_drafts.shape[0] != B or not (num_drafts == K).all() or not (n_sched == K + 1).all():
            return None
        return self.graphs.padded_size(B, K)

    def _propose(self, inputs, num_drafts: np.ndarray, R: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft up to K tokens for each sampling row (row r: num_drafts[r]); returns ([R, K], q [R, K, V])."""
        r, ib, b = self.runner, self.runner.input_batch, self.runner.buffers
        target, dev = r.model, r.device
        V = r.model_config.vocab_size
        slots_r = inputs.slots[inputs.sample_rows]  # [R]
        drafts = torch.zeros(R, K, dtype=torch.int64, device=dev)
        q = torch.zeros(R, K, V, dtype=torch.float32, device=dev)
        h = self.draft_hidden[_upload(slots_r, dev)]  # [R, H]
        last_pos = ib.num_tokens[slots_r] - 1  # [R] position of each row's last token
        sampling = b.sampling(R)
        for j in range(K):
            act = np.nonzero(num_drafts > j)[0]
            act_t = _upload(act, dev)
            tokens, q_j = sample_draft(target.compute_logits(h[act_t]),
                                       sampling[act_t].replace(uses=ib.truncation_uses(slots_r[act], V)), offset=j)
            drafts[act_t, j] = tokens
            q[act_t, j] = q_j
            nxt = np.nonzero(num_drafts > j + 1)[0]
            if nxt.shape[0] == 0:
                continue
            # the drafter reads its own output as h at the positions the target has not verified yet
            nxt_t = _upload(nxt, dev)
            positions = last_pos[nxt] + j  # [A]
            meta = self._single_token_meta(slots_r[nxt], positions)
            pos_t = _upload(positions, dev)
            h[nxt_t] = self.drafter(target.model.embed_tokens(drafts[nxt_t, j]), h[nxt_t],
                                    rope_for(target, pos_t, h.dtype), meta)
        return drafts, q

    def _single_token_meta(self, slots: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """Attention metadata of one query token per row at `positions` [A] (drafter look-ahead steps)."""
        ib, dev, bs = self.runner.input_batch, self.runner.device, self.runner.block_size
        n = slots.shape[0]
        seq_lens = positions + 1
        max_blocks = -(-int(seq_lens.max()) // bs)
        slot_mapping = ib.block_table[slots, positions // bs].astype(np.int64) * bs + positions % bs
        return AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=_upload(seq_lens.astype(np.int32), dev),
            block_tables=_upload(ib.block_table[slots, :max_blocks], dev),
            slot_mapping=_upload(slot_mapping, dev),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            deterministic=self.runner.config.deterministic,
        )

    @staticmethod
    def next_tokens(ids, stop=None, stop_tokens=None, prompt_next=None) -> torch.Tensor:
        """The token after each position of an eagerly run step, int64 [T] (the input of `catch_up`).

        ids [T]: the step's tokens (drafts included). stop [R]: flat index of each sampling row's last
        accepted position, stop_tokens [R]: the new token after it (both None: no row samples).
        prompt_next: (flat index [A], token [A]) of prefilling rows' last token and the prompt token after
        it. Positions after a row's stop get a wrong next token; their drafter KV is rolled back with the
        target's."""
        next_ids = torch.zeros_like(ids)
        next_ids[:-1] = ids[1:]
        if prompt_next is not None:
            next_ids[prompt_next[0]] = prompt_next[1]
        if stop is not None:
            next_ids[stop] = stop_tokens
        return next_ids

    def catch_up(self, next_ids, positions, meta, hidden, aux, stop=None, state=None) -> None:
        """Run the drafter over every token of the step with the token after it; save the sampling rows' state.

        next_ids, positions [T]: the token after each position (right at least up to each row's stop) and
        the positions. stop [R]: flat index of each sampling row's last accepted position, state [R]: the
        draft_hidden rows to save its drafter output to (None: no row samples). No host sync.
        """
        target = self.runner.model
        features = self.drafter.target_features(hidden, aux)
        out = self.drafter(target.model.embed_tokens(next_ids), features,
                           rope_for(target, positions, hidden.dtype), meta)  # [T, H]
        if stop is not None:
            self.draft_hidden[state] = out[stop]

    def _finish(self, inputs, output_ids, num_accepted, logprobs, top, num_drafts, routed=None) -> RunnerOutput:
        R, K1 = output_ids.shape
        # the step's one device -> host copy (token ids < 2**24 are exact in float32)
        packed = torch.cat([output_ids.float(), num_accepted[:, None].float(), logprobs.float()], dim=1).cpu()
        ids = packed[:, :K1].to(torch.int64).tolist()
        counts = packed[:, K1].to(torch.int64).tolist()
        lps = packed[:, K1 + 1 :].tolist()
        top_list = None
        if top is not None:
            top_ids, top_vals = top[0].cpu().tolist(), top[1].float().cpu().tolist()
            top_list = [[list(zip(top_ids[i][j], top_vals[i][j])) for j in range(counts[i] + 1)] for i in range(R)]
        sampled = [ids[i][: counts[i] + 1] for i in range(R)]
        rows = inputs.sample_rows
        self.runner.input_batch.append_sampled(inputs.slots[rows], sampled)
        routed_experts = None
        if routed is not None:  # the positions of rejected drafts are not final: each row reports up to its accepted
            rejected = np.zeros(inputs.slots.shape[0], dtype=np.int64)  # [B]
            rejected[rows] = num_drafts - np.asarray(counts, dtype=np.int64)
            routed_experts = self.runner.routed_finish(routed, routed.ends - rejected[routed.rows])
        return RunnerOutput(
            req_ids=[inputs.req_ids[i] for i in rows.tolist()],
            sampled_token_ids=sampled,
            logprobs=[lps[i][: counts[i] + 1] for i in range(R)],
            top_logprobs=top_list,
            num_draft_tokens=num_drafts.tolist(),
            routed_experts=routed_experts,
        )
