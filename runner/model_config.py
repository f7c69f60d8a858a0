"""Model hyper-parameters read from a Hugging Face `config.json`.

Accepts every architecture registered with `runner.models.ModelRegistry` (the built-in Llama, Mistral,
Qwen2 and Qwen3 dense families, Qwen2-MoE and Qwen3-MoE, and any model registered from outside), and keeps the raw dict as
`hf_config` for a model class's own keys. The fields here are those every decoder has; the Llama / Qwen
family rules (q/k/v bias, o_proj bias, q/k norm) follow the built-in architectures, or config.json's
`model_type` for another registered one. Reads both the transformers-5 rope format (`rope_parameters`) and
the older `rope_theta` + `rope_scaling`. Raises ValueError for an unknown architecture or a missing field;
knows nothing about weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.models.registry import ModelRegistry

_FAMILIES = {  # the built-in architectures' config rules
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # Llama's layers and names; sliding-window attention only as a length cap
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2",  # the Qwen2 attention (qkv bias); sparse blocks: runner/models/qwen_moe.py
    "Qwen3MoeForCausalLM": "qwen3",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    architecture: str  # the registered name picked from config.json's `architectures`
    family: str  # "llama" | "qwen2" | "qwen3" for the built-in architectures, else config.json's model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_proj_bias: bool  # bias on o_proj (Llama with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    checkpoint_dtype: str | None
    eos_token_ids: list[int]
    sliding_window: int | None = None  # attention window of some layers; the engine keeps sequences within it
    hf_config: dict = field(default_factory=dict)  # config.json as read, for keys a model class parses itself

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model directory {path} has no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        config = cls.from_dict(raw, source=str(cfg_file))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen_file}: not valid JSON ({e})") from None
            eos = _as_id_list(gen.get("eos_token_id"))
            if eos:
                config.eos_token_ids = sorted(set(config.eos_token_ids) | set(eos))
        return config

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"{source}: architectures must be a list of names, got {archs!r}")
        arch, _ = ModelRegistry.resolve(archs, source)
        family = _FAMILIES.get(arch, str(raw.get("model_type", "")))

        def need(key: str):
            if key not in raw or raw[key] is None:
                raise ValueError(f"{source}: missing required field {key!r}")
            return raw[key]

        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        # Mistral always slides when sliding_window is set; Qwen2 / Qwen3 only with use_sliding_window
        window = raw.get("sliding_window") if arch == "MistralForCausalLM" or raw.get("use_sliding_window") else None
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_proj_bias=family == "llama" and bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            checkpoint_dtype=dtype if isinstance(dtype, str) else None,
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
            sliding_window=int(window) if window is not None else None,
            hf_config=dict(raw),
        )


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
