"""One engine step on the device: apply the scheduler's diffs, gather inputs, forward, sample, copy out.

    execute(sched)
      input_batch.apply(sched)          persistent slots: free finished, add new, apply diffs
      inputs = input_batch.gather()     flat tokens, positions, KV slots, query offsets (host)
      stage into pinned host buffers, then three non-blocking copies to the persistent device buffers
      hidden = model(...)               paged attention over the bound KV cache
      logits = lm_head(hidden[rows that sample])
      tokens, logprobs = sampler(...)   counter-based noise, no host sync
      one copy of results to the host   the step's only sync

MoE routing replay: a model with a `routed_experts_shape` (num_moe_layers, top_k) gets a routing store next to
the KV cache, int32 [num_kv_blocks * block_size + 1, num_moe_layers, top_k] (`routed_store`: one row per KV
slot, and a last one that takes padding tokens' writes, slot -1), bound with `model.bind_routed_experts`,
allocated, freed, slept and woken with the cache, and counted in its per-block bytes. Its MoE layers write
the experts of every token they run at the token's KV slot. For the requests that asked
(`RequestSampling.return_routed_experts`), each step gathers the rows of the positions that became final,
from the first one not reported yet (`InputBatch.routed_from`) through the block table, right after the
forward, and copies them out with the sampled tokens (`RoutedGather`, into `RunnerOutput.routed_experts`);
steps without such requests do nothing of this. Under tensor parallelism
only rank 0 keeps a store (the router is replicated, so rank 0's choices are every rank's).

LoRA (`config.max_loras > 0`): `self.lora` is a `runner.lora.runtime.LoraRuntime` (adapter slots, hooked into the
model's linears); each request's slot (`InputBatch.lora_slot`) is staged per token into `StepBuffers.lora_idx`, and
every forward runs inside `self.lora.tokens(...)` (a step without adapter tokens with none: eagerly, or through the
decode graphs captured with the hooks off; a step with them with the buffer, so a decode graph builds the step's
tiles itself). Without LoRA none of it exists.

Embedding prompts (`NewRequestData.prompt_embeds`): a step whose tokens include prompt positions of such a request
(`StepInputs.embeds`, from runner/input_batch.py) runs eagerly and hands the model those tokens' indices and rows
(`model(..., embeds=(index [E], rows [E, hidden]))`, two non-blocking copies), which replace the embedding lookups
of their placeholder tokens; the request's generated tokens, and every other request's, are looked up as usual.
Only prefill tokens can be prompt rows, so decode steps (and their graphs) never see them; steps without them pass
nothing.

The device buffers (`[max_num_batched_tokens]`, `[max_num_seqs, ...]`) are allocated once, so a CUDA
graph can capture a step that reads them. Under tensor parallelism (`tp` given) the runner is one rank's:
its model shard, its KV heads, and a sampler that takes the rank's vocabulary shard of the logits
(runner/parallel/). Not here: scheduling decisions (rollout/), tokenization.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runner.attention import AttentionBackend, AttentionMetadata
from runner.config import RunnerConfig
from kernels.common import upload
from runner.input_batch import InputBatch, StepInputs
from runner.loader import CheckpointWeights, load_model
from runner.messages import RunnerOutput, SchedulerOutput
from runner.model_config import ModelConfig, parse_dtype
from runner.sampler import Sampler
from runner.sampling_tensors import NO_TRUNCATION
from runner.step_buffers import StepBuffers
from runner.weight_sync import WeightSync

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RoutedGather:
    """The routed experts one step reports: positions [starts[i], ends[i]) of each request that asked,
    gathered from the routing store after the step's forward (`ModelRunner.routed_plan` / `routed_launch`)."""

    req_ids: list[str]
    rows: np.ndarray  # [Q] int64 batch rows of the reporting requests
    slots: np.ndarray  # [Q] int64 their runner slots
    starts: np.ndarray  # [Q] int64 first position not reported yet
    ends: np.ndarray  # [Q] int64 the request's computed count after this step (speculative: drafts included)
    host: torch.Tensor | None = None  # [sum(ends - starts), L_moe, k] int32 host (pinned on CUDA), copied non-blocking
    event: "torch.cuda.Event | None" = None  # recorded after the copy

    def result(self, ends: np.ndarray | None = None) -> dict[str, tuple[int, np.ndarray]]:
        """req_id -> (first position, int32 [n, L_moe, k] rows), once the copy has landed; `ends` [Q] (speculative
        steps: the accepted counts) cuts each request's rows short. The arrays are views of `host`."""
        if self.event is not None:
            self.event.synchronize()
        rows, out, offset = self.host.numpy(), {}, 0
        keep = self.ends if ends is None else ends
        for req_id, start, end, kept in zip(self.req_ids, self.starts.tolist(), self.ends.tolist(), keep.tolist()):
            out[req_id] = (start, rows[offset : offset + kept - start])
            offset += end - start
        return out


