"""Write random-weight checkpoints in the Hugging Face layout without transformers.

Used by the demo, tests and benchmarks on machines where no weights can be downloaded: small ones drawn on
the CPU, and real-sized ones drawn on a GPU and streamed to sharded files (`write_random_checkpoint(...,
device="cuda", shards=2)`). Also the shapes of real models (`QWEN25_05B`, `QWEN3_8B`, ...). The tensors (names and
shapes) are those the registered model class declares in its `checkpoint_layout` (runner/models/layout.py),
which for the built-in families is the layout of transformers' Llama/Qwen2/Qwen3 `save_pretrained`; the
config.json keys are transformers'.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from runner.model_config import ModelConfig
from runner.models import ModelRegistry

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

QWEN25_05B = dict(
    family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0,
    max_position_embeddings=32768,
)
QWEN3_8B = dict(
    family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    rope_theta=1_000_000.0, max_position_embeddings=40960,
)
LLAMA31_8B = dict(
    family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500_000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)
QWEN3_32B = dict(
    family="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    rope_theta=1_000_000.0, max_position_embeddings=40960,
)

MODEL_SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "qwen3-8b": QWEN3_8B, "llama-3.1-8b": LLAMA31_8B, "qwen3-32b": QWEN3_32B}


def random_state_dict(config: dict, dtype: torch.dtype, seed: int, std: float) -> dict[str, torch.Tensor]:
    """A random tensor for every checkpoint name the model of `config` (config.json as a dict) declares, in
    declaration order from one generator: N(0, std^2), or 1 + N(0, 0.01) for norm weights."""
    cfg = ModelConfig.from_dict(config)
    _, model_cls = ModelRegistry.resolve([cfg.architecture])
    with torch.device("meta"):
        model = model_cls(cfg, None, None)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, slot in model.checkpoint_layout(0, 1).items():
        noise = torch.randn(slot.shape, generator=g)
        sd[name] = (1.0 + 0.1 * noise if slot.init == "ones" else noise * std).to(dtype)
    return sd


def write_random_checkpoint(
    path: str | Path, *, family: str = "llama", dtype: str = "float32", seed: int = 0, std: float = 0.1,
    architecture: str | None = None, device: str = "cpu", shards: int = 1, **overrides
) -> Path:
    """A random model in HF layout at `path` (config.json, generation_config.json, model.safetensors).

    `family` sets config.json's model_type and, unless `architecture` names another registered one, its
    architecture. With `device` other than "cpu" or `shards` > 1 the tensors are drawn on `device` one at a
    time, in declaration order from one generator on it (N(0, std^2), 1 + N(0, 0.01) for norm weights, as
    `random_state_dict`; on the CPU the same values), and streamed to `shards` files of about equal bytes,
    model-0000i-of-0000n.safetensors with a model.safetensors.index.json, so the host holds one tensor at a time:
    the way to write real-sized checkpoints on a GPU machine."""
    from safetensors.torch import save_file

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = write_config(path, family=family, dtype=dtype, architecture=architecture, **overrides)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device == "cpu" and shards == 1:
        sd = random_state_dict(config, torch_dtype, seed, std)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_streamed(path, config, torch_dtype, seed, std, torch.device(device), shards)
    return path


def write_config(path: str | Path, *, family: str = "llama", dtype: str = "float32", architecture: str | None = None,
                 **overrides) -> dict:
    """config.json and generation_config.json of a small model of `family` at `path`, `overrides` on top of the
    defaults; returns the config as a dict. (A checkpoint without weights: for `load_format="dummy"`.)"""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    config.update(overrides)
    if family in ("qwen3", "qwen3_moe"):
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.update(architectures=[architecture or ARCH[family]], model_type=family, dtype=dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return config


def _write_streamed(path: Path, config: dict, dtype: torch.dtype, seed: int, std: float, device: torch.device,
                    shards: int) -> None:
    """The random tensors of `config`'s model drawn on `device` and written tensor by tensor to `shards` files."""
    from runner.safetensors_io import write_file

    cfg = ModelConfig.from_dict(config)
    _, model_cls = ModelRegistry.resolve([cfg.architecture])
    with torch.device("meta"):
        model = model_cls(cfg, None, None)
    layout = model.checkpoint_layout(0, 1)
    names = list(layout)
    sizes = [math.prod(layout[n].shape) for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]  # consecutive names, cut at multiples of total / shards
    seen = 0
    for name, size in zip(names, sizes):
        groups[min(shards - 1, seen * shards // max(total, 1))].append(name)
        seen += size
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(name: str) -> torch.Tensor:
        slot = layout[name]
        noise = torch.randn(slot.shape, generator=g, device=device)
        return (1.0 + 0.1 * noise if slot.init == "ones" else noise * std).to(dtype)

    groups = [group for group in groups if group]  # a tensor bigger than a shard's share leaves one empty
    if len(groups) == 1:
        write_file(path / "model.safetensors", [(n, dtype, layout[n].shape) for n in names], draw)
        return
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_file(path / file, [(n, dtype, layout[n].shape) for n in group], draw)
        weight_map |= {n: file for n in group}
    index = {"metadata": {"total_size": total * dtype.itemsize}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
