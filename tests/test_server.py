"""The HTTP server (uvicorn on 127.0.0.1, a free port; httpx as the client): SGLang /generate and OpenAI
/v1/completions give the engine's own results; every hole the server had is closed with a named 4xx in
OpenAI's error shape, and the server answers a normal request after each; the API key guards everything but
/health and never shows in logs or answers; limits (n, body size, pending prompts) hold; a client that
disconnects aborts its requests, streaming or not; sleep / wake and weight reloads through their endpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from safetensors.torch import load_file, save_file  # noqa: E402

from conftest import perturbed_checkpoint  # noqa: E402
from server_harness import LiveServer  # noqa: E402

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server_config import ServerConfig  # noqa: E402
from trainer_bridge import toy_task  # noqa: E402

PROMPT = "12+34="
KEY = "sk-test-3f9c1a7d"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return toy_task.write_model(tmp_path_factory.mktemp("server_toy"), hidden_size=32, num_layers=2, seed=4)


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=16, num_kv_blocks=64)


def serving(model_dir, **server) -> LiveServer:
    return LiveServer(AsyncEngine(config(model_dir)), ServerConfig(**server))


class Held:
    """Holds the engine's thread inside a command (so requests queue behind it) until released."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.started, self.gate = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(engine.call(
            lambda e: self.started.set() or self.gate.wait(60))))

    def __enter__(self) -> "Held":
        self.thread.start()
        assert self.started.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self.thread.join(30)


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def error_of(r) -> dict:
    """The OpenAI-shaped error of a response: {"message", "type", "param", "code"} and nothing else."""
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def assert_normal_request_served(client) -> None:
    r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_generate_and_completions_return_the_engine_results(model_dir):
    local = Engine(config(model_dir))
    ids = local.tokenizer.encode(PROMPT)
    sampled = SamplingParams(n=2, max_tokens=10, seed=3, ignore_eos=True)
    expected = local.generate([ids], sampled)[0]
    with serving(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 10, "n": 2, "sampling_seed": 3, "ignore_eos": True}})
        assert r.status_code == 200
        results = r.json()
        assert [x["output_ids"] for x in results] == [c.token_ids for c in expected.outputs]
        meta = results[0]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 10} and meta["prompt_tokens"] == len(ids)
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(expected.outputs[0].logprobs, abs=1e-6)
        assert meta["policy_versions"] == [0] * 10
        # top logprobs as SGLang spells them: per token [[logprob, id, text], ...], most likely first
        r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
                                           "return_text_in_logprobs": True, "sampling_params": {
                                               "max_new_tokens": 4, "sampling_seed": 3, "ignore_eos": True}})
        tops = r.json()["meta_info"]["output_top_logprobs"]
        assert len(tops) == 4 and all(len(t) == 3 and t[0][0] >= t[1][0] >= t[2][0] for t in tops)
        assert tops[0][0][2] == local.tokenizer.decode([tops[0][0][1]], False)
        # a batch of text prompts, one result each, stop strings as SGLang spells them
        r = client.post("/generate", json={"text": [PROMPT, "7+8="], "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "stop": ["0"], "ignore_eos": True}})
        batch = r.json()
        greedy = local.generate([PROMPT, "7+8="], SamplingParams(max_tokens=12, temperature=0, stop=["0"], ignore_eos=True))
        assert [x["text"] for x in batch] == [o.outputs[0].text for o in greedy]
        matched = [x["meta_info"]["finish_reason"].get("matched") for x in batch]
        assert matched == [o.outputs[0].stop_reason for o in greedy] and "0" in matched
        # streamed: the result so far after each step (its text too, never null, each a prefix of the next),
        # the last one equal to the whole answer, then [DONE]; with a stop string, text past it is never sent
        for stop in ([], ["0"]):
            body = {"input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": 10, "sampling_seed": 3, "ignore_eos": True, "stop": stop}}
            with client.stream("POST", "/generate", json=body) as r:
                events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
            assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) >= 3
            chunks = [json.loads(e) for e in events[:-1]]
            whole = local.generate([ids], SamplingParams(max_tokens=10, seed=3, ignore_eos=True, stop=stop))[0].outputs[0]
            lengths = [len(c["output_ids"]) for c in chunks]
            assert lengths == sorted(lengths) and chunks[-1]["output_ids"] == whole.token_ids
            texts = [c["text"] for c in chunks]
            assert all(isinstance(t, str) and whole.text.startswith(t) for t in texts) and texts[-1] == whole.text
            assert len(set(texts)) > 2  # growing with the tokens
        # every accepted connection has TCP_NODELAY: a reused keep-alive connection gets its answer at once
        import socket

        (conn,) = srv.server.server_state.connections
        assert conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        r = client.post("/generate", json={"text": [PROMPT, PROMPT], "stream": True})
        assert r.status_code == 400 and "one prompt" in error_of(r)["message"]
        r = client.post("/generate", json={"input_ids": [100000], "stream": True})  # refused before streaming
        assert r.status_code == 400 and "outside the vocabulary" in error_of(r)["message"]
        # OpenAI completions
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "n": 2, "seed": 3,
                                                 "ignore_eos": True, "logprobs": 1, "return_token_ids": True})
        body = r.json()
        assert body["object"] == "text_completion" and len(body["choices"]) == 2
        assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in expected.outputs]
        assert [c["text"] for c in body["choices"]] == [c.text for c in expected.outputs]
        assert [c["prompt_token_ids"] for c in body["choices"]] == [ids, ids]
        assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected.outputs[0].logprobs, abs=1e-6)
        assert body["usage"]["completion_tokens"] == 20 and body["usage"]["prompt_tokens"] == len(ids)
        # prompt-major: the n completions of a prompt come before the next prompt's
        r = client.post("/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 4, "n": 2, "seed": 5,
                                                 "ignore_eos": True, "return_token_ids": True})
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert [c["prompt_token_ids"] for c in choices] == [ids, ids, ids[:3], ids[:3]]
        second = local.generate([ids[:3]], SamplingParams(n=2, max_tokens=4, seed=5, ignore_eos=True))[0]
        assert [c["token_ids"] for c in choices[2:]] == [c.token_ids for c in second.outputs]


