"""Drafter models: an EAGLE head and a DeepSeek-V3-style MTP module, and their safetensors directories.

Both read the target's hidden state h_t of position t and the embedding of the next token x_{t+1}, run
one decoder layer (the target's own `DecoderLayer` code, so it uses the same paged attention), and return
a normed hidden state that the target's LM head turns into logits for x_{t+2}:

    eagle:  z = fc([emb(x_{t+1}); h_t])                       EAGLE
            h_t = aux_proj([h^(l1)_t; h^(l2)_t; ...])          EAGLE-3 option: several target layers
    mtp:    z = eh_proj([enorm(emb(x_{t+1})); hnorm(h_t)])     DeepSeek-V3 MTP
    out = norm(layer(z))                                       [T, H], fed back as h when drafting ahead

The token embedding and LM head are the target's (passed in, never copied). A drafter has its own
one-layer KV cache that uses the target's block tables. Saved as a directory: config.json (DrafterConfig)
+ model.safetensors (this module's parameters). Not here: when to draft, verification, training loops.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runner.attention import AttentionBackend, AttentionMetadata
from runner.model_config import ModelConfig
from runner.models.llama import DecoderLayer, RMSNorm, Rotary


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    """Shape of a drafter; the rest (heads, rope, norm eps) is the target's."""

    method: str
    """"eagle" or "mtp"."""
    hidden_size: int
    """The target's hidden size."""
    vocab_size: int
    """The target's vocabulary size (the drafter uses the target's embedding and LM head)."""
    aux_layers: list[int] = field(default_factory=list)
    """EAGLE-3 option: target layers whose outputs (concatenated) replace the final hidden state as input."""

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "mtp"):
            raise ValueError(f"drafter method must be 'eagle' or 'mtp', got {self.method!r}")
        if self.aux_layers and self.method != "eagle":
            raise ValueError("aux_layers (EAGLE-3 style inputs) apply to the eagle drafter only")

    def check_target(self, target: ModelConfig, source: str) -> None:
        if self.hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{source}: drafter for hidden_size={self.hidden_size}, vocab_size={self.vocab_size} does not fit "
                f"the target (hidden_size={target.hidden_size}, vocab_size={target.vocab_size})"
            )
        bad = [i for i in self.aux_layers if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(f"{source}: aux_layers {bad} outside the target's {target.num_layers} layers")


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target_cfg: ModelConfig, backend: AttentionBackend | None) -> None:
        super().__init__()
        cfg.check_target(target_cfg, "drafter")
        self.config = cfg
        H = cfg.hidden_size
        self.aux_layers = tuple(sorted(cfg.aux_layers))
        if cfg.method == "eagle":
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.aux_proj = nn.Linear(len(self.aux_layers) * H, H, bias=False) if self.aux_layers else None
        else:
            self.enorm = RMSNorm(H, target_cfg.rms_norm_eps)
            self.hnorm = RMSNorm(H, target_cfg.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DecoderLayer(dataclasses.replace(target_cfg, num_layers=1), backend)
        self.norm = RMSNorm(H, target_cfg.rms_norm_eps)

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The h the drafter reads from the target: final hidden [..., H], or aux_proj(aux [..., n*H])."""
        if self.aux_layers:
            assert aux is not None and aux.shape[-1] == len(self.aux_layers) * self.config.hidden_size
            return self.aux_proj(aux)
        return hidden

    def forward(
        self,
        next_embeds: torch.Tensor,  # [T, H] (paged) or [B, T, H] (dense): embedding of x_{t+1}
        features: torch.Tensor,  # same shape: h_t (target_features, or a previous drafter output)
        rope: Rotary,  # of the positions t (rope_for)
        meta: AttentionMetadata | None,  # None: dense causal attention (training)
    ) -> torch.Tensor:
        """Returns the normed drafter hidden state, same leading shape; logits = target LM head of it."""
        if self.config.method == "eagle":
            z = self.fc(torch.cat([next_embeds, features], dim=-1))
        else:
            z = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(features)], dim=-1))
        out, residual = self.layer(rope, z, None, meta)
        out, _ = self.norm(out, residual)
        return out

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.layer.self_attn.k_cache, self.layer.self_attn.v_cache = k_cache, v_cache


def rope_for(target, positions: torch.Tensor, dtype: torch.dtype, dense: bool = False) -> Rotary:
    """Rotary inputs for `positions` [T] from the target's table (the drafter shares it); dense: training."""
    return Rotary.make(positions, target.cos_sin_cache, dtype, dense=dense)


def new_drafter(
    method: str, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
    backend: AttentionBackend | None, *, aux_layers: list[int] | None = None, seed: int = 0,
) -> Drafter:
    """A freshly initialised drafter (seeded): matrices N(0, 1/fan_in), biases 0, norms 1."""
    cfg = DrafterConfig(method=method, hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                        aux_layers=list(aux_layers or []))
    drafter = Drafter(cfg, target_cfg, backend)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)  # norm weights
    return drafter.to(device=device, dtype=dtype)


def save_drafter(drafter: Drafter, path: str | Path) -> Path:
    """Write config.json + model.safetensors to directory `path` (created)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dataclasses.asdict(drafter.config), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_drafter(
    path: str | Path, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
    backend: AttentionBackend | None,
) -> Drafter:
    """Load a drafter directory written by `save_drafter`; ValueError if it is missing, bad or does not fit."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"drafter directory {path} needs config.json and model.safetensors")
    try:
        raw = json.loads(cfg_file.read_text())
        cfg = DrafterConfig(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{cfg_file}: not a drafter config ({e})") from None
    cfg.check_target(target_cfg, str(path))
    drafter = Drafter(cfg, target_cfg, backend)
    state = load_file(str(weights))
    expected = drafter.state_dict()
    if set(state) != set(expected):
        raise ValueError(f"{weights}: tensors {sorted(set(state) ^ set(expected))} missing or unexpected")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{weights}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype)
