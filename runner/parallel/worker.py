"""Tensor-parallel ranks behind one engine: rank 0 drives, worker ranks follow.

    Engine (rank 0)                               worker rank r = 1..P-1 (spawned process)
      TensorParallelRunner.execute(sched)           run_worker loop:
        broadcast {"op": "execute", ...}   ----->     msg = broadcast_json()
        local ModelRunner.execute(sched)               ModelRunner.execute(decode(msg))
              \\___ collectives inside the forward and the sampler ___/
        -> RunnerOutput (rank 0's copy)               (its copy is dropped)

Every call that touches the model (KV-cache sizing, cache allocation, graph capture, a step, scoring,
a weight update, sleep / wake, release) is one JSON message from rank 0 over the gloo control channel,
then the same call on every rank, so all ranks enter their collectives in the same order. Step messages
are plain data (the scheduler's dataclasses as JSON). Under async scheduling the message is "launch":
every rank enqueues step t+1 and then collects step t, so each rank stages its next step while the
device runs the current one; any other message finds the workers' step collected (rank 0 drains first).
Weight updates come two ways: records from rank 0, whose payloads follow their JSON metadata as broadcast
tensors ("apply_weight_update"), or rank-local, where the message carries one JSON handle per rank and
each rank maps its own part's bucket, written by the trainer rank on its host or device
("apply_rank_local_update", weight_updates/transports/rank_local.py). Not here: scheduling (rollout/),
the layers and the sampler (this package's other modules).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import sys
import tempfile

import torch

from rollout.config import EngineConfig
from rollout.sampling_params import SamplingParams
from rollout.scheduler import CachedRequestData, NewRequestData, SchedulerOutput
from runner.model_config import ModelConfig

logger = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a group on "cuda:N" uses cuda:N+r; on the CPU every rank uses the CPU."""
    base = torch.device(device)
    return base if base.type == "cpu" else torch.device("cuda", (base.index or 0) + rank)


def check_rank_devices(device: str, size: int, num_gpus: int) -> None:
    """ValueError unless the `size` ranks of a group on `device` each find their GPU among `num_gpus`."""
    last = rank_device(device, size - 1)
    if last.type == "cuda" and last.index >= num_gpus:
        raise ValueError(f"tensor_parallel_size={size} on {device} needs {rank_device(device, 0)} .. {last}, "
                         f"but this host has {num_gpus} GPU(s)")


# ---- plain-data encoding of the scheduler's output -------------------------------------------------------
def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode_sched(sched: SchedulerOutput) -> dict:
    out = _fields(sched)
    out["new_reqs"] = [{**_fields(r), "params": _fields(r.params)} for r in sched.new_reqs]
    cached = sched.cached_reqs  # columns, not one object per request: a decode step carries every running one
    out["cached_reqs"] = {"req_id": [c.req_id for c in cached], "new_block_ids": [c.new_block_ids for c in cached],
                          "num_computed_tokens": [c.num_computed_tokens for c in cached]}
    out["finished_req_ids"] = sorted(sched.finished_req_ids)
    out["preempted_req_ids"] = sorted(sched.preempted_req_ids)
    return out


def decode_sched(data: dict) -> SchedulerOutput:
    data = dict(data)
    data["new_reqs"] = [NewRequestData(**{**r, "params": SamplingParams(**r["params"])}) for r in data["new_reqs"]]
    cached = data["cached_reqs"]
    data["cached_reqs"] = [CachedRequestData(r, b, n) for r, b, n in
                           zip(cached["req_id"], cached["new_block_ids"], cached["num_computed_tokens"])]
    data["finished_req_ids"] = set(data["finished_req_ids"])
    data["preempted_req_ids"] = set(data["preempted_req_ids"])
    return SchedulerOutput(**data)


# ---- weight-update records: JSON metadata + broadcast payloads -------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _payloads(update) -> list[torch.Tensor]:
    from weight_updates import Dense

    if isinstance(update, Dense):
        return [update.tensor]
    escapes = update.escapes if update.escapes is not None else update.values.new_empty(0)
    return [update.indices.gaps, update.indices.overflow, update.values, escapes]


def broadcast_updates(tp, updates: list | None) -> list:
    """Rank 0 passes its Dense/Patch records; every rank returns equal records (payloads on the host)."""
    from weight_updates import Dense, PackedIndices, Patch

    meta = None
    if tp.rank == 0:
        meta = [
            {"kind": "dense" if isinstance(u, Dense) else "patch", "name": u.name, "checksum": u.checksum,
             "tensors": [(_dtype_name(t.dtype), list(t.shape)) for t in _payloads(u)]}
            for u in updates
        ]
    meta = tp.broadcast_json(meta)
    records = []
    for i, m in enumerate(meta):
        if tp.rank == 0:
            tensors = [t.detach().cpu().contiguous() for t in _payloads(updates[i])]
        else:
            tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in m["tensors"]]
        for t in tensors:
            tp.broadcast_host_tensor(t)
        if tp.rank == 0:
            records.append(updates[i])
        elif m["kind"] == "dense":
            records.append(Dense(name=m["name"], tensor=tensors[0], checksum=m["checksum"]))
        else:
            gaps, overflow, values, escapes = tensors
            records.append(Patch(name=m["name"], indices=PackedIndices(gaps=gaps, overflow=overflow), values=values,
                                 checksum=m["checksum"], escapes=escapes if values.dtype == torch.int8 else None))
    return records


