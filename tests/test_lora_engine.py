"""LoRA in the engine (CPU, float32) against transformers + peft on tiny random Llama and Qwen2 checkpoints with real
PEFT adapters (random, non-zero B): logits with an adapter, greedy against peft's generate, a batch mixing the base
and two adapters equal to each alone, swaps under one name, the prefix cache kept apart per adapter, outputs
recording the adapter and its version per token, adapter pushes through TrainerBridge (dense, then a patch) equal to
peft's updated adapter merged, refused pushes changing nothing, chunked prefill with preemption, and an engine
without LoRA carrying none of it; and the server's side through httpx and the official `openai` package (vLLM's
load / unload endpoints, the `model` field, /v1/models with parents, SGLang's lora_path, the admin and key gates)."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from conftest import load_hf, make_checkpoint, perturb_lora
from rollout import Engine, EngineConfig, RequestOutputKind, SamplingParams
from runner.lora import LORA_MODULES
from trainer_bridge import TrainerBridge

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 3], list(range(3, 30))]


def write_adapter(base_dir, out_dir, *, seed, **lora_kwargs):
    """A PEFT adapter of `base_dir` with random A and B (B not zero-initialised) saved to `out_dir`."""
    torch.manual_seed(seed)
    lora_kwargs.setdefault("target_modules", list(LORA_MODULES))
    pm = peft.get_peft_model(load_hf(base_dir), peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    pm.save_pretrained(out_dir)
    return out_dir


def write_adapters(base_dir, root, names=("a", "b", "c")) -> dict:
    """The test adapters of `base_dir` under `root`, by name: a, rank 4 on every module; b, rank 2 rsLoRA on some;
    c, rank 8 on every module (a replacement for a)."""
    kwargs = {"a": dict(seed=1, r=4, lora_alpha=8),
              "b": dict(seed=2, r=2, lora_alpha=3, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
              "c": dict(seed=5, r=8, lora_alpha=4)}
    return {name: write_adapter(base_dir, root / name, **kwargs[name]) for name in names}


def peft_model(base_dir, adapter_dir):
    return peft.PeftModel.from_pretrained(load_hf(base_dir), adapter_dir).eval()


def hf_greedy(model, prompt, n=8):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def config(path, **kw) -> EngineConfig:
    kw = {"dtype": "float32", "max_loras": 3, "max_lora_rank": 8, "num_kv_blocks": 96, "max_num_seqs": 8, **kw}
    return EngineConfig(model=str(path), **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v with bias
def base(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(f"lora_engine_{request.param}"), request.param, seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("lora_engine_adapters"))


@pytest.fixture(scope="module")
def peft_models(base, adapters):
    return {name: peft_model(base, path) for name, path in adapters.items()}


@pytest.fixture(scope="module")
def engine(base, adapters):
    e = Engine(config(base))
    for name in ("a", "b"):
        e.load_lora(name, str(adapters[name]))
    return e


def slot_of(engine, name) -> int:
    return next(info.slot for info in engine.list_loras() if info.name == name)


def _logits(engine, tokens, lora=None):
    engine.step()  # the runner forgets requests that finished in the last step
    return engine.collective_rpc("full_sequence_logits", tokens, -1 if lora is None else slot_of(engine, lora))[0]


def test_logits_with_an_adapter_match_peft(engine, base, peft_models):
    tokens = list(range(3, 40))
    with torch.no_grad():
        plain = load_hf(base)(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(_logits(engine, tokens), plain, atol=1e-4, rtol=1e-4)
        for name in ("a", "b"):
            ref = peft_models[name](torch.tensor([tokens])).logits[0]
            assert (ref - plain).abs().max() > 0.1, "the adapter must change the logits for the test to mean anything"
            torch.testing.assert_close(_logits(engine, tokens, name), ref, atol=1e-4, rtol=1e-4)


def test_greedy_equals_peft_generate(engine, base, peft_models):
    plain = load_hf(base)
    for name, model in (("a", peft_models["a"]), ("b", peft_models["b"]), (None, plain)):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=name)
        outs = engine.generate(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outs):
            c = out.outputs[0]
            assert c.token_ids == hf_greedy(model, prompt, 8), (name, prompt)
            assert c.lora == name
            assert c.lora_versions == (None if name is None else [0] * 8)
    a_tokens = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="a"))
    assert a_tokens[0].outputs[0].token_ids != hf_greedy(plain, PROMPTS[0], 8)  # the adapter changes the tokens


def test_a_mixed_batch_equals_each_request_alone(engine):
    loras = [None, "a", "b", "a", None, "b", "a", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=100 + i, ignore_eos=True, lora=lora)
              for i, lora in enumerate(loras)]
    together = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = engine.generate([prompt], p)[0].outputs[0]
        mixed = out.outputs[0]
        assert mixed.token_ids == alone.token_ids and mixed.lora == alone.lora == p.lora
        assert mixed.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # the same prompt and seed under each adapter gives three different samples
    same = engine.generate([PROMPTS[3]] * 3, [SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True,
                                                             lora=lora) for lora in (None, "a", "b")])
    assert len({tuple(o.outputs[0].logprobs) for o in same}) == 3


def test_swapping_adapters_under_one_name_serves_the_new_one(engine, adapters, peft_models):
    engine.load_lora("x", str(adapters["a"]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="x")
    assert engine.generate(PROMPTS[:1], params)[0].outputs[0].token_ids == hf_greedy(peft_models["a"], PROMPTS[0], 8)
    # an unfinished request holds the adapter: unloading it is refused, and nothing changes
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, lora="x"), request_id="holds-x")
    with pytest.raises(ValueError, match="unfinished"):
        engine.unload_lora("x")
    assert "x" in [info.name for info in engine.list_loras()]
    engine.abort_request("holds-x")
    engine.unload_lora("x")
    assert "x" not in [info.name for info in engine.list_loras()]
    with pytest.raises(ValueError, match="SamplingParams.lora.*'x'"):
        engine.generate(PROMPTS[:1], params)
    engine.load_lora("x", str(adapters["c"]))  # rank 8 into the freed slot, which held rank 4
    out = engine.generate(PROMPTS[:1], params)[0].outputs[0]
    assert out.token_ids == hf_greedy(peft_models["c"], PROMPTS[0], 8)
    assert out.token_ids != hf_greedy(peft_models["a"], PROMPTS[0], 8)
    tokens = list(range(3, 30))
    with torch.no_grad():
        torch.testing.assert_close(_logits(engine, tokens, "x"), peft_models["c"](torch.tensor([tokens])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    engine.unload_lora("x")


def test_load_refusals_name_the_problem(engine, adapters, base, tmp_path):
    with pytest.raises(ValueError, match="loaded already"):
        engine.load_lora("a", str(adapters["b"]))
    wide = write_adapter(base, tmp_path / "wide", seed=9, r=16, lora_alpha=16)
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.load_lora("wide", str(wide))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_lora("missing", str(tmp_path / "nowhere"))
    assert [info.name for info in engine.list_loras()] == ["a", "b"]
    engine.load_lora("third", str(adapters["c"]))
    with pytest.raises(ValueError, match="max_loras=3"):
        engine.load_lora("fourth", str(adapters["c"]))
    engine.unload_lora("third")
    with pytest.raises(ValueError, match="no LoRA adapter named 'third'"):
        engine.unload_lora("third")


def test_the_prefix_cache_is_never_shared_across_adapters(engine, adapters):
    prompt = list(range(50, 90))  # two full blocks of 16 and a part
    params = {lora: SamplingParams(temperature=0, max_tokens=2, lora=lora) for lora in (None, "a", "b")}

    def cached(lora):
        return engine.generate([prompt], params[lora])[0].num_cached_prompt_tokens

    engine.kv_manager.reset_prefix_cache()
    assert cached("a") == 0
    assert cached("b") == 0  # computed under a: not reused for b
    assert cached(None) == 0  # nor for the base
    assert cached("a") == 32 and cached("b") == 32 and cached(None) == 32  # each reuses its own
    # the same name loaded again is another adapter: nothing of the old load is reused
    engine.load_lora("y", str(adapters["a"]))
    params["y"] = SamplingParams(temperature=0, max_tokens=2, lora="y")
    assert cached("y") == 0 and cached("y") == 32
    engine.unload_lora("y")
    engine.load_lora("y", str(adapters["a"]))
    assert cached("y") == 0
    engine.unload_lora("y")
    # the n samples of one adapter prompt share its blocks
    out = engine.generate([list(range(20, 60))], SamplingParams(n=3, temperature=1.0, max_tokens=2, lora="a"))[0]
    assert out.num_cached_prompt_tokens == 2 * 32


def test_chunked_prefill_and_preemption_with_adapters(base, adapters, engine):
    small = Engine(config(base, max_num_batched_tokens=5, num_kv_blocks=10, block_size=8, max_num_seqs=3))
    for name in ("a", "b"):
        small.load_lora(name, str(adapters[name]))
    loras = ["a", None, "b", "a", "b"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, lora=lora) for lora in loras]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    got = small.generate(prompts, params)
    assert small.scheduler.stats.num_preemptions > 0, "the test must preempt"
    want = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert g.outputs[0].logprobs == pytest.approx(w.outputs[0].logprobs, abs=1e-5)


class _EagerGraphs:
    """`runner.cuda_graph.DecodeGraphs` on the CPU: its replay path with each "graph" a `decode_forward` run
    eagerly, recording the (size, truncation, lora) keys replayed."""

    def __new__(cls, runner):
        from runner.cuda_graph import DecodeGraphs, capture_sizes

        class Graphs(DecodeGraphs):
            def _capture_one(self, size, truncation, lora):
                key = (size, truncation, lora)
                graphs = self

                class Eager:
                    def replay(self):
                        graphs.outputs[key] = runner.decode_forward(*key)

                self.graphs[key], self.outputs[key] = Eager(), None

            def replay(self, size, truncation=False, lora=False):
                self.replayed.append((size, truncation, lora))
                return super().replay(size, truncation, lora)

        graphs = Graphs(runner, capture_sizes(runner.max_decode_rows))
        graphs.replayed = []
        return graphs


def test_decode_graphs_without_adapter_tokens_take_the_variant_without_lora(base, adapters, engine):
    """Decode steps with an adapter token replay the LoRA variant, steps without one the variant with the hooks off
    (the graph path's selection, run eagerly on the CPU); the tokens equal the eager engine's."""
    graphed = Engine(config(base))
    for name in ("a", "b"):
        graphed.load_lora(name, str(adapters[name]))
    runner = graphed.runner
    runner.graphs = _EagerGraphs(runner)
    assert runner.graphs.lora_variants == (True, False)
    loras = ["a", None, "b", None]
    lengths = [3, 9, 5, 9]  # the adapter requests finish first: the last decode steps have base tokens only
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora=lora)
              for lora, n in zip(loras, lengths)]
    got = graphed.generate(PROMPTS, params)
    want = engine.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert g.outputs[0].logprobs == pytest.approx(w.outputs[0].logprobs, abs=1e-5)
    replayed = runner.graphs.replayed
    # decode steps: 2 with all four requests, 2 with three (b still running), 4 with the two base requests
    assert [lora for _, _, lora in replayed] == [True] * 4 + [False] * 4, replayed
    assert [size for size, _, _ in replayed] == [4] * 4 + [2] * 4
    base_only = graphed.generate(PROMPTS[:2], GREEDY)
    assert [lora for _, _, lora in replayed[8:]] == [False] * (GREEDY.max_tokens - 1)
    assert [o.outputs[0].token_ids for o in base_only] == [o.outputs[0].token_ids
                                                          for o in engine.generate(PROMPTS[:2], GREEDY)]
    without = _EagerGraphs(Engine(EngineConfig(model=str(base), dtype="float32", num_kv_blocks=32)).runner)
    assert without.lora_variants == (False,)
    with pytest.raises(AssertionError, match="needs a runner with LoRA"):
        without.replay(1, False, True)


def test_delta_outputs_fold_into_the_final_one(engine):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, lora="b", output_kind=RequestOutputKind.DELTA)
    engine.add_request(PROMPTS[1], params, request_id="delta-b")
    folded = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if folded is None:
                folded = copy.deepcopy(out)
            else:
                folded.add(out)
    final = engine.generate([PROMPTS[1]], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, lora="b"))[0]
    assert [c.token_ids for c in folded.outputs] == [c.token_ids for c in final.outputs]
    assert [c.lora_versions for c in folded.outputs] == [[0] * 6] * 2 and all(c.lora == "b" for c in folded.outputs)


# ---- pushes ---------------------------------------------------------------------------------------------------
def test_adapter_pushes_then_greedy_equals_peft_merged(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("a", str(adapters["a"]))
    trainer = peft_model(base, adapters["a"])  # the trainer's copy, as it was loaded
    bridge = TrainerBridge(engine, lora="a")
    assert set(bridge.specs) == set(engine.lora_specs("a")) and len(bridge.specs) == 2 * 7 * 2
    perturb_lora(trainer, seed=0, fraction=1.0)
    first = bridge.push_weights(trainer)  # a PeftModel: its lora tensors only, named with ".default"
    assert first.num_dense == len(bridge.specs) and first.num_patch == 0
    assert first.lora_version == 1 and first.version == 1 == engine.policy_version
    perturb_lora(trainer, seed=1, fraction=0.05)
    second = bridge.push_weights(trainer)
    assert second.num_patch > 0 and second.nbytes < first.nbytes and second.lora_version == 2
    merged = copy.deepcopy(trainer).merge_and_unload()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="a")
    outs = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert c.token_ids == hf_greedy(merged, prompt, 8)
        assert c.lora_versions == [2] * 8 and c.policy_versions == [2] * 8
    tokens = list(range(3, 40))
    with torch.no_grad():
        torch.testing.assert_close(_logits(engine, tokens, "a"), trainer(torch.tensor([tokens])).logits[0],
                                   atol=1e-4, rtol=1e-4)
        # the base is untouched by adapter pushes
        torch.testing.assert_close(_logits(engine, tokens), load_hf(base)(torch.tensor([tokens])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    # rollouts of the bridge sample with its adapter
    batch = bridge.rollout([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert batch.samples[0].completion_ids == hf_greedy(merged, PROMPTS[0], 8)
    # a state dict in PEFT's saved names (no adapter segment), one tensor changed
    state = {n.replace(".default", ""): p.detach().clone() for n, p in trainer.named_parameters() if ".lora_" in n}
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    state[name][0, 0] += 1.0
    third = bridge.push_weights({name: state[name]})
    assert third.num_patch == 1 and third.lora_version == 3
    assert torch.equal(engine.runner.lora.target(slot_of(engine, "a")).views[name], state[name])


def test_a_version_change_mid_request_is_recorded_per_token(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("a", str(adapters["a"]))
    trainer = peft_model(base, adapters["a"])
    bridge = TrainerBridge(engine, lora="a")
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora="a"),
                       request_id="spans")
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id="base")
    outs = {}
    for _ in range(3):
        for out in engine.step():
            outs[out.request_id] = out
    perturb_lora(trainer, seed=2, fraction=1.0)
    bridge.push_weights(trainer)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    spans, plain = outs["spans"].outputs[0], outs["base"].outputs[0]
    assert spans.lora_versions == [0, 0, 0, 1, 1, 1] and spans.policy_versions == [0, 0, 0, 1, 1, 1]
    assert plain.lora is None and plain.lora_versions is None and plain.policy_versions == [0, 0, 0, 1, 1, 1]


def test_refused_pushes_change_nothing(base, adapters):
    engine = Engine(config(base))
    engine.load_lora("b", str(adapters["b"]))  # rank 2 on q, v, up, down
    bridge = TrainerBridge(engine, lora="b")
    slot = slot_of(engine, "b")
    before = {n: v.clone() for n, v in engine.runner.lora.target(slot).views.items()}
    tokens_before = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, lora="b"))
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    hidden = before[q_a].shape[1]
    bad = {
        "rank": ({q_a: torch.randn(8, hidden),
                  "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 8)}, "shape"),
        "module": ({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.randn(2, hidden)},
                   "k_proj"),
        "shape": ({q_a: torch.randn(2, hidden + 1)}, "shape"),
        "not lora": ({"model.layers.0.self_attn.q_proj.weight": torch.randn(64, hidden)}, "not a PEFT"),
        "two adapters": ({q_a.replace("lora_A.", "lora_A.one."): torch.randn(2, hidden),
                          q_a.replace("lora_A.", "lora_A.two."): torch.randn(2, hidden)}, "several adapters"),
    }
    for what, (weights, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            bridge.push_weights(weights)
        assert engine.list_loras()[0].version == 0 and engine.policy_version == 0, what
        for n, v in engine.runner.lora.target(slot).views.items():
            assert torch.equal(v, before[n]), (what, n)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        TrainerBridge(engine, lora="nope")
    after = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, lora="b"))
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in tokens_before]
    # a good push still goes through afterwards
    good = {q_a: before[q_a] + 0.1}
    assert bridge.push_weights(good).lora_version == 1


def test_an_engine_without_lora_carries_none_of_it(base):
    engine = Engine(EngineConfig(model=str(base), dtype="float32", num_kv_blocks=32))
    runner = engine.runner
    assert runner.lora is None and not hasattr(runner.buffers, "lora_idx")
    assert all(getattr(m, "lora", None) is None for m in runner.model.modules())
    assert engine.list_loras() == []
    with pytest.raises(ValueError, match="SamplingParams.lora: this engine serves no LoRA adapters"):
        engine.generate(PROMPTS[:1], SamplingParams(lora="a"))
    with pytest.raises(ValueError, match="max_loras is 0"):
        engine.load_lora("a", "/nonexistent")


def test_config_checks():
    with pytest.raises(ValueError, match="max_loras must be an integer >= 0"):
        EngineConfig(model="m", max_loras=-1)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(model="m", max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_target_modules"):
        EngineConfig(model="m", max_loras=1, lora_target_modules="q_proj")
    with pytest.raises(ValueError, match="lora_merged does not support tensor_parallel_size"):
        EngineConfig(model="m", max_loras=1, lora_merged=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora_deferred does not support tensor_parallel_size"):
        EngineConfig(model="m", max_loras=1, lora_deferred=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="SamplingParams.lora must be a non-empty"):
        SamplingParams(lora="")


def test_lora_overlap_reaches_the_runner_and_the_cpu_runs_the_reference_whole(engine, base):
    """`EngineConfig.lora_overlap` is the runner's (False by default, True kept); on the CPU the runtime never forks
    (no side stream: `start` gives None and the hook runs add_lora_ref); a YAML mapping sets it too."""
    from rollout.config import from_mapping

    assert EngineConfig(model="m").lora_overlap is False
    assert EngineConfig(model="m", lora_overlap=True).runner_config().lora_overlap is True
    assert EngineConfig(model="m").runner_config().lora_overlap is False
    assert from_mapping(EngineConfig, {"model": "m", "lora_overlap": True}).lora_overlap is True
    runtime = engine.runner.lora
    assert runtime.overlap is False and runtime._side is None
    hook = engine.runner.model.model.layers[0].self_attn.qkv_proj.lora
    with runtime.tokens(torch.zeros(3, dtype=torch.int64)):
        assert hook.start(torch.zeros(3, hook.stack.A.shape[2])) is None


def test_lora_fused_linear_reaches_the_runner_and_the_cpu_keeps_its_matmul(engine, base):
    """`EngineConfig.lora_fused_linear` is on by default for slot mode on CUDA only (not on the CPU, in merged or
    deterministic mode, beside the overlapped or deferred hooks, under tensor parallelism), reaches the runner, is
    refused beside the overlapped or deferred hooks or deterministic mode when asked for; on the CPU the hooks never
    take a layer's matmul (`LoraHook.linear` gives None)."""
    from rollout.config import from_mapping

    assert EngineConfig(model="m").lora_fused_linear is False
    assert EngineConfig(model="m", max_loras=4).lora_fused_linear is False  # the CPU
    cuda = dict(model="m", device="cuda", max_loras=4)
    assert EngineConfig(**cuda).lora_fused_linear is True
    assert EngineConfig(**cuda, lora_fused_linear=False).lora_fused_linear is False
    assert EngineConfig(**cuda).runner_config().lora_fused_linear is True
    assert EngineConfig(model="m", device="cuda").lora_fused_linear is False  # no slots
    for off in (dict(max_loras=1, lora_merged=True), dict(deterministic=True), dict(lora_overlap=True),
                dict(lora_deferred=True), dict(tensor_parallel_size=2)):
        assert EngineConfig(**(cuda | off)).lora_fused_linear is False, off
    assert from_mapping(EngineConfig, {"model": "m", "lora_fused_linear": True}).runner_config().lora_fused_linear
    for other in ("lora_overlap", "lora_deferred"):
        with pytest.raises(ValueError, match="lora_fused_linear runs each adapted linear and its LoRA in one launch"):
            EngineConfig(model="m", lora_fused_linear=True, **{other: True})
    with pytest.raises(ValueError, match="lora_fused_linear is not batch-invariant.*deterministic=True"):
        EngineConfig(**cuda, lora_fused_linear=True, deterministic=True)
    runtime = engine.runner.lora
    assert runtime.fused_linear is False
    proj = engine.runner.model.model.layers[0].self_attn.qkv_proj
    runtime.fused_linear = True  # asked for, but on the CPU: the layer keeps its matmul and hook
    try:
        with runtime.tokens(torch.zeros(3, dtype=torch.int64)), torch.no_grad():
            assert proj.lora.linear(torch.zeros(3, proj.in_features), proj.weight, proj.bias) is None
    finally:
        runtime.fused_linear = False


@pytest.fixture(scope="module")
def engine_deferred(base, adapters):
    """`lora_deferred`: o_proj's and down_proj's deltas go into the residual sum, gate_up_proj's to the
    SiLU-and-mul."""
    e = Engine(config(base, lora_deferred=True))
    for name in ("a", "b"):
        e.load_lora(name, str(adapters[name]))
    return e


def test_deferred_mode_matches_peft_and_defers_o_down_and_gate_up(engine_deferred, engine, base, peft_models):
    """With `lora_deferred` the logits (prefill and decode) still match peft's and the greedy tokens equal it;
    the o_proj and down_proj hooks take the residual sum, gate_up_proj's leaves its delta to the SiLU-and-mul,
    qkv_proj's adds its float32 delta after the matmul, and a forward leaves nothing behind."""
    from rollout.config import from_mapping

    assert EngineConfig(model="m").lora_deferred is False
    with pytest.raises(ValueError, match="lora_deferred replaces lora_overlap"):
        EngineConfig(model="m", lora_deferred=True, lora_overlap=True)
    assert from_mapping(EngineConfig, {"model": "m", "lora_deferred": True}).runner_config().lora_deferred is True
    runtime = engine_deferred.runner.lora
    layer = engine_deferred.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.lora.defer == layer.mlp.down_proj.lora.defer == "residual"
    assert layer.mlp.gate_up_proj.lora.defer == "consumer" and layer.self_attn.qkv_proj.lora.defer == "add"
    assert engine.runner.model.model.layers[0].self_attn.o_proj.lora.defer is None
    tokens = list(range(3, 40))
    with torch.no_grad():
        for name in ("a", "b"):
            ref = peft_models[name](torch.tensor([tokens])).logits[0]
            torch.testing.assert_close(_logits(engine_deferred, tokens, name), ref, atol=1e-4, rtol=1e-4)
    for name in ("a", "b", None):
        model = load_hf(base) if name is None else peft_models[name]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora=name)
        outs = engine_deferred.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 8) for p in PROMPTS], name
    assert all(hook.residual is None and hook.pending is None for hook in runtime.hooks)


