"""Shared fixtures: tiny random-weight checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_checkpoint(path: Path, family: str = "llama", *, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Write a random-weight transformers model of `family` to `path`; returns the path."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in _FAMILIES[family])
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.save_pretrained(path)
    return path


def load_hf(path: Path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(family: str = "llama", **overrides) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{family}")
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return factory
