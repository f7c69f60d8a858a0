"""How the engine reaches its runner: one interface for a single process and for a tensor-parallel group.

    executor.launch(sched) -> handle; executor.collect(handle) -> RunnerOutput; executor.execute(sched)
                                          one step (every rank runs it; rank 0's results come back)
    executor.collective_rpc(method, *args) -> [result of rank 0, rank 1, ...]
                                          any other call, on every rank: `method` names a ModelRunner
                                          method or attribute path ("allocate_kv_cache",
                                          "weight_sync.prepare"), or "package.module:function", which is
                                          called as function(runner, *args)
    executor.driver                       rank 0's ModelRunner (its device, weights, graphs, ...)

An exception on any rank reaches the caller as one error after every rank has finished the call (see
`runner.parallel.rpc.rank_error`); in a single process it is the runner's own exception. Adding a call
that must run on every rank is therefore a method on ModelRunner (or a function anywhere) and nothing
else. `make_executor` picks the single-process one or `runner.parallel.worker.TensorParallelExecutor`.
Not here: scheduling, the steps' contents.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from runner.config import RunnerConfig
    from runner.messages import RunnerOutput, SchedulerOutput
    from runner.model_config import ModelConfig
    from runner.model_runner import ModelRunner, StepHandle


def resolve(runner: "ModelRunner", method: str):
    """The callable `method` names on `runner` (see the module docstring)."""
    if ":" in method:
        module, _, name = method.partition(":")
        fn = getattr(importlib.import_module(module), name)
        return lambda *args: fn(runner, *args)
    target = runner
    for part in method.split("."):
        if part.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} names a private attribute")
        target = getattr(target, part)
    return target


class Executor(Protocol):
    driver: "ModelRunner"

    def launch(self, sched: "SchedulerOutput") -> "StepHandle": ...

    def collect(self, handle: "StepHandle") -> "RunnerOutput": ...

    def execute(self, sched: "SchedulerOutput") -> "RunnerOutput": ...

    def collective_rpc(self, method: str, *args: Any) -> list: ...

    def release(self) -> None: ...


class LocalExecutor:
    """One process, one ModelRunner."""

    def __init__(self, config: "RunnerConfig", model_config: "ModelConfig", max_model_len: int) -> None:
        from runner.model_runner import ModelRunner

        self.driver = ModelRunner(config, model_config, max_model_len)

    def launch(self, sched: "SchedulerOutput") -> "StepHandle":
        return self.driver.launch(sched)

    def collect(self, handle: "StepHandle") -> "RunnerOutput":
        return self.driver.collect(handle)

    def execute(self, sched: "SchedulerOutput") -> "RunnerOutput":
        return self.driver.execute(sched)

    def collective_rpc(self, method: str, *args: Any) -> list:
        return [resolve(self.driver, method)(*args)]

    def release(self) -> None:
        self.driver.release()


def make_executor(config: "RunnerConfig", model_config: "ModelConfig", max_model_len: int) -> Executor:
    if config.tensor_parallel_size > 1:
        from runner.parallel.worker import TensorParallelExecutor

        return TensorParallelExecutor(config, model_config, max_model_len)
    return LocalExecutor(config, model_config, max_model_len)
