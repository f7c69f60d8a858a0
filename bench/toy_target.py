"""A learnable toy target for speculative-decoding tests and benchmarks (no downloads).

`counting_corpus` makes rows x_t = (start + stride * t) mod vocab (stride 1..3): predictable after two
tokens, so a trained target is confident and a good drafter can match it. `train_toy_target` trains a
random-init Llama checkpoint on it with plain torch (the engine's own model code, via TrainingModel) and
saves it in Hugging Face names. Not part of the product: only tests and benchmarks use it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch


def counting_corpus(num: int, length: int, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [num, length] counting rows with random start and stride in {1, 2, 3}."""
    start = torch.randint(vocab_size, (num, 1), generator=gen)
    stride = torch.randint(1, 4, (num, 1), generator=gen)
    return (start + stride * torch.arange(length)[None, :]) % vocab_size


def train_toy_target(path: str | Path, *, seconds: float, vocab_size: int = 32, hidden_size: int = 64,
                     num_layers: int = 2, seq_len: int = 24, batch_size: int = 32, device: str = "cpu",
                     seed: int = 0) -> tuple[Path, float]:
    """Train for `seconds`; returns (checkpoint directory path/"target", last training loss)."""
    from safetensors.torch import save_file

    from runner.testing import write_random_checkpoint
    from trainer_bridge.training_model import TrainingModel

    path = Path(path)
    src = write_random_checkpoint(path / "init", vocab_size=vocab_size, hidden_size=hidden_size,
                                  intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=vocab_size - 1,
                                  seed=seed, std=0.05)
    model = TrainingModel.from_pretrained(src, max_position=1024, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    deadline = time.perf_counter() + seconds
    loss = torch.tensor(float("nan"))
    while time.perf_counter() < deadline:
        ids = counting_corpus(batch_size, seq_len, vocab_size, gen).to(device)
        loss = -model.token_logprobs(ids).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = path / "target"
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone().contiguous() for k, v in model.checkpoint_state().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    return out, loss.item()
