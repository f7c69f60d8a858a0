"""Tensor-parallel ranks behind one engine: rank 0 drives, worker ranks follow.

    Engine (rank 0)                                  worker rank r = 1..P-1 (spawned process)
      TensorParallelExecutor.execute(sched)            follow() loop:
        broadcast {"kind": "step", "op": "execute"} --->  msg = broadcast_json()
        local ModelRunner.execute(sched)                  ModelRunner.execute(SchedulerOutput.from_dict(...))
              \\___ collectives inside the forward and the sampler ___/
        -> RunnerOutput (rank 0's copy)                   (its copy is dropped)

      TensorParallelExecutor.collective_rpc(m, *args)
        broadcast {"kind": "rpc", "method", "args"} ---->  the args (JSON, then their tensors as bytes)
        + each tensor argument, broadcast as bytes
        run m on rank 0                                   run m on this rank (errors caught)
        all-gather every rank's {result | error}  <--->   all-gather
        -> [results in rank order], or one error naming the failing ranks

Every call that touches the model goes to every rank in the same order, so all ranks enter their
collectives together. A step carries no reply (its results are rank 0's); any other call is a collective
RPC (runner/executor.py), whose results and errors are gathered from every rank, so an error on one rank
(a ValueError, a weight-update error, an out-of-memory in wake_up) reaches the caller naming the rank and
leaves every rank waiting for the next message. Under async scheduling the step message is "launch":
every rank enqueues step t+1 and then collects step t, so each rank stages its next step while the
device runs the current one; an RPC finds the workers' step collected (rank 0 drains first). Not here:
scheduling (rollout/), the layers and the sampler (this package's other modules).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import tempfile

import torch

from runner.config import RunnerConfig
from runner.messages import RunnerOutput, SchedulerOutput
from runner.model_config import ModelConfig
from runner.parallel.rpc import decode, describe, empty_tensors, encode, rank_error, tensor_specs

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


# ---- every rank ------------------------------------------------------------------------------------------
class _Follower:
    """A worker rank's ModelRunner and its step in flight; runs what rank 0 announces."""

    def __init__(self, runner, tp) -> None:
        self.runner, self.tp = runner, tp
        self.in_flight = None  # a launched step (async scheduling), collected one step later

    def step(self, msg: dict) -> None:
        sched = SchedulerOutput.from_dict(msg["sched"])
        if msg["op"] == "launch":  # launch t+1, then collect t, as rank 0 does
            handle = self.runner.launch(sched)
            self._collect()
            self.in_flight = handle
        else:
            self._collect()
            self.runner.execute(sched)

    def rpc(self, msg: dict) -> None:
        self._collect()  # an RPC finds no step in flight, as rank 0 drains before it
        tensors = empty_tensors(msg["tensors"])
        for t in tensors:
            self.tp.broadcast_host_tensor(t)
        _run_and_gather(self.tp, self.runner, msg["method"], decode(msg["args"], tensors))

    def _collect(self) -> None:
        if self.in_flight is not None:
            self.runner.collect(self.in_flight)
            self.in_flight = None


def _run_and_gather(tp, runner, method: str, args: list):
    """Run `method` on this rank, then gather every rank's outcome; rank 0 returns the results in rank order
    or raises one error naming the failing ranks (workers return nothing)."""
    from runner.executor import resolve

    value, error = None, None
    try:
        value = resolve(runner, method)(*args)
    except Exception as e:  # reported to rank 0 through the gather below; this rank waits for the next call
        error = describe(e)
        if tp.rank == 0:
            logger.debug("collective_rpc %s failed on rank 0", method, exc_info=True)
    outcome = {"error": error, "value": None if error is not None or tp.rank == 0 else encode(value)}
    outcomes = tp.all_gather_json(outcome)
    if tp.rank != 0:
        return None
    errors = [o["error"] for o in outcomes]
    if any(e is not None for e in errors):
        raise rank_error(method, errors)
    return [value] + [decode(o["value"]) for o in outcomes[1:]]


