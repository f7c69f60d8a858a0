"""Write small random-weight checkpoints in the Hugging Face layout without transformers.

Used by the demo and benchmarks on machines where no weights can be downloaded. The layout (names,
shapes, config.json keys) is that of transformers' Llama/Qwen2/Qwen3 `save_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

QWEN25_05B = dict(
    family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0,
    max_position_embeddings=32768,
)


def random_state_dict(config: dict, family: str, dtype: torch.dtype, seed: int, std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    vocab = config["vocab_size"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": ones(h)}
    if not config.get("tie_word_embeddings"):
        sd["lm_head.weight"] = rnd(vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        sd[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        sd[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        if family == "qwen2":
            for n, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                sd[p + f"self_attn.{n}_proj.bias"] = rnd(rows)
        if family == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = ones(hd)
            sd[p + "self_attn.k_norm.weight"] = ones(hd)
        sd[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd)
        sd[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        sd[p + "mlp.up_proj.weight"] = rnd(inter, h)
        sd[p + "mlp.down_proj.weight"] = rnd(h, inter)
        sd[p + "input_layernorm.weight"] = ones(h)
        sd[p + "post_attention_layernorm.weight"] = ones(h)
    return sd


def write_random_checkpoint(
    path: str | Path, *, family: str = "llama", dtype: str = "float32", seed: int = 0, std: float = 0.1, **overrides
) -> Path:
    """A random model in HF layout at `path` (config.json, generation_config.json, model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    config.update(overrides)
    if family == "qwen3":
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.update(architectures=[ARCH[family]], model_type=family, dtype=dtype)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    sd = random_state_dict(config, family, torch_dtype, seed, std)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return path
