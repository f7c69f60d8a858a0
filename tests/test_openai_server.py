"""The server as the official `openai` package sees it (a real uvicorn server on 127.0.0.1, an API key set), on
a tiny random qwen2 model whose directory carries a byte-level BPE tokenizer.json and a ChatML chat template
with Hermes tools: completions with top logprobs, echo and streaming; models.list; chat completions (the
prompt is exactly transformers' apply_chat_template ids; streaming deltas; logprobs); a completion that calls
a tool, parsed into `tool_calls` (the runner's reported tokens are scripted, the model runs as usual); a wrong
field's message naming it; 401 without the key. httpx for the extensions: return_token_ids, prompt_logprobs
(checked against transformers' own forward, the oracle), return_tokens_as_token_ids against the engine,
policy versions after a weight reload, cache_salt keeping prefix caches apart, BOS as the tokenizer adds it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import load_hf, perturbed_checkpoint  # noqa: E402
from server_harness import LiveServer, ScriptedTokens, chat_checkpoint  # noqa: E402

from rollout import AsyncEngine, Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.server_config import ServerConfig  # noqa: E402

KEY = "sk-local-7e41"
NAME = "tiny-chat"
VOCAB = 320
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("openai"), seed=11, vocab_size=VOCAB)


def engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=16, num_kv_blocks=128, **kw)


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(AsyncEngine(engine_config(model_dir)), ServerConfig(api_key=KEY, served_model_name=NAME)) as srv:
        yield srv
    srv.engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def local(model_dir):
    return Engine(engine_config(model_dir))


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_completions_top_logprobs_echo_and_stream(client, local):
    ids = local.tokenizer.encode("hello world")
    r = client.completions.create(model=NAME, prompt="hello world", max_tokens=6, logprobs=5, seed=1,
                                  extra_body={"ignore_eos": True})
    expected = local.generate([ids], SamplingParams(max_tokens=6, seed=1, ignore_eos=True, top_logprobs=5))[0]
    choice, want = r.choices[0], expected.outputs[0]
    assert choice.text == want.text and r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert lp.tokens == [local.tokenizer.decode([t], False) for t in want.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    for top, top_want, token in zip(lp.top_logprobs, want.top_logprobs, lp.tokens):
        # the 5 most likely and the sampled token, keyed by text (tokens of the same text share a key)
        values = list(top.values())
        assert values == sorted(values, reverse=True)  # most likely first
        assert len(top_want) == 5 and [v for _, v in top_want] == sorted((v for _, v in top_want), reverse=True)
        assert set(top) <= {local.tokenizer.decode([t], False) for t, _ in top_want} | {token} and token in top
        assert values[0] == pytest.approx(top_want[0][1], abs=1e-5)
    # echo: the prompt's text and tokens first (its first token has no logprob)
    r = client.completions.create(model=NAME, prompt="hello world", max_tokens=3, logprobs=2, echo=True, seed=1,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    three = local.generate([ids], SamplingParams(max_tokens=3, seed=1, ignore_eos=True))[0].outputs[0]
    assert r.choices[0].text == "hello world" + three.text
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(ids):] == pytest.approx(want.logprobs[:3], abs=1e-5)
    # streamed: text deltas that concatenate to the same completion, then a usage chunk
    chunks = list(client.completions.create(model=NAME, prompt="hello world", max_tokens=6, seed=1, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert len([c for c in chunks if c.choices]) >= 3  # deltas, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_wrong_field_is_named_and_a_missing_key_is_401(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", extra_body={"temprature": 0.5})
    assert "temprature" in e.value.message and e.value.param == "temprature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", temperature=-2)
    assert "temperature must be a finite number >= 0" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], top_logprobs=3)
    assert "top_logprobs needs logprobs" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", n=5000)
    assert "max_n" in e.value.message and e.value.param == "n"
    for key in ("wrong", None):
        anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "unset", max_retries=0,
                                  default_headers=None if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as e:
            anonymous.models.list()
        assert e.value.status_code == 401 and KEY not in e.value.message
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_chat_prompt_is_the_templates_ids_and_streams_deltas(client, http, local, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "what is the weather?"}]
    r = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 8, "seed": 2,
                                                "n": 2, "return_token_ids": True, "ignore_eos": True})
    body = r.json()
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert body["prompt_token_ids"] == list(prompt)
    expected = local.generate([list(prompt)], SamplingParams(n=2, max_tokens=8, seed=2, ignore_eos=True))[0]
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in expected.outputs]
    assert [c["message"]["content"] for c in body["choices"]] == [c.text for c in expected.outputs]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16, "total_tokens": len(prompt) + 16,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}
    assert all(c["policy_versions"] == [0] * 8 for c in body["choices"])
    # the SDK: logprobs with top_logprobs, and a stream whose deltas make the same message (role first)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, seed=2, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
    assert [t.logprob for t in content] == pytest.approx(expected.outputs[0].logprobs, abs=1e-5)
    stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, seed=2, n=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    for j in range(2):
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == j]
        assert "".join(deltas) == expected.outputs[j].text
    finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length", "length"]
    # chat_template_kwargs reach the template
    plain = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
    thinking_off = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 1, "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    off = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           enable_thinking=False)
    assert thinking_off.json()["prompt_token_ids"] == list(off) != plain.json()["prompt_token_ids"]


def test_a_multi_turn_tool_episode_renders_exactly(http, hf_tokenizer):
    """The assistant's earlier call (arguments as OpenAI sends them: a JSON string) and the tool's answer are
    rendered as transformers renders them (arguments as an object)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 2,
                                                "return_token_ids": True})
    assert r.status_code == 200, r.text
    as_template_reads_it = [messages[0], {**messages[1], "content": None, "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
    want = hf_tokenizer.apply_chat_template(as_template_reads_it, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    assert r.json()["prompt_token_ids"] == list(want)


@pytest.fixture(scope="module")
def tool_server(model_dir):
    from tokenizers import Tokenizer

    engine = Engine(engine_config(model_dir))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ScriptedTokens(engine, tok.encode("Let me check. " + CALL_TEXT, add_special_tokens=False).ids
                   + [tok.token_to_id("<|im_end|>")])
    with LiveServer(AsyncEngine(engine), ServerConfig(api_key=KEY, served_model_name=NAME)) as srv:
        yield srv
    srv.engine.close()


def test_a_completion_that_calls_a_tool_comes_back_as_tool_calls(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER_TOOL], max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content == "Let me check."
    # streamed: content deltas, then the call as OpenAI's delta.tool_calls
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER_TOOL], max_tokens=100,
                                                stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    # tool_choice "none": the text comes back as it is; without tools, too
    for extra in ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, {}):
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=100, **extra)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == "Let me check. " + CALL_TEXT