def run_worker(rank: int, size: int, store_path: str, config: RunnerConfig, model_config: ModelConfig,
               max_model_len: int, num_threads: int, models: dict[str, str]) -> None:
    """Entry point of a spawned worker rank: register rank 0's models (`models`: architecture -> import
    path), then follow rank 0's calls until "release"."""
    from runner.model_runner import ModelRunner
    from runner.models import ModelRegistry
    from runner.parallel.group import TPGroup

    for arch, path in models.items():
        ModelRegistry.register_model(arch, path)
    torch.set_num_threads(num_threads)
    tp = TPGroup(rank, size, rank_device(config.device, rank), store_path, expert_parallel=config.expert_parallel)
    try:
        follower = _Follower(ModelRunner(config, model_config, max_model_len, tp=tp), tp)
        while True:
            msg = tp.broadcast_json()
            if msg["kind"] == "release":
                break
            if msg["kind"] == "step":
                follower.step(msg)
            else:
                follower.rpc(msg)
    except BaseException:
        tp.close()
        raise
    # A released rank leaves at once, without aborting its NCCL communicators or tearing the interpreter
    # down: either can block past rank 0's join, and process exit releases the communicators and the CUDA
    # context anyway. The rank has nothing left to save but its streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorParallelExecutor:
    """Rank 0's side of a tensor-parallel engine: spawns the worker ranks, announces every step and call."""

    def __init__(self, config: RunnerConfig, model_config: ModelConfig, max_model_len: int) -> None:
        import torch.multiprocessing as mp

        from runner.model_runner import ModelRunner
        from runner.models import ModelRegistry
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
                        args=(r, size, store, config, model_config, max_model_len, torch.get_num_threads(),
                              ModelRegistry.import_paths()))
            for r in range(1, size)
        ]
        for w in self._workers:
            w.start()
        tp = None
        try:
            tp = TPGroup(0, size, rank_device(config.device, 0), store, expert_parallel=config.expert_parallel)
            self.driver = ModelRunner(config, model_config, max_model_len, tp=tp)
        except BaseException:
            for w in self._workers:
                w.terminate()
            if tp is not None:
                tp.close()
            raise
        self.tp = tp
        self._closed = False
        atexit.register(self.release)

    def _announce(self, msg: dict) -> None:
        assert not self._closed, "the tensor-parallel executor is released"
        self.tp.broadcast_json(msg)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._announce({"kind": "step", "op": "execute", "sched": sched.to_dict()})
        return self.driver.execute(sched)

    def launch(self, sched: SchedulerOutput):
        """Async scheduling: every rank enqueues the step; rank 0's handle is collected by `collect`."""
        self._announce({"kind": "step", "op": "launch", "sched": sched.to_dict()})
        return self.driver.launch(sched)

    def collect(self, handle) -> RunnerOutput:
        return self.driver.collect(handle)

    def collective_rpc(self, method: str, *args) -> list:
        """Run `method` (see runner/executor.py) on every rank; every rank's result, in rank order. Raises one
        error naming the failing ranks if it raised on any; every rank is then ready for the next call."""
        tensors: list[torch.Tensor] = []
        encoded = encode(list(args), tensors)
        self._announce({"kind": "rpc", "method": method, "args": encoded, "tensors": tensor_specs(tensors)})
        for t in tensors:
            self.tp.broadcast_host_tensor(t)
        return _run_and_gather(self.tp, self.driver, method, list(args))

    def release(self) -> None:
        """Stop the workers, drop rank 0's weights and cache, and leave the process group; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.release)
        try:
            self.tp.broadcast_json({"kind": "release"})
            self.driver.release()
        finally:
            self.tp.close()  # while the workers close theirs, not after waiting for them
            for w in self._workers:
                w.join(timeout=60)
                if w.is_alive():
                    logger.warning("tensor-parallel worker %s did not exit; terminating it", w.name)
                    w.terminate()
            if os.path.exists(self._store):
                os.unlink(self._store)
