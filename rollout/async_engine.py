"""asyncio front end: many coroutines share one Engine that steps in a background thread.

Agentic and multi-turn RL rollouts are many independent episodes, each waiting on its own completion
(then calling a tool, then asking again). `AsyncEngine` lets each episode `await generate(...)` (or
`async for` over `stream(...)`, which yields deltas: the new tokens and text of each step) while the engine
batches whatever requests are pending at every step::

    engine = AsyncEngine(EngineConfig(model="path/to/hf_dir"))

    async def episode(prompt_ids):
        out = await engine.generate(prompt_ids, SamplingParams(max_tokens=64, seed=1))
        follow_up = prompt_ids + out.outputs[0].token_ids + tool_result_ids
        return await engine.generate(follow_up, SamplingParams(max_tokens=64, seed=2))

    results = await asyncio.gather(*(episode(p) for p in prompts))
    await engine.call(lambda e: bridge.push_weights(policy))   # between steps, on the engine's thread
    engine.close()

The Engine is used only from its thread: requests, aborts and `call`s are commands the thread runs
between steps, so a weight update or `sleep` never lands in the middle of a step. A bad request raises
its ValueError in the coroutine that sent it; the others go on. A cancelled `generate` / `stream` aborts
its request; `abort(request_id)` ends one early and its caller gets the partial output (partial rollouts:
stop the stragglers once enough groups are done); `abort_all()` ends every one. `pause()` stops stepping (requests
keep their place and blocks; commands such as weight updates still run) until `resume()`. Not here: HTTP serving (rollout/server.py), chat
templates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from rollout.config import EngineConfig
from rollout.outputs import RequestOutput
from rollout.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from rollout.engine import Engine

logger = logging.getLogger(__name__)

_STOP = object()  # the command that ends the engine thread


class AsyncEngine:
    """One `Engine` driven by a background thread; coroutine-friendly `generate`, `stream`, `abort` and `call`."""

    def __init__(self, config_or_engine: "EngineConfig | Engine") -> None:
        from rollout.engine import Engine

        self.engine = config_or_engine if isinstance(config_or_engine, Engine) else Engine(config_or_engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, loop, future) | _STOP
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._ids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None  # a step that raised: the engine thread has stopped
        self._paused = False  # engine thread only: no steps while set
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)
        self._thread.start()

    # ---- coroutines ---------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestOutput:
        """The finished RequestOutput of one prompt (all n samples, cumulative), built once, when it finishes."""
        out = None
        async for out in self._outputs(prompt, params, request_id, RequestOutputKind.FINAL_ONLY):
            pass
        return out

    def stream(self, prompt, params: SamplingParams | None = None,
               request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one prompt (`params.output_kind` is set to DELTA): after every step that gave it
        tokens, a RequestOutput of the samples that changed, each with only its new token ids, logprobs, top
        logprobs, policy versions and text (from the first chunk on; a trailing partial character, or text
        that could still begin a stop string, waits for the next). A sample's last delta carries its
        finish_reason and the last output is `finished`; a sample's deltas concatenate to the text and lists
        that `generate` returns (`RequestOutput.add` folds them)."""
        return self._outputs(prompt, params, request_id, RequestOutputKind.DELTA)

    async def _outputs(self, prompt, params: SamplingParams | None, request_id: str | None,
                       kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
        """The prompt's outputs of `kind`, the last one finished; aborts the request if the consumer stops early."""
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):  # anything else is refused by add_request
            params = dataclasses.replace(params, output_kind=kind)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        rid = f"async-{next(self._ids)}" if request_id is None else str(request_id)

        def add(engine) -> str:
            engine.add_request(prompt, params, rid)  # a bad request raises here, and nothing is queued
            self._streams[rid] = (loop, outputs)
            return rid

        try:
            await self.call(add)
        except asyncio.CancelledError:  # the add still runs on the engine thread: abort what it added
            def undo(engine) -> None:
                if self._streams.get(rid, (None, None))[1] is outputs:
                    self._abort(engine, rid)

            if not self._closed and self._error is None:
                self._post(undo)
            raise
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished and not self._closed and self._error is None:  # cancelled, or the consumer stopped early
                self._post(lambda engine: self._abort(engine, rid))

    async def abort(self, request_id: str) -> bool:
        """Abort a request: its `generate` returns the output so far (its `stream` ends with a last delta),
        finish_reason "abort" for the samples still running. False for an id that is unknown or already finished."""
        return await self.call(lambda engine: self._abort_one(engine, request_id))

    def _abort_one(self, engine, request_id: str) -> bool:
        out = engine.abort_request(request_id)
        target = self._streams.pop(request_id, None)
        if out is not None and target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        return out is not None

    async def abort_all(self) -> int:
        """Abort every request in flight, as `abort` does each; returns how many there were."""
        def abort_all(engine) -> int:
            return sum(self._abort_one(engine, rid) for rid in list(self._streams))

        return await self.call(abort_all)

    async def pause(self) -> None:
        """Stop stepping once the step in flight is done: requests keep their place (and KV blocks) and new
        ones queue; commands still run. Until `resume()`."""
        def pause(engine) -> None:
            self._paused = True

        await self.call(pause)

    async def resume(self) -> None:
        """Step again after `pause()` (nothing if not paused)."""
        def resume(engine) -> None:
            self._paused = False

        await self.call(resume)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine's thread between two steps; returns its result or raises its error.
        For anything else the Engine offers: weight updates, sleep / wake_up, stats."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(fn, loop, future)
        return await future

    # ---- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread (pending coroutines get a RuntimeError) and release the engine."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        self._thread.join()
        self.engine.close()

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the engine thread ------------------------------------------------------------------------------
    def _post(self, fn, loop: asyncio.AbstractEventLoop | None = None, future: asyncio.Future | None = None) -> None:
        if self._closed or self._error is not None:
            raise RuntimeError(f"the AsyncEngine is {'closed' if self._closed else 'stopped'}") from self._error
        self._commands.put((fn, loop, future))

    def _run(self) -> None:
        engine = self.engine
        try:
            engine.runner.use_in_this_thread()
        except BaseException as e:
            logger.exception("the engine thread could not select its device; the AsyncEngine stops")
            self._error = e
            self._fail_all(e)
            return
        while True:
            # wait for work when idle; otherwise take every command that arrived during the last step
            idle = self._paused or not engine.has_unfinished_requests()
            try:
                commands = [self._commands.get(block=idle)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._fail_all(RuntimeError("the AsyncEngine was closed"))
                    return
                self._execute(*command)
            if not self._paused and engine.has_unfinished_requests():
                try:
                    outs = engine.step()
                except BaseException as e:  # the engine's state is unknown: stop, and tell every waiter
                    logger.exception("engine step failed; the AsyncEngine stops")
                    self._error = e
                    self._fail_all(e)
                    return
                for out in outs:
                    target = self._streams.get(out.request_id)
                    if target is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    loop, outputs = target
                    loop.call_soon_threadsafe(outputs.put_nowait, out)

    def _execute(self, fn, loop, future) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:
            if future is None:
                logger.warning("engine command failed: %s", e)
            else:
                loop.call_soon_threadsafe(_settle, future, None, e)
            return
        if future is not None:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _abort(self, engine, rid: str) -> None:
        self._streams.pop(rid, None)
        engine.abort_request(rid)

    def _fail_all(self, error: BaseException) -> None:
        for rid, (loop, outputs) in list(self._streams.items()):
            loop.call_soon_threadsafe(outputs.put_nowait, error)
        self._streams.clear()
        while True:  # commands that will never run
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[2] is not None:
                command[1].call_soon_threadsafe(_settle, command[2], None, error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
