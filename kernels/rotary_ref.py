"""Rotary position embedding (NeoX / Hugging Face "rotate_half" layout) in plain torch.

`cos_sin_cache` is float32 `[max_position, head_dim]`: the first half of each row holds cos(pos * f_i),
the second half sin(pos * f_i), for the `head_dim // 2` inverse frequencies f_i (after any rope scaling).
As in Hugging Face, cos and sin are cast to the activation dtype before they multiply q and k.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) and `sin` already signed (-s, s):
    (x2, x1) * (-s, s) is (-x2, x1) * (s, s) exactly, one op fewer."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos (c, c) and signed sin (-s, s), [T, 1, D] in `dtype`, for the given positions [T] (shared by all
    layers of a step); `apply_rotary_cos_sin` takes them."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.to(torch.int64))  # [T, D]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :].to(dtype)
    sin = torch.cat((-cs[:, half:], cs[:, half:]), dim=-1)[:, None, :].to(dtype)
    return cos, sin


def apply_rotary_cos_sin(query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def apply_rotary_heads(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] heads (e.g. the query and key heads of a fused projection, side by side) with the
    cos / signed sin of `rotary_cos_sin`; the same values as rotating query and key apart."""
    return _rotate(heads, cos, sin)


def apply_rotary_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_position, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions; returns new tensors of the inputs' dtype."""
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    return apply_rotary_cos_sin(query, key, cos, sin)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2], with "default", "linear" or "llama3" scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos half then sin half."""
    pos = torch.arange(max_position, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :].to(torch.float32)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