def test_every_hole_gets_a_named_4xx_and_the_server_goes_on(model_dir):
    """The holes of the issue: each gets its 4xx in OpenAI's shape with a message naming the field and the
    rule; after each, a normal request is answered."""
    with serving(model_dir, max_body_bytes=1 << 16) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        cases = [
            ("/generate", {"text": PROMPT, "sampling_params": {"temperature": "hot"}},
             "sampling_params.temperature", "sampling_params.temperature must be a finite number >= 0, got 'hot'"),
            ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature",
             "temperature must be a finite number >= 0, got 'hot'"),
            ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature", "finite number >= 0"),
            ("/generate", {"input_ids": ["a", "b"]}, "input_ids", "input_ids must be a list of token ids"),
            ("/generate", {"input_ids": [100000]}, "input_ids", "outside the vocabulary"),
            ("/v1/completions", {"prompt": [[3, 4], [100000]]}, "prompt[1]", "outside the vocabulary"),
            ("/generate", {"text": PROMPT, "sampling_params": {"beam_width": 2}}, "sampling_params.beam_width",
             "unknown field 'sampling_params.beam_width'"),
            ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of", "unknown field 'best_of'"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 1},
             "frequency_penalty", "unknown field 'frequency_penalty'"),
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20]"),
            ("/v1/completions", {"prompt": PROMPT, "n": 2.5}, "n", "n must be an integer >= 1"),
            ("/v1/completions", {"prompt": PROMPT, "seed": True}, "seed", "seed must be an integer"),
            ("/v1/completions", {"prompt": PROMPT, "cache_salt": "s" * 257}, "cache_salt", "at most 256 characters"),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, None, "only allowed with echo"),
            ("/v1/completions", {"prompt": PROMPT, "model": "other"}, "model", "does not exist"),
            ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
             "messages[0].role must be one of"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
             "tool_choice", 'tool_choice must be "auto" or "none"'),
            ("/generate", {"sampling_params": {}}, None, "give one of 'text' or 'input_ids'"),
            ("/update_weights_from_disk", {"model_path": 3}, "model_path", "model_path must be a checkpoint directory"),
            ("/abort_request", {"rid": "x", "all": True}, "all", "unknown field 'all'"),
            ("/abort_request", {}, None, "give 'rid' or 'abort_all': true"),
            ("/pause_generation", {"mode": "later"}, "mode", 'mode must be "abort", "retract" or "in_place"'),
            ("/update_weights_from_disk", {"model_path": "x", "weight_version": "seven"}, "weight_version",
             'weight_version must be a decimal integer string such as "7"'),
            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 2,
                                            "world_size": 2, "backend": "gloo"}, None, "rank_offset must be < world_size"),
            ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]},
             None, "one entry per tensor"),
            ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                                  "group_name": "g"}, "group_name", "is not joined"),
            ("/update_weights_from_distributed", {"names": ["a"], "encoding": "patch"}, None,
             "encoding 'patch' takes names and buckets"),
            ("/release_memory_occupation", {"tags": ["everything"]}, "tags", 'tags must be a list of "weights"'),
            ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [1, "a"]}, "stop_token_ids",
             "stop_token_ids must be a list of token ids"),
        ]
        for path, body, param, message in cases:
            r = client.post(path, json=body)
            err = error_of(r)
            expected_status = 404 if param == "model" else 400
            assert r.status_code == expected_status, (path, body, r.text)
            assert message in err["message"] and err["param"] == param, (path, body, err)
            assert err["type"] == ("not_found_error" if expected_status == 404 else "invalid_request_error")
            assert_normal_request_served(client)
        # NaN and infinities (Python's json writes them) are not numbers here
        for path, raw, message in (
                ("/generate", b'{"text": "1+1=", "sampling_params": {"temperature": NaN}}',
                 "sampling_params.temperature must be a finite number >= 0, got nan"),
                ("/v1/completions", b'{"prompt": "1+1=", "top_p": Infinity}', "top_p must be a number in (0, 1], got inf"),
                ("/v1/completions", b'{"prompt": "1+1=", "temperature": 1e999}', "temperature must be a finite number")):
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and message in error_of(r)["message"], r.text
            assert_normal_request_served(client)
        for raw, problem in ((b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object")):
            r = client.post("/v1/completions", content=raw)
            assert r.status_code == 400 and problem in error_of(r)["message"]
        # a body past max_body_bytes: 413, whether its length is declared or streamed in chunks
        big = {"prompt": "1" * (1 << 16), "max_tokens": 1}
        r = client.post("/v1/completions", json=big)
        assert r.status_code == 413 and "max_body_bytes" in error_of(r)["message"]
        r = client.post("/v1/completions", content=iter([json.dumps(big).encode()]))  # chunked: no length
        assert r.status_code == 413
        assert_normal_request_served(client)
        # unknown endpoints and methods: OpenAI's shape too
        assert client.get("/v1/nothing").status_code == 404 and error_of(client.get("/v1/nothing"))["code"] == "not_found"
        assert client.get("/v1/completions").status_code == 405
        assert client.get("/health").json() == {"status": "ok"}


def test_a_client_that_leaves_while_its_body_is_read_is_logged_once_and_starts_nothing(model_dir, caplog):
    caplog.set_level(logging.INFO)
    with serving(model_dir) as srv:
        with socket.create_connection(srv.sock.getsockname()[:2], timeout=30) as sock:  # half a declared body, then gone
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "')
        until(lambda: any("before its request to /v1/completions was read" in r.getMessage() for r in caplog.records))
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            assert_normal_request_served(client)
        assert not srv.engine.engine.has_unfinished_requests()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_oversized_n_is_refused_at_once_and_a_600_prompt_batch_fits_the_default_body_cap(model_dir, ckpt_factory):
    with serving(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        with Held(srv.engine):  # the engine is busy: the refusal must not wait for it
            start = time.monotonic()
            r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"n": 100000}})
            elapsed = time.monotonic() - start
        assert r.status_code == 400 and error_of(r)["param"] == "n" and "max_n" in error_of(r)["message"]
        assert elapsed < 1.0, elapsed
        assert_normal_request_served(client)
    # 600 prompts of 460 token ids each: past the old fixed cap of 1 MiB, inside the default 32 MiB
    long_model = ckpt_factory("llama")  # max_model_len 512
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 128, (600, 460), generator=g).tolist()
    body = {"prompt": prompts, "max_tokens": 1, "return_token_ids": True}
    assert len(json.dumps(body)) > 1 << 20
    with LiveServer(AsyncEngine(EngineConfig(model=str(long_model), dtype="float32", num_kv_blocks=256))) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert [c["prompt_token_ids"] for c in r.json()["choices"]] == prompts


