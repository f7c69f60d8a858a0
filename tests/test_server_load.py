"""A bounded load test on 127.0.0.1: 200 concurrent mixed requests (completions, chat, /generate, streamed and
not, a few clients that disconnect, one oversized n) against a tiny CPU model served by uvicorn.

Every request that fits is answered exactly once, and every sample it asked for comes back exactly once
with the tokens a fresh engine gives the same (prompt, seed) (the engine runs in deterministic mode, where a
seeded sample does not depend on its batch): nothing lost, duplicated or mixed up between requests. The
oversized request is refused in under a second while the others run; the clients that left are aborted and
nothing is left running. p50 / p99 latency are printed. Bounded: 200 requests, 8 tokens each, one run."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from server_harness import LiveServer, chat_checkpoint  # noqa: E402

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server_config import ServerConfig  # noqa: E402

NUM_REQUESTS = 200
NEW_TOKENS = 8
KINDS = ["completion", "completion_stream", "chat", "chat_stream", "generate", "generate_stream"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("load"), seed=21)


def engine_config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=64, num_kv_blocks=1024)


def plan(rng: random.Random) -> list[dict]:
    """The requests: kind, prompt token ids (or chat text), n, seed; 8 of them disconnect, one asks n=100000."""
    out = []
    for i in range(NUM_REQUESTS):
        kind = KINDS[i % len(KINDS)]
        n = 1 if kind in ("chat_stream", "generate_stream") else rng.choice([1, 2, 3])
        out.append({"i": i, "kind": kind, "n": n, "seed": 1000 + i,
                    "ids": [rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))],
                    "text": f"request {i}: " + " ".join(rng.choice(["sun", "rain", "Paris", "fox"]) for _ in range(5)),
                    "disconnect": i % 25 == 7})
    out[NUM_REQUESTS // 2]["kind"] = "oversized"
    return out


async def send(client: httpx.AsyncClient, req: dict, added: dict[tuple, threading.Event]) -> dict:
    """Runs one request; returns what came back: {"samples": {index: token ids}, "prompt": ids, "status"}.
    `added`: an event per prompt of the clients that leave, set once the engine holds that prompt."""
    kind, n, seed = req["kind"], req["n"], req["seed"]
    common = {"max_tokens": NEW_TOKENS, "seed": seed, "ignore_eos": True, "n": n, "return_token_ids": True}
    sglang = {"max_new_tokens": NEW_TOKENS, "sampling_seed": seed, "ignore_eos": True, "n": n}
    messages = [{"role": "user", "content": req["text"]}]
    start = time.perf_counter()
    result = {"samples": {}, "prompt": req["ids"], "finishes": {}}
    if kind == "oversized":
        r = await client.post("/generate", json={"input_ids": req["ids"], "sampling_params": {**sglang, "n": 100000}})
        result.update(status=r.status_code, error=r.json()["error"])
    elif req["disconnect"]:
        body = {"prompt": req["ids"], **common, "max_tokens": 200, "stream": kind.endswith("stream")}
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # leave after the first event
        else:  # leave once the engine holds the request (a fixed wait could end before the server read it)
            task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            arrived = await asyncio.to_thread(added[tuple(req["ids"])].wait, 60)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert arrived, req
        result.update(status="left")
    elif kind == "completion":
        r = await client.post("/v1/completions", json={"prompt": req["ids"], **common})
        for c in r.json()["choices"]:
            result["samples"].setdefault(c["index"], []).append(c["token_ids"])
            result["finishes"].setdefault(c["index"], []).append(c["finish_reason"])
        result["status"] = r.status_code
    elif kind in ("completion_stream", "chat_stream"):
        path = "/v1/completions" if kind == "completion_stream" else "/v1/chat/completions"
        body = {"prompt": req["ids"]} if kind == "completion_stream" else {"messages": messages}
        async with client.stream("POST", path, json={**body, **common, "stream": True}) as r:
            result["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "prompt_token_ids" in chunk:
                    result["prompt"] = chunk["prompt_token_ids"]
                for c in chunk["choices"]:
                    if "prompt_token_ids" in c:
                        result["prompt"] = c["prompt_token_ids"]
                    if c.get("token_ids"):
                        result["samples"].setdefault(c["index"], [[]])[0].extend(c["token_ids"])
                    if c.get("finish_reason"):
                        result["finishes"].setdefault(c["index"], []).append(c["finish_reason"])
    elif kind == "chat":
        r = await client.post("/v1/chat/completions", json={"messages": messages, **common})
        body = r.json()
        result["prompt"] = body["prompt_token_ids"]
        for c in body["choices"]:
            result["samples"].setdefault(c["index"], []).append(c["token_ids"])
            result["finishes"].setdefault(c["index"], []).append(c["finish_reason"])
        result["status"] = r.status_code
    elif kind == "generate":
        r = await client.post("/generate", json={"input_ids": req["ids"], "sampling_params": sglang})
        results = r.json()
        for j, x in enumerate(results if isinstance(results, list) else [results]):
            result["samples"].setdefault(j, []).append(x["output_ids"])
            result["finishes"].setdefault(j, []).append(x["meta_info"]["finish_reason"]["type"])
        result["status"] = r.status_code
    elif kind == "generate_stream":
        last = None
        async with client.stream("POST", "/generate", json={"input_ids": req["ids"], "stream": True,
                                                             "sampling_params": sglang}) as r:
            result["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        result["samples"][0] = [last["output_ids"]]
        result["finishes"][0] = [last["meta_info"]["finish_reason"]["type"]]
    result["seconds"] = time.perf_counter() - start
    return result


def test_200_concurrent_mixed_requests(model_dir, caplog):
    caplog.set_level(logging.INFO)
    requests = plan(random.Random(5))
    with LiveServer(AsyncEngine(engine_config(model_dir)), ServerConfig()) as srv:
        engine = srv.engine.engine
        aborted: list[str] = []
        real_abort = engine.abort_request

        def abort_request(rid):
            out = real_abort(rid)
            if out is not None:
                aborted.append(rid)
            return out

        engine.abort_request = abort_request
        added = {tuple(req["ids"]): threading.Event() for req in requests if req["disconnect"]}
        real_add = engine.add_request

        def add_request(prompt, *args, **kwargs):
            out = real_add(prompt, *args, **kwargs)
            if isinstance(prompt, list) and tuple(prompt) in added:
                added[tuple(prompt)].set()
            return out

        engine.add_request = add_request

        async def main():
            limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS + 10)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(send(client, r, added) for r in requests))

        start = time.perf_counter()
        results = asyncio.run(main())
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:  # aborts land between steps
            time.sleep(0.01)
        assert not engine.has_unfinished_requests() and srv.app.state.server.pending == 0
    srv.engine.close()

    oversized = next(res for req, res in zip(requests, results) if req["kind"] == "oversized")
    assert oversized["status"] == 400 and oversized["error"]["param"] == "n"
    assert oversized["seconds"] < 1.0, oversized["seconds"]
    # the clients that left (200 tokens asked, gone once the engine held the request or after one event)
    # were aborted, one line each
    left = [req for req in requests if req["disconnect"] and req["kind"] != "oversized"]
    assert len(aborted) == len(left)
    lines = [r for r in caplog.records if r.name == "rollout.server" and "client left" in r.getMessage()]
    assert len(lines) == len(left)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]

    # every fitting request: answered, each asked-for sample exactly once, finished by length, with the
    # tokens a fresh engine gives the same prompt and seed
    fitting = [(req, res) for req, res in zip(requests, results) if req["kind"] != "oversized" and not req["disconnect"]]
    local = Engine(engine_config(model_dir))
    params = [SamplingParams(n=req["n"], max_tokens=NEW_TOKENS, seed=req["seed"], ignore_eos=True) for req, _ in fitting]
    expected = local.generate([res["prompt"] for _, res in fitting], params)
    for (req, res), want in zip(fitting, expected):
        assert res["status"] == 200, (req["kind"], res)
        assert sorted(res["samples"]) == list(range(req["n"])), (req["kind"], res["samples"].keys())
        assert all(len(v) == 1 for v in res["samples"].values()), req["kind"]  # no duplicates
        assert all(f == ["length"] for f in res["finishes"].values()), (req["kind"], res["finishes"])
        assert [res["samples"][j][0] for j in range(req["n"])] == [c.token_ids for c in want.outputs], req["kind"]
    latencies = sorted(res["seconds"] for _, res in fitting)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99) - 1]
    samples = sum(req["n"] for req, _ in fitting)
    print(json.dumps({"requests": len(fitting), "samples": samples, "wall_s": round(wall, 2),
                      "p50_s": round(p50, 3), "p99_s": round(p99, 3), "aborted": len(aborted),
                      "oversized_refused_s": round(oversized["seconds"], 4)}))
