"""Typed configuration of a training run (the schema of configs/grpo_*.yaml).

`RunConfig` nests one keyword-only dataclass per concern; its defaults are the toy CPU demo. YAML files
load through `rollout.config.from_mapping`, so an unknown key is a ValueError naming the key and the
file, and every bad value is a ValueError naming its key. `--set a.b=value` overrides are applied to
the parsed mapping before it is checked. Nothing here builds models or engines.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import EngineConfig, from_mapping, load_yaml


def _float(obj: Any, section: str, *names: str) -> None:
    """Coerce float fields in place; YAML reads `1e-3` as a string, so numeric strings are accepted."""
    for name in names:
        value = getattr(obj, name)
        try:
            if isinstance(value, bool):
                raise TypeError
            setattr(obj, name, float(value))
        except (TypeError, ValueError):
            raise ValueError(f"{section}.{name} must be a number, got {value!r}") from None


def _check(cond: bool, key: str, value: Any, rule: str) -> None:
    if not cond:
        raise ValueError(f"{key} must be {rule}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """The addition task (see trainer_bridge.toy_task)."""

    max_digits: int = 2
    """Operands have 1..max_digits digits."""
    prompt_template: str = "{a}+{b}="
    """How a prompt is written from operands {a} and {b}."""
    num_eval_prompts: int = 128
    """Held-out prompts scored after the warm-up and after RL."""
    eval_samples_per_prompt: int = 4
    """Samples per held-out prompt (temperature as in training); reward is their mean."""

    def __post_init__(self) -> None:
        _check(self.max_digits >= 1, "task.max_digits", self.max_digits, ">= 1")
        _check("{a}" in self.prompt_template and "{b}" in self.prompt_template, "task.prompt_template",
               self.prompt_template, "a template with {a} and {b}")
        _check(self.num_eval_prompts >= 1, "task.num_eval_prompts", self.num_eval_prompts, ">= 1")
        _check(self.eval_samples_per_prompt >= 1, "task.eval_samples_per_prompt", self.eval_samples_per_prompt, ">= 1")


@dataclass(kw_only=True, slots=True)
class ToyModelConfig:
    """The tiny Llama built from scratch when `RunConfig.model` is None, and its supervised warm-up."""

    hidden_size: int = 64
    num_layers: int = 2
    warmup_steps: int = 500
    """AdamW steps of teacher-forced training on fresh problems."""
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3

    def __post_init__(self) -> None:
        _float(self, "toy_model", "warmup_lr")
        _check(self.hidden_size >= 8 and self.hidden_size % 8 == 0, "toy_model.hidden_size", self.hidden_size,
               "a multiple of 8 (4 heads of even size)")
        _check(self.num_layers >= 1, "toy_model.num_layers", self.num_layers, ">= 1")
        _check(self.warmup_steps >= 0, "toy_model.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.warmup_batch_size >= 1, "toy_model.warmup_batch_size", self.warmup_batch_size, ">= 1")
        _check(self.warmup_lr > 0, "toy_model.warmup_lr", self.warmup_lr, "> 0")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Where the trainer's copy of the model lives."""

    device: str = "cpu"
    dtype: str = "float32"
    """Master-weight dtype; pushes are cast to the engine dtype."""
    num_threads: int = 1
    """torch intra-op threads on the CPU (0 leaves torch's default)."""

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "bfloat16"), "trainer.dtype", self.dtype, "float32 or bfloat16")
        _check(self.num_threads >= 0, "trainer.num_threads", self.num_threads, ">= 0")


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """Settings shared by GRPO and PPO: what each step samples and how the policy is optimised."""

    steps: int = 250
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    """GRPO's group size; PPO works with any value (1 is classic PPO)."""
    max_tokens: int = 6
    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    lr: float = 3e-4
    clip_low: float = 0.2
    """Importance ratio lower clip: 1 - clip_low."""
    clip_high: float = 0.28
    """Importance ratio upper clip: 1 + clip_high."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference (the starting policy); 0 loads no reference."""
    epochs_per_batch: int = 1
    """Optimizer steps on each rollout batch (> 1 makes the clip matter)."""
    max_grad_norm: float = 1.0
    eval_every: int = 25
    """Score the held-out prompts every this many steps (0: only before and after)."""
    sleep_level: int = 0
    """The colocated pattern: after each rollout the engine sleeps while the trainer updates (1: its KV
    cache is freed; 2: also its weights, woken before the push), then wakes. 0 never sleeps."""
    value_coef: float = 0.5
    """PPO: weight of the value loss."""
    gamma: float = 1.0
    """PPO: discount."""
    gae_lambda: float = 0.95
    """PPO: GAE lambda."""
    off_policy_correction: str = "none"
    """Rollout-vs-trainer correction: "none"; "tis" (each token's loss times min(r, importance_cap)); "mis"
    (times r, and tokens with r outside [1/importance_cap, importance_cap] dropped), r = exp(trainer - rollout)
    logprob under the pre-update policy. With "tis" / "mis" the clipped ratio is taken against the trainer's
    pre-update logprobs instead of the rollout's (the decoupled form). See trainer_bridge.bridge.importance_weights."""
    importance_cap: float = 2.0
    """C of `off_policy_correction` (> 1)."""
    routing_replay: bool | None = None
    """MoE models (R3): rollouts return the experts every token was routed to, and the trainer's forwards (policy
    and reference) route those positions to them. None: on when the engine's model routes, off for dense models
    (True with a dense model: the engine refuses the rollout)."""

    def __post_init__(self) -> None:
        _float(self, "rl", "temperature", "lr", "clip_low", "clip_high", "kl_coef", "max_grad_norm", "gamma", "gae_lambda",
               "importance_cap")
        _check(self.sleep_level in (0, 1, 2), "rl.sleep_level", self.sleep_level, "0, 1 or 2")
        for key in ("steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "epochs_per_batch"):
            _check(getattr(self, key) >= 1, f"rl.{key}", getattr(self, key), ">= 1")
        _check(self.temperature > 0, "rl.temperature", self.temperature, "> 0 (RL samples)")
        _check(self.lr > 0, "rl.lr", self.lr, "> 0")
        _check(0 <= self.clip_low < 1, "rl.clip_low", self.clip_low, "in [0, 1)")
        _check(self.clip_high >= 0, "rl.clip_high", self.clip_high, ">= 0")
        _check(self.kl_coef >= 0, "rl.kl_coef", self.kl_coef, ">= 0")
        _check(self.max_grad_norm > 0, "rl.max_grad_norm", self.max_grad_norm, "> 0")
        _check(self.eval_every >= 0, "rl.eval_every", self.eval_every, ">= 0")
        _check(0 <= self.gamma <= 1, "rl.gamma", self.gamma, "in [0, 1]")
        _check(0 <= self.gae_lambda <= 1, "rl.gae_lambda", self.gae_lambda, "in [0, 1]")
        _check(self.off_policy_correction in ("none", "tis", "mis"), "rl.off_policy_correction",
               self.off_policy_correction, "none, tis or mis")
        _check(self.importance_cap > 1, "rl.importance_cap", self.importance_cap, "> 1")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    wandb: bool = True
    """Log to wandb (skipped with a note when wandb is not installed)."""
    wandb_mode: str | None = None
    """"offline", "online" or "disabled"; None means online if WANDB_API_KEY is set, else offline."""
    wandb_project: str = "rollout-rl"
    plot: bool = True
    """Write plot.png (reward, logprob mismatch, sync time per step)."""
    progress: bool = True
    """Progress bars and per-step summary lines."""

    def __post_init__(self) -> None:
        _check(self.wandb_mode in (None, "offline", "online", "disabled"), "logging.wandb_mode", self.wandb_mode,
               "offline, online, disabled or null")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One training run. The defaults are the toy demo on a local CPU engine."""

    algorithm: str = "grpo"
    """"grpo" or "ppo"."""
    output_dir: str = "runs/demo"
    """Where the toy model, metrics.jsonl, plot.png, summary.json and wandb runs go."""
    model: str | None = None
    """A Hugging Face model directory; None builds and warms up the toy model in output_dir/model."""
    seed: int = 0
    engine: dict[str, Any] = field(default_factory=lambda: {"dtype": "float32", "max_num_seqs": 512})
    """EngineConfig fields except `model` (a local engine in this process). `engine.deterministic: true`
    also gives the trainer's forward the same batch-invariant kernels, so the logprob mismatch is exactly 0."""
    pool: str | None = None
    """A RolloutPool YAML (see configs/pool_cpu.yaml); set, it replaces the local engine."""
    task: TaskConfig = field(default_factory=TaskConfig)
    toy_model: ToyModelConfig = field(default_factory=ToyModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(self.algorithm in ("grpo", "ppo"), "algorithm", self.algorithm, "grpo or ppo")
        if not isinstance(self.engine, dict):
            raise ValueError(f"engine must be a mapping of EngineConfig fields, got {type(self.engine).__name__}")
        if "model" in self.engine:
            raise ValueError("engine.model: set the top-level `model` key instead")
        self.engine_config("<check>")  # unknown keys and bad values fail here, naming the key

    @property
    def deterministic(self) -> bool:
        return bool(self.engine.get("deterministic", False))

    def engine_config(self, model: str) -> EngineConfig:
        return from_mapping(EngineConfig, {"model": model, **self.engine}, "engine")


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """RunConfig from a YAML file (or the defaults), then `key.sub=value` overrides (values parsed as YAML)."""
    import yaml

    data = copy.deepcopy(load_yaml(path)) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(text))
    return from_mapping(RunConfig, data, source)