def test_prompt_and_completion_token_bounds(model_dir):
    with serving(model_dir, max_prompt_tokens=8, max_tokens=4) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        for path, body, param in (
                ("/v1/completions", {"prompt": "1234567890", "max_tokens": 2}, "prompt"),
                ("/v1/completions", {"prompt": [3] * 9, "max_tokens": 2}, "prompt"),
                ("/generate", {"input_ids": [[3, 4], [3] * 9]}, "input_ids[1]"),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5}, "max_tokens"),
                ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}},
                 "sampling_params.max_new_tokens")):
            r = client.post(path, json=body)
            assert r.status_code == 400 and error_of(r)["param"] == param, (path, body, r.text)
        # defaults (16 for completions, 128 for /generate) are capped at the bound, not refused
        r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = client.post("/generate", json={"text": PROMPT, "sampling_params": {"ignore_eos": True}})
        assert len(r.json()["output_ids"]) == 4


def test_too_many_pending_prompts_get_429_with_retry_after(model_dir):
    with serving(model_dir, max_pending_requests=2) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        def send(results, i):
            results[i] = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})

        results: dict = {}
        with Held(srv.engine):
            senders = [threading.Thread(target=send, args=(results, i)) for i in range(2)]
            for t in senders:
                t.start()
            until(lambda: srv.app.state.server.pending == 2)
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert error_of(r)["type"] == "rate_limit_error"
            r = client.post("/v1/completions", json={"prompt": [PROMPT] * 3, "max_tokens": 2})
            assert r.status_code == 400 and "at most 2 prompts" in error_of(r)["message"]
        for t in senders:
            t.join(30)
        assert [results[i].status_code for i in range(2)] == [200, 200]
        assert srv.app.state.server.pending == 0
        assert_normal_request_served(client)