@dataclass(slots=True)
class StepHandle:
    """A launched step: where its results will land on the host, and for which slots."""

    req_ids: list[str] = field(default_factory=list)  # requests of the sampling rows, in row order
    slots: np.ndarray | None = None  # [R] int64 slot of each sampling row
    positions: np.ndarray | None = None  # [R] int64 index of the sampled token in its slot's buffer
    epochs: np.ndarray | None = None  # [R] int64 the slots' owners at launch (InputBatch.slot_epoch)
    tokens: torch.Tensor | None = None  # [R] int64 host (pinned on CUDA), filled by a non-blocking copy
    logprobs: torch.Tensor | None = None  # [R] float32 host
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # device (ids [R, N], logprobs [R, N]) if asked for
    event: "torch.cuda.Event | None" = None  # recorded after the copies
    routed: RoutedGather | None = None  # the routed experts the step reports, if any request asked
    output: RunnerOutput | None = None  # set when the step already ran to completion

    @classmethod
    def done(cls, output: RunnerOutput) -> "StepHandle":
        return cls(output=output)


class ModelRunner:
    def __init__(self, config: RunnerConfig, model_config: ModelConfig, max_model_len: int, tp=None) -> None:
        self.config = config
        self.model_config = model_config
        self.tp = tp  # runner.parallel.group.TPGroup, or None
        self.device = torch.device(config.device) if tp is None else tp.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, by its index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = parse_dtype(config.dtype if config.dtype != "auto" else (model_config.checkpoint_dtype or "float32"))
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.backend = AttentionBackend(self.device)
        start = time.perf_counter()
        self.load_stats: dict[str, float] = {}
        """The load's parts in seconds (`load_model`'s `stats`: allocate, fill, and the chunked reader's fill_read /
        fill_wait)."""
        self.model = load_model(
            config.model, model_config, self.dtype, self.device, self.backend, max_model_len, config.deterministic, tp,
            random_seed=config.seed if config.load_format == "dummy" else None, stats=self.load_stats,
        )
        self.load_seconds = time.perf_counter() - start
        """Seconds the weight load took (`load_model`: on CUDA until the weights are in place)."""
        set_gemv_rows = getattr(self.model, "set_gemv_rows", None)  # optional (runner/models/interface.py)
        if self.device.type == "cuda" and not config.deterministic and set_gemv_rows is not None:
            set_gemv_rows(config.fused_gemv_rows)
        self.num_kv_heads = self.model.num_kv_heads  # this rank's
        shape = getattr(self.model, "routed_experts_shape", None) if config.enable_return_routed_experts else None
        self.routed_experts_shape: tuple[int, int] | None = None if shape is None else tuple(shape)
        """(num_moe_layers, top_k) when requests may ask for their routed experts; None for a dense model or with
        `enable_return_routed_experts` off."""
        self._keeps_routing = shape is not None and (tp is None or tp.rank == 0)
        self.routed_store: torch.Tensor | None = None  # [num_kv_blocks * block_size + 1, L_moe, k] int32 (rank 0)
        if tp is None:
            self.weights = CheckpointWeights(self.model)
            self.sampler = Sampler(self.device, config.deterministic)
        else:
            from runner.parallel.sampling import TensorParallelSampler
            from runner.parallel.weights import ShardedCheckpointWeights

            self.weights = ShardedCheckpointWeights(self.model, tp)
            self.sampler = TensorParallelSampler(Sampler(self.device, config.deterministic), tp, config.tp_sampling)
        self.input_batch = InputBatch(
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, block_size=config.block_size
        )
        self.lora = None  # runner.lora.runtime.LoraRuntime when config.max_loras > 0 (slots hooked into the model)
        if config.max_loras:
            from runner.lora.runtime import LoraRuntime

            self.lora = LoraRuntime(self.model, model_config, max_loras=config.max_loras,
                                    max_rank=config.max_lora_rank, target_modules=config.lora_target_modules,
                                    device=self.device, dtype=self.dtype, overlap=config.lora_overlap,
                                    deferred=config.lora_deferred, fused_linear=config.lora_fused_linear,
                                    tp=self.tp)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens, config.max_num_seqs, self.input_batch.max_blocks_per_seq, self.device,
            lora=self.lora is not None,
        )
        self.num_kv_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs = None  # DecodeGraphs once captured (CUDA, enforce_eager=False)
        self._recapture = False  # asleep: capture the graphs again on wake
        S = config.max_num_seqs
        # [2 * max_num_seqs]: the last token sampled per slot; row S + r is graph padding row r's scratch
        self.last_sampled = torch.zeros(2 * S, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self._out_buffers = [  # two pinned result buffers: a step in flight and the one being collected
            (torch.zeros(S, dtype=torch.int64, pin_memory=pin), torch.zeros(S, dtype=torch.float32, pin_memory=pin))
            for _ in range(2)
        ]
        self._out_flip = 0
        self._upload_done: torch.cuda.Event | None = None
        self.spec = None  # SpeculativeRunner when config.speculative is set
        if config.speculative is not None:
            from runner.spec_decode.spec_runner import SpeculativeRunner

            self.spec = SpeculativeRunner(self)
        self.weight_sync = WeightSync(self)

    # ---- KV cache ------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.finfo(self.dtype).bits // 8
        drafter = 0 if self.spec is None else self.spec.kv_bytes_per_block()
        routing = 0
        if self._keeps_routing:
            num_moe_layers, top_k = self.routed_experts_shape
            routing = self.block_size * num_moe_layers * top_k * 4  # int32 rows of the routing store
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem + drafter + routing

    def determine_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cpu":
            wanted = self.config.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
            return max(1, min(wanted, self.config.kv_cache_bytes // per_block))
        activation_bytes, graph_bytes = self._profile_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, CUDA context, other processes
        budget = total * self.config.gpu_memory_utilization - used - activation_bytes - graph_bytes
        num = int(budget // per_block)
        logger.info(
            "GPU memory: total %.1f GiB, in use %.2f GiB, activation peak %.2f GiB, graphs %.2f GiB -> KV cache "
            "%.2f GiB (%d blocks) at gpu_memory_utilization=%.2f",
            total / 2**30, used / 2**30, activation_bytes / 2**30, graph_bytes / 2**30,
            max(num, 0) * per_block / 2**30, max(num, 0), self.config.gpu_memory_utilization,
        )
        if num < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache: total {total / 2**30:.1f} GiB, in use {used / 2**30:.1f} GiB, "
                f"activations {activation_bytes / 2**30:.2f} GiB, graphs {graph_bytes / 2**30:.2f} GiB at "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}; raise it or use a smaller max_num_batched_tokens"
            )
        return num

    @torch.inference_mode()
    def _profile_memory(self) -> tuple[int, int]:
        """Peak activation bytes of a max_num_batched_tokens step, and the bytes of the largest decode graph.

        Both run over a small temporary KV cache that is freed afterwards.
        """
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        seq_len = min(self.max_model_len, num_tokens)
        num_seqs = max(1, min(num_tokens // seq_len, cfg.max_num_seqs))
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(blocks_per_seq * num_seqs + 1, quiet=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        b, dev = self.buffers, self.device
        T = num_seqs * seq_len
        b.input_ids[:T] = 0
        b.positions[:T] = torch.arange(seq_len, device=dev).repeat(num_seqs)
        b.slot_mapping[:T] = torch.arange(T, device=dev)
        b.query_start_loc[: num_seqs + 1] = torch.arange(num_seqs + 1, device=dev, dtype=torch.int32) * seq_len
        b.seq_lens[:num_seqs] = seq_len
        b.block_tables[:num_seqs, :blocks_per_seq] = torch.arange(
            num_seqs * blocks_per_seq, device=dev, dtype=torch.int32
        ).view(num_seqs, blocks_per_seq)
        if self.lora is not None:
            b.lora_idx[:T] = 0  # every token through slot 0's adapter: the LoRA kernels' memory is counted too
        meta = AttentionMetadata(
            query_start_loc=b.query_start_loc[: num_seqs + 1], seq_lens=b.seq_lens[:num_seqs],
            block_tables=b.block_tables[:num_seqs, :blocks_per_seq], slot_mapping=b.slot_mapping[:T],
            max_query_len=seq_len, max_seq_len=seq_len, deterministic=cfg.deterministic,
        )
        with self._adapters(T):
            hidden = self.model(b.input_ids[:T], b.positions[:T], meta)
        rows = cfg.max_num_seqs
        idx = torch.arange(rows, device=dev) % T
        logits = self.model.compute_logits(hidden[idx])
        sampling = b.sampling(rows)  # every row with top-p (the most memory); a step's upload overwrites them
        sampling.temperature.fill_(1.0)
        sampling.top_k.zero_()
        sampling.top_p.fill_(0.9)
        sampling.min_p.zero_()
        self.sampler(logits, sampling)
        del hidden, logits
        torch.cuda.synchronize()
        activation_bytes = torch.cuda.max_memory_allocated(self.device) - base
        graph_bytes = 0
        if not cfg.enforce_eager:
            from runner.cuda_graph import DecodeGraphs

            b.seq_lens.zero_()
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(self.device)[0]
            probe = DecodeGraphs(self, [self.max_decode_rows])
            probe.capture()
            graph_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
            probe.release()
            if self.spec is not None and self.spec.graphs is not None:  # speculative steps replay their own graphs
                graph_bytes = max(graph_bytes, self.spec.graphs.probe_bytes())
        self._drop_kv_cache()
        torch.cuda.empty_cache()
        return activation_bytes, graph_bytes

    def _drop_kv_cache(self) -> None:
        self.kv_caches = []
        self.model.bind_kv_cache([(None, None)] * self.model_config.num_layers)
        if self.routed_store is not None:
            self.routed_store = None
            self.model.bind_routed_experts(None)

    def allocate_kv_cache(self, num_blocks: int, quiet: bool = False) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.model.bind_kv_cache(self.kv_caches)
        if self._keeps_routing:
            # the last row takes the writes of padding tokens (KV slot -1), so the model writes unmasked
            self.routed_store = torch.zeros(num_blocks * self.block_size + 1, *self.routed_experts_shape,
                                            dtype=torch.int32, device=self.device)
            self.model.bind_routed_experts(self.routed_store)
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        if not quiet:
            logger.info(
                "KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, self.block_size,
                num_blocks * self.kv_bytes_per_block() / 2**20,
            )

    # ---- one step ------------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step and return its sampled tokens (launch, then wait for it)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> "StepHandle":
        """Enqueue one step on the device without waiting for it; `collect` returns its tokens.

        Each sampling row gets a placeholder token (-1) in its slot right away, so the next step can be
        staged before this one finishes: a placeholder input token is read on the device from
        `last_sampled`, where this step's sampler writes. Speculative steps run to completion here.
        """
        self.input_batch.apply(sched)
        if sched.is_empty:
            return StepHandle.done(RunnerOutput(req_ids=[], sampled_token_ids=[]))
        if self.spec is not None:
            return StepHandle.done(self.spec.execute(sched))
        inputs = self.input_batch.gather(sched)
        routed = self.routed_plan(inputs)
        top_n = int(self.input_batch.top_logprobs[inputs.slots[inputs.sample_rows]].max(initial=0))
        uses = self.input_batch.truncation_uses(inputs.slots[inputs.sample_rows], self.model_config.vocab_size)
        num_reqs = inputs.slots.shape[0]
        if self._upload_done is not None:  # the previous step's upload has left the pinned staging buffers
            self._upload_done.synchronize()
        b = self.buffers
        R = inputs.sample_rows.shape[0]
        uses_lora = self.uses_lora(inputs)
        if (
            self.graphs is not None
            and inputs.max_query_len == 1
            and R == num_reqs
            and num_reqs <= self.graphs.max_size
            and top_n == 0
            and inputs.embeds is None
        ):
            size = self.graphs.padded_size(num_reqs)
            self._stage(inputs)
            self.fill_padding_rows(num_reqs, size)
            self._upload(inputs, size, in_graph=True)
            tokens, logprobs = self.graphs.replay(size, any(uses), uses_lora)
            if routed is not None:
                self.routed_launch(routed)
            return self._handle(inputs, tokens[:num_reqs], logprobs[:num_reqs], in_graph=True, routed=routed)
        self._stage(inputs)
        self._upload(inputs, num_reqs)
        meta = self._metadata(inputs)
        T = inputs.input_ids.shape[0]
        extra = {} if inputs.embeds is None else {"embeds": self._prompt_embeds(inputs)}
        with self._adapters(T, uses_lora):
            hidden = self.model(b.input_ids[:T], b.positions[:T], meta, **extra)
        if routed is not None:
            self.routed_launch(routed)
        if R == 0:
            if routed is None:
                return StepHandle.done(RunnerOutput(req_ids=[], sampled_token_ids=[]))
            nothing = torch.empty(0, dtype=torch.int64, device=self.device)  # no token; the routing rows come out
            return self._handle(inputs, nothing, nothing.float(), routed=routed)
        logits = self.model.compute_logits(hidden[b.logits_indices[:R]])
        tokens, logprobs, top = self.sampler(logits, b.sampling(R, uses, top_n))
        return self._handle(inputs, tokens, logprobs, top, routed=routed)

    def _prompt_embeds(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(token index [E] int64, rows [E, hidden]) on the device, copied without a host wait: the step's tokens
        whose input embeddings are embedding-prompt rows, and those rows."""
        e = inputs.embeds
        rows = e.rows[0] if len(e.rows) == 1 else torch.cat(e.rows)
        return upload(torch.from_numpy(e.token_index), self.device), upload(rows, self.device)

    def _upload(self, inputs: StepInputs, num_block_rows: int, in_graph: bool = False) -> None:
        """Copy the staged inputs to the device (three copies from pinned memory, no host wait) and fill
        placeholder input tokens from `last_sampled` (`in_graph`: the decode graph fills them itself)."""
        h = self.buffers.host
        # tokens sampled by a step still in flight
        pending = np.empty(0, dtype=np.int64) if in_graph else np.flatnonzero(inputs.input_ids < 0)
        if pending.size:
            rows = np.searchsorted(inputs.query_start_loc[1:], pending, side="right")
            StepBuffers.put(h.pending_index, pending)
            StepBuffers.put(h.pending_slots, inputs.slots[rows])
        StepBuffers.put(h.sample_slots, inputs.slots[inputs.sample_rows])
        self.buffers.upload(num_block_rows)
        if pending.size:
            b = self.buffers
            b.input_ids.index_copy_(0, b.pending_index[: pending.size],
                                    self.last_sampled.index_select(0, b.pending_slots[: pending.size]))
        if self.device.type == "cuda":
            if self._upload_done is None:
                self._upload_done = torch.cuda.Event()
            self._upload_done.record()

    def _handle(self, inputs: StepInputs, tokens: torch.Tensor, logprobs: torch.Tensor, top=None,
                in_graph: bool = False, routed: RoutedGather | None = None) -> "StepHandle":
        """Start the copy of this step's results to the host and put placeholders in the sampling slots.

        `top` (ids [R, N], logprobs [R, N] on the device), when asked for, is copied out at `collect`.
        `in_graph`: the decode graph has already kept the tokens in `last_sampled`."""
        rows = inputs.sample_rows
        slots = inputs.slots[rows]
        R = rows.shape[0]
        if not in_graph:
            self.last_sampled.index_copy_(0, self.buffers.sample_slots[:R], tokens)
        out_tokens, out_logprobs = self._out_buffers[self._out_flip]
        self._out_flip ^= 1
        out_tokens[:R].copy_(tokens, non_blocking=True)
        out_logprobs[:R].copy_(logprobs.float(), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        ib = self.input_batch
        positions = ib.num_tokens[slots].copy()  # [R] where each sampled token goes
        ib.token_ids[slots, positions] = -1
        ib.num_tokens[slots] += 1
        return StepHandle(req_ids=[inputs.req_ids[r] for r in rows.tolist()], slots=slots, positions=positions,
                          epochs=ib.slot_epoch[slots].copy(), tokens=out_tokens[:R], logprobs=out_logprobs[:R],
                          top=top, event=event, routed=routed)

    def collect(self, handle: "StepHandle") -> RunnerOutput:
        """Wait for a launched step; write its tokens into the slots that still hold their requests."""
        if handle.output is not None:
            return handle.output
        if handle.event is not None:
            handle.event.synchronize()
        token_list = handle.tokens.tolist()
        logprob_list = handle.logprobs.tolist()
        ib = self.input_batch
        owned = ib.slot_epoch[handle.slots] == handle.epochs  # slots freed or handed on since are left alone
        ib.token_ids[handle.slots[owned], handle.positions[owned]] = np.asarray(token_list, dtype=np.int64)[owned]
        top_list = None
        if handle.top is not None:
            ids, vals = handle.top[0].cpu().tolist(), handle.top[1].float().cpu().tolist()
            top_list = [[list(zip(i, v))] for i, v in zip(ids, vals)]
        return RunnerOutput(
            req_ids=handle.req_ids,
            sampled_token_ids=[[t] for t in token_list],
            logprobs=[[lp] for lp in logprob_list],
            top_logprobs=top_list,
            routed_experts=None if handle.routed is None else handle.routed.result(),
        )

    # ---- routing replay (MoE) --------------------------------------------------------------------------
    def routed_plan(self, inputs: StepInputs) -> RoutedGather | None:
        """What this step reports of the routed experts (host side only), or None: no store here, or no request
        of the step asked. Each reporting request: from its first position not reported yet to its computed
        count after the step."""
        if self.routed_store is None:
            return None
        ib = self.input_batch
        starts = ib.routed_from[inputs.slots]  # [B]
        rows = np.flatnonzero(starts >= 0)
        if rows.shape[0] == 0:
            return None
        return RoutedGather(req_ids=[inputs.req_ids[r] for r in rows.tolist()], rows=rows, slots=inputs.slots[rows],
                            starts=starts[rows], ends=inputs.seq_lens[rows].astype(np.int64))

    def routed_launch(self, gather: RoutedGather, final: bool = True) -> None:
        """Enqueue, after the step's forward (which wrote the rows), the gather of `gather`'s rows from the store
        through the block tables and their copy to the host; no host wait. `final`: every position the step
        computed is final, so the requests report from `gather.ends` on (speculative steps: `routed_finish`)."""
        ib = self.input_batch
        index = upload(torch.from_numpy(ib.kv_slots(gather.slots, gather.starts, gather.ends)), self.device)
        rows = self.routed_store.index_select(0, index)  # [N, L_moe, k]
        if self.device.type == "cuda":
            gather.host = torch.empty(rows.shape, dtype=torch.int32, pin_memory=True)
            gather.host.copy_(rows, non_blocking=True)
            gather.event = torch.cuda.Event()
            gather.event.record()
        else:
            gather.host = rows
        if final:
            ib.routed_from[gather.slots] = gather.ends

    def routed_finish(self, gather: RoutedGather, ends: np.ndarray) -> dict[str, tuple[int, np.ndarray]]:
        """A speculative step's report: each request's rows up to `ends` [Q], its computed count once rejected
        drafts are rolled back; it reports from there on next."""
        self.input_batch.routed_from[gather.slots] = ends
        return gather.result(ends)

    # ---- CUDA graphs -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_forward(self, size: int, truncation: bool = True,
                       lora: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One pure-decode step over the first `size` rows of the step buffers (what a graph captures).

        truncation=False: no row uses top-k / top-p / min-p, so the sampler may take its split kernel. The
        sampling tensors are views of the step buffers, so a captured graph reads each step's values.
        lora=False: the LoRA hooks add nothing (a step where no token has an adapter)."""
        b = self.buffers
        meta = AttentionMetadata(
            query_start_loc=b.query_start_loc[: size + 1],
            seq_lens=b.seq_lens[:size],
            block_tables=b.block_tables[:size],
            slot_mapping=b.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            deterministic=self.config.deterministic,
        )
        with self._adapters(size, lora):  # with LoRA the tiles of the step's slots are built inside the graph
            hidden = self.model(self._decode_input_ids(size), b.positions[:size], meta)
        logits = self.model.compute_logits(hidden)
        tokens, logprobs, _ = self.sampler(logits, b.sampling(size, None if truncation else NO_TRUNCATION))
        # every row samples; padding rows' sample slots are scratch rows of last_sampled
        self.last_sampled.index_copy_(0, b.sample_slots[:size], tokens)
        return tokens, logprobs

    def _decode_input_ids(self, size: int) -> torch.Tensor:
        """[size] int64: the first `size` decode rows' input tokens, placeholders (-1, tokens of the step
        before, still in flight when this one was staged) taken from `last_sampled` by the rows' slots."""
        b = self.buffers
        input_ids = b.input_ids[:size]
        return torch.where(input_ids < 0, self.last_sampled.index_select(0, b.sample_slots[:size]), input_ids)

    def resolve_placeholders(self, size: int) -> None:
        """Write the first `size` decode rows' placeholder input tokens into the input buffer, as the decode
        graph reads them when it runs."""
        self.buffers.input_ids[:size].copy_(self._decode_input_ids(size))

    def fill_padding_rows(self, start: int, end: int) -> None:
        """Make rows [start, end) inert padding in the host staging: one query token, no context, no KV write."""
        if end <= start:
            return
        h = self.buffers.host
        h.query_start_loc[start + 1 : end + 1] = np.arange(start + 1, end + 1)
        h.seq_lens[start:end] = 0
        h.slot_mapping[start:end] = -1
        h.input_ids[start:end] = 0
        h.positions[start:end] = 0
        h.sample_slots[start:end] = np.arange(start, end) + self.config.max_num_seqs  # scratch rows
        if self.lora is not None:
            h.lora_idx[start:end] = -1
        self.buffers.pad_sampling(start, end)

    # ---- sleep / wake: device memory for a trainer sharing the device between rollout batches ------------
    def sleep(self, offload_weights: bool) -> None:
        """Free the KV cache and the CUDA graphs (their contents are not kept); with `offload_weights` also
        move every parameter (target and drafter) to host memory, pinned on CUDA. The modules keep their
        Parameter objects, only `.data` moves, so checkpoint views and weight receivers stay valid."""
        self._recapture = self.graphs is not None
        self.free_kv_cache()
        if offload_weights:
            pin = self.device.type == "cuda"
            for p in self._parameters():
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                host.copy_(p.data)
                p.data = host
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_weights(self) -> None:
        """Move offloaded parameters back to the device (bitwise the values they had)."""
        for p in self._parameters():
            if p.device != self.device:
                p.data = p.data.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wake_kv_cache(self) -> None:
        """Allocate the KV cache again (same number of blocks, zeroed); nothing if it is allocated already. On
        failure (out of memory) nothing stays allocated and the error is raised. The graphs come back with
        `recapture_graphs` (under tensor parallelism a collective: only once every rank holds its cache)."""
        if self.kv_caches:
            return
        try:
            self.allocate_kv_cache(self.num_kv_blocks, quiet=True)
        except BaseException:
            self.free_kv_cache()
            raise

    def recapture_graphs(self) -> None:
        """Capture the decode graphs that `sleep` released; on failure the cache and graphs are freed again."""
        if not self._recapture or self.graphs is not None:
            return
        try:
            self.capture_graphs()
        except BaseException:
            self.free_kv_cache()
            raise

    def use_in_this_thread(self) -> None:
        """Make this runner's device the calling thread's current one (a new thread starts on device 0, and
        kernels launch on the current device)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def free_kv_cache(self) -> None:
        """Drop the KV cache and the graphs that read it (as asleep)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self._drop_kv_cache()
        if self.spec is not None:
            self.spec.free_kv_cache()

    def _parameters(self) -> list[torch.nn.Parameter]:
        params = list(self.model.parameters())
        if self.spec is not None:
            seen = {id(p) for p in params}  # an MTP drafter shares the target's LM head
            params += [p for p in self.spec.drafter.parameters() if id(p) not in seen]
        return params

    def release(self) -> None:
        """Drop graphs, KV caches, the drafter and the weights (with the weight receivers, which reach them)
        so their device memory is freed now."""
        self.free_kv_cache()  # the target's and the drafter's caches and graphs
        self.spec = None
        self.weight_sync = None
        self.lora = None
        self.model = None
        self.weights = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def max_decode_rows(self) -> int:
        """The most requests one decode step can hold: a step runs at most max_num_seqs requests and at most
        max_num_batched_tokens tokens."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def capture_graphs(self) -> None:
        from runner.cuda_graph import DecodeGraphs, capture_sizes

        self.graphs = DecodeGraphs(self, capture_sizes(self.max_decode_rows))
        self.graphs.capture()

    def _stage(self, inputs: StepInputs) -> None:
        """Write the step's inputs into the host staging views (uploaded by `StepBuffers.upload`)."""
        h, ib, put = self.buffers.host, self.input_batch, StepBuffers.put
        put(h.input_ids, inputs.input_ids)
        put(h.positions, inputs.positions)
        put(h.slot_mapping, inputs.slot_mapping)
        put(h.query_start_loc, inputs.query_start_loc)
        put(h.seq_lens, inputs.seq_lens)
        num_reqs = inputs.slots.shape[0]
        max_blocks = -(-inputs.max_seq_len // self.block_size)
        h.block_tables[:num_reqs, :max_blocks] = ib.block_table[inputs.slots, :max_blocks]
        rows = inputs.slots[inputs.sample_rows]
        put(h.logits_indices, inputs.logits_indices)
        hs = h.sampling  # one line per SamplingTensors field
        put(hs.temperature, ib.temperature[rows])
        put(hs.top_k, ib.top_k[rows])
        put(hs.top_p, ib.top_p[rows])
        put(hs.min_p, ib.min_p[rows])
        put(hs.seeds, ib.seed[rows])
        put(hs.positions, ib.num_tokens[rows] - ib.num_prompt_tokens[rows])
        if self.lora is not None:  # each token's adapter slot: its request's
            put(h.lora_idx, np.repeat(ib.lora_slot[inputs.slots], np.diff(inputs.query_start_loc)))

    def uses_lora(self, inputs: StepInputs) -> bool:
        """Whether some request of the step has an adapter (always False without LoRA slots)."""
        return self.lora is not None and bool((self.input_batch.lora_slot[inputs.slots] >= 0).any())

    def _adapters(self, num_tokens: int, used: bool = True):
        """The LoRA context of a forward over the first `num_tokens` tokens of the step buffers: their adapter
        slots (`used`), or none; nothing without LoRA."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.tokens(self.buffers.lora_idx[:num_tokens] if used else None)

    def prepare(self, inputs: StepInputs) -> AttentionMetadata:
        """Stage and upload one step's inputs into the step buffers; returns its attention metadata."""
        self._stage(inputs)
        self.buffers.upload(inputs.slots.shape[0])
        return self._metadata(inputs)

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        b = self.buffers
        num_reqs, num_tokens = inputs.slots.shape[0], inputs.input_ids.shape[0]
        max_blocks = -(-inputs.max_seq_len // self.block_size)
        return AttentionMetadata(
            query_start_loc=b.query_start_loc[: num_reqs + 1],
            seq_lens=b.seq_lens[:num_reqs],
            block_tables=b.block_tables[:num_reqs, :max_blocks],
            slot_mapping=b.slot_mapping[:num_tokens],
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            deterministic=self.config.deterministic,
        )

    def lora_tokens(self, num_tokens: int, lora_slot: int):
        """The LoRA context of a forward of one sequence of `num_tokens` tokens, all with the adapter in
        `lora_slot` (-1: the base model; any other value needs LoRA on)."""
        if lora_slot < 0:
            return contextlib.nullcontext()
        if self.lora is None or lora_slot >= self.lora.max_loras:
            raise ValueError(f"lora_slot {lora_slot} is not a LoRA slot of this runner")
        return self.lora.tokens(torch.full((num_tokens,), lora_slot, dtype=torch.int64, device=self.device))

    def full_sequence_logits(self, token_ids: list[int], lora_slot: int = -1) -> torch.Tensor:
        """Logits [len(token_ids), vocab] of one sequence in a single prefill over the first cache blocks
        (under tensor parallelism a collective: every rank calls it, through `collective_rpc`, and gets the full
        vocabulary), with the LoRA adapter in `lora_slot` (-1: the base model).

        For tests and scoring on an idle engine only: it overwrites KV blocks 0..n, so no request may be running.
        """
        assert not self.input_batch.slot_of, "full_sequence_logits needs an idle runner"
        n = len(token_ids)
        num_blocks = -(-n // self.block_size)
        assert num_blocks <= self.num_kv_blocks
        dev = self.device
        block_table = torch.arange(num_blocks, dtype=torch.int32, device=dev)[None, :]
        meta = AttentionMetadata.one_sequence(n, n, block_table, torch.arange(n, dtype=torch.int64, device=dev),
                                              self.config.deterministic)
        with torch.inference_mode():
            ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
            with self.lora_tokens(n, lora_slot):
                hidden = self.model(ids, torch.arange(n, device=dev), meta)
            logits = self.model.compute_logits(hidden)
            if self.tp is None:
                return logits
            from runner.parallel.sampling import gather_vocab

            return gather_vocab(self.tp, logits)
