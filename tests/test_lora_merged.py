"""LoRA's merged mode (`EngineConfig.lora_merged`; CPU, float32 unless said) against transformers + peft on tiny
random Llama and Qwen2 checkpoints with real PEFT adapters (random, non-zero B): the merged weights equal peft's
merge, logits and greedy equal peft's and the same adapter's in slot mode, with no slots or hooks in the runner;
pushes (dense, patch, one tensor) recompute exactly the modules they wrote and then equal peft's updated adapter;
refused pushes change no weight; unload restores every base weight bitwise (also in bfloat16, where subtracting
the delta back would not), across a deep sleep too; a base request, a base push and a second merged load are
refused while an adapter is merged, as are a merge while base requests run (or a base update is staged) and an
unload while the adapter's run; the prefix cache does not hand blocks the base computed before the merge to the
adapter's requests; the server serves the merged adapter and refuses the base."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_engine_holds, load_hf, make_checkpoint, perturb_lora
from rollout import Engine, EngineConfig, SamplingParams
from test_lora_engine import hf_greedy, peft_model, write_adapter, write_adapters
from trainer_bridge import TrainerBridge

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 3], list(range(3, 30))]
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def config(path, **kw) -> EngineConfig:
    kw = {"dtype": "float32", "max_loras": 1, "lora_merged": True, "num_kv_blocks": 96, "max_num_seqs": 8, **kw}
    return EngineConfig(model=str(path), **kw)


def weights(engine) -> dict[str, torch.Tensor]:
    """A copy of every checkpoint weight the engine holds."""
    return {name: engine.runner.weights.view(name).clone() for name in engine.weight_specs()}


def changed(engine, before) -> set[str]:
    return {name for name, t in before.items() if not torch.equal(engine.runner.weights.view(name), t)}


def logits(engine, tokens):
    engine.step()  # the runner forgets requests that finished in the last step
    return engine.collective_rpc("full_sequence_logits", tokens, -1)[0]


def greedy(engine, prompts, lora):
    return [o.outputs[0] for o in engine.generate(prompts, SamplingParams(**GREEDY, lora=lora))]


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v with bias
def base(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(f"lora_merged_{request.param}"), request.param, seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("lora_merged_adapters"), ("a", "b"))


@pytest.fixture(scope="module")
def slot_engine(base, adapters):
    e = Engine(config(base, lora_merged=False, max_loras=2, max_lora_rank=8))
    for name in ("a", "b"):
        e.load_lora(name, str(adapters[name]))
    return e


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_merged_adapter_equals_peft_and_slot_mode(base, adapters, slot_engine, name):
    engine = Engine(config(base))
    runner = engine.runner
    assert runner.lora is None and not hasattr(runner.buffers, "lora_idx")  # the plain model path
    assert all(getattr(m, "lora", None) is None for m in runner.model.modules())
    before = weights(engine)
    info = engine.load_lora(name, str(adapters[name]))
    assert info.merged and info.slot == -1 and info.version == 0 and engine.list_loras() == [info]
    model = peft_model(base, adapters[name])
    reference = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's merge, in float32
    adapted = {f"model.layers.{i}.{parent}.{m}.weight" for i in range(2) for parent, m in
               [("self_attn", m) for m in ("q_proj", "k_proj", "v_proj", "o_proj")] +
               [("mlp", m) for m in ("gate_proj", "up_proj", "down_proj")] if m in info.modules}
    assert changed(engine, before) == adapted  # exactly the adapted modules' weights were rewritten
    for n in adapted:
        torch.testing.assert_close(engine.runner.weights.view(n), reference[n], atol=1e-6, rtol=0)
    tokens = list(range(3, 40))
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
        assert (ref - load_hf(base)(torch.tensor([tokens])).logits[0]).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(logits(engine, tokens), ref, atol=1e-4, rtol=1e-4)
    outs = greedy(engine, PROMPTS, name)
    slots = greedy(slot_engine, PROMPTS, name)
    for prompt, out, slot in zip(PROMPTS, outs, slots):
        assert out.token_ids == hf_greedy(model, prompt) == slot.token_ids, prompt
        assert out.lora == name and out.lora_versions == [0] * 8
        assert out.logprobs == pytest.approx(slot.logprobs, abs=1e-4)


def test_pushes_refold_the_modules_they_write(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("a", str(adapters["a"]))
    trainer = peft_model(base, adapters["a"])
    bridge = TrainerBridge(engine, lora="a")
    assert len(bridge.specs) == 2 * 7 * 2
    perturb_lora(trainer, seed=0, fraction=1.0)
    first = bridge.push_weights(trainer)
    assert first.num_dense == len(bridge.specs) and first.lora_version == 1 == engine.policy_version
    perturb_lora(trainer, seed=1, fraction=0.05)
    second = bridge.push_weights(trainer)
    assert second.num_patch > 0 and second.lora_version == 2 and engine.list_loras()[0].version == 2
    merged = copy.deepcopy(trainer).merge_and_unload()
    for prompt, out in zip(PROMPTS, greedy(engine, PROMPTS, "a")):
        assert out.token_ids == hf_greedy(merged, prompt) and out.lora_versions == [2] * 8, prompt
    tokens = list(range(3, 40))
    with torch.no_grad():
        torch.testing.assert_close(logits(engine, tokens), merged(torch.tensor([tokens])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    reference = merged.state_dict()
    # one tensor pushed: only its module's merged weight is rewritten, to peft's merge of the new adapter
    before = weights(engine)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    state = {n.replace(".default", ""): p.detach().clone() for n, p in trainer.named_parameters() if ".lora_" in n}
    state[name][3, 1] += 1.0
    assert bridge.push_weights({name: state[name]}).num_patch == 1
    assert changed(engine, before) == {"model.layers.1.mlp.down_proj.weight"}
    with torch.no_grad():
        trainer.get_parameter(name.replace("lora_B.weight", "lora_B.default.weight")).copy_(state[name])
    reference = copy.deepcopy(trainer).merge_and_unload().state_dict()
    torch.testing.assert_close(engine.runner.weights.view("model.layers.1.mlp.down_proj.weight"),
                               reference["model.layers.1.mlp.down_proj.weight"], atol=1e-6, rtol=0)


def test_refused_pushes_change_no_weight(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("b", str(adapters["b"]))  # rank 2 on q, v, up, down
    bridge = TrainerBridge(engine, lora="b")
    before = weights(engine)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    hidden = engine.model_config.hidden_size
    bad = {"rank": ({q_a: torch.randn(8, hidden),
                     q_a.replace("lora_A", "lora_B"): torch.randn(64, 8)}, "shape"),
           "module": ({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.randn(2, hidden)},
                      "k_proj"),
           "shape": ({q_a: torch.randn(2, hidden + 1)}, "shape")}
    for what, (records, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            bridge.push_weights(records)
        assert not changed(engine, before), what
        assert engine.list_loras()[0].version == 0 and engine.policy_version == 0, what
    good = bridge.push_weights({q_a: torch.randn(2, hidden)})
    assert good.lora_version == 1 and changed(engine, before) == {"model.layers.0.self_attn.q_proj.weight"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unload_restores_the_base_bitwise(base, adapters, dtype):
    engine = Engine(config(base, dtype=dtype))
    before = weights(engine)
    want = greedy(engine, PROMPTS, None)
    engine.load_lora("a", str(adapters["a"]))
    trainer = peft_model(base, adapters["a"])
    bridge = TrainerBridge(engine, lora="a")
    for seed in range(3):  # pushes in between: each refold starts again from the kept base
        perturb_lora(trainer, seed=seed, fraction=0.5)
        bridge.push_weights(trainer)
    assert len(changed(engine, before)) == 2 * 7
    engine.unload_lora("a")
    assert engine.list_loras() == []
    assert_engine_holds(engine, before)
    got = greedy(engine, PROMPTS, None)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # another adapter under the same name afterwards is merged into the same base
    engine.load_lora("a", str(adapters["b"]))
    if dtype == "float32":
        model = peft_model(base, adapters["b"])
        assert [o.token_ids for o in greedy(engine, PROMPTS, "a")] == [hf_greedy(model, p) for p in PROMPTS]
    engine.unload_lora("a")
    assert_engine_holds(engine, before)


def test_the_base_is_not_served_while_merged(base, adapters, tmp_path):
    engine = Engine(config(base))
    base_bridge = TrainerBridge(engine)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="base-running")
    with pytest.raises(ValueError, match="base request.*unfinished"):
        engine.load_lora("a", str(adapters["a"]))
    assert engine.list_loras() == []
    engine.abort_request("base-running")
    before = weights(engine)
    engine.load_lora("a", str(adapters["a"]))
    merged = weights(engine)
    with pytest.raises(ValueError, match="SamplingParams.lora=None.*not served.*'a'"):
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="SamplingParams.lora=None"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="lora_merged holds one adapter at a time"):
        engine.load_lora("b", str(adapters["b"]))
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="base weight update while adapter 'a' is merged"):
        base_bridge.push_weights({q: before[q] + 1.0})
    with pytest.raises(ValueError, match="merged"):
        engine.apply_weight_update(engine.policy_version + 1, engine.export_weights()[:1])
    with pytest.raises(ValueError, match="merged"):
        engine.prepare_weight_update(engine.policy_version + 1, engine.export_weights()[:1])
    assert not changed(engine, merged) and engine.policy_version == 0
    assert [info.name for info in engine.list_loras()] == ["a"]
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, lora="a"), request_id="a-running")
    with pytest.raises(ValueError, match="unfinished"):
        engine.unload_lora("a")
    assert not changed(engine, merged)
    engine.abort_request("a-running")
    engine.unload_lora("a")
    assert_engine_holds(engine, before)
    assert base_bridge.push_weights({q: before[q] + 1.0}).version == 1  # the base is served again
    assert len(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_a_staged_base_update_blocks_a_merge(base, adapters):
    engine = Engine(config(base))
    q = "model.layers.0.self_attn.q_proj.weight"
    engine.prepare_weight_update(1, [r for r in engine.export_weights() if r.name == q])
    with pytest.raises(ValueError, match="staged"):
        engine.load_lora("a", str(adapters["a"]))
    engine.drop_weight_update()
    assert engine.load_lora("a", str(adapters["a"])).merged


def test_base_blocks_from_before_the_merge_are_not_reused(base, adapters):
    engine = Engine(config(base))
    prompt = list(range(50, 90))  # two full blocks of 16 and a part
    model = peft_model(base, adapters["a"])

    def run(lora):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora=lora))[0]
        return out.num_cached_prompt_tokens, out.outputs[0].token_ids

    cached, base_tokens = run(None)
    assert cached == 0 and run(None) == (32, base_tokens)  # the base's blocks are in the cache
    engine.load_lora("a", str(adapters["a"]))
    want = hf_greedy(model, prompt, 4)
    assert want != base_tokens
    assert run("a") == (0, want)  # not the base's blocks
    assert run("a") == (32, want)  # its own
    engine.unload_lora("a")
    assert run(None) == (32, base_tokens)  # the base written back bitwise: its blocks are valid again
    engine.load_lora("a", str(adapters["a"]))
    assert run("a") == (0, want)  # a new load: nothing of the old one is reused


def test_a_push_mid_request_is_recorded_per_token(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("a", str(adapters["a"]))
    trainer = peft_model(base, adapters["a"])
    bridge = TrainerBridge(engine, lora="a")
    engine.add_request(PROMPTS[0], SamplingParams(**{**GREEDY, "max_tokens": 6}, lora="a"), request_id="spans")
    outs = {}
    for _ in range(3):
        for out in engine.step():
            outs[out.request_id] = out
    perturb_lora(trainer, seed=2, fraction=1.0)
    bridge.push_weights(trainer)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    spans = outs["spans"].outputs[0]
    assert spans.lora_versions == [0, 0, 0, 1, 1, 1] and spans.policy_versions == [0, 0, 0, 1, 1, 1]


def test_sleep_keeps_the_merged_weights_and_unload_still_restores(base, adapters):
    engine = Engine(config(base))
    before = weights(engine)
    engine.load_lora("a", str(adapters["a"]))
    want = [o.token_ids for o in greedy(engine, PROMPTS, "a")]
    engine.sleep(2)  # the weights move to host memory and back: new storage
    with pytest.raises(ValueError, match="sleeps"):
        engine.unload_lora("a")
    engine.wake_up()
    assert [o.token_ids for o in greedy(engine, PROMPTS, "a")] == want
    engine.unload_lora("a")  # writes into the parameters' new storage
    assert_engine_holds(engine, before)
    engine.sleep(2)
    with pytest.raises(ValueError, match="sleeps"):
        engine.load_lora("a", str(adapters["a"]))
    engine.wake_up()
    assert engine.list_loras() == [] and not changed(engine, before)


def test_config_checks_and_target_modules(base, adapters):
    for kw in ({}, {"max_loras": 2}):
        with pytest.raises(ValueError, match="lora_merged.*max_loras=1"):
            EngineConfig(model="m", lora_merged=True, **kw)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="m", lora_merged=True, max_loras=1, tensor_parallel_size=2)
    engine = Engine(config(base, lora_target_modules=["q_proj", "v_proj"]))
    merged = engine._loras.merged
    hidden, kv = engine.model_config.hidden_size, engine.model_config.num_kv_heads * engine.model_config.head_dim
    assert merged.nbytes == 2 * (hidden * hidden + kv * hidden) * 4  # q and v of both layers, float32
    before = weights(engine)
    with pytest.raises(ValueError, match="lora_target_modules"):
        engine.load_lora("a", str(adapters["a"]))  # it adapts o_proj and the MLP too
    assert engine.list_loras() == [] and not changed(engine, before)
    qv = write_adapter(base, adapters["a"].parent / "qv", seed=4, r=32, lora_alpha=16,  # above max_lora_rank=16
                       target_modules=["q_proj", "v_proj"])
    engine.load_lora("qv", str(qv))  # merged mode has no rank limit (max_lora_rank sizes slots)
    with torch.no_grad():
        ref = peft_model(base, qv)(torch.tensor([PROMPTS[3]])).logits[0]
    torch.testing.assert_close(logits(engine, PROMPTS[3]), ref, atol=1e-4, rtol=1e-4)


# ---- the server: the same endpoints over a merged engine -------------------------------------------------------
def test_server_serves_the_merged_adapter_and_refuses_the_base(tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from server_harness import LiveServer, chat_checkpoint

    from rollout import AsyncEngine
    from rollout.server_config import ServerConfig

    chat = chat_checkpoint(tmp_path, seed=11)
    sql = write_adapter(chat, tmp_path / "sql", seed=1, r=4, lora_alpha=8)
    local = Engine(config(chat))
    ids = local.tokenizer.encode("what is the weather in Paris today?")
    want_base = greedy(local, [ids], None)[0].token_ids
    local.load_lora("sql", str(sql))
    want = greedy(local, [ids], "sql")[0].token_ids
    assert want != want_base
    engine = AsyncEngine(config(chat))
    with LiveServer(engine, ServerConfig(served_model_name="base")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(sql)})
        assert r.status_code == 200, r.text
        assert [c["id"] for c in http.get("/v1/models").json()["data"]] == ["base", "sql"]
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        out = http.post("/v1/completions", json={**body, "model": "sql"}).json()["choices"][0]
        assert out["token_ids"] == want and out["lora_versions"] == [0] * 8
        scoring_only = {"max_tokens": 0, "echo": True, "logprobs": 0}  # runner/scoring.py, no request
        for extra in ({}, {"prompt_logprobs": 0}, scoring_only):
            r = http.post("/v1/completions", json={**body, "model": "base", **extra})
            assert r.status_code == 400 and "merged" in r.text, (extra, r.text)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(sql)})
        assert r.status_code == 400 and "one adapter at a time" in r.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        r = http.post("/v1/completions", json={**body, "model": "base"})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want_base
    srv.engine.close()