def test_prompt_logprobs_are_the_models_own(http, model_dir, local):
    """prompt_logprobs (and echo + logprobs with max_tokens 0, as evaluation harnesses score text) against
    transformers' forward of the same checkpoint: each token's logprob, its rank and the top-k."""
    ids = local.tokenizer.encode("the quick brown fox jumps over the lazy dog") * 2
    hf = load_hf(model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [n, V]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row = got[i], logp[i - 1]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            assert entry[str(t)]["rank"] == rank or t == ids[i]
        assert len(entry) <= 4
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["usage"]["completion_tokens"] == 0 and lp["token_logprobs"][0] is None
    want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # while another request runs: scoring lends its own blocks, so the running request's KV is untouched and
    # its tokens are the ones a fresh engine gives (deterministic mode)
    running = {"prompt": ids[:20], "max_tokens": 40, "seed": 9, "ignore_eos": True, "stream": True,
               "return_token_ids": True}
    tokens = []
    with http.stream("POST", "/v1/completions", json=running) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                if len(tokens) >= 2:
                    break
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "prompt_logprobs": 0, "return_token_ids": True})
        for line in lines:
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert len(tokens) == 40 and tokens == local.generate([ids[:20]], SamplingParams(
        max_tokens=40, seed=9, ignore_eos=True))[0].outputs[0].token_ids
    chat = r.json()
    chat_ids = chat["prompt_token_ids"]
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and all(
        list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], chat_ids[1:]))


