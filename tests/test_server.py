"""The HTTP server (aiohttp, a real socket on localhost): SGLang /generate and OpenAI /v1/completions give
the engine's own results; bad requests get a 400 naming the problem and the server goes on; sleep / wake
and weight reloads from disk through their endpoints."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from conftest import perturbed_checkpoint  # noqa: E402

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server import build_app  # noqa: E402
from trainer_bridge import toy_task  # noqa: E402

PROMPT = "12+34="


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return toy_task.write_model(tmp_path_factory.mktemp("server_toy"), hidden_size=32, num_layers=2, seed=4)


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=16, num_kv_blocks=64)


def run(model_dir, scenario):
    async def main():
        with AsyncEngine(config(model_dir)) as engine:
            async with TestClient(TestServer(build_app(engine, str(model_dir)))) as client:
                return await scenario(client, engine)

    return asyncio.run(main())


def test_generate_and_completions_return_the_engine_results(model_dir):
    local = Engine(config(model_dir))
    ids = local.tokenizer.encode(PROMPT)
    sampled = SamplingParams(n=2, max_tokens=10, seed=3, ignore_eos=True)
    expected = local.generate([ids], sampled)[0]

    async def scenario(client, engine):
        r = await client.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 10, "n": 2, "sampling_seed": 3, "ignore_eos": True}})
        assert r.status == 200
        results = await r.json()
        assert [x["output_ids"] for x in results] == [c.token_ids for c in expected.outputs]
        meta = results[0]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 10} and meta["prompt_tokens"] == len(ids)
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(expected.outputs[0].logprobs, abs=1e-6)
        assert meta["policy_versions"] == [0] * 10
        # a batch of text prompts, one result each, stop strings as SGLang spells them
        r = await client.post("/generate", json={"text": [PROMPT, "7+8="], "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "stop": ["0"], "ignore_eos": True}})
        batch = await r.json()
        greedy = local.generate([PROMPT, "7+8="], SamplingParams(max_tokens=12, temperature=0, stop=["0"], ignore_eos=True))
        assert [x["text"] for x in batch] == [o.outputs[0].text for o in greedy]
        matched = [x["meta_info"]["finish_reason"].get("matched") for x in batch]
        assert matched == [o.outputs[0].stop_reason for o in greedy] and "0" in matched
        # streamed: the result so far after each step (its text too, never null, each a prefix of the next),
        # the last one equal to the whole answer, then [DONE]; with a stop string, text past it is never sent
        for stop in ([], ["0"]):
            r = await client.post("/generate", json={"input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": 10, "sampling_seed": 3, "ignore_eos": True, "stop": stop}})
            events = [e.removeprefix("data: ") for e in (await r.text()).split("\n\n") if e]
            assert r.status == 200 and events[-1] == "[DONE]" and len(events) >= 3
            chunks = [json.loads(e) for e in events[:-1]]
            whole = local.generate([ids], SamplingParams(max_tokens=10, seed=3, ignore_eos=True, stop=stop))[0].outputs[0]
            lengths = [len(c["output_ids"]) for c in chunks]
            assert lengths == sorted(lengths) and chunks[-1]["output_ids"] == whole.token_ids
            texts = [c["text"] for c in chunks]
            assert all(isinstance(t, str) and whole.text.startswith(t) for t in texts) and texts[-1] == whole.text
            assert len(set(texts)) > 2  # growing with the tokens
        r = await client.post("/generate", json={"text": [PROMPT, PROMPT], "stream": True})
        assert r.status == 400 and "one prompt" in (await r.json())["error"]
        r = await client.post("/generate", json={"input_ids": [100000], "stream": True})  # refused before streaming
        assert r.status == 400 and "outside the vocabulary" in (await r.json())["error"]
        # OpenAI completions
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "n": 2, "seed": 3,
                                                       "ignore_eos": True, "logprobs": 1})
        body = await r.json()
        assert body["object"] == "text_completion" and len(body["choices"]) == 2
        assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in expected.outputs]
        assert [c["text"] for c in body["choices"]] == [c.text for c in expected.outputs]
        assert len(body["choices"][0]["logprobs"]["tokens"]) == 10
        assert body["usage"]["completion_tokens"] == 20

    run(model_dir, scenario)


def test_bad_requests_sleep_and_weights_from_disk(model_dir, tmp_path):
    # a checkpoint with every weight moved: the reload must reproduce a fresh engine on it
    moved = perturbed_checkpoint(model_dir, tmp_path / "moved", seed=1)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = Engine(config(moved)).generate([PROMPT], greedy)[0].outputs[0].token_ids

    async def scenario(client, engine):
        for body, problem in (({"text": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
                              ({"text": PROMPT, "sampling_params": {"beam_width": 2}}, "unknown sampling_params"),
                              ({"input_ids": [100000]}, "outside the vocabulary"),
                              ({"sampling_params": {}}, "give 'text'")):
            r = await client.post("/generate", json=body)
            assert r.status == 400 and problem in (await r.json())["error"]
        # a /generate call aborted by its rid returns what it has: the engine thread is held inside a command
        # while the request and its abort queue up behind it, so the abort lands before the request finishes
        async def until(condition):
            while not condition():
                await asyncio.sleep(0.01)

        started, gate = threading.Event(), threading.Event()
        held = asyncio.create_task(engine.call(lambda e: started.set() or gate.wait(30)))
        await until(started.is_set)
        pending = asyncio.create_task(client.post("/generate", json={"text": PROMPT, "rid": "slow", "sampling_params": {
            "max_new_tokens": 40, "ignore_eos": True}}))
        await until(lambda: engine._commands.qsize() >= 1)
        aborted = asyncio.create_task(client.post("/abort_request", json={"rid": "slow"}))
        await until(lambda: engine._commands.qsize() >= 2)
        gate.set()
        await held
        assert (await (await aborted).json()) == {"success": True}
        partial = await (await pending).json()
        assert partial["meta_info"]["finish_reason"]["type"] == "abort" and len(partial["output_ids"]) < 40
        # one refused prompt of a batch refuses the batch and leaves none of its prompts running
        r = await client.post("/generate", json={"input_ids": [[3, 4], [100000]], "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True}})
        assert r.status == 400 and "outside the vocabulary" in (await r.json())["error"]
        assert not await engine.call(lambda e: e.has_unfinished_requests())
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "echo": True})
        assert r.status == 400 and "echo" in (await r.json())["error"]
        assert (await client.get("/health")).status == 200

        assert (await client.post("/release_memory_occupation", json={})).status == 200
        r = await client.post("/generate", json={"text": PROMPT})
        assert r.status == 400 and "sleeps" in (await r.json())["error"]
        assert (await client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})).status == 200

        r = await client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert r.status == 400 and "safetensors" in (await r.json())["error"]
        r = await client.post("/update_weights_from_disk", json={"model_path": str(moved)})
        assert r.status == 200 and (await r.json())["version"] == 1
        r = await client.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        result = await r.json()
        assert result["output_ids"] == expected and result["meta_info"]["policy_versions"] == [1] * 8
        assert (await (await client.get("/get_model_info")).json())["policy_version"] == 1
        r = await client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        cached = await client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        assert (await cached.json())["meta_info"]["cached_tokens"] > 0  # the prompt's full blocks were reused
        assert (await (await client.get("/flush_cache")).json()) == {"success": True}
        fresh = await client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        assert (await fresh.json())["meta_info"]["cached_tokens"] == 0

    run(model_dir, scenario)


def test_load_weights_refuses_a_foreign_checkpoint_and_changes_nothing(model_dir, tmp_path):
    engine = Engine(config(model_dir))
    before = {n: engine.runner.weights.view(n).clone() for n in engine.weight_specs()}
    foreign = tmp_path / "foreign"
    shutil.copytree(model_dir, foreign)
    weights = load_file(foreign / "model.safetensors")
    for extra, problem in (({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, "not a weight"),
                           ({"model.norm.weight": torch.zeros(3)}, "shape")):
        save_file({**weights, **extra}, foreign / "model.safetensors")
        with pytest.raises(ValueError, match=problem):
            engine.load_weights(str(foreign))
    assert engine.policy_version == 0
    assert all(torch.equal(engine.runner.weights.view(n), w) for n, w in before.items())


def test_serve_command_answers_over_a_socket(model_dir):
    """`python -m rollout serve` end to end: a subprocess on a free port answers /health and /generate."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "rollout", "serve", "--model", str(model_dir), "--port", str(port)],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):  # the engine loads, then the socket opens
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert json.load(r) == {"status": "ok"}
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        else:
            raise AssertionError("the server did not come up in 30 s")
        body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body)) as r:
            assert len(json.load(r)["output_ids"]) == 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
