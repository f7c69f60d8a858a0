"""Write small random-weight checkpoints in the Hugging Face layout without transformers.

Used by the demo and benchmarks on machines where no weights can be downloaded. The tensors (names and
shapes) are those the registered model class declares in its `checkpoint_layout` (runner/models/layout.py),
which for the built-in families is the layout of transformers' Llama/Qwen2/Qwen3 `save_pretrained`; the
config.json keys are transformers'.
"""

from __future__ import annotations

import json
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
    architecture: str | None = None, **overrides
) -> Path:
    """A random model in HF layout at `path` (config.json, generation_config.json, model.safetensors).

    `family` sets config.json's model_type and, unless `architecture` names another registered one, its
    architecture."""
    from safetensors.torch import save_file

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
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    sd = random_state_dict(config, torch_dtype, seed, std)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return path
