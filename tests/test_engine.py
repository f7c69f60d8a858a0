"""Engine API: outputs, text prompts, stop rules, request loop, shared prompt blocks, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.config import from_mapping


def save_tokenizer(path, vocab_size=128):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    tok.train_from_iterator(["hello world", "one two three four", "the quick brown fox"] * 20, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(ckpt_factory, tmp_path_factory):
    src = ckpt_factory("qwen2")
    dst = tmp_path_factory.mktemp("with_tok")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    save_tokenizer(dst)
    return dst


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=16, num_kv_blocks=128))


def test_generate_api_shape_and_text(engine):
    outs = engine.generate(["hello world", "one two"], SamplingParams(n=3, max_tokens=6, seed=7, ignore_eos=True))
    assert len(outs) == 2
    for out in outs:
        assert out.prompt_token_ids and len(out.outputs) == 3
        for j, c in enumerate(out.outputs):
            assert c.index == j
            assert len(c.token_ids) == 6 and len(c.logprobs) == 6 and len(c.policy_versions) == 6
            assert c.finish_reason == "length"
            assert isinstance(c.text, str) and c.text == engine.tokenizer.decode(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
    assert outs[0].prompt == "hello world"


def test_add_request_step_loop_and_abort(engine):
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    other = engine.add_request([8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
            if out.request_id == rid and out.finished:
                engine.abort_request(other)
    assert seen[rid].outputs[0].finish_reason == "length" and len(seen[rid].outputs[0].token_ids) == 4
    assert engine.kv_manager.pool.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_stop_tokens_min_tokens_and_eos(engine):
    greedy = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    stop = toks[3]
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True))[0]
    first = toks.index(stop)
    assert out.outputs[0].token_ids == toks[: first + 1] and out.outputs[0].finish_reason == "stop"
    later = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                                           min_tokens=first + 1, ignore_eos=True))[0]
    assert len(later.outputs[0].token_ids) > first + 1  # the early stop token was not honoured


def test_eos_from_generation_config(model_dir, tmp_path):
    for f in model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    probe = Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=32, max_num_seqs=2))
    toks = probe.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [toks[2]]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    eng = Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=32, max_num_seqs=2))
    out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == toks[: toks.index(toks[2]) + 1] and out.finish_reason == "stop"


def test_n_samples_hold_prompt_blocks_once(model_dir):
    eng = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8))
    prompt = list(range(10, 30))  # 20 tokens = 5 full blocks
    eng.add_request(prompt, SamplingParams(n=8, max_tokens=3, ignore_eos=True), request_id="p")
    pool = eng.kv_manager.pool
    group = eng.output_processor.get("p")
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, pool.num_used_blocks)
        running = [m for m in group.members if m.block_ids]
        if len(running) == 8:
            shared = running[0].block_ids[:4]  # the 4 full blocks before the prompt's last token
            assert all(m.block_ids[:4] == shared for m in running)
            assert all(pool.ref_cnt[b] == 8 for b in shared)
    # 4 shared prompt blocks + at most 2 own blocks per sample (prompt tail + 3 outputs), never 8 copies
    assert peak <= 4 + 8 * 2
    assert pool.num_used_blocks == 0
    assert "p" not in eng.output_processor  # reported finished once, then forgotten


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, 500], SamplingParams(), "outside the vocabulary"),
        (list(range(2, 100)) * 6, SamplingParams(), "max_model_len"),
        ([1.5, 2], SamplingParams(), "list of int"),
    ],
)
def test_bad_requests_raise_and_others_continue(engine, prompt, params, match):
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done[rid].outputs[0].token_ids) == 5


def test_generate_validates_all_prompts_first(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5, 6], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="must be SamplingParams"):
        engine.generate([[5, 6], [7]], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n must"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_config_errors(tmp_path, ckpt_factory):
    with pytest.raises(ValueError, match="unknown key.*max_num_seq"):
        from_mapping(EngineConfig, {"model": "x", "max_num_seq": 4}, "preset.yaml")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="x", dtype="float64")
    with pytest.raises(ValueError, match="speculative.*unknown key"):
        from_mapping(EngineConfig, {"model": "x", "speculative": {"methd": "eagle"}}, "p.yaml")
    cfg = from_mapping(EngineConfig, {"model": "x", "speculative": {"method": "mtp"}})
    assert cfg.speculative.method == "mtp"


def test_checkpoint_errors(ckpt_factory, tmp_path):
    src = ckpt_factory("llama")
    # unknown architecture
    d1 = tmp_path / "arch"
    shutil.copytree(src, d1)
    cfg = json.loads((d1 / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d1 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture"):
        Engine(EngineConfig(model=str(d1)))
    # missing safetensors
    d2 = tmp_path / "missing"
    shutil.copytree(src, d2)
    (d2 / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        Engine(EngineConfig(model=str(d2)))
    # corrupt safetensors
    d3 = tmp_path / "corrupt"
    shutil.copytree(src, d3)
    (d3 / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        Engine(EngineConfig(model=str(d3)))
    # shape mismatch between config and checkpoint
    d4 = tmp_path / "shape"
    shutil.copytree(src, d4)
    cfg = json.loads((d4 / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d4 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape mismatch.*mlp"):
        Engine(EngineConfig(model=str(d4)))
    with pytest.raises(ValueError, match="config.json"):
        Engine(EngineConfig(model=str(tmp_path / "nowhere")))


def test_sharded_checkpoint_loads(tmp_path):
    from conftest import load_hf, make_checkpoint

    path = make_checkpoint(tmp_path / "src", "qwen3", seed=3)
    hf = load_hf(path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = Engine(EngineConfig(model=str(path), num_kv_blocks=16)).generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    b = Engine(EngineConfig(model=str(tmp_path / "sharded"), num_kv_blocks=16)).generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_cli_generate_with_a_config_file(model_dir, tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"model: {model_dir}\ndtype: float32\nmax_num_seqs: 4\n")
    proc = subprocess.run([sys.executable, "-m", "rollout", "generate", "--config", str(cfg), "--prompt-ids", "5,6,7",
                           "--max-tokens", "3", "--seed", "1", "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout.splitlines()[0])["token_ids"]) == 3
    cfg.write_text(f"model: {model_dir}\nmax_num_seq: 4\n")
    proc = subprocess.run([sys.executable, "-m", "rollout", "generate", "--config", str(cfg), "--prompt-ids", "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key" in proc.stderr and "max_num_seq" in proc.stderr


def test_cli_generate(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "rollout", "generate", "--model", str(model_dir), "--prompt", "hello world",
         "--n", "2", "--max-tokens", "5", "--seed", "3", "--dtype", "float32", "--ignore-eos"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    samples = [l for l in lines if "sample" in l]
    assert len(samples) == 2 and all(len(s["token_ids"]) == 5 for s in samples)
    assert any("tokens_per_s" in l for l in lines)


def test_top_logprobs_in_outputs(engine):
    outs = engine.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=4, top_logprobs=3, ignore_eos=True),
                                                 SamplingParams(max_tokens=4, seed=1, ignore_eos=True)])
    greedy, plain = outs[0].outputs[0], outs[1].outputs[0]
    assert plain.top_logprobs is None
    assert len(greedy.top_logprobs) == len(greedy.token_ids) == 4
    for token, lp, top in zip(greedy.token_ids, greedy.logprobs, greedy.top_logprobs):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == token and abs(top[0][1] - lp) < 1e-6  # greedy: the sampled token is the top one


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_stops_once_enough_prompts_finish(model_dir, async_scheduling):
    """Over-sampling: with min_finished_prompts=2 the two short prompts finish, the long ones come back cut
    short (finish_reason "abort", a prefix of what they would have generated), and nothing is left running."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=8, async_scheduling=async_scheduling))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13]]
    params = [SamplingParams(max_tokens=m, n=2, seed=s, ignore_eos=True) for s, m in enumerate((40, 3, 40, 4))]
    full = engine.generate(prompts, params)
    outs = engine.generate(prompts, params, min_finished_prompts=2)
    assert [o.finished for o in outs] == [True] * 4
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "length", "abort", "length"]
    for cut, whole in zip(outs, full):
        for c, w in zip(cut.outputs, whole.outputs):
            assert c.token_ids == w.token_ids[: len(c.token_ids)] and len(c.logprobs) == len(c.token_ids)
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="min_finished_prompts"):
        engine.generate(prompts, params, min_finished_prompts=5)


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_gc_freeze_moves_the_start_up_heap_out_of_collections_until_close(model_dir, gc_freeze):
    import gc

    gc.unfreeze()
    e = Engine(EngineConfig(model=str(model_dir), max_num_seqs=4, gc_freeze=gc_freeze))
    frozen = gc.get_freeze_count()
    assert (frozen > 0) == gc_freeze
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    e.close()
    if gc_freeze:  # (without it the engine freezes nothing; a library may freeze its own objects meanwhile)
        assert gc.get_freeze_count() == 0


