"""AsyncEngine: concurrent multi-turn episodes over one engine thread give the synchronous engine's results
(deterministic mode, so batch composition cannot change a token); streaming, bad requests, cancellation,
commands between steps, close."""

from __future__ import annotations

import asyncio

import pytest

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams

TOOL = [9, 9, 4]  # what a "tool" appends between the two turns


@pytest.fixture(scope="module")
def model(ckpt_factory):
    return ckpt_factory("qwen2", seed=5)


def config(model, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", deterministic=True, max_num_seqs=8, num_kv_blocks=128, **kw)


def episode_params(i: int) -> tuple[list[int], SamplingParams, SamplingParams]:
    prompt = [2 + i, 3 + 2 * i, 7, 11 + i][: 2 + i % 3]
    return (prompt, SamplingParams(max_tokens=6 + i % 4, seed=100 + i, ignore_eos=True),
            SamplingParams(n=2, max_tokens=5, seed=200 + i, ignore_eos=True))


def run_sync(engine: Engine, i: int):
    prompt, first, second = episode_params(i)
    out = engine.generate([prompt], first)[0]
    follow = prompt + out.outputs[0].token_ids + TOOL
    return out.outputs[0].token_ids, [c.token_ids for c in engine.generate([follow], second)[0].outputs]


async def run_async(engine: AsyncEngine, i: int):
    prompt, first, second = episode_params(i)
    await asyncio.sleep(0.001 * (i % 3))  # episodes start and finish at different steps
    out = await engine.generate(prompt, first)
    follow = prompt + out.outputs[0].token_ids + TOOL
    return out.outputs[0].token_ids, [c.token_ids for c in (await engine.generate(follow, second)).outputs]


def test_concurrent_episodes_equal_the_synchronous_engine(model):
    sync_engine = Engine(config(model))
    expected = [run_sync(sync_engine, i) for i in range(10)]

    async def main():
        with AsyncEngine(config(model)) as engine:
            results = await asyncio.gather(*(run_async(engine, i) for i in range(10)))
            return results, engine.engine.scheduler.stats.num_steps

    results, num_steps = asyncio.run(main())
    assert results == expected
    assert num_steps < sync_engine.scheduler.stats.num_steps / 3  # the episodes shared steps


def test_stream_bad_request_cancel_and_call_between_steps(model):
    async def main():
        with AsyncEngine(config(model)) as engine:
            # streaming: one delta per step (each step adds one token), only the last one finished; the deltas
            # concatenate to what generate returns
            seeded = SamplingParams(max_tokens=8, seed=4, ignore_eos=True)
            deltas = [o async for o in engine.stream([5, 6, 7], seeded)]
            assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 8
            assert [o.finished for o in deltas] == [False] * 7 + [True]
            whole = await engine.generate([5, 6, 7], seeded)
            assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.outputs[0].token_ids
            assert [lp for o in deltas for lp in o.outputs[0].logprobs] == whole.outputs[0].logprobs
            # a bad request fails in its own coroutine; the good ones finish
            good = [engine.generate([4, 5], SamplingParams(max_tokens=6, seed=s, ignore_eos=True)) for s in range(3)]
            results = await asyncio.gather(engine.generate([], SamplingParams()), *good, return_exceptions=True)
            assert isinstance(results[0], ValueError) and "empty" in str(results[0])
            assert all(len(r.outputs[0].token_ids) == 6 for r in results[1:])
            # cancelling a consumer aborts its request and frees its blocks
            seen = asyncio.Event()

            async def consume():
                async for _ in engine.stream([8, 9], SamplingParams(max_tokens=100, ignore_eos=True)):
                    seen.set()

            task = asyncio.create_task(consume())
            await seen.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            idle = await engine.call(lambda e: (e.has_unfinished_requests(), e.kv_manager.pool.num_used_blocks, len(e.output_processor)))
            assert idle == (False, 0, 0)
            # a command's error reaches its caller; the engine thread goes on
            with pytest.raises(ValueError, match="sleep level"):
                await engine.call(lambda e: e.sleep(7))
            assert (await engine.generate([3, 4], SamplingParams(max_tokens=2))).finished
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate([3, 4], SamplingParams(max_tokens=2))

    asyncio.run(main())


def test_abort_returns_the_partial_output_to_its_caller(model):
    """Partial rollouts: Engine.abort_request hands back what a prompt has so far; through AsyncEngine.abort
    the awaiting generate returns it, finish_reason "abort" for the samples still running."""
    engine = Engine(config(model))
    engine.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=50, seed=1, ignore_eos=True), request_id="a")
    for _ in range(5):
        engine.step()
    out = engine.abort_request("a")
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 50 and len(c.logprobs) == len(c.token_ids) for c in out.outputs)
    assert engine.abort_request("a") is None and engine.kv_manager.pool.num_used_blocks == 0

    async def main():
        with AsyncEngine(config(model)) as aengine:
            task = asyncio.create_task(aengine.generate([5, 6, 7], SamplingParams(max_tokens=200, seed=1, ignore_eos=True),
                                                        request_id="long"))
            short = await aengine.generate([8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
            assert await aengine.abort("long") and not await aengine.abort("long")
            return short, await task

    short, partial = asyncio.run(main())
    c = partial.outputs[0]
    full = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=200, seed=1, ignore_eos=True))[0].outputs[0]
    assert short.outputs[0].finish_reason == "length"
    assert c.finish_reason == "abort" and 1 <= len(c.token_ids) < 200
    assert c.token_ids == full.token_ids[: len(c.token_ids)]  # seeded: the start of the unaborted sample


def test_a_failing_step_reaches_every_waiter_and_stops_the_engine(model):
    async def main():
        aengine = AsyncEngine(config(model))
        try:
            def broken():
                raise RuntimeError("device lost")

            aengine.engine.step = broken
            results = await asyncio.gather(*(aengine.generate([3, 4, 5], SamplingParams(max_tokens=4)) for _ in range(3)),
                                           return_exceptions=True)
            # the step's error itself, or (for a request sent after the thread stopped) one caused by it
            assert all(isinstance(r, RuntimeError) and "device lost" in f"{r} {r.__cause__}" for r in results)
            with pytest.raises(RuntimeError, match="stopped"):
                await aengine.generate([3, 4], SamplingParams(max_tokens=2))
        finally:
            aengine.close()

    asyncio.run(main())