def test_deferred_mode_keeps_the_hooks_for_a_long_prefill(engine_deferred, peft_models, monkeypatch):
    """Above DEFER_MAX_TOKENS tokens a forward's gate_up and qkv hooks add their own delta (no float32 copy of the
    output); o_proj and down_proj still go into the residual sum. The logits stay peft's."""
    from runner.lora import runtime

    monkeypatch.setattr(runtime, "DEFER_MAX_TOKENS", 30)
    kinds = []
    real = runtime.LoraHook._deferred
    monkeypatch.setattr(runtime.LoraHook, "_deferred", lambda self, *a, **kw: (kinds.append(self.defer),
                                                                              real(self, *a, **kw))[1])
    tokens = list(range(3, 40))  # 37 tokens in one forward
    with torch.no_grad():
        ref = peft_models["a"](torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(_logits(engine_deferred, tokens, "a"), ref, atol=1e-4, rtol=1e-4)
    layers = len(engine_deferred.runner.model.model.layers)
    assert sorted(kinds) == ["residual"] * (2 * layers)


def test_a_deferred_delta_nobody_takes_is_caught_and_not_kept(engine_deferred):
    """A gate_up delta left for a SiLU-and-mul that never ran fails the forward's exit, and the next forward starts
    without it."""
    runtime = engine_deferred.runner.lora
    linear = engine_deferred.runner.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(3, linear.in_features)
    with pytest.raises(AssertionError, match="1 deferred LoRA deltas were left unconsumed"):
        with runtime.tokens(torch.tensor([0, -1, 1])):
            linear(x)
    assert all(hook.pending is None for hook in runtime.hooks)
    with runtime.tokens(torch.tensor([0, -1, 1])):
        out = linear(x)
        delta = linear.lora_delta()
    assert delta.shape == out.shape and delta.dtype == torch.float32 and not delta[1].any() and delta[0].any()


def test_deferred_mode_mixed_batch_equals_each_request_alone(engine_deferred, engine):
    """Base and adapter requests in one batch get what each gets alone, and what the default hooks give (fp32:
    within rounding)."""
    loras = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=200 + i, ignore_eos=True, lora=lora)
              for i, lora in enumerate(loras)]
    together = engine_deferred.generate(prompts, params)
    default = engine.generate(prompts, params)
    for prompt, p, out, ref in zip(prompts, params, together, default):
        alone = engine_deferred.generate([prompt], p)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert out.outputs[0].logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)