def test_startup_phases_are_timed(model_dir, monkeypatch):
    """Each start-up phase is timed where it runs: a slow weight load shows in "load" alone, and the phases add
    up to the total."""
    import time

    import runner.model_runner

    real = runner.model_runner.load_model

    def slow_load(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner.model_runner, "load_model", slow_load)
    engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=4))
    times = engine.startup_times
    assert list(times) == ["config_tokenizer", "load", "runner_init", "profile", "kv_alloc", "graph_capture", "other",
                           "total"]
    assert times["load"] >= 1.0 and max(v for k, v in times.items() if k not in ("load", "total")) < 1.0
    assert sum(v for k, v in times.items() if k != "total") == pytest.approx(times["total"], abs=1e-6)
    engine.close()


def test_one_prompt_sent_as_separate_requests_is_computed_once(model_dir):
    """Four requests with the same 40-token prompt in one generate call (as verl sends a prompt's samples): the
    prompt's full blocks are computed once and hit by the others, and each request samples what it samples alone."""
    prompt = list(range(3, 43))
    params = [SamplingParams(max_tokens=6, seed=i, ignore_eos=True) for i in range(4)]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=8, num_kv_blocks=64, block_size=8))
    together = engine.generate([prompt] * 4, params)
    assert [o.num_cached_prompt_tokens for o in together] == [0, 32, 32, 32]
    alone = [Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8))
             .generate([prompt], [p])[0] for p in params[:2]]
    assert [o.outputs[0].token_ids for o in together[:2]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_leaves_the_runner_idle(model_dir, async_scheduling):
    """When generate returns with nothing left to run, its requests have left the runner too (not only at the
    next step), so idle-engine calls such as full_sequence_logits work right after it."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                 async_scheduling=async_scheduling))
    prompt = [5, 9, 13, 2]
    first = engine.generate([prompt, [7, 8]], SamplingParams(max_tokens=5, seed=1, ignore_eos=True))
    assert not engine.runner.input_batch.slot_of
    logits = engine.collective_rpc("full_sequence_logits", prompt + first[0].outputs[0].token_ids)[0]
    assert logits.shape[0] == 9
    again = engine.generate([prompt, [7, 8]], SamplingParams(max_tokens=5, seed=1, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
