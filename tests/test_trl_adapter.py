"""TRL 1.16's real GRPOTrainer sampling from a bf16 engine through TRLAdapter, on the CPU.

Trainer in float32 (TRL's default on the CPU), engine in bfloat16: every push is the trainer's weights cast
to bf16, so after the first (dense) push only coordinates whose bf16 value moved are sent.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", minversion="1.16")

from rollout import EngineConfig, SamplingParams  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from trainer_bridge import toy_task  # noqa: E402
from trainer_bridge.integrations.trl import TRLAdapter  # noqa: E402

from conftest import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 (written by transformers) with the toy task's character tokenizer."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("trl_qwen2")
    make_checkpoint(path, "qwen2", vocab_size=len(toy_task.VOCAB), hidden_size=32, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=toy_task.PAD_ID,
                    eos_token_id=toy_task.EOS_ID, pad_token_id=toy_task.PAD_ID)
    toy_task.build_tokenizer(path)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token=toy_task.EOS,
                                  pad_token=toy_task.PAD)
    tok.save_pretrained(path)
    return path


def _trainer(model_dir, out_dir, adapter, reward_func, *, steps=3, peft_config=None):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, temperature=1.0, learning_rate=3e-4, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, use_vllm=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    problems = toy_task.make_problems(32, max_digits=2, seed=0)
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems]})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOTrainer(model=model, reward_funcs=reward_func, args=args, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config,
                       rollout_func=adapter.rollout_func, callbacks=[adapter.callback])


def test_grpo_trainer_three_steps_pushes_exact_sparse_versioned_weights(model_dir, tmp_path):
    torch.manual_seed(0)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=64, num_kv_blocks=128))
    adapter = TRLAdapter(engine, sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=7),
                         off_policy_correction="tis", importance_cap=2.0)
    seen = []

    def length_reward(completions, policy_versions, importance_weights, **kwargs):
        # the adapter's extra fields reach reward functions, one entry per completion
        seen.append((list(policy_versions), list(importance_weights)))
        return [float(len(c)) for c in completions]

    trainer = _trainer(model_dir, tmp_path, adapter, length_reward)
    from transformers import TrainerCallback

    checked = []

    class CheckEngine(TrainerCallback):  # added after adapter.callback, so it runs after each step's push
        def on_step_end(self, args, state, control, **kwargs):
            exact = all(torch.equal(engine.runner.weights.view(n).view(torch.int16),
                                    p.detach().to(torch.bfloat16).view(torch.int16))
                        for n, p in trainer.model.named_parameters())
            checked.append((state.global_step, engine.policy_version, exact))

    trainer.add_callback(CheckEngine())
    trainer.train()

    # after step k the engine is at version k and holds the trainer's weights cast to bf16, bit for bit
    assert checked == [(1, 1, True), (2, 2, True), (3, 3, True)]
    assert engine.runner.weights.view("lm_head.weight").dtype == torch.bfloat16
    first, *later = adapter.pushes
    assert len(adapter.pushes) == 3 and first.num_patch == 0 and first.nbytes == first.dense_nbytes
    assert all(p.num_patch > 0 and p.nbytes < p.dense_nbytes for p in later), [p.to_json() for p in later]
    assert [p.version for p in adapter.pushes] == [1, 2, 3]
    # rollout k + 1 (k = 0, 1, 2) was sampled entirely under version k
    assert len(adapter.rollout_versions) == 3
    for k, versions in enumerate(adapter.rollout_versions):
        assert versions and set(versions) == {k}, (k, set(versions))
    assert [sorted({v for vs in pv for v in vs}) for pv, _ in seen] == [[0], [1], [2]]
    # the TIS weights are per completion token, within (0, C]
    for pv, iw in seen:
        assert [len(w) for w in iw] == [len(v) for v in pv]
        assert all(0.0 < w <= 2.0 for ws in iw for w in ws)
    # bytes, seconds and the mismatch reach TRL's logs
    logged = [row for row in trainer.state.log_history if "bridge/push_bytes" in row]
    assert len(logged) == 3
    assert [row["bridge/push_bytes"] for row in logged] == [float(p.nbytes) for p in adapter.pushes]
    assert all(row["bridge/push_s"] > 0 and 0 <= row["bridge/mismatch_abs_mean"] < 0.1 for row in logged)
    assert all("bridge/is_weight_mean" in row for row in logged)
    print("TRL figures:", [(p.version, p.nbytes, p.dense_nbytes, round(p.seconds, 4)) for p in adapter.pushes])


def test_grpo_trainer_training_a_lora_adapter_pushes_only_the_adapter(model_dir, tmp_path):
    """GRPOTrainer with a peft LoraConfig, the engine serving the adapter (TrainerBridge(engine, lora=...)):
    every rollout samples with it, each push carries its A / B tensors only and leaves
    the engine's adapter slot equal to the trainer's adapter, bitwise; the base weights are never sent."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from trainer_bridge import TrainerBridge

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             task_type="CAUSAL_LM")
    # the engine starts from an adapter of the same shape; the first push replaces its values
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(tmp_path / "init")
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=64, num_kv_blocks=128,
                                 max_loras=1, max_lora_rank=4))
    engine.load_lora("policy", str(tmp_path / "init"))
    base = {n: engine.runner.weights.view(n).clone() for n in engine.weight_specs()}
    adapter = TRLAdapter(bridge=TrainerBridge(engine, lora="policy"),
                         sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=7))
    trainer = _trainer(model_dir, tmp_path / "out", adapter, lambda completions, **kw: [float(len(c)) for c in completions],
                       peft_config=config)
    slot = engine.list_loras()[0].slot
    from transformers import TrainerCallback

    checked = []

    class CheckAdapter(TrainerCallback):  # after adapter.callback: each step's push has landed
        def on_step_end(self, args, state, control, **kwargs):
            views = engine.runner.lora.slots.named_views(slot)
            trained = {n.replace(".default", ""): p.detach() for n, p in trainer.model.named_parameters()
                       if "lora_" in n}
            checked.append(sorted(views) == sorted(trained)
                           and all(torch.equal(views[n], trained[n]) for n in views))

    trainer.add_callback(CheckAdapter())
    trainer.train()
    assert checked == [True, True, True]
    assert all(torch.equal(engine.runner.weights.view(n), t) for n, t in base.items())  # the base was not sent
    adapter_bytes = sum(t.numel() * 4 for t in engine.runner.lora.slots.named_views(slot).values())
    first, *later = adapter.pushes
    # (fp32 on both sides: a step moves most adapter elements, so later pushes are mostly dense too)
    assert first.nbytes == adapter_bytes and all(p.dense_nbytes == adapter_bytes >= p.nbytes for p in later)
    assert [p.lora_version for p in adapter.pushes] == [1, 2, 3]
    assert len(adapter.rollout_versions) == 3