def test_linear_starts_its_hook_before_the_matmul_and_hands_it_the_result(monkeypatch):
    import runner.layers
    from runner.layers import Linear

    events = []
    real = runner.layers.linear

    def recording_linear(*args):
        events.append("matmul")
        return real(*args)

    class Hook:
        fused = None  # what `linear` gives: None, the layer runs its matmul and the hook's halves

        def linear(self, x, weight, bias):
            events.append("linear")
            return self.fused

        def start(self, x):
            events.append("start")
            return "partials"

        def __call__(self, out, x, partials):
            events.append(partials)
            return out + 1

    monkeypatch.setattr(runner.layers, "linear", recording_linear)
    layer = Linear(4, 3)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(2, 4)
    plain = layer(x)
    layer.lora = Hook()
    events.clear()
    assert torch.equal(layer(x), plain + 1)
    assert events == ["linear", "start", "matmul", "partials"]
    layer.lora.fused = torch.zeros(2, 3)  # the hook takes the whole layer (EngineConfig.lora_fused_linear)
    events.clear()
    assert layer(x) is layer.lora.fused and events == ["linear"]
    layer.set_deterministic(True)  # deterministic mode keeps its own linears
    events.clear()
    assert torch.equal(layer(x), real(x, layer.weight, None, True) + 1)
    assert events == ["start", "matmul", "partials"]