def test_api_key_guards_every_endpoint_but_health_and_never_shows(model_dir, caplog):
    caplog.set_level(logging.DEBUG)
    with serving(model_dir, api_key=KEY) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        guarded = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": PROMPT}),
                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                   ("POST", "/generate", {"text": PROMPT}), ("GET", "/get_model_info", None),
                   ("POST", "/update_weights_from_disk", {"model_path": "/nowhere"}),
                   ("POST", "/release_memory_occupation", {}), ("POST", "/resume_memory_occupation", {}),
                   ("POST", "/flush_cache", None), ("POST", "/abort_request", {"rid": "x"})]
        answers = []
        for method, path, body in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and error_of(r)["type"] == "authentication_error", (path, headers)
                answers.append(r.text)
        assert client.get("/health").status_code == 200  # probes need no key
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=auth).status_code == 200
        r = client.post("/v1/completions", headers=auth, json={"prompt": PROMPT, "max_tokens": 2, "user": KEY})
        assert r.status_code == 200
        r = client.post("/update_weights_from_disk", headers=auth, json={"model_path": "/nowhere"})
        assert r.status_code == 400
        answers.append(r.text)
        for body in ({"prompt": PROMPT, "oops": KEY}, {"prompt": PROMPT, "temperature": KEY}):
            r = client.post("/v1/completions", headers=auth, json=body)
            assert r.status_code == 400
            answers.append(r.text)
    assert KEY not in repr(ServerConfig(api_key=KEY))
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert KEY not in logged and all(KEY not in a for a in answers)


def test_admin_endpoints_can_be_turned_off(model_dir):
    with serving(model_dir, enable_admin=False) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for path in ("/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
                     "/flush_cache", "/abort_request"):
            r = client.post(path, json={})
            assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
        assert_normal_request_served(client)


