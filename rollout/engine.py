"""The engine: requests in, completions out, one scheduler step and one runner step at a time.

    add_request(prompt, params) -> n Requests (one per sample) queued in the scheduler
    step():
        sched = scheduler.schedule()          which requests, how many tokens each, which blocks
        out   = executor.execute(sched)       forward + sample on every rank; one copy out (rank 0's)
        done  = scheduler.update(sched, out)  append tokens, finish, free blocks
        return output_processor.process(done) the outputs of the prompts that changed
    generate(prompts, params) = add all, step until done, outputs in prompt order

This module is that loop. What surrounds it lives next to it: outputs (rollout/output_processor.py),
weight updates (rollout/engine_weights.py: every path drains the step in flight and bumps
`policy_version` once), LoRA adapters (rollout/loras.py), sleep and wake (rollout/sleep.py), speculative-decoding
statistics (rollout/spec_stats.py), and every call that must run on every rank is `collective_rpc`
(runner/executor.py). A bad request is refused at `add_request` with a ValueError and never reaches the
scheduler, so it cannot disturb the requests already running.

A prompt is text, a list of token ids, or one of vLLM's dict prompts: {"prompt": text}, {"prompt_token_ids": ids}
or {"prompt_embeds": tensor [T, hidden_size]} (rows of input embeddings, checked and keyed for the prefix cache by
rollout/prompt_embeds.py; not with speculative decoding, whose drafter embeds the prompt's token ids, nor under
tensor parallelism, whose step messages carry no tensors).

With `tensor_parallel_size=P > 1` this process is rank 0: it runs the scheduler, and the executor
(runner/parallel/worker.py) spawns P - 1 worker ranks and sends them each step's scheduler output as
plain data. Call `close()` (or use the engine as a context manager) to stop them; exit does it too.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable, Sequence


from rollout.config import EngineConfig
from rollout.engine_weights import EngineWeights
from rollout.kv_cache_manager import KVCacheManager
from rollout.model_files import resolve_model
from rollout.output_processor import OutputProcessor
from rollout.outputs import RequestOutput
from rollout.request import Request, RequestGroup, RoutedExperts
from rollout.sampling_params import RequestOutputKind, SamplingParams
from rollout.scheduler import Scheduler
from rollout.sleep import SleepState
from rollout.spec_stats import SpecDecodeTotals, new_spec_stats
from rollout.startup import PhaseTimer
from rollout.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rollout.loras import LoraInfo
    from rollout.prompt_embeds import PromptEmbeds
    from rollout.weight_sink import EngineSink
    from weight_updates import UpdateResult

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Mapping[str, Any]
_DICT_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")  # vLLM's TextPrompt, TokensPrompt, EmbedsPrompt


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from kernels.sampling_ref import sample_seed  # torch, no CUDA
        from runner.executor import make_executor
        from runner.model_config import ModelConfig

        timer = PhaseTimer()
        self._sample_seed = sample_seed
        self.config = config
        # config.model: a directory, or a hub id found in (or fetched into) the local Hugging Face cache
        self.model_dir = model_dir = str(resolve_model(config.model))
        """The directory the model's files are read from (config.model as given stays the model's name)."""
        self.tokenizer_dir = str(resolve_model(config.tokenizer, needs=None)) if config.tokenizer else model_dir
        """Where the tokenizer (and chat template) files are: config.tokenizer resolved, else model_dir."""
        self.model_config = ModelConfig.from_dir(model_dir)
        max_pos = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={max_pos}")
        self.max_model_len = config.max_model_len or min(max_pos, 8192)
        window = self.model_config.sliding_window
        if window is not None and self.max_model_len > window:
            # within the window sliding-window attention is full attention, which is what the kernels compute
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding_window={window}; "
                                 "sliding-window attention is supported only up to the window")
            logger.info("max_model_len capped at the model's sliding_window=%d", window)
            self.max_model_len = window
        self.tokenizer = Tokenizer.find(self.tokenizer_dir)
        timer.mark("config_tokenizer")
        self.executor = make_executor(config.runner_config(model_dir), self.model_config, self.max_model_len)
        self.runner = self.executor.driver  # rank 0's ModelRunner
        self._loras = None  # EngineLoras when config.max_loras > 0; before the KV sizing, which counts what it holds
        if config.max_loras:
            from rollout.loras import EngineLoras

            self._loras = EngineLoras(self, config.max_loras, merged=config.lora_merged)
        timer.mark("runner_init", load=self.runner.load_seconds)  # around the load: CUDA context, buffers, TP ranks
        rpc = self.executor.collective_rpc
        num_blocks = min(rpc("determine_num_kv_blocks"))  # each rank measures its own memory
        timer.mark("profile")  # CUDA: a profile step and a probe graph of the largest size
        rpc("allocate_kv_cache", num_blocks)
        timer.mark("kv_alloc")
        if self.runner.device.type == "cuda" and not config.enforce_eager and config.speculative is None:
            rpc("capture_graphs")
        timer.mark("graph_capture")
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            kv_manager=self.kv_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._rng = random.Random(config.seed)
        self.output_processor = OutputProcessor(self.tokenizer)  # per-prompt output state; builds every output
        self._ids = itertools.count()
        self._sleep = SleepState(self.collective_rpc, self.kv_manager.reset_prefix_cache)
        self._weights = EngineWeights(self)
        self._inflight = None  # async scheduling: (SchedulerOutput, StepHandle) launched, not yet collected
        self._drained: list[Request] = []  # requests that got tokens in a drain, reported by the next step
        self.spec_controller = None  # SpecController (auto-off) when speculating
        if config.speculative is not None:
            from runner.spec_decode.controller import SpecController

            self.spec_controller = SpecController(config.speculative.num_speculative_tokens,
                                                  auto_off=config.speculative.auto_off)
            self._spec_totals = SpecDecodeTotals(config.speculative.num_speculative_tokens)
        self.recent_sequences: deque[list[int]] = deque(maxlen=1024)
        """Token ids (prompt + completion) of recently finished samples, for online drafter training."""
        if config.gc_freeze:
            gc.collect()
            gc.freeze()
        self.startup_times: dict[str, float] = timer.done()
        """Seconds of each start-up phase (logged at INFO): config_tokenizer, load (rank 0's weight load),
        runner_init (the rest of building the runners), profile (KV-cache sizing), kv_alloc, graph_capture, other,
        total (their sum)."""

    # ---- properties ---------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.scheduler.policy_version

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_manager.pool.num_blocks

    @property
    def routed_experts_shape(self) -> tuple[int, int] | None:
        """(num_moe_layers, top_k) of the `routed_experts` a request may ask for (`SamplingParams.
        return_routed_experts`); None when it may not (see `routed_experts_refusal`)."""
        return self.runner.routed_experts_shape

    def routed_experts_refusal(self) -> str | None:
        """Why a request may not ask for `return_routed_experts` here, in words; None when it may."""
        if self.runner.routed_experts_shape is not None:
            return None
        if getattr(self.runner.model, "routed_experts_shape", None) is None:
            return f"{self.model_config.architecture} is a dense model (no MoE layers, so no routed experts)"
        return "this engine keeps no routing store (EngineConfig.enable_return_routed_experts is False)"

    def prompt_embeds_refusal(self) -> str | None:
        """Why this engine takes no embedding prompts ({"prompt_embeds": tensor}), in words; None when it does."""
        if self.config.speculative is not None:
            return ("not with speculative decoding (EngineConfig.speculative): the drafter embeds the prompt's token "
                    "ids, which an embedding prompt has not")
        if self.config.tensor_parallel_size > 1:
            return ("not under tensor parallelism (EngineConfig.tensor_parallel_size > 1): the step messages that "
                    "reach the other ranks carry no tensors")
        return None

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one prompt (n samples): text, token ids, or a dict prompt (module docstring). Raises ValueError, and
        queues nothing, for a bad request."""
        self._sleep.check_awake("add_request")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids, embeds = self._tokenize(prompt, params.add_special_tokens)
        self._validate_prompt(token_ids, params, embeds)
        return self._add(text, token_ids, params, request_id, params.output_kind, embeds)

    def _add(self, text: str | None, token_ids: list[int], params: SamplingParams, request_id: str | None,
             kind: RequestOutputKind, embeds: "PromptEmbeds | None" = None) -> str:
        """Queue a tokenized, validated prompt whose outputs are of `kind` (an embedding prompt: `embeds`, and
        placeholder `token_ids`)."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        group = RequestGroup(request_id, text, list(token_ids), params, prompt_embeds=embeds)
        routing = self.routed_experts_shape if params.return_routed_experts else None  # (L_moe, k)
        routing_rows = len(token_ids) + min(max_tokens, 512)  # a first capacity of the rows (they grow as needed)
        lora = None if params.lora is None else self._loras.get(params.lora, "SamplingParams.lora")
        cache_keys = () if params.cache_salt is None else (("cache_salt", params.cache_salt),)
        if lora is not None:  # blocks computed under an adapter are shared only with requests of the same load
            cache_keys += (lora.cache_key,)
        if embeds is not None:  # blocks of an embedding prompt are shared only with byte-identical embeddings
            cache_keys += (("prompt_embeds", embeds.digest),)
        for j in range(params.n):
            req = Request(
                req_id=f"{request_id}-{j}",
                group=group,
                sample_index=j,
                seed=self._sample_seed(base_seed, j),
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids),
                spec_stats=new_spec_stats(self.config.speculative.num_speculative_tokens) if self.config.speculative else None,
                cache_keys=cache_keys,
                routed_experts=None if routing is None else RoutedExperts(*routing, routing_rows),
                lora=lora,
            )
            group.members.append(req)
        self.output_processor.add(group, kind)
        for req in group.members:
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop every sample of a prompt and free its blocks. Returns the prompt's last output, in its
        output kind (cumulative: everything so far; delta: what is new; samples still running end with
        finish_reason "abort" and the tokens they had), or None for an id that is unknown or already
        reported; the prompt is not reported again. For partial rollouts: abort the stragglers once enough
        groups have finished, and keep or resubmit what they generated."""
        group = self.output_processor.get(request_id)
        if group is None:
            return None
        self.scheduler.abort([m.req_id for m in group.members])
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._drained)
                or self.output_processor.has_unreported())

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output of every prompt that changed, of the kind its
        `SamplingParams.output_kind` asks for (by default everything so far: RequestOutputKind.CUMULATIVE).

        A prompt whose samples have all finished is reported once, finished, and then forgotten.
        """
        self._sleep.check_awake("step")
        return self.output_processor.process(self._step())

    def _step(self) -> list[Request]:
        """schedule -> execute -> update; returns the requests that got tokens."""
        if self.config.async_scheduling:
            return self._step_async()
        batch_size = len(self.scheduler.running)
        if self.spec_controller is not None:
            self.scheduler.num_lookahead_tokens = self.spec_controller.lookahead(batch_size)
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        out = self.executor.execute(sched)
        changed = self.scheduler.update(sched, out)
        if self.spec_controller is not None:
            self._spec_totals.record_step(self.spec_controller, batch_size, self.scheduler.num_lookahead_tokens > 0,
                                          sched, out, time.perf_counter() - start)
            self.recent_sequences.extend(list(r.token_ids) for r in changed if r.status.finished)
        return changed

    def _step_async(self) -> list[Request]:
        """schedule(t+1) -> launch(t+1) -> collect(t) -> update(t): the host schedules and stages the next
        step while the device runs the current one. Returns the requests that got tokens from step t."""
        sched = self.scheduler.schedule()
        self.scheduler.advance(sched)
        handle = self.executor.launch(sched)
        changed, self._drained = self._drained, []  # tokens a drain collected are reported now
        if self._inflight is not None:
            prev_sched, prev_handle = self._inflight
            changed += self.scheduler.update(prev_sched, self.executor.collect(prev_handle), advanced=True)
        self._inflight = None if sched.is_empty else (sched, handle)
        return changed

    def _drain(self) -> None:
        """Finish the step in flight (async scheduling), so nothing runs while weights change; the requests
        it gave tokens to are reported by the next step."""
        if self._inflight is None:
            return
        sched, handle = self._inflight
        self._inflight = None
        self._drained += self.scheduler.update(sched, self.executor.collect(handle), advanced=True)

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        min_finished_prompts: int | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns one RequestOutput per prompt, in order.

        `min_finished_prompts`: stop as soon as that many prompts have all their samples finished; the
        others are aborted and come back with what they generated (finish_reason "abort" for their
        unfinished samples). For over-sampling: send more prompts than a batch needs (dynamic sampling)
        and cut the long tail."""
        self._sleep.check_awake("generate")
        if (isinstance(prompts, (str, Mapping))
                or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if min_finished_prompts is not None and not 1 <= min_finished_prompts <= len(prompts):
            raise ValueError(f"min_finished_prompts must be in [1, {len(prompts)}], got {min_finished_prompts}")
        # tokenize and validate every prompt before queueing any, so a bad one leaves nothing half-added
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
        tokenized = [self._tokenize(prompt, p.add_special_tokens) for prompt, p in zip(prompts, params)]
        for (_, token_ids, embeds), p in zip(tokenized, params):
            self._validate_prompt(token_ids, p, embeds)
        final_only = RequestOutputKind.FINAL_ONLY
        ids = [self._add(text, token_ids, p, None, final_only, embeds)
               for (text, token_ids, embeds), p in zip(tokenized, params)]
        wanted, done = set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(p.n for p in params), desc="generate", unit="seq")
        start, num_tokens = time.perf_counter(), 0
        enough = len(ids) if min_finished_prompts is None else min_finished_prompts
        while len(done) < enough:
            changed = self._step()
            if bar is not None:
                for req in changed:
                    if req.status.finished:
                        num_tokens += req.num_output_tokens
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.0f}")
            # final-only: a prompt's output is built once, when it finishes; other callers' prompts wait
            for out in self.output_processor.process(changed, only=wanted):
                done[out.request_id] = out
        if bar is not None:
            bar.close()
        for rid in ids:
            if rid not in done:
                done[rid] = self.abort_request(rid)
        if not self.scheduler.has_unfinished():
            self._drain()  # a last step in flight can only hold tokens of finished or aborted requests
            if self.scheduler.has_removals_to_send:  # an empty step: the runner drops them, and is idle
                self.executor.execute(self.scheduler.schedule())
        return [done[rid] for rid in ids]

    def close(self) -> None:
        """Release device memory (graphs, KV cache, weights) now; the engine cannot be used afterwards."""
        if self.config.gc_freeze:
            gc.unfreeze()  # first: the release's collection must reach objects frozen at start-up
        self._weights = None  # its weight sink reaches the weights
        if self._loras is not None:
            self._loras.release()  # merged mode's base copy
        self.executor.release()
        self.executor = self.runner = None
        if self.config.gc_freeze:
            gc.unfreeze()  # and what was frozen meanwhile (seen on the GPU machine: a library's objects)

    def collective_rpc(self, method: str, *args) -> list:
        """Run a runner method (a name or attribute path on `runner.model_runner.ModelRunner`, or
        "package.module:function" called as function(runner, *args)) on every rank, between steps; returns
        every rank's result in rank order. An exception on any rank raises one error naming the ranks, and
        every rank stays ready for the next call (see runner/executor.py)."""
        self._drain()
        return self.executor.collective_rpc(method, *args)

    # ---- weights (rollout/engine_weights.py) --------------------------------------------------------------
    def weight_sink(self) -> "EngineSink":
        """What a transport's receiver writes into: `IpcReceiver(conn, engine.weight_sink())`, `NixlReceiver`,
        `DistReceiver`, `InProcessSender` (weight_updates.transports). Each of its sessions finishes the step in
        flight and checks that the weights are on the device before it starts, and one that publishes moves
        `policy_version` once: running requests' later tokens record the new version, and no new request
        reuses prefix-cache blocks of older weights. Nothing else is to be called.

        Every record is checked (shape, dtype, bounds, checksum) before anything is written, on every rank
        under tensor parallelism. The sink's own sessions keep no copy of the old values of densely updated
        tensors (it would need as much free device memory as the update), so only a target that fails to
        hold written bits, caught by the read-back, could leave them changed, and that error says so."""
        return self._weights.sink()

    def weight_specs(self) -> dict:
        """Checkpoint name -> (shape, dtype) of every tensor a weight update may carry."""
        return self._weights.specs()

    def export_weights(self) -> list:
        """Every weight as a full checkpoint-shaped `Dense` record, e.g. to bring another engine to these
        weights (under tensor parallelism gathered from every rank). In one process the tensors are views of
        the live weights: use them before the next update, or clone them."""
        return self._weights.export()

    def apply_weight_update(self, version: int, updates) -> "UpdateResult":
        """Apply Dense/Patch records between steps; on success `policy_version` becomes `version`.

        Nothing is written unless every record validates; a failed update raises (a ValueError naming the
        problem) and leaves the weights and the version as they were. Running requests keep going; their
        later tokens record the new version, and no new request reuses prefix-cache blocks of older weights.
        One session of `weight_sink()`: prepare, commit and publish in one call."""
        return self._weights.apply(version, updates)

    def prepare_weight_update(self, version: int, updates) -> None:
        """Stage an update that peers must agree on (the workers of a `RolloutPool`): finish the step in flight,
        validate every record (on every rank), write nothing. Then `commit_weight_update()` (write and verify)
        and `publish_weight_update()` (the version moves), or `drop_weight_update()` at any point before
        publishing. Raises a ValueError (WeightUpdateError) and stages nothing if the update is refused.

        A staged update keeps the old values of densely updated tensors from commit until publish or drop (as
        much device memory as its dense records, on each rank), so that a drop after commit restores them.
        The engine does not sleep while an update is staged, and must not step between commit and publish
        (tokens would be sampled from new weights under the old version)."""
        self._weights.prepare(version, updates)

    def commit_weight_update(self) -> None:
        """Write and verify the staged update; the version does not move yet. A failure writes the old values
        back, leaves nothing staged and raises."""
        self._weights.commit()

    def publish_weight_update(self) -> "UpdateResult":
        """Make the committed update current: `policy_version` becomes its version."""
        return self._weights.publish()

    def drop_weight_update(self) -> str:
        """Drop the staged update, writing back what its commit wrote; returns what was restored, in words
        ("nothing staged" if no update is)."""
        return self._weights.drop()

    def load_weights(self, path: str, version: int | None = None) -> "UpdateResult":
        """Overwrite the weights in place with a checkpoint directory's (safetensors, the same architecture:
        the names and shapes the engine holds; float tensors cast to the engine's dtype), as one dense
        update: every tensor is checked before any is written. `version` defaults to policy_version + 1."""
        return self._weights.load(path, version)

    def rank_local_layouts(self) -> list[dict]:
        """Per rank, checkpoint name -> `CheckpointSlot`: which rows or columns of each checkpoint tensor
        the rank holds (`shard`, along `dim`) and their shape (`shard_shape`); what a trainer cuts its
        weights by for `update_weights_rank_local` (see `weight_updates.transports.rank_local`)."""
        return self._weights.rank_local_layouts()

    def rank_local_checksums(self) -> list[dict[str, int]]:
        """Per rank, checkpoint name -> checksum (`weight_updates.checksum`) of the rank's part as it holds
        it now: what a trainer compares its own parts with (`TrainerBridge.adopt_engine_weights`)."""
        return self._weights.rank_local_checksums()

    def update_weights_rank_local(self, version: int, handles: Sequence[dict]) -> "UpdateResult":
        """Apply a weight update whose records for rank r (in rank r's coordinates, see
        `rank_local_layouts`) the trainer staged where rank r can map them: `handles[r]` is the JSON of
        `weight_updates.transports.rank_local.stage_bucket` (a /dev/shm segment on the CPU, a CUDA IPC
        handle on the GPU). Only the handles travel through this process; each rank maps its own bucket.

        Every rank validates before any rank writes, and `policy_version` becomes `version` only when every
        rank has written and verified; otherwise a WeightUpdateError (a ValueError) names the failing ranks
        and their errors, and every rank's weights and the version are as they were. Returns rank 0's result."""
        return self._weights.update_rank_local(version, handles)

    # ---- LoRA adapters (rollout/loras.py) -------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> "LoraInfo":
        """Load the PEFT adapter directory `path` (adapter_config.json + adapter_model.safetensors) into a free
        adapter slot under `name`, for requests with `SamplingParams(lora=name)`. Checked in full (against the
        model, `max_lora_rank` and `lora_target_modules`) before the slot is written; a ValueError otherwise, and
        when the name is taken or every slot is in use. Between steps; running requests go on. With
        `EngineConfig.lora_merged` the adapter is folded into the base weights instead (no rank limit), refused
        while one is merged or base requests are unfinished (rollout/loras.py)."""
        return self._lora_manager().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Free `name`'s slot (zeroed; merged mode: the base weights written back bitwise). Refused (ValueError)
        while any unfinished request uses the adapter: finish or abort them first. A later `load_lora` under the
        same name is a new adapter (no prefix-cache blocks of the old one are reused)."""
        self._lora_manager().unload(name)

    def list_loras(self) -> list["LoraInfo"]:
        """The loaded adapters, in load order (none when LoRA is off)."""
        return [] if self._loras is None else [lora.info() for lora in self._loras.loaded.values()]

    def lora_specs(self, name: str) -> dict:
        """PEFT tensor name (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`) -> (shape, dtype)
        of every tensor of adapter `name` a push may carry (A [r, in], B [out, r])."""
        return self._lora_manager().specs(name)

    def apply_lora_update(self, name: str, updates, version: int | None = None) -> "UpdateResult":
        """Write Dense/Patch records of adapter `name`'s A / B tensors (names of `lora_specs`) in place, between
        steps; `version`, the adapter's new version, defaults to its current one + 1. Nothing is written unless
        every record validates (a wrong name, rank or shape raises a ValueError and changes nothing). On success
        `policy_version` moves by one (no new request reuses prefix-cache blocks of the old weights) and later
        tokens of the adapter's requests record the new adapter version (`CompletionOutput.lora_versions`).
        Returns the session's result (its `version` is the adapter's)."""
        return self._lora_manager().apply(name, updates, version)

    def prepare_lora_update(self, name: str, updates, version: int | None = None) -> None:
        """`apply_lora_update` staged for peers that must agree (the workers of a `RolloutPool`), as
        `prepare_weight_update` stages a base update: validate every record, write nothing (a ValueError, and nothing
        staged, if refused); then `commit_lora_update()` and `publish_lora_update()`, or `drop_lora_update()` at any
        point before publishing. While it is staged the engine takes no base update, no other push, no unload of the
        adapter and no sleep, and must not step between commit and publish."""
        self._lora_manager().prepare(name, updates, version)

    def commit_lora_update(self) -> None:
        """Write and verify the staged adapter push; the versions do not move yet. A failure writes the old values
        back, leaves nothing staged and raises."""
        self._lora_manager().commit()

    def publish_lora_update(self) -> "UpdateResult":
        """Make the committed adapter push current: the adapter's version and `policy_version` move by one."""
        return self._lora_manager().publish()

    def drop_lora_update(self) -> str:
        """Drop the staged adapter push, writing back what its commit wrote; what was restored, in words ("nothing
        staged" if no push is)."""
        return self._lora_manager().drop()

    def export_lora(self, name: str) -> list:
        """Every A / B tensor of adapter `name` as a full `Dense` record in PEFT's names (copies), e.g. to bring
        another engine's load of the same adapter to its pushed weights (`apply_lora_update`)."""
        return self._lora_manager().export(name)

    def _lora_manager(self):
        if self._loras is None:
            raise ValueError("this engine serves no LoRA adapters (EngineConfig.max_loras is 0)")
        return self._loras

    # ---- sleep / wake (rollout/sleep.py) ---------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give device memory to a trainer that shares the device between rollout batches.

        Level 1 frees the KV cache and the CUDA graphs; the weights stay on the device, so weight updates
        still apply while the engine sleeps. Level 2 also moves the weights to host memory (pinned on CUDA);
        updates then wait for `wake_up(["weights"])`. The prefix cache is emptied (its blocks' contents are
        gone). Requires no unfinished requests: finish or abort them first.
        """
        if self.has_unfinished_requests():
            raise ValueError("sleep() with unfinished requests: finish or abort them first")
        if self._weights.staged is not None or (self._loras is not None and self._loras.staged is not None):
            raise ValueError("sleep() with a staged weight update: publish or drop it first")
        self._sleep.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what `sleep` freed: `tags` "weights" and/or "kv_cache" (default both), so a caller can
        restore the weights, push an update, and only then allocate the KV cache. The KV cache comes back
        empty (same size, graphs captured again); the weights bitwise as they were or as updated."""
        self._sleep.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleep.asleep)

    # ---- lifetime ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- speculative decoding ---------------------------------------------------------------------------
    @property
    def spec_decode_stats(self) -> dict | None:
        """Engine totals (counters as in each output's spec_decode_stats) and, under "auto_off", per batch-size
        bucket the measured tokens/s with and without speculation and whether it speculates there now."""
        if self.spec_controller is None:
            return None
        return self._spec_totals.summary(self.spec_controller)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt, add_special_tokens: bool
                  ) -> tuple[str | None, list[int], "PromptEmbeds | None"]:
        """(text or None, token ids, None), or for an embedding prompt (None, placeholder ids, its PromptEmbeds)."""
        if isinstance(prompt, Mapping):
            return self._dict_prompt(prompt, add_special_tokens)
        return (*self._tokens(prompt, add_special_tokens), None)

    def _dict_prompt(self, prompt: Mapping, add_special_tokens: bool
                     ) -> tuple[str | None, list[int], "PromptEmbeds | None"]:
        keys = set(prompt)
        unknown = sorted(map(str, keys - set(_DICT_PROMPT_KEYS)))
        if unknown:
            raise ValueError(f"a dict prompt takes one of the keys {list(_DICT_PROMPT_KEYS)}, got unknown {unknown}")
        if "prompt_embeds" in keys and len(keys) > 1:
            raise ValueError(f"prompt_embeds cannot be combined with other prompt fields {sorted(keys - {'prompt_embeds'})}: "
                             "a prompt is text, token ids or embeddings")
        if len(keys) != 1:
            raise ValueError(f"a dict prompt takes exactly one of {list(_DICT_PROMPT_KEYS)}, got {sorted(keys)}")
        (key,) = keys
        value = prompt[key]
        if key == "prompt_embeds":
            return (None, *self._embeds_prompt(value))
        if key == "prompt" and not isinstance(value, str):
            raise ValueError(f"prompt (of a dict prompt) must be a str, got {type(value).__name__}")
        if key == "prompt_token_ids" and (isinstance(value, str) or not isinstance(value, Sequence)
                                          or not all(isinstance(t, int) for t in value)):
            raise ValueError(f"prompt_token_ids must be a list of int token ids, got {type(value).__name__}")
        return (*self._tokens(value, add_special_tokens), None)

    def _embeds_prompt(self, value) -> tuple[list[int], "PromptEmbeds"]:
        """An embedding prompt's placeholder token ids and its checked rows (rollout/prompt_embeds.py)."""
        from rollout.prompt_embeds import PLACEHOLDER_TOKEN_ID, check_prompt_embeds

        refusal = self.prompt_embeds_refusal()
        if refusal is not None:
            raise ValueError(f"prompt_embeds: {refusal}")
        embeds = check_prompt_embeds(value, hidden_size=self.model_config.hidden_size, dtype=self.runner.dtype)
        return [PLACEHOLDER_TOKEN_ID] * embeds.num_tokens, embeds

    def _tokens(self, prompt: str | Sequence[int], add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is text but {self.config.tokenizer or self.config.model} has no tokenizer.json; "
                    "pass token ids instead"
                )
            return prompt, self.tokenizer.encode(prompt, add_special_tokens)
        if not isinstance(prompt, Sequence) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"prompt must be a str, a list of int token ids or a dict prompt, got {type(prompt).__name__}")
        return None, list(prompt)

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams,
                         embeds: "PromptEmbeds | None" = None) -> None:
        if len(token_ids) == 0:
            raise ValueError("prompt is empty")
        if embeds is not None and embeds.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt_embeds has {embeds.num_tokens} rows (prompt positions); max_model_len="
                             f"{self.max_model_len} leaves no room to generate")
        if params.lora is not None and self._loras is None:
            raise ValueError("SamplingParams.lora: this engine serves no LoRA adapters (EngineConfig.max_loras is 0)")
        if self._loras is not None:
            self._loras.check_request(params.lora)  # merged mode: no base requests while an adapter is merged
        if params.return_routed_experts:
            refusal = self.routed_experts_refusal()
            if refusal is not None:
                raise ValueError(f"SamplingParams.return_routed_experts: {refusal}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, but {self.config.tokenizer or self.config.model} has no "
                             "tokenizer.json; use stop_token_ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        total = min(len(token_ids) + params.max_tokens, self.max_model_len)
        need = -(-total // self.config.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks but the cache has {self.num_kv_blocks}; "
                "lower max_tokens or enlarge the cache"
            )
