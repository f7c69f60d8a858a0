"""The trainer-side model: the engine's own model code in training mode, parameters in checkpoint names.

`TrainingModel` wraps the same `DecoderForCausalLM` the engine serves, with a full-sequence forward (no
KV cache) and autograd. Because the code is shared, rollout logprobs and trainer logprobs differ only by
kernel numerics; with `deterministic=True` on both sides they are bitwise equal (batch-invariant kernels,
see `runner/layers.py` and `kernels/attention_ref.rowwise_attention_ref`). The backward pass differentiates
through the same ops. `checkpoint_state()` gives views of the
parameters under Hugging Face names — exactly what `TrainerBridge.push_weights` sends.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.loader import CheckpointWeights, load_model
from runner.model_config import ModelConfig, parse_dtype
from runner.models.llama import DecoderForCausalLM


class TrainingModel(nn.Module):
    def __init__(self, model: DecoderForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", max_position: int | None = None,
        deterministic: bool = False,
    ) -> "TrainingModel":
        cfg = ModelConfig.from_dir(path)
        max_position = max_position or min(cfg.max_position_embeddings, 8192)
        model = load_model(path, cfg, parse_dtype(dtype), torch.device(device), None, max_position, deterministic)
        model.train()
        return cls(model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (float32)."""
        hidden = self.model.forward_dense(input_ids)
        return self.model.compute_logits(hidden).float()

    def token_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Differentiable logprob of each next token: [B, T - 1], entry t scores input_ids[:, t + 1]."""
        logits = self.forward(input_ids)[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> a view of the live parameter rows (no copies)."""
        weights = CheckpointWeights(self.model)
        return {name: weights.view(name).detach() for name in weights.layout}