def test_a_client_that_disconnects_aborts_its_requests(model_dir, caplog):
    """Non-streaming: the client gives up while its request waits; streaming: it leaves after two events.
    Either way the engine aborts the request, the server logs one line (no traceback) and goes on."""
    caplog.set_level(logging.INFO)
    with serving(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        engine = srv.engine.engine
        aborted = []
        real_abort = engine.abort_request

        def abort_request(rid):
            out = real_abort(rid)
            aborted.append((rid, out))
            return out

        engine.abort_request = abort_request
        body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
        with Held(srv.engine):
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body, timeout=0.5)
        until(lambda: aborted and not engine.has_unfinished_requests())
        assert aborted[0][0].startswith("cmpl-")
        # streaming: leave after two events
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            seen = []
            for line in lines:
                if line.startswith("data:"):
                    seen.append(line)
                if len(seen) == 2:
                    break
        until(lambda: len(aborted) == 2 and not engine.has_unfinished_requests())
        rid, out = aborted[1]
        assert out is not None and out.outputs and len(out.outputs[0].token_ids) < 50  # cut short
        assert_normal_request_served(client)
    left = [r for r in caplog.records if r.name == "rollout.server" and "client left" in r.getMessage()]
    assert len(left) == 2, [r.getMessage() for r in left]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_bad_requests_sleep_and_weights_from_disk(model_dir, tmp_path):
    # a checkpoint with every weight moved: the reload must reproduce a fresh engine on it
    moved = perturbed_checkpoint(model_dir, tmp_path / "moved", seed=1)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = Engine(config(moved)).generate([PROMPT], greedy)[0].outputs[0].token_ids
    with serving(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        # a /generate call aborted by its rid returns what it has: the engine thread is held inside a command
        # while the request and its abort queue up behind it, so the abort lands before the request finishes
        results = {}
        with Held(srv.engine):
            sender = threading.Thread(target=lambda: results.setdefault("r", client.post("/generate", json={
                "text": PROMPT, "rid": "slow", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})))
            sender.start()
            until(lambda: srv.engine._commands.qsize() >= 1)
            aborter = threading.Thread(target=lambda: results.setdefault("a", client.post(
                "/abort_request", json={"rid": "slow"})))
            aborter.start()
            until(lambda: srv.engine._commands.qsize() >= 2)
        sender.join(30)
        aborter.join(30)
        assert results["a"].json() == {"success": True}
        partial = results["r"].json()
        assert partial["meta_info"]["finish_reason"]["type"] == "abort" and len(partial["output_ids"]) < 40
        # one refused prompt of a batch refuses the batch and leaves none of its prompts running
        r = client.post("/generate", json={"input_ids": [[3, 4], [100000]], "sampling_params": {
            "max_new_tokens": 40, "ignore_eos": True}})
        assert r.status_code == 400 and error_of(r)["param"] == "input_ids[1]"
        assert not srv.engine.engine.has_unfinished_requests()

        assert client.post("/release_memory_occupation", json={}).status_code == 200
        r = client.post("/generate", json={"text": PROMPT})
        assert r.status_code == 400 and "sleeps" in error_of(r)["message"]
        assert client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}).status_code == 200
        assert client.post("/release_memory_occupation").status_code == 200  # no body: all of it
        assert client.post("/resume_memory_occupation").status_code == 200

        r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
        assert r.status_code == 400 and "safetensors" in error_of(r)["message"]
        r = client.post("/update_weights_from_disk", json={"model_path": str(moved)})
        assert r.status_code == 200 and r.json()["version"] == 1
        r = client.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        result = r.json()
        assert result["output_ids"] == expected and result["meta_info"]["policy_versions"] == [1] * 8
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert r.json()["choices"][0]["policy_versions"] == [1] * 3
        assert client.get("/get_model_info").json()["policy_version"] == 1
        client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        cached = client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        assert cached.json()["meta_info"]["cached_tokens"] > 0  # the prompt's full blocks were reused
        assert client.get("/flush_cache").json() == {"success": True}
        fresh = client.post("/generate", json={"text": PROMPT * 4, "sampling_params": {"max_new_tokens": 2}})
        assert fresh.json()["meta_info"]["cached_tokens"] == 0


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
    """`python -m rollout serve` end to end: a subprocess on a free port answers /health and /generate, logs
    one line when it listens, and a port already taken is one line of error, not a traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "rollout", "serve", "--model", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # the engine loads, then the socket opens
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up in 60 s"
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}, timeout=60)
        assert len(r.json()["output_ids"]) == 5
        taken = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
        assert taken.returncode != 0 and "Traceback" not in taken.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr.strip().splitlines()[-1]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    listening = [line for line in err.splitlines() if "serving" in line]
    assert len(listening) == 1 and f"http://127.0.0.1:{port}" in listening[0], err
    assert "Traceback" not in err
