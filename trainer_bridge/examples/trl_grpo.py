"""TRL's GRPOTrainer on the toy addition task, sampling from this engine through TRLAdapter (CPU, minutes).

    python trainer_bridge/examples/trl_grpo.py --steps 3 [--config configs/trl_grpo.yaml] [--output-dir DIR]

Writes a tiny random Qwen2 (transformers) and the toy character tokenizer when `model` is null, starts a local
engine in the configured dtype, and trains with `GRPOTrainer(..., rollout_func=adapter.rollout_func,
callbacks=[adapter.callback])`; the reward is the toy task's (the completion starts with the sum) plus 0.1 * the share of digits. Prints one
line per optimizer step: the engine's policy version, push bytes (and the dense size) and seconds, the
rollout-vs-trainer mismatch and the reward. It does not tune anything: a random model learns little in 3 steps.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file from a checkout
    sys.path.insert(0, str(ROOT))


@dataclass(kw_only=True, slots=True)
class TRLExampleConfig:
    """The schema of configs/trl_grpo.yaml."""

    model: str | None = None
    """A Hugging Face model directory with a tokenizer; None writes a tiny random Qwen2 in output_dir/model."""
    output_dir: str = "runs/trl_grpo"
    """GRPOTrainer's output_dir (and where the tiny model goes)."""
    engine: dict[str, Any] = field(default_factory=lambda: {"dtype": "bfloat16"})
    """EngineConfig fields except `model`."""
    max_tokens: int = 6
    """Completion length cap, the engine's max_tokens and GRPOConfig.max_completion_length."""
    temperature: float = 1.0
    """Sampling temperature of the engine and the trainer."""
    seed: int = 0
    off_policy_correction: str = "none"
    """none, tis or mis (see TRLAdapter)."""
    importance_cap: float = 2.0
    grpo: dict[str, Any] = field(default_factory=dict)
    """GRPOConfig keyword arguments; use_vllm, max_steps, output_dir, max_completion_length, temperature and
    seed are set from this file and the command line."""


def write_tiny_qwen2(path: Path) -> Path:
    """A random 2-layer Qwen2 written by transformers, with the toy task's tokenizer (as a transformers tokenizer)."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from trainer_bridge import toy_task

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(toy_task.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=toy_task.PAD_ID, eos_token_id=toy_task.EOS_ID,
                         pad_token_id=toy_task.PAD_ID)
    Qwen2ForCausalLM(config).save_pretrained(path)
    toy_task.build_tokenizer(path)
    PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token=toy_task.EOS,
                            pad_token=toy_task.PAD).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python trainer_bridge/examples/trl_grpo.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "trl_grpo.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout import EngineConfig, SamplingParams
    from rollout.config import from_mapping, load_yaml
    from rollout.engine import Engine
    from trainer_bridge import toy_task
    from trainer_bridge.integrations.trl import TRLAdapter

    cfg = from_mapping(TRLExampleConfig, load_yaml(args.config), args.config)
    out_dir = Path(args.output_dir or cfg.output_dir)
    torch.set_num_threads(1)
    model_dir = Path(cfg.model) if cfg.model else write_tiny_qwen2(out_dir / "model")
    engine = Engine(from_mapping(EngineConfig, {"model": str(model_dir), **cfg.engine}, "engine"))
    adapter = TRLAdapter(engine, sampling=SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                                         seed=cfg.seed),
                         off_policy_correction=cfg.off_policy_correction, importance_cap=cfg.importance_cap)

    problems = toy_task.make_problems(256, max_digits=2, seed=cfg.seed)
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                          "answer": [p.answer for p in problems]})

    def addition_reward(completions, answer, **kwargs):
        """1 for the right sum, plus 0.1 * the share of digits (a random model needs some signal)."""
        return [toy_task.reward(toy_task.Problem(prompt="", answer=a), c) + 0.1 * sum(ch.isdigit() for ch in c)
                / max(1, len(c)) for c, a in zip(completions, answer)]

    class PrintStep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "bridge/push_bytes" in logs:
                print(f"step {state.global_step}: version {engine.policy_version}  push "
                      f"{int(logs['bridge/push_bytes'])} B of {int(logs['bridge/push_dense_bytes'])} dense in "
                      f"{logs['bridge/push_s']:.4f} s  mismatch {logs['bridge/mismatch_abs_mean']:.2e}  "
                      f"reward {logs.get('reward', float('nan')):.3f}", flush=True)

    grpo_args = GRPOConfig(**{**cfg.grpo, "output_dir": str(out_dir), "max_steps": args.steps, "use_vllm": False,
                              "max_completion_length": cfg.max_tokens, "temperature": cfg.temperature,
                              "seed": cfg.seed, "use_cpu": not torch.cuda.is_available(), "report_to": [],
                              "save_strategy": "no", "disable_tqdm": True})
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=addition_reward, args=grpo_args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          rollout_func=adapter.rollout_func, callbacks=[adapter.callback, PrintStep()])
    trainer.train()
    total = sum(p.nbytes for p in adapter.pushes)
    print(f"{len(adapter.pushes)} steps, engine policy_version {engine.policy_version}, {total} push bytes in "
          f"{sum(p.seconds for p in adapter.pushes):.3f} s (dense would be {sum(p.dense_nbytes for p in adapter.pushes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