# ---- every rank: one runner and the calls rank 0 announces ---------------------------------------------
class _Rank:
    """What each rank holds: its group, its ModelRunner shard, its weight receivers.

    Two receivers write the same weights: "broadcast" in full checkpoint coordinates (every rank gets
    every record) and "rank_local" in the rank's own (each rank maps its own bucket). Each caches
    checksums in its own coordinates, so an update through one drops the other's cache, and both follow
    rank 0's policy version.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp) -> None:
        from runner.model_runner import ModelRunner

        self.tp = tp
        self.runner = ModelRunner(config, model_config, max_model_len, tp=tp)
        self.receivers: dict = {}  # "broadcast" | "rank_local" -> WeightReceiver, made on first use
        self.in_flight = None  # a worker's launched step (async scheduling), collected one step later

    def _receiver(self, path: str, current_version: int):
        from weight_updates import WeightReceiver

        receiver = self.receivers.get(path)
        if receiver is None:
            if path == "broadcast":
                receiver = WeightReceiver(self.runner.weights, version=current_version, dense_rollback=False)
            else:
                from runner.parallel.weights import RankLocalWeights

                # The rollback copy: a peer's failure after this rank wrote must leave this rank unchanged.
                receiver = WeightReceiver(RankLocalWeights(self.runner.model), version=current_version, dense_rollback=True)
            self.receivers[path] = receiver
        receiver.version = current_version
        for other_path, other in self.receivers.items():
            if other_path != path:
                other.invalidate_checksums()
        return receiver

    def handle(self, msg: dict, updates: list | None = None):
        op = msg["op"]
        runner = self.runner
        if op == "launch":  # a worker under async scheduling: launch t+1, then collect t, as rank 0 does
            handle = runner.launch(decode_sched(msg["sched"]))
            self._collect()
            self.in_flight = handle
            return None
        self._collect()  # any other call finds no step in flight, as rank 0 drains before it
        if op == "determine_num_kv_blocks":
            return self.tp.min_int(runner.determine_num_kv_blocks())
        if op == "allocate_kv_cache":
            return runner.allocate_kv_cache(msg["num_blocks"])
        if op == "capture_graphs":
            return runner.capture_graphs()
        if op == "sleep":
            return runner.sleep(msg["offload_weights"])
        if op == "wake_weights":
            return runner.wake_weights()
        if op == "wake_kv_cache":
            return runner.wake_kv_cache()
        if op == "execute":
            return runner.execute(decode_sched(msg["sched"]))
        if op == "full_sequence_logits":
            from runner.model_runner import full_sequence_logits

            return full_sequence_logits(runner, msg["token_ids"])
        if op == "apply_weight_update":
            records = broadcast_updates(self.tp, updates)
            return self._receiver("broadcast", msg["current_version"]).apply(msg["version"], records)
        if op == "apply_rank_local_update":
            from weight_updates.transports.rank_local import serve_rank_local

            receiver = self._receiver("rank_local", msg["current_version"])
            return serve_rank_local(receiver, msg["version"], msg["handles"][self.tp.rank], exchange=self.tp.all_gather_json)
        if op == "rank_local_checksums":
            from runner.parallel.weights import RankLocalWeights
            from weight_updates.checksum import checksum_tensors

            weights = RankLocalWeights(runner.model)
            names = list(weights.layout)
            sums = checksum_tensors([weights.view(n) for n in names]).tolist()
            return self.tp.all_gather_json(dict(zip(names, sums)))
        raise AssertionError(f"unknown op {op!r}")

    def _collect(self) -> None:
        """Collect the step in flight (its tokens fill the rank's token history)."""
        if self.in_flight is not None:
            self.runner.collect(self.in_flight)
            self.in_flight = None


def run_worker(rank: int, size: int, store_path: str, config: EngineConfig, model_config: ModelConfig,
               max_model_len: int, num_threads: int) -> None:
    """Entry point of a spawned worker rank: follow rank 0's calls until "release"."""
    from runner.parallel.group import TPGroup
    from weight_updates import WeightUpdateError

    torch.set_num_threads(num_threads)
    tp = TPGroup(rank, size, rank_device(config.device, rank), store_path)
    try:
        state = _Rank(config, model_config, max_model_len, tp)
        while True:
            msg = tp.broadcast_json()
            if msg["op"] == "release":
                break
            try:
                state.handle(msg)
            except WeightUpdateError:  # rank 0 raises the same error to the caller
                pass
    except BaseException:
        tp.close()
        raise
    # A released rank leaves at once, without aborting its NCCL communicators or tearing the interpreter
    # down: either can block past rank 0's join, and process exit releases the communicators and the CUDA
    # context anyway. The rank has nothing left to save but its streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorParallelRunner:
    """Rank 0's runner under tensor parallelism: spawns the worker ranks and mirrors every call to them.

    Reads of other attributes (`device`, `weights`, `model`, ...) go to rank 0's own ModelRunner.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        import torch.multiprocessing as mp

        from runner.parallel.group import TPGroup

        size = config.tensor_parallel_size
        check_rank_devices(config.device, size, torch.cuda.device_count())
        fd, store = tempfile.mkstemp(prefix="tp_store_")
        os.close(fd)
        os.unlink(store)  # the file store creates it
        self._store = store
        ctx = mp.get_context("spawn")
        self._workers = [
            ctx.Process(target=run_worker, daemon=True, name=f"tp-rank-{r}",
                        args=(r, size, store, config, model_config, max_model_len, torch.get_num_threads()))
            for r in range(1, size)
        ]
        for w in self._workers:
            w.start()
        tp = None
        try:
            tp = TPGroup(0, size, rank_device(config.device, 0), store)
            self._rank = _Rank(config, model_config, max_model_len, tp)
        except BaseException:
            for w in self._workers:
                w.terminate()
            if tp is not None:
                tp.close()
            raise
        self.tp = tp
        self.runner = self._rank.runner
        self._closed = False
        atexit.register(self.release)

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet: construction failed
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _call(self, msg: dict, updates: list | None = None):
        assert not self._closed, "the tensor-parallel runner is released"
        self.tp.broadcast_json(msg)
        return self._rank.handle(msg, updates)

    def determine_num_kv_blocks(self) -> int:
        """The fewest blocks any rank can hold (each rank measures its own memory)."""
        return self._call({"op": "determine_num_kv_blocks"})

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call({"op": "allocate_kv_cache", "num_blocks": num_blocks})

    def capture_graphs(self) -> None:
        self._call({"op": "capture_graphs"})

    def sleep(self, offload_weights: bool) -> None:
        self._call({"op": "sleep", "offload_weights": bool(offload_weights)})

    def wake_weights(self) -> None:
        self._call({"op": "wake_weights"})

    def wake_kv_cache(self) -> None:
        self._call({"op": "wake_kv_cache"})

    def execute(self, sched: SchedulerOutput):
        return self._call({"op": "execute", "sched": encode_sched(sched)})

    def launch(self, sched: SchedulerOutput):
        """Async scheduling: every rank enqueues the step; rank 0's handle is collected by `collect`."""
        assert not self._closed, "the tensor-parallel runner is released"
        self.tp.broadcast_json({"op": "launch", "sched": encode_sched(sched)})
        return self.runner.launch(sched)

    def collect(self, handle):
        return self.runner.collect(handle)

    def full_sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Full-vocabulary logits [len(token_ids), vocab] of one sequence (see model_runner.full_sequence_logits)."""
        return self._call({"op": "full_sequence_logits", "token_ids": list(token_ids)})

    def apply_weight_update(self, version: int, updates: list, current_version: int):
        """Apply Dense/Patch records on every rank (each writes its own shard); rank 0's UpdateResult."""
        from weight_updates import Dense, Patch, WeightUpdateError

        updates = list(updates)
        for u in updates:  # checked before any rank starts: the workers must see well-formed records
            if not isinstance(u, (Dense, Patch)):
                raise WeightUpdateError(f"not an update record: {type(u).__name__}")
        msg = {"op": "apply_weight_update", "version": version, "current_version": current_version}
        return self._call(msg, updates)

    def apply_rank_local_update(self, version: int, handles: list[dict], current_version: int):
        """Every rank maps `handles[rank]` (JSON from `weight_updates.transports.rank_local.stage_bucket`:
        its own part's records) and applies it; the ranks vote so that all publish `version` or none changes
        anything. Returns rank 0's UpdateResult; raises WeightUpdateError naming the failing ranks."""
        if len(handles) != self.tp.size:
            raise ValueError(f"{len(handles)} handles for {self.tp.size} tensor-parallel ranks")
        msg = {"op": "apply_rank_local_update", "version": version, "current_version": current_version, "handles": list(handles)}
        try:
            json.dumps(msg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"rank-local handles must be plain JSON: {e}") from None
        return self._call(msg)

    def rank_local_checksums(self) -> list[dict[str, int]]:
        """Per rank, checkpoint name -> checksum of the rank's part (`weight_updates.checksum`)."""
        return self._call({"op": "rank_local_checksums"})

    def release(self) -> None:
        """Stop the workers, drop rank 0's weights and cache, and leave the process group; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.release)
        try:
            self.tp.broadcast_json({"op": "release"})
            self.runner.release()
        finally:
            self.tp.close()  # while the workers close theirs, not after waiting for them
            for w in self._workers:
                w.join(timeout=60)
                if w.is_alive():
                    logger.warning("tensor-parallel worker %s did not exit; terminating it", w.name)
                    w.terminate()
            if os.path.exists(self._store):
                os.unlink(self._store)
