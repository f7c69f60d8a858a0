"""TrainerBridge against a local engine: token-stream records, exact weight pushes, refusals, mismatch."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_holds
from rollout import EngineConfig, SamplingParams
from rollout.engine import Engine
from trainer_bridge import TrainerBridge, TrainingModel, logprob_mismatch, toy_task
from trainer_bridge.bridge import importance_weights

PROMPTS = ["12+3=", "7+75=", "99+1="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return toy_task.write_model(tmp_path_factory.mktemp("toy"), hidden_size=32, num_layers=2, seed=0)


def make_engine(model_dir, dtype="float32") -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=64, num_kv_blocks=64))


def test_rollout_records_are_aligned_and_masked(model_dir):
    bridge = TrainerBridge(make_engine(model_dir))
    batch = bridge.rollout(PROMPTS, SamplingParams(n=3, max_tokens=5, seed=11))
    assert batch.num_prompts == 3 and len(batch.samples) == 9
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(i, j) for i in range(3) for j in range(3)]
    for s in batch.samples:
        prompt_ids = toy_task.encode(PROMPTS[s.prompt_index])
        p, n = len(prompt_ids), len(s.token_ids)
        assert len(s.loss_mask) == len(s.logprobs) == len(s.policy_versions) == n
        assert s.num_prompt_tokens == p and s.token_ids[:p] == prompt_ids
        assert s.loss_mask == [0] * p + [1] * (n - p)
        assert s.logprobs[:p] == [0.0] * p and all(lp <= 0.0 for lp in s.logprobs[p:])
        assert any(lp < 0.0 for lp in s.logprobs[p:])
        assert s.policy_versions == [-1] * p + [0] * (n - p)
        assert 1 <= n - p <= 5
    padded = batch.padded(pad_id=0)
    width = max(len(s.token_ids) for s in batch.samples)
    for t in (padded.input_ids, padded.loss_mask, padded.logprobs, padded.policy_versions):
        assert tuple(t.shape) == (9, width)
    assert padded.loss_mask.sum().item() == batch.num_completion_tokens
    assert padded.logprobs[padded.loss_mask == 0].abs().sum().item() == 0.0
    assert batch.version_lag() == (0.0, 0)
    again = bridge.rollout(PROMPTS, SamplingParams(n=3, max_tokens=5, seed=11))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in batch.samples]
    # prompts get different seeds: the same prompt twice in one call is not sampled identically
    twin = bridge.rollout(["5+5="] * 2, SamplingParams(n=4, max_tokens=5, seed=3))
    assert [s.token_ids for s in twin.samples[:4]] != [s.token_ids for s in twin.samples[4:]]


def test_push_weights_is_bitwise_exact_dense_then_patch(model_dir):
    engine = make_engine(model_dir)
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    first = bridge.push_weights(model)
    assert first.version == 1 == engine.policy_version and first.num_patch == 0 and first.num_dense > 0
    assert_engine_holds(engine, model.checkpoint_state())
    name = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        model.checkpoint_state()[name].view(-1)[:7] += 1.0  # a few coordinates of one tensor
    second = bridge.push_weights(model)
    assert second.version == 2 and second.num_patch >= 1 and second.nbytes < first.nbytes / 10
    assert second.changed_fraction < 1e-3
    assert_engine_holds(engine, model.checkpoint_state())
    # a mapping and an iterable of pairs are accepted too, as is a subset of the parameters
    state = {k: v + 0.5 for k, v in list(model.checkpoint_state().items())[:3]}
    assert bridge.push_weights(state).version == 3
    assert bridge.push_weights(list(state.items())).nbytes < 1024  # unchanged since the last push
    assert_engine_holds(engine, state)


def test_fp32_master_weights_are_cast_to_engine_dtype(model_dir):
    engine = make_engine(model_dir, dtype="bfloat16")
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir, dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.001)
    bridge.push_weights(model)
    for name, t in model.checkpoint_state().items():
        view = engine.runner.weights.view(name)
        assert view.dtype == torch.bfloat16
        assert torch.equal(view.view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"model.layers.9.mlp.up_proj.weight": torch.zeros(64, 32)}, "unknown parameter"),
        ({"model.norm.weight": torch.zeros(31)}, "shape"),
        ({"model.norm.weight": torch.zeros(32, dtype=torch.int32)}, "floating point"),
        ([], "no parameters"),
        (42, "cannot push"),
    ],
)
def test_bad_push_raises_and_changes_nothing(model_dir, bad, match):
    engine = make_engine(model_dir)
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir)
    bridge.push_weights(model)
    before = {n: engine.runner.weights.view(n).clone() for n in bridge.specs}
    with torch.no_grad():
        model.checkpoint_state()["model.norm.weight"].add_(1.0)
    # the good tensor comes first, so a half-applied push would be visible
    good = {"model.norm.weight": model.checkpoint_state()["model.norm.weight"]}
    payload = {**good, **bad} if isinstance(bad, dict) else bad
    with pytest.raises(ValueError, match=match):
        bridge.push_weights(payload)
    assert engine.policy_version == 1
    for n, t in before.items():
        assert torch.equal(engine.runner.weights.view(n), t), n
    # the bridge's snapshot did not move either: the next good push lands exactly
    assert bridge.push_weights(model).version == 2
    assert_engine_holds(engine, model.checkpoint_state())


def test_mismatch_is_near_zero_right_after_a_push(model_dir):
    engine = make_engine(model_dir)
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    bridge.push_weights(model)
    batch = bridge.rollout(PROMPTS, SamplingParams(n=4, max_tokens=6, seed=5))
    padded = batch.padded()
    with torch.no_grad():
        m = bridge.logprob_mismatch(padded, model.token_logprobs(padded.input_ids))
    # fp32 on both sides, same model code: only kernel rounding differs (observed ~1e-7)
    assert m["mismatch_abs_mean"] < 1e-5 and m["mismatch_abs_max"] < 1e-4 and m["ratio_dev_mean"] < 1e-5
    # before the push the trainer's weights differ from the engine's, and the metric shows it
    stale = TrainingModel.from_pretrained(model_dir)
    with torch.no_grad():
        assert bridge.logprob_mismatch(batch, stale.token_logprobs(padded.input_ids))["mismatch_abs_mean"] > 1e-3


def test_logprob_mismatch_values():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = torch.tensor([[-1.0, -2.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = logprob_mismatch(rollout, trainer, mask)
    assert m["mismatch_abs_mean"] == pytest.approx(0.25) and m["mismatch_abs_max"] == pytest.approx(0.5)
    assert m["ratio_dev_mean"] == pytest.approx((1 - torch.exp(torch.tensor(-0.5)).item()) / 2)
    assert m["mismatch_kl"] == pytest.approx((torch.exp(torch.tensor(-0.5)).item() - 1 + 0.5) / 2)
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(rollout, trainer[:, :2], mask)


def test_bridge_refuses_a_non_engine():
    with pytest.raises(ValueError, match="generate"):
        TrainerBridge(object())


def test_after_dense_patch_and_ipc_pushes_greedy_equals_a_fresh_engine(model_dir, tmp_path):
    """bf16 engine: after a dense push, a patch push and a shared-memory IPC push, the engine generates
    exactly what a fresh engine loaded from the trainer's updated checkpoint generates."""
    import json
    import multiprocessing as mp
    import shutil
    import threading

    from safetensors.torch import save_file

    from weight_updates.transports.ipc import IpcReceiver, IpcSender

    engine = make_engine(model_dir, dtype="bfloat16")
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir)  # fp32 master weights
    g = torch.Generator().manual_seed(1)

    def step(scale: float) -> None:  # an optimizer-like step on a few percent of the coordinates
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g) * (torch.rand(p.shape, generator=g) < 0.05))

    step(0.05)
    assert bridge.push_weights(model).num_dense > 0
    step(0.01)
    assert bridge.push_weights(model).num_patch > 0
    step(0.01)
    pending = bridge.differ.encode(model.checkpoint_state())
    trainer_end, rollout_end = mp.Pipe()
    version = engine.policy_version + 1
    sent = []
    sender = threading.Thread(target=lambda: sent.append(IpcSender(trainer_end, bucket_bytes=4096, timeout_s=30).send(version, pending.updates)))
    sender.start()
    result = IpcReceiver(rollout_end, engine.weight_sink(), timeout_s=30).serve_one(start_timeout_s=30)
    sender.join(30)
    bridge.differ.commit(pending)
    assert result.num_patch > 0 and engine.policy_version == version  # the sink published the version
    assert sent[0].received == (result,) and sent[0].num_patch == result.num_patch

    fresh_dir = tmp_path / "updated"
    shutil.copytree(model_dir, fresh_dir)
    (fresh_dir / "model.safetensors").unlink()
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in model.checkpoint_state().items()}
    save_file(state, str(fresh_dir / "model.safetensors"))
    config = json.loads((fresh_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (fresh_dir / "config.json").write_text(json.dumps(config))
    assert_engine_holds(engine, state)
    fresh = make_engine(fresh_dir, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    theirs = [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, params)]
    assert ours == theirs


def test_adopting_the_engines_weights_makes_the_first_push_a_patch(model_dir):
    engine = make_engine(model_dir, dtype="bfloat16")
    bridge = TrainerBridge(engine)
    model = TrainingModel.from_pretrained(model_dir)  # the checkpoint the engine loaded, in fp32
    other = TrainingModel.from_pretrained(model_dir)
    with torch.no_grad():
        other.checkpoint_state()["model.norm.weight"].add_(1.0)
    with pytest.raises(ValueError, match="model.norm.weight"):
        bridge.adopt_engine_weights(other)
    assert bridge.adopt_engine_weights(model) == len(model.checkpoint_state())
    assert engine.policy_version == 0  # nothing was sent
    name = "model.layers.0.mlp.up_proj.weight"
    with torch.no_grad():
        model.checkpoint_state()[name].view(-1)[:5] += 0.5
    result = bridge.push_weights(model)
    assert result.num_dense == 0 and result.num_patch >= 1 and result.nbytes < 1024
    assert_engine_holds(engine, {n: t.to(torch.bfloat16) for n, t in model.checkpoint_state().items()})


def test_rollout_with_min_finished_prompts_returns_cut_samples_marked_abort(model_dir):
    bridge = TrainerBridge(make_engine(model_dir))
    prompts = ["12+34=", "5+6=", "70+8=", "9+9="]
    batch = bridge.rollout(prompts, SamplingParams(n=2, max_tokens=30, seed=3, ignore_eos=True, min_tokens=30),
                           min_finished_prompts=4)
    assert {s.finish_reason for s in batch.samples} == {"length"}
    ragged = SamplingParams(n=2, max_tokens=30, seed=3, ignore_eos=True, stop=["5"])  # samples end at random steps
    cut = bridge.rollout(prompts, ragged, min_finished_prompts=1)
    reasons = [s.finish_reason for s in cut.samples]
    assert reasons.count("abort") >= 2 and len(reasons) - reasons.count("abort") >= 2, reasons
    for s in cut.samples:  # a cut sample stays aligned: one logprob and one mask bit per token
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs)


def test_importance_weights_tis_and_mis_values():
    # ratios exp(trainer - rollout): e^1 = 2.718 (above C = 2), e^0 = 1, e^-1 = 0.368 (below 1/C = 0.5),
    # e^0.5 = 1.649 (inside), and a masked-out token whose huge ratio must not count
    rollout = torch.tensor([[-2.0, -1.0, -1.0, -1.5, -9.0]])
    trainer = torch.tensor([[-1.0, -1.0, -2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    e = torch.e
    w, s = importance_weights(rollout, trainer, mask, mode="tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 1 / e, e**0.5, 0.0]]))
    assert s["is_truncated_frac"] == 0.25 and s["is_masked_frac"] == 0.0
    assert abs(s["is_weight_mean"] - (2.0 + 1.0 + 1 / e + e**0.5) / 4) < 1e-6
    assert abs(s["is_ratio_max"] - e) < 1e-6
    w, s = importance_weights(rollout, trainer, mask, mode="mis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0, e**0.5, 0.0]]))
    assert s["is_masked_frac"] == 0.5 and s["is_truncated_frac"] == 0.0
    assert abs(s["is_weight_mean"] - (1.0 + e**0.5) / 4) < 1e-6
    w, s = importance_weights(rollout, trainer, mask, mode="none", cap=2.0)
    assert torch.equal(w, mask) and s["is_weight_mean"] == 1.0
    trainer.requires_grad_(True)
    assert not importance_weights(rollout, trainer, mask, mode="tis", cap=2.0)[0].requires_grad
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_weights(rollout, trainer, mask, mode="clip", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 1"):
        importance_weights(rollout, trainer, mask, mode="tis", cap=1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        importance_weights(rollout, trainer[:, :3], mask, mode="tis", cap=2.0)


def test_bridge_importance_weights_align_with_the_batch_and_carry_the_mismatch(model_dir):
    engine = make_engine(model_dir)
    bridge = TrainerBridge(engine)
    batch = bridge.rollout(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=5))
    padded = batch.padded()
    shift = torch.zeros(padded.input_ids.shape[0], padded.input_ids.shape[1] - 1)  # [B, T-1]
    shift[:, ::2] = 1.0  # trainer logprob 1 nat above the rollout's on every other position: ratio e > C
    trainer_logp = padded.logprobs[:, 1:] + shift
    w, stats = bridge.importance_weights(batch, trainer_logp, mode="tis", cap=1.5)
    mask = padded.loss_mask[:, 1:]
    assert torch.allclose(w, torch.where(shift > 0, 1.5, 1.0) * mask)
    assert stats["is_truncated_frac"] == ((shift > 0) & (mask > 0)).sum().item() / mask.sum().item()
    assert stats["mismatch_abs_max"] == pytest.approx(1.0) and "mismatch_kl" in stats
    w, stats = bridge.importance_weights(padded, trainer_logp, mode="mis", cap=1.5)
    assert torch.allclose(w, torch.where(shift > 0, 0.0, 1.0) * mask)
    assert stats["is_masked_frac"] == ((shift > 0) & (mask > 0)).sum().item() / mask.sum().item()


def test_grpo_and_ppo_losses_weight_each_token_by_its_importance_weight():
    from trainer_bridge import grpo, ppo
    from trainer_bridge.config import RLConfig

    rl = RLConfig()
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.tensor([[2.0, 0.5, 9.0]])
    # ratio 1 on every token (baseline = logp): per-token loss is -A * w, mean over the 2 masked-in tokens
    loss, _ = grpo.grpo_loss(logp, logp.detach(), mask, torch.tensor([1.0]), rl, is_weights=w)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -0.25, 0.0]]))  # d/dlogp of -w*exp(logp-b)/2
    adv = torch.tensor([[1.0, -2.0, 0.0]])
    values = torch.zeros(1, 3)
    loss, stats = ppo.ppo_loss(logp.detach(), values, logp.detach(), mask, adv, torch.zeros(1, 3), rl, is_weights=w)
    assert stats["policy_loss"] == pytest.approx(-(2.0 * 1.0 + 0.5 * -2.0) / 2)


@pytest.mark.parametrize("algorithm, correction", [("grpo", "tis"), ("ppo", "mis")])
def test_grpo_and_ppo_runs_log_their_importance_weights(tmp_path, algorithm, correction):
    import json
    from pathlib import Path

    from trainer_bridge import grpo, ppo
    from trainer_bridge.config import load_run_config

    configs = Path(__file__).resolve().parent.parent / "configs"
    cfg = load_run_config(configs / "grpo_toy.yaml", [
        f"output_dir={tmp_path}", "logging.wandb=false", "logging.progress=false", "logging.plot=false",
        f"algorithm={algorithm}", "engine.dtype=bfloat16", "toy_model.warmup_steps=20", "rl.steps=2",
        "rl.prompts_per_step=4", "rl.samples_per_prompt=2", "rl.eval_every=0", "task.num_eval_prompts=4",
        f"rl.off_policy_correction={correction}", "rl.importance_cap=1.01",
    ])
    (grpo if algorithm == "grpo" else ppo).train(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:  # a bf16 engine against fp32 master weights: the ratios are not all 1
        assert r["mismatch_abs_max"] > 0 and r["is_ratio_max"] > 0 and 0 < r["is_weight_mean"] <= 1.01
        frac = r["is_truncated_frac" if correction == "tis" else "is_masked_frac"]
        assert 0.0 <= frac <= 1.0


def test_off_policy_correction_config_is_checked():
    from trainer_bridge.config import RLConfig

    with pytest.raises(ValueError, match="rl.off_policy_correction must be none, tis or mis"):
        RLConfig(off_policy_correction="clip")
    with pytest.raises(ValueError, match="rl.importance_cap must be > 1"):
        RLConfig(importance_cap=1.0)
