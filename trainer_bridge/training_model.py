"""The trainer-side model: the engine's own model code in training mode, parameters in checkpoint names.

`TrainingModel` wraps the same model class the engine serves (the one registered for the checkpoint's
architecture, e.g. `DecoderForCausalLM`), with a full-sequence forward (no KV cache) and autograd. Because
the code is shared, rollout logprobs and trainer logprobs differ only by kernel numerics; with
`deterministic=True` on both sides they are bitwise equal (batch-invariant kernels, see `runner/layers.py`
and `kernels/attention_ref.rowwise_attention_ref`). The backward pass differentiates through the same ops.
`checkpoint_state()` gives views of the parameters under Hugging Face names, through the model's
`checkpoint_layout` — exactly what `TrainerBridge.push_weights` sends.

Routing replay (R3) for MoE models: `token_logprobs(..., routed_experts=...)` (and `hidden_states`) hand the
experts the rollout chose ([B, T - 1, num_moe_layers, top_k], `CompletionOutput.routed_experts` aligned by
`TrainerBridge.rollout`) to the model's `forward_dense`, which routes positions 0 .. T - 2 to them and
recomputes their weights from its own router, so gradients still reach the router.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.deterministic import kernel_forward
from runner.loader import CheckpointWeights, load_model
from runner.model_config import ModelConfig, parse_dtype
from runner.models import CausalLM

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)  # what routed_experts may hold


class TrainingModel(nn.Module):
    def __init__(self, model: CausalLM) -> None:
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

    def hidden_states(self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, hidden] (the model's `forward_dense`). `routed_experts`
        (MoE routing replay): integer [B, T - 1, num_moe_layers, top_k], the experts of positions 0 .. T - 2
        (the last position routes by its own router); a ValueError unless the model routes and the shape fits."""
        if routed_experts is None:
            return self.model.forward_dense(input_ids)
        shape = getattr(self.model, "routed_experts_shape", None)
        if shape is None:
            raise ValueError(f"routed_experts: {type(self.model).__name__} has no MoE layers to replay them in")
        routed_experts = torch.as_tensor(routed_experts, device=input_ids.device)
        want = (input_ids.shape[0], input_ids.shape[1] - 1, *shape)
        if tuple(routed_experts.shape) != want or routed_experts.dtype not in _INDEX_DTYPES:
            raise ValueError(f"routed_experts must be an integer tensor [B, T - 1, num_moe_layers, top_k] = "
                             f"{list(want)} for input_ids {list(input_ids.shape)}, got {routed_experts.dtype} "
                             f"{list(routed_experts.shape)}")
        return self.model.forward_dense(input_ids, routed_experts=routed_experts)

    def token_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0,
                       routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Differentiable logprob of each next token: [B, T - 1], entry t scores input_ids[:, t + 1].

        `routed_experts` [B, T - 1, num_moe_layers, top_k] (MoE): replay these experts (see `hidden_states`).
        In deterministic mode on CUDA the logprobs come from the engine sampler's own reduction
        (`kernels.sampling.token_logprobs`), so they equal the rollout logprobs bitwise.
        """
        logits = self.model.compute_logits(self.hidden_states(input_ids, routed_experts))[:, :-1]  # [B, T-1, V]
        targets = input_ids[:, 1:]  # [B, T-1]

        def reference(lg: torch.Tensor) -> torch.Tensor:
            lg = lg.float() if temperature == 1.0 else lg.float() / temperature
            return torch.log_softmax(lg, dim=-1).gather(-1, targets.reshape(lg.shape[:-1])[..., None]).squeeze(-1)

        if not (self.model.deterministic and logits.is_cuda):
            return reference(logits)
        from kernels.sampling import token_logprobs

        b, t, v = logits.shape
        flat_targets = targets.reshape(-1)
        temps = torch.full((b * t,), float(temperature), dtype=torch.float32, device=logits.device)
        flat = kernel_forward(lambda lg: token_logprobs(lg, flat_targets, temps), reference,
                              logits.reshape(b * t, v).contiguous())
        return flat.view(b, t)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> a view of the live parameter rows (no copies)."""
        weights = CheckpointWeights(self.model)
        return {name: weights.view(name).detach() for name in weights.layout}
