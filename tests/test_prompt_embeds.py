"""Prompt embeddings ({"prompt_embeds": tensor [T, hidden]}) on the CPU in float32: a prompt given as its own rows of
the embedding table (`engine.runner.model.model.embed_tokens.weight[ids]`) gives bitwise the outputs of the token
prompt (greedy tokens, seeded samples and their logprobs and top logprobs, n > 1), with synchronous and async
scheduling, with chunked prefill and with preemption (the two runs are scheduled alike, so every float is compared
with ==); with a LoRA adapter and with MoE routing replay too. The prefix cache shares blocks between byte-identical
embedding prompts only (never with a token prompt); every refusal names the field and its rule and queues nothing;
the server takes vLLM's `prompt_embeds` (base64 safetensors) from the official `openai` package and SGLang's
`input_embeds` on /generate, and answers a bad blob with a 400 naming the field. A CUDA test (skipped here) checks
the graph-captured decode path on a GPU."""

from __future__ import annotations

import base64
import dataclasses
import io

import pytest
import torch

from conftest import make_checkpoint
from rollout import Engine, EngineConfig, SamplingParams
from rollout.prompt_embeds import check_prompt_embeds, decode_prompt_embeds, encode_prompt_embeds

PROMPTS = [[5, 9, 13, 2, 7], [100], list(range(3, 40)), [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(n=3, temperature=1.0, top_k=50, max_tokens=10, seed=7, ignore_eos=True, logprobs=True,
                        top_logprobs=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prompt_embeds_llama"), "llama", seed=5)


def config_of(path, **kw) -> EngineConfig:
    return EngineConfig(**{"model": str(path), "dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 8, **kw})


def engine_of(path, **kw) -> Engine:
    return Engine(config_of(path, **kw))


@pytest.fixture(scope="module")
def engine(model_dir):
    return engine_of(model_dir)


def rows(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The prompt's own rows of the engine's embedding table, [len(ids), hidden], a copy."""
    return engine.runner.model.model.embed_tokens.weight[ids].detach().clone()


def embeds_of(engine: Engine, prompts) -> list[dict]:
    return [{"prompt_embeds": rows(engine, ids)} for ids in prompts]


def results(outs) -> list:
    return [[(c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, c.text) for c in out.outputs] for out in outs]


@pytest.mark.parametrize("engine_kw", [
    {},
    dict(async_scheduling=True),
    dict(max_num_batched_tokens=6, block_size=4),  # the long prompts in chunks of a 6-token budget
    dict(max_num_batched_tokens=10, num_kv_blocks=14, block_size=4, max_num_seqs=4, async_scheduling=True),  # preempts
], ids=["plain", "async", "chunked", "chunked-preempted-async"])
def test_embedding_rows_of_a_prompt_give_its_outputs_bitwise(model_dir, engine_kw):
    engine = engine_of(model_dir, **engine_kw)

    def run(prompts, params):
        engine.kv_manager.reset_prefix_cache()  # both runs start from an empty cache, so they are scheduled alike
        return engine.generate(prompts, params)

    for params in (GREEDY, SEEDED):
        before = engine.scheduler.stats.num_preemptions
        expected = run(PROMPTS, params)
        token_preemptions = engine.scheduler.stats.num_preemptions - before
        got = run(embeds_of(engine, PROMPTS), params)
        assert results(got) == results(expected)
        assert engine.scheduler.stats.num_preemptions - before == 2 * token_preemptions  # scheduled alike
        if "num_kv_blocks" in engine_kw:
            assert token_preemptions > 0
        for out, ids in zip(got, PROMPTS):
            assert out.prompt is None and out.prompt_token_ids is None  # vLLM's: an embedding prompt has no ids
            assert len(out.outputs) == params.n and all(len(c.token_ids) == params.max_tokens for c in out.outputs)
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used_blocks == 0
    engine.step()  # hands the last finished ids to the runner
    assert not engine.runner.input_batch.slot_of and not engine.runner.input_batch.prompt_embeds


def test_add_request_streams_an_embedding_prompt_and_keeps_its_own_copy(engine):
    ids = PROMPTS[2]
    expected = engine.generate([ids], SEEDED)[0]
    tensor = rows(engine, ids)
    engine.add_request({"prompt_embeds": tensor}, SEEDED, request_id="mine")
    tensor.zero_()  # the engine took a copy when it was added
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "mine" and final.finished
    assert results([final]) == results([expected])


def test_other_dtypes_are_cast_to_the_models(engine):
    ids = PROMPTS[0]
    expected = engine.generate([ids], GREEDY)[0]
    got = engine.generate([{"prompt_embeds": rows(engine, ids).double()}], GREEDY)[0]  # float64 -> float32: exact
    assert results([got]) == results([expected])
    checked = check_prompt_embeds(rows(engine, ids).half(), hidden_size=64, dtype=torch.float32)
    assert checked.tensor.dtype == torch.float32 and torch.equal(checked.tensor, rows(engine, ids).half().float())


def test_dict_prompts_of_text_and_token_ids_are_taken_too(engine):
    ids = PROMPTS[0]
    expected = engine.generate([ids], GREEDY)[0]
    got = engine.generate({"prompt_token_ids": ids}, GREEDY)[0]  # one dict prompt, not a list
    assert results([got]) == results([expected]) and got.prompt_token_ids == ids


def test_prefix_blocks_are_shared_by_byte_identical_embedding_prompts_only(model_dir):
    engine = engine_of(model_dir, block_size=4)
    ids = list(range(10, 31))  # 21 tokens: 5 full blocks
    full = (len(ids) - 1) // 4 * 4  # cached tokens of a whole-prompt hit (one token always runs)

    def cached(prompt, n=1):
        out = engine.generate([prompt], dataclasses.replace(GREEDY, n=n, logprobs=True))[0]
        return out.num_cached_prompt_tokens, out.outputs[0]

    first, expected = cached({"prompt_embeds": rows(engine, ids)})
    assert first == 0
    again, got = cached({"prompt_embeds": rows(engine, ids)})  # a new tensor with the same bytes
    assert again == full and got.token_ids == expected.token_ids  # from the shared blocks (computed in other shapes:
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-5, rtol=0)  # float32 rounding apart)
    assert cached({"prompt_embeds": rows(engine, ids).double()})[0] == full  # the same bytes once cast
    changed = rows(engine, ids)
    changed[-1] += 0.5  # another prompt, whose first 20 rows are the same: the key is the whole tensor's hash
    assert cached({"prompt_embeds": changed})[0] == 0
    assert cached(ids)[0] == 0  # the token prompt of the same rows shares nothing with them
    assert cached(ids)[0] == full  # (while token prompts share as usual)
    assert cached({"prompt_embeds": rows(engine, ids[:8] + [3] + ids[9:])})[0] == 0
    n_samples, _ = cached({"prompt_embeds": rows(engine, list(range(50, 71)))}, n=3)
    assert n_samples == 2 * full  # the n samples of one embedding prompt share its blocks


def test_refusals_name_the_field_and_queue_nothing(engine, monkeypatch):
    good = rows(engine, PROMPTS[0])
    sparse = good.to_sparse()
    bad = good.clone()
    bad[2, 7] = float("nan")
    inf = good.clone()
    inf[0, 0] = float("inf")
    cases = [
        ({"prompt_embeds": good.tolist()}, "prompt_embeds must be a torch.Tensor of shape [T, hidden_size=64], got list"),
        ({"prompt_embeds": good[0]}, "prompt_embeds must be 2-D [T, hidden_size=64], got shape (64,)"),
        ({"prompt_embeds": good[None]}, "prompt_embeds must be 2-D [T, hidden_size=64], got shape (1, 5, 64)"),
        ({"prompt_embeds": good[:, :32]}, "prompt_embeds rows must have the model's hidden_size=64, got shape (5, 32)"),
        ({"prompt_embeds": good[:0]}, "prompt_embeds must have at least 1 row"),
        ({"prompt_embeds": torch.ones(5, 64, dtype=torch.int64)}, "prompt_embeds must have a floating-point dtype"),
        ({"prompt_embeds": sparse}, "prompt_embeds must be a dense (strided) tensor"),
        ({"prompt_embeds": torch.empty(5, 64, device="meta")}, "prompt_embeds must hold data"),
        ({"prompt_embeds": bad}, "prompt_embeds must hold finite values (after the cast to the model's torch.float32); "
                                 "[2, 7] is nan"),
        ({"prompt_embeds": inf}, "[0, 0] is inf"),
        ({"prompt_embeds": good, "prompt_token_ids": [1, 2]},
         "prompt_embeds cannot be combined with other prompt fields ['prompt_token_ids']"),
        ({"prompt_embeds": good, "prompt": "hi"}, "prompt_embeds cannot be combined with other prompt fields ['prompt']"),
        ({"prompt_embed": good}, "unknown ['prompt_embed']"),
        ({}, "a dict prompt takes exactly one of"),
        ({"prompt_token_ids": "12"}, "prompt_token_ids must be a list of int token ids"),
        ({"prompt": [1, 2]}, "prompt (of a dict prompt) must be a str"),
        ({"prompt_embeds": torch.zeros(engine.max_model_len, 64)}, f"prompt_embeds has {engine.max_model_len} rows"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError) as e:
            engine.add_request(prompt, GREEDY)
        assert message in str(e.value), (prompt.keys(), str(e.value))
        with pytest.raises(ValueError, match="prompt"):  # generate checks every prompt before queueing any
            engine.generate([PROMPTS[0], prompt], GREEDY)
        assert not engine.has_unfinished_requests()
    # the configurations the engine refuses them under (set on this engine's config only for the refusal to read:
    # building a speculative or a tensor-parallel engine is another test file's business)
    with monkeypatch.context() as m:
        m.setattr(engine.config, "speculative", object())
        with pytest.raises(ValueError, match=r"prompt_embeds: not with speculative decoding"):
            engine.add_request({"prompt_embeds": good}, GREEDY)
    with monkeypatch.context() as m:
        m.setattr(engine.config, "tensor_parallel_size", 2)
        with pytest.raises(ValueError, match=r"prompt_embeds: not under tensor parallelism"):
            engine.add_request({"prompt_embeds": good}, GREEDY)
    assert not engine.has_unfinished_requests()
    assert engine.generate([{"prompt_embeds": good}], GREEDY)[0].outputs[0].finish_reason == "length"


def test_a_rollout_pool_refuses_them_before_anything_travels():
    from rollout.pool import RolloutPool

    pool = RolloutPool.__new__(RolloutPool)  # no workers: the refusal comes before any is used
    for prompts in ({"prompt_embeds": torch.zeros(2, 64)}, [[1, 2], {"prompt_embeds": torch.zeros(2, 64)}]):
        with pytest.raises(ValueError, match="prompt_embeds: not through a RolloutPool"):
            pool.submit(prompts, GREEDY)


def test_the_http_blob_round_trips_and_refuses_what_is_not_one_tensor():
    t = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(decode_prompt_embeds(encode_prompt_embeds(t)), t)
    from safetensors.torch import save

    two = base64.b64encode(save({"a": t, "b": t.clone()})).decode()
    pickled = io.BytesIO()
    torch.save(t, pickled)  # vLLM's client format: refused, never unpickled
    for text, message in [("not base64!", "prompt_embeds must be base64"),
                          (base64.b64encode(save({})).decode(), "prompt_embeds must hold exactly one tensor, got 0"),
                          (two, "prompt_embeds must hold exactly one tensor, got 2"),
                          (base64.b64encode(pickled.getvalue()).decode(), "prompt_embeds is not a safetensors blob"),
                          (base64.b64encode(b"garbage").decode(), "prompt_embeds is not a safetensors blob")]:
        with pytest.raises(ValueError) as e:
            decode_prompt_embeds(text)
        assert message in str(e.value)


def test_a_lora_adapter_samples_an_embedding_prompt_as_its_token_prompt(model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from conftest import load_hf

    torch.manual_seed(1)
    adapter = peft.get_peft_model(load_hf(model_dir), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"]))
    adapter.save_pretrained(tmp_path / "a")
    engine = engine_of(model_dir, max_loras=1, max_lora_rank=4, max_num_batched_tokens=8)
    engine.load_lora("a", str(tmp_path / "a"))
    params = [dataclasses.replace(SEEDED, lora="a"), dataclasses.replace(SEEDED, seed=8)]  # adapter and base mixed
    expected = engine.generate(PROMPTS[2:], params)
    got = engine.generate(embeds_of(engine, PROMPTS[2:]), params)
    assert results(got) == results(expected)
    assert [c.lora for c in got[0].outputs] == ["a"] * 3 and got[1].outputs[0].lora is None
    base = engine.generate([PROMPTS[2]], SEEDED)[0]
    assert results([base]) != results(got[:1])  # the adapter changes the samples: the comparison can fail


def test_routed_experts_of_an_embedding_prompt_are_its_token_prompts(ckpt_factory):
    engine = engine_of(ckpt_factory("qwen3_moe"), max_num_batched_tokens=8, block_size=4)
    params = SamplingParams(n=2, max_tokens=6, seed=3, ignore_eos=True, return_routed_experts=True)
    expected = engine.generate(PROMPTS[2:], params)
    got = engine.generate(embeds_of(engine, PROMPTS[2:]), params)
    assert results(got) == results(expected)
    for e, g, ids in zip(expected, got, PROMPTS[2:]):
        for ce, cg in zip(e.outputs, g.outputs):
            assert cg.routed_experts.shape[0] == len(ids) + len(cg.token_ids) - 1
            assert (cg.routed_experts == ce.routed_experts).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_and_one_token_prefill_steps(model_dir):
    """On a GPU with decode graphs captured: a 1-token embedding prompt and a chunk that ends in 1 prompt token
    (query length 1, which a graph would replay with the placeholder's embedding) run eagerly with their rows;
    decode steps replay graphs as usual. Same tokens as the token prompts, run alike (bitwise)."""
    engine = engine_of(model_dir, device="cuda", num_kv_blocks=None, max_num_batched_tokens=5, block_size=4,
                       deterministic=True, gpu_memory_utilization=0.3)
    try:
        assert engine.runner.graphs is not None
        prompts = [[100], list(range(3, 9)), list(range(20, 41))]
        for params in (GREEDY, SEEDED):
            expected = engine.generate(prompts, params)
            assert results(engine.generate(embeds_of(engine, prompts), params)) == results(expected)
    finally:
        engine.close()  # its cache would hold most of the GPU for the tests after it


# ---- the server ------------------------------------------------------------------------------------------------
KEY, NAME, VOCAB = "sk-embeds-4", "tiny-embeds", 320


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    pytest.importorskip("fastapi")  # before the harness, which imports the server
    from server_harness import chat_checkpoint

    return chat_checkpoint(tmp_path_factory.mktemp("embeds_server"), seed=13, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def server(chat_dir):
    pytest.importorskip("fastapi")
    from server_harness import LiveServer

    from rollout import AsyncEngine
    from rollout.server_config import ServerConfig

    # deterministic: a prompt's tokens do not depend on what the server batched it with
    with LiveServer(AsyncEngine(config_of(chat_dir, deterministic=True)),
                    ServerConfig(api_key=KEY, served_model_name=NAME, max_prompt_tokens=64)) as srv:
        yield srv
    srv.engine.close()


@pytest.fixture(scope="module")
def http(server):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def table(chat_dir):
    """The served model's embedding table, as its checkpoint holds it (float32)."""
    from safetensors.torch import load_file

    return load_file(str(chat_dir / "model.safetensors"))["model.embed_tokens.weight"]


def test_openai_completions_take_prompt_embeds(server, http, table):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ids = [[11, 40, 7, 200, 93, 5], list(range(60, 81))]
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model=NAME, max_tokens=7, temperature=1.0, seed=5, n=2, logprobs=2)
    expected = client.completions.create(prompt=ids, extra_body=extra, **kw)
    got = client.completions.create(prompt="", extra_body={"prompt_embeds": [encode_prompt_embeds(table[p])
                                                                            for p in ids], **extra}, **kw)
    assert len(got.choices) == 4
    for e, g in zip(expected.choices, got.choices):
        assert (g.index, g.text, g.model_extra["token_ids"], g.logprobs.token_logprobs, g.logprobs.top_logprobs) == \
            (e.index, e.text, e.model_extra["token_ids"], e.logprobs.token_logprobs, e.logprobs.top_logprobs)
        assert e.model_extra["prompt_token_ids"] in ids and g.model_extra.get("prompt_token_ids") is None  # none
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens == sum(map(len, ids))
    one = client.completions.create(model=NAME, prompt="", max_tokens=4, temperature=0,  # vLLM's client example
                                    extra_body={"prompt_embeds": encode_prompt_embeds(table[ids[0]])})
    greedy = client.completions.create(model=NAME, prompt=ids[0], max_tokens=4, temperature=0)
    assert one.choices[0].text == greedy.choices[0].text
    long = dict(model=NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(prompt=ids[1], **long).choices[0].text
    assert len(text) > 4
    long["stop"] = [text[2:4]]  # a stop string inside the completion: it looks at generated tokens only
    stopped = client.completions.create(prompt=ids[1], **long).choices[0]
    long["extra_body"] = {**long["extra_body"], "prompt_embeds": encode_prompt_embeds(table[ids[1]])}
    got_stop = client.completions.create(prompt="", **long).choices[0]
    assert (got_stop.text, got_stop.finish_reason) == (stopped.text, "stop") and len(stopped.text) < len(text)
    r = http.post("/v1/completions", json={"prompt_embeds": encode_prompt_embeds(table[ids[0]]), "max_tokens": 4,
                                           "temperature": 0, "stream": True})  # no prompt field at all, streamed
    assert r.status_code == 200
    chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json

    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == greedy.choices[0].text


def test_bad_prompt_embeds_are_400s_naming_the_field(server, http, table):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    good = encode_prompt_embeds(table[[3, 4, 5]])
    pickled = io.BytesIO()
    torch.save(table[[3, 4, 5]], pickled)
    cases = [
        ({"prompt_embeds": "%%%"}, "prompt_embeds", "prompt_embeds must be base64"),
        ({"prompt_embeds": base64.b64encode(pickled.getvalue()).decode()}, "prompt_embeds",
         "prompt_embeds is not a safetensors blob"),
        ({"prompt_embeds": [good, encode_prompt_embeds(table[[3, 4]][:, :10])]}, "prompt_embeds[1]",
         "prompt_embeds[1] rows must have the model's hidden_size=64"),
        ({"prompt_embeds": encode_prompt_embeds(torch.full((2, 64), float("nan")))}, "prompt_embeds",
         "prompt_embeds must hold finite values"),
        ({"prompt_embeds": encode_prompt_embeds(table[3])}, "prompt_embeds", "prompt_embeds must be 2-D"),
        ({"prompt_embeds": encode_prompt_embeds(torch.zeros(65, 64))}, "prompt_embeds", "this server takes at most 64"),
        ({"prompt_embeds": good, "prompt": "hello"}, "prompt_embeds", "prompt_embeds cannot be combined"),
        ({"prompt_embeds": good, "echo": True}, "echo", "echo with prompt_embeds"),
        ({"prompt_embeds": good, "prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs with prompt_embeds"),
        ({"prompt_embeds": 7}, "prompt_embeds", "prompt_embeds must be base64 of a safetensors blob"),
        ({}, "prompt", "prompt is required"),
    ]
    for body, param, message in cases:
        r = http.post("/v1/completions", json={"max_tokens": 2, **body})
        assert r.status_code == 400, (body.keys(), r.text)
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="", extra_body={"prompt_embeds": "bm90IHNhZmV0ZW5zb3Jz"})
    assert "prompt_embeds is not a safetensors blob" in str(e.value)
    assert http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}).status_code == 200  # still serving


def test_sglang_generate_takes_input_embeds(http, table):
    ids = [[11, 40, 7, 200, 93, 5], [9, 8, 7]]
    sp = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    expected = http.post("/generate", json={"input_ids": ids, "sampling_params": sp, "return_logprob": True}).json()
    got = http.post("/generate", json={"input_embeds": [table[p].tolist() for p in ids], "sampling_params": sp,
                                       "return_logprob": True}).json()
    assert len(got) == 2
    for e, g in zip(expected, got):
        assert (g["text"], g["output_ids"], g["meta_info"]["output_token_logprobs"]) == \
            (e["text"], e["output_ids"], e["meta_info"]["output_token_logprobs"])
        assert g["meta_info"]["prompt_tokens"] == e["meta_info"]["prompt_tokens"]
    one = http.post("/generate", json={"input_embeds": table[ids[1]].tolist(), "sampling_params": sp}).json()
    assert one["output_ids"] == expected[1]["output_ids"]
    for body, param, message in [
        ({"input_embeds": [[0.5] * 64, [0.5] * 63]}, "input_embeds", "input_embeds must be rows of equal length"),
        ({"input_embeds": [[0.5] * 10]}, "input_embeds", "input_embeds rows must have the model's hidden_size=64"),
        ({"input_embeds": [[[0.5] * 64], [[0.5] * 3]]}, "input_embeds[1]", "input_embeds[1] rows must have"),
        ({"input_embeds": [[0.5] * 64], "input_ids": [3]}, None, "give one of 'text' or 'input_ids' (or 'input_embeds')"),
    ]:
        r = http.post("/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.json()["error"]["message"], \
            r.text