def test_chat_prompts_are_tokenized_as_trl_does_and_bad_settings_are_refused(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=64))
    adapter = TRLAdapter(engine, sampling=SamplingParams(max_tokens=3, temperature=1.0, seed=1),
                         measure_mismatch=False)

    class FakeTrainer:  # the attributes of GRPOTrainer the adapter reads
        processing_class = tok
        chat_template = None
        chat_template_kwargs = {}
        temperature = 1.0
        _metrics = None

    calls = []
    generate = engine.generate

    def spy(prompts, params, **kwargs):  # what reaches the engine: requests and their n
        calls.append((list(prompts), [p.n for p in params]))
        return generate(prompts, params, **kwargs)

    engine.generate = spy
    chat = [[{"role": "user", "content": "12+3"}]] * 2 + [[{"role": "user", "content": "7+5"}]] * 2
    out = adapter.rollout_func(chat, FakeTrainer())
    assert out["prompt_ids"] == [toy_task.encode("12+3=")] * 2 + [toy_task.encode("7+5=")] * 2
    assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert all(1 <= len(c) <= 3 for c in out["completion_ids"]) and "importance_weights" not in out
    # TRL's layout (each prompt G times in a row): one request per distinct prompt with n = G, sharing its prefix
    assert calls[-1] == ([toy_task.encode("12+3="), toy_task.encode("7+5=")], [2, 2])
    text = adapter.rollout_func(["12+3=", "7+5=", "12+3="], FakeTrainer())
    assert text["prompt_ids"] == [toy_task.encode(p) for p in ("12+3=", "7+5=", "12+3=")]
    assert calls[-1][1] == [1, 1, 1]  # any other layout: one request per entry
    FakeTrainer.temperature = 0.7
    with pytest.raises(ValueError, match="temperature"):
        adapter.rollout_func(["1+1="], FakeTrainer())
    with pytest.raises(ValueError, match="sampling.n must be 1"):
        TRLAdapter(engine, sampling=SamplingParams(n=4))
    with pytest.raises(ValueError, match="off_policy_correction must be one of"):
        TRLAdapter(engine, sampling=SamplingParams(), off_policy_correction="clip")
    with pytest.raises(ValueError, match="measure_mismatch"):
        TRLAdapter(engine, sampling=SamplingParams(), off_policy_correction="mis", measure_mismatch=False)


def test_the_example_runs_and_prints_its_pushes(tmp_path):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    run = subprocess.run([sys.executable, str(root / "trainer_bridge" / "examples" / "trl_grpo.py"), "--steps", "2",
                          "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = re.findall(r"^step (\d+): version (\d+)  push (\d+) B of (\d+) dense", run.stdout, re.M)
    assert [(s, v) for s, v, _, _ in steps] == [("1", "1"), ("2", "2")]
    (_, _, b1, d1), (_, _, b2, d2) = steps
    assert b1 == d1 and int(b2) < int(d2)  # the first push dense, the second a patch
    assert "2 steps, engine policy_version 2" in run.stdout