def test_target_modules_limit_the_slots(base, adapters):
    engine = Engine(config(base, lora_target_modules=["q_proj", "v_proj"]))
    assert {fused for _, fused in engine.runner.lora.slots.stacks} == {"qkv_proj"}
    with pytest.raises(ValueError, match="lora_target_modules"):
        engine.load_lora("a", str(adapters["a"]))  # it adapts o_proj and the MLP too
    with pytest.raises(ValueError, match="lora_target_modules"):
        Engine(config(base, lora_target_modules=["lm_head"]))


def test_a_moe_model_adapts_its_attention(tmp_path):
    base = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=3)
    attention = write_adapter(base, tmp_path / "attn", seed=1, r=4, lora_alpha=8,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = Engine(config(base))
    assert {fused for _, fused in engine.runner.lora.slots.stacks} == {"qkv_proj", "o_proj"}
    engine.load_lora("attn", str(attention))
    model, tokens = peft_model(base, attention), list(range(3, 30))
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_logits(engine, tokens, "attn"), ref, atol=1e-4, rtol=1e-4)
    out = engine.generate([tokens], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora="attn"))
    assert out[0].outputs[0].token_ids == hf_greedy(model, tokens, 8)


# ---- the server: vLLM's adapter endpoints, the OpenAI `model` field, /v1/models, SGLang's lora_path -------------
KEY, NAME, VOCAB = "sk-lora-31", "tiny-base", 320


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from server_harness import chat_checkpoint

    return chat_checkpoint(tmp_path_factory.mktemp("lora_server"), seed=11, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def chat_adapters(chat_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server_adapters")
    return {"sql": write_adapter(chat_dir, root / "sql", seed=1, r=4, lora_alpha=8),
            "math": write_adapter(chat_dir, root / "math", seed=2, r=2, lora_alpha=4, target_modules=["q_proj"])}


@pytest.fixture(scope="module")
def server(chat_dir):
    pytest.importorskip("fastapi")
    from server_harness import LiveServer

    from rollout import AsyncEngine
    from rollout.server_config import ServerConfig

    engine = AsyncEngine(config(chat_dir, max_loras=2))
    with LiveServer(engine, ServerConfig(api_key=KEY, served_model_name=NAME)) as srv:
        yield srv
    srv.engine.close()


@pytest.fixture(scope="module")
def http(server):
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def local(chat_dir, chat_adapters):
    e = Engine(config(chat_dir, max_loras=2))
    for name, path in chat_adapters.items():
        e.load_lora(name, str(path))
    return e


def test_server_loads_selects_lists_and_unloads_adapters(server, http, local, chat_dir, chat_adapters):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(chat_adapters["sql"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(NAME, None), ("sql", NAME)]
    assert cards[1]["root"] == str(chat_adapters["sql"])
    assert [m.id for m in client.models.list().data] == [NAME, "sql"] and client.models.retrieve("sql").id == "sql"
    ids = local.tokenizer.encode("what is the weather in Paris today?")
    want = {lora: local.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=lora))[0]
            .outputs[0].token_ids for lora in (None, "sql")}
    assert want[None] != want["sql"]
    for model, lora in ((NAME, None), ("sql", "sql")):
        body = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True}).json()
        assert body["model"] == model and body["choices"][0]["token_ids"] == want[lora]
        assert body["choices"][0].get("lora_versions") == (None if lora is None else [0] * 6)
    c = client.completions.create(model="sql", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert c.model == "sql" and c.choices[0].text == local.tokenizer.decode(want["sql"], True)
    # chat with the adapter: the template's ids, sampled with it
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                     "return_token_ids": True}).json()["prompt_token_ids"]
    assert chat.model == "sql" and chat.choices[0].model_extra["token_ids"] == local.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, lora="sql"))[0].outputs[0].token_ids
    # prompt logprobs are the adapter's (peft's forward)
    with torch.no_grad():
        logp = torch.log_softmax(peft_model(chat_dir, chat_adapters["sql"])(torch.tensor([ids])).logits[0], -1)
    scored = http.post("/v1/completions", json={"model": "sql", "prompt": ids, "max_tokens": 1,
                                                "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert [scored[i][str(ids[i])]["logprob"] for i in range(1, len(ids))] == pytest.approx(
        [logp[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    # SGLang's /generate: lora_path by name, one per prompt in a batch
    out = http.post("/generate", json={"input_ids": [ids, ids], "lora_path": [None, "sql"], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert [o["output_ids"] for o in out] == [want[None], want["sql"]]
    assert "lora_versions" not in out[0]["meta_info"] and out[1]["meta_info"]["lora_versions"] == [0] * 6
    bad = http.post("/generate", json={"input_ids": ids, "lora_path": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    # unknown models are OpenAI's 404; refused loads are 400s and change nothing
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=ids, max_tokens=1)
    assert e.value.code == "model_not_found"
    for body in ({"lora_name": "sql", "lora_path": str(chat_adapters["math"])},  # the name is taken
                 {"lora_name": "other", "lora_path": str(chat_dir / "missing")},
                 {"lora_name": NAME, "lora_path": str(chat_adapters["math"])}):
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, body
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [NAME, "sql"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=ids, max_tokens=1)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_adapter_endpoints_need_the_key_and_admin(server, chat_dir, chat_adapters):
    httpx = pytest.importorskip("httpx")
    from server_harness import LiveServer

    from rollout import AsyncEngine
    from rollout.server_config import ServerConfig

    body = {"lora_name": "math", "lora_path": str(chat_adapters["math"])}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 401
    with LiveServer(AsyncEngine(config(chat_dir, max_loras=1)), ServerConfig(enable_admin=False)) as srv:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert httpx.post(srv.url + path, json=body, timeout=60).status_code == 404
    srv.engine.close()