def test_token_id_extensions_match_the_engine(http, local):
    ids = local.tokenizer.encode("hello world")
    r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5, "seed": 4, "ignore_eos": True,
                                           "logprobs": 2, "return_tokens_as_token_ids": True,
                                           "return_token_ids": True})
    choice = r.json()["choices"][0]
    want = local.generate([ids], SamplingParams(max_tokens=5, seed=4, ignore_eos=True, top_logprobs=2))[0].outputs[0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want.token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    for top, top_want, t, lp in zip(choice["logprobs"]["top_logprobs"], want.top_logprobs, want.token_ids,
                                    want.logprobs):
        expected = {f"token_id:{i}": v for i, v in top_want} | {f"token_id:{t}": lp}
        assert top == pytest.approx(expected, abs=1e-5) and list(top.values()) == sorted(top.values(), reverse=True)


def test_cache_salt_keeps_prefix_caches_apart(http):
    prompt = "what is the weather in Paris today? sunny, 21 C " * 3  # sent by no other test

    def cached(**extra) -> int:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0  # the same salt shares the prompt's blocks
    assert cached(cache_salt="tenant-b") == 0  # another salt does not
    assert cached() == 0  # neither does no salt
    r = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_policy_versions_follow_a_weight_reload(model_dir, tmp_path):
    moved = perturbed_checkpoint(model_dir, tmp_path / "moved", seed=3)
    with LiveServer(AsyncEngine(engine_config(model_dir))) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        messages = [{"role": "user", "content": "hi"}]
        before = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True})
        assert before.json()["choices"][0]["policy_versions"] == [0, 0, 0]
        assert c.post("/update_weights_from_disk", json={"model_path": str(moved)}).json()["version"] == 1
        after = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "ignore_eos": True})
        assert after.json()["choices"][0]["policy_versions"] == [1, 1, 1]
    srv.engine.close()


def test_text_prompts_get_the_tokenizers_bos_and_chat_prompts_nothing_more(model_dir, tmp_path):
    """A tokenizer whose post-processor adds BOS (as Llama's does): a text prompt gets exactly the tokenizer's
    own ids (BOS first), unless add_special_tokens is false; a chat prompt is the template's ids alone."""
    import transformers
    from tokenizers import Tokenizer, processors

    bos_dir = tmp_path / "bos"
    shutil.copytree(model_dir, bos_dir)
    tok = Tokenizer.from_file(str(bos_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.save(str(bos_dir / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(str(bos_dir))
    with LiveServer(AsyncEngine(engine_config(bos_dir))) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        text = "hello world"
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == hf(text).input_ids and hf(text).input_ids[0] == bos
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True,
                                            "add_special_tokens": False})
        assert r.json()["choices"][0]["prompt_token_ids"] == hf(text, add_special_tokens=False).input_ids
        r = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        assert r.json()["meta_info"]["prompt_tokens"] == len(hf(text).input_ids)
        messages = [{"role": "user", "content": text}]
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.json()["prompt_token_ids"] == list(want) and want[0] != bos
    srv.engine.close()


def test_chat_stream_carries_prompt_logprobs_and_ids_first(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "prompt_logprobs": 1,
            "return_token_ids": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids = first["prompt_token_ids"]
    assert len(first["prompt_logprobs"]) == len(ids) and first["prompt_logprobs"][0] is None
    assert all(str(t) in e for e, t in zip(first["prompt_logprobs"][1:], ids[1:]))
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks) == 3


def test_spec_decode_stats_per_choice(tmp_path):
    """With a drafter, each choice carries its request's acceptance counters (completions and /generate)."""
    from runner.testing import write_random_checkpoint

    from rollout.config import SpeculativeConfig

    path = write_random_checkpoint(tmp_path / "m", vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, std=0.3)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=16, num_kv_blocks=256, block_size=4,
                                 speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2)))
    engine.spec_controller.auto_off = False
    with LiveServer(AsyncEngine(engine)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 10, "ignore_eos": True, "n": 2})
        for choice in r.json()["choices"]:
            s = choice["spec_decode_stats"]
            assert s["num_spec_steps"] > 0 and sum(s["acceptance_histogram"]) == s["num_spec_steps"]
            assert len(choice["policy_versions"]) == 10
        r = c.post("/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        assert r.json()["meta_info"]["spec_decode_stats"]["num_spec_steps"] > 0
    srv.engine.close()
