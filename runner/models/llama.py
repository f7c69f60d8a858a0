"""Llama / Qwen2 / Qwen3 decoder over a paged KV cache.

Projections are fused (q|k|v rows in `qkv_proj`, gate|up rows in `gate_up_proj`). Each layer declares
how its checkpoint tensors map into its parameters (`checkpoint_layout(tp_rank, tp_size)`, see
runner/models/layout.py) and the model composes them, so the loader, the weight-update sessions, the
trainer and the random-checkpoint writer all read the same map. Inputs are flat token lists `[T]` with
positions `[T]`; attention reads and writes the paged cache bound to each layer (`bind_kv_cache`).

Under tensor parallelism (`tp` given) each rank builds only its shard: its query / kv heads in `qkv_proj`
and `o_proj`, its intermediate rows in `gate_up_proj` / `down_proj`, its vocabulary rows in the embedding
and the LM head, and `compute_logits` returns the rank's vocabulary shard; the layouts map each checkpoint
tensor's rows or columns to the rank's parameter. Registered for the Llama, Mistral, Qwen2 and Qwen3
architectures (runner/models/__init__.py). Not here: the collectives themselves (runner/parallel/), sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary_ref import (
    apply_rotary_cos_sin, apply_rotary_heads, apply_rotary_ref, build_cos_sin_cache, rope_inv_freq, rotary_cos_sin,
)
from kernels.activation_ref import silu_and_mul_ref
from kernels.attention_ref import rowwise_attention_ref
from runner.attention import AttentionBackend, AttentionMetadata
from runner.deterministic import kernel_forward, set_deterministic_all
from runner.layers import Linear, linear
from runner.model_config import ModelConfig
from runner.models.layout import CheckpointSlot, module_layout, part, whole
from runner.parallel.layers import (
    ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, even_partition, head_partition, rank_and_size,
)

if TYPE_CHECKING:
    from runner.parallel.group import TPGroup


def _linear_input(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """Deterministic mode on CUDA: an empty [rows, cols] output for a kernel whose result feeds a linear
    layer, laid out so that the batch-invariant matmul reads it without a padded copy."""
    from kernels.matmul import padded_rows

    return padded_rows(rows, cols, like.dtype, like.device)


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add. Triton on CUDA (inference, and training in
    deterministic mode, where the backward goes through the torch reference), torch otherwise."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.deterministic = False

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """weight [size], replicated."""
        return {"weight": whole("weight", tuple(self.weight.shape), init="ones")}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        eps = self.eps
        if x.is_cuda and (self.deterministic or not torch.is_grad_enabled()):
            from kernels.norm import fused_add_rms_norm, rms_norm

            shape = x.shape  # the kernels take [T, H]; the trainer's dense forward passes [B, T, H]
            x = x.reshape(-1, shape[-1])
            dest = _linear_input(x.shape[0], shape[-1], x) if self.deterministic else None
            if residual is None:
                out = kernel_forward(lambda a, w: rms_norm(a, w, eps, dest), lambda a, w: rms_norm_ref(a, w, eps),
                                     x, self.weight)
                return out.view(shape)
            out, res = kernel_forward(lambda a, r, w: fused_add_rms_norm(a, r, w, eps, dest),
                                      lambda a, r, w: fused_add_rms_norm_ref(a, r, w, eps),
                                      x, residual.reshape(-1, shape[-1]), self.weight)
            return out.view(shape), res.view(shape)
        if residual is None:
            return rms_norm_ref(x, self.weight, eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, eps)


@dataclass(slots=True)
class Rotary:
    """Rotary inputs of one forward, shared by all layers: positions and, on the torch path, their cos/sin.

    The Triton kernel serves the engine on CUDA, and the trainer's dense forward in deterministic mode
    (tokens flattened to [B*T], backward through the torch reference)."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_pos, D] float32
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # cos, signed sin [T, 1, D] (torch path), else None

    @classmethod
    def make(cls, positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype, dense: bool,
             deterministic: bool = False) -> "Rotary":
        use_kernel = positions.is_cuda and (deterministic or (not dense and not torch.is_grad_enabled()))
        cos_sin = None if use_kernel else rotary_cos_sin(positions, cos_sin_cache, dtype)
        return cls(positions, cos_sin_cache, cos_sin)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_sin is not None:
            return apply_rotary_cos_sin(q, k, *self.cos_sin)
        from kernels.rotary import apply_rotary

        lead = q.shape[:-2]
        positions = self.positions.repeat(q.shape[0]) if q.dim() == 4 else self.positions  # [B*T] for dense
        q2, k2 = q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:])
        cache = self.cos_sin_cache
        q2, k2 = kernel_forward(lambda a, b: apply_rotary(a, b, positions, cache),
                                lambda a, b: apply_rotary_ref(a, b, positions, cache), q2, k2)
        return q2.view(*lead, *q.shape[-2:]), k2.view(*lead, *k.shape[-2:])

    def apply_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, norms=None) -> torch.Tensor:
        """Kernel path, paged [T, H, D] inputs: q rotated in place and returned; the rotated k and v go to
        their cache slots (`kernels.rotary.rotary_store_kv`), bitwise what `apply` + the store would write;
        `norms` (q_norm weight, k_norm weight, eps): the heads RMS-normalised first, in the same launch."""
        from kernels.rotary import rotary_store_kv

        return rotary_store_kv(q, k, v, self.positions, self.cos_sin_cache, k_cache, v_cache, slot_mapping,
                               norms=norms)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.hidden_size, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.total_num_heads, self.total_num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        heads = head_partition(cfg.num_heads, cfg.num_kv_heads, *rank_and_size(tp))
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.deterministic = False
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """q/k/v_proj: the rank's heads' rows (kv heads replicated on the ranks that share them), fused in
        that order in qkv_proj; o_proj, q_norm, k_norm: their own declarations."""
        hd, h = self.head_dim, self.hidden_size
        heads = head_partition(self.total_num_heads, self.total_num_kv_heads, tp_rank, tp_size)
        q_full, kv_full = self.total_num_heads * hd, self.total_num_kv_heads * hd
        q0, q, kv0, kv = heads.q_start * hd, heads.num_heads * hd, heads.kv_start * hd, heads.num_kv_heads * hd
        layout: dict[str, CheckpointSlot] = {}
        for kind in ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",):
            tail = (h,) if kind == "weight" else ()
            fused = f"qkv_proj.{kind}"
            layout[f"q_proj.{kind}"] = part(fused, (q_full, *tail), shard=(q0, q0 + q), at=0)
            layout[f"k_proj.{kind}"] = part(fused, (kv_full, *tail), shard=(kv0, kv0 + kv), at=q)
            layout[f"v_proj.{kind}"] = part(fused, (kv_full, *tail), shard=(kv0, kv0 + kv), at=q + kv)
        for name in ("q_norm", "k_norm", "o_proj"):
            if getattr(self, name) is not None:
                layout.update(module_layout(getattr(self, name), tp_rank, tp_size, f"{name}."))
        return layout

    def forward(self, rope: Rotary, hidden, meta: AttentionMetadata | None) -> torch.Tensor:
        """Paged: hidden [T, H] with `meta`. Dense (training): hidden [B, T, H], meta None, causal per row."""
        return self.o_proj(self.attend(rope, self.qkv_proj(hidden), meta))

    def attend(self, rope: Rotary, qkv: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        """`forward` between the projections: qkv [..., Hq*D + 2*Hkv*D] -> the heads' outputs [..., Hq*D]."""
        lead = qkv.shape[:-1]
        if meta is not None and not qkv.is_cuda and self.q_norm is None:
            return self._paged_torch(rope, qkv, meta)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(*lead, self.num_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        # the engine on CUDA in fast mode: the q / k norms go into the rotary + KV-store kernel
        fuse_norms = self.q_norm is not None and meta is not None and rope.cos_sin is None and not self.deterministic
        if self.q_norm is not None and not fuse_norms:
            q, k = self.q_norm(q), self.k_norm(k)
        if meta is None:
            q, k = rope.apply(q, k)
            out = self._dense_attention(q, k, v)
        else:
            if rope.cos_sin is None:  # CUDA: one launch rotates q and writes the rotated k and v to the cache
                norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if fuse_norms else None
                q = rope.apply_and_store(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, norms)
            else:
                q, k = rope.apply(q, k)
                self.backend.store(k, v, self.k_cache, self.v_cache, meta)
            dest = None
            if self.deterministic and q.is_cuda:
                dest = _linear_input(q.shape[0], self.q_size, q).view(q.shape)
            out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, out=dest)
        return out.reshape(*lead, self.q_size)

    def _paged_torch(self, rope: Rotary, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The paged CPU path: query and key heads rotated together, K/V stored and read through the backend.
        qkv [T, Hq*D + 2*Hkv*D] -> [T, Hq*D]."""
        num_tokens, hq, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk = apply_rotary_heads(qkv[:, : self.q_size + self.kv_size].view(num_tokens, hq + hkv, d), *rope.cos_sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, hkv, d)
        self.backend.store(qk[:, hq:], v, self.k_cache, self.v_cache, meta)
        out = self.backend.attend(qk[:, :hq], self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(num_tokens, self.q_size)

    def _dense_attention(self, q, k, v) -> torch.Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D], causal, no cache."""
        if not self.deterministic:
            return self._sdpa_attention(q, k, v)
        if q.is_cuda:  # the engine's deterministic Triton kernel; gradients through SDPA
            return kernel_forward(self._paged_kernel_attention, self._sdpa_attention, q, k, v)
        # CPU: the same row-local reduction the engine's paged path uses in this mode
        b, t = q.shape[:2]
        group = self.num_heads // self.num_kv_heads
        queries = q.view(b, t, self.num_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(b, self.num_kv_heads, group * t, self.head_dim)
        pos = torch.arange(t, device=q.device)
        causal = (pos[None, :] <= pos[:, None])[None, None, None].expand(b, 1, group, t, t)
        out = rowwise_attention_ref(queries, k.transpose(1, 2), v.transpose(1, 2),
                                    causal.reshape(b, 1, group * t, t), self.scale)
        out = out.view(b, self.num_kv_heads, group, t, self.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(b, t, self.num_heads, self.head_dim)

    def _sdpa_attention(self, q, k, v) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2) if group > 1 else k
        v = v.repeat_interleave(group, dim=2) if group > 1 else v
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )
        return out.transpose(1, 2)

    def _paged_kernel_attention(self, q, k, v) -> torch.Tensor:
        """Each row's K/V laid out as pages of a temporary cache, then the engine's paged attention kernel
        in deterministic mode: bitwise what the engine computes for the same tokens."""
        from kernels.attention import paged_attention

        b, t = q.shape[:2]
        page = 16
        pages = -(-t // page)
        shape = (b, pages * page, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = k.new_zeros(shape), v.new_zeros(shape)
        k_cache[:, :t], v_cache[:, :t] = k, v
        k_cache = k_cache.view(b * pages, page, self.num_kv_heads, self.head_dim)
        v_cache = v_cache.view(b * pages, page, self.num_kv_heads, self.head_dim)
        dev = q.device
        block_tables = torch.arange(b * pages, dtype=torch.int32, device=dev).view(b, pages)
        query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev) * t
        seq_lens = torch.full((b,), t, dtype=torch.int32, device=dev)
        flat_q = q.reshape(b * t, self.num_heads, self.head_dim).contiguous()
        out = paged_attention(flat_q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, self.scale, t, t,
                              out=_linear_input(b * t, self.q_size, q).view(flat_q.shape), deterministic=True)
        return out.view(b, t, self.num_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = cfg.hidden_size, cfg.intermediate_size
        start, end = even_partition(cfg.intermediate_size, *rank_and_size(tp), "intermediate_size")
        self.intermediate = end - start  # this rank's rows of gate and up, columns of down
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, "intermediate_size")
        self.deterministic = False

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """gate_proj, up_proj [I, H]: the rank's rows, fused gate|up in gate_up_proj; down_proj: its own."""
        rows = even_partition(self.intermediate_size, tp_rank, tp_size, "intermediate_size")
        shape = (self.intermediate_size, self.hidden_size)
        return {
            "gate_proj.weight": part("gate_up_proj.weight", shape, shard=rows, at=0),
            "up_proj.weight": part("gate_up_proj.weight", shape, shard=rows, at=rows[1] - rows[0]),
            **module_layout(self.down_proj, tp_rank, tp_size, "down_proj."),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down(gate_up, self.gate_up_proj.lora_delta())

    def down(self, gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The block from the gate_up projection's output gate_up [..., 2 * intermediate] on -> [..., H]; `delta`
        (float32, gate_up's shape): a LoRA delta the SiLU-and-mul adds to gate_up first (`Linear.lora_delta`)."""
        if gate_up.is_cuda and (self.deterministic or not torch.is_grad_enabled()):
            from kernels.activation import silu_and_mul  # one kernel, as in the engine (Triton on CUDA)

            rows = gate_up.numel() // gate_up.shape[-1]
            dest = _linear_input(rows, self.intermediate, gate_up) if self.deterministic else None
            return self.down_proj(kernel_forward(lambda g: silu_and_mul(g, dest, delta=delta),
                                                 lambda g: silu_and_mul_ref(g, delta), gate_up))
        return self.down_proj(silu_and_mul_ref(gate_up, delta))


class DecoderLayer(nn.Module):
    """Attention then a feed-forward block `mlp` (the dense `MLP` unless one is given), each after an RMSNorm
    fused with the residual add. A feed-forward block is called as `mlp(hidden)`, or as `mlp(hidden, meta)`
    when it declares `takes_metadata = True` (a MoE block records its routing per KV slot).

    A paged forward of at most `gemv_rows` tokens (set by the engine on CUDA, `EngineConfig.fused_gemv_rows`;
    0 elsewhere) runs the qkv and gate_up projections with the residual add + RMSNorm before them, and the down
    projection with the SiLU-and-mul before it, as single fused matrix-vector kernels (kernels/gemv.py); a
    projection with a LoRA hook keeps the unfused path (the hook reads the normalised input)."""

    gemv_rows = 0

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None, tp: TPGroup | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp) if mlp is None else mlp

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        layout: dict[str, CheckpointSlot] = {}
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):  # the writer's draw order
            layout.update(module_layout(getattr(self, name), tp_rank, tp_size, f"{name}."))
        return layout

    def forward(self, rope, hidden, residual, meta):
        if meta is not None and 0 < hidden.shape[0] <= self.gemv_rows and not torch.is_grad_enabled():
            return self._forward_gemv(rope, hidden, residual, meta)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        self.self_attn.o_proj.lora_residual(residual)  # the sum o_proj's output joins next
        hidden = self.self_attn(rope, hidden, meta)
        return self._norm_feed_forward(hidden, residual, meta)

    def _norm_feed_forward(self, hidden, residual, meta):
        """The post-attention norm (with the residual add), then the feed-forward block -> (out, residual); a
        layer whose block fuses the norm overrides it (runner/models/qwen_moe.py)."""
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if isinstance(self.mlp, MLP):
            self.mlp.down_proj.lora_residual(residual)  # the sum down_proj's output joins next
        return self._feed_forward(hidden, meta), residual

    def _feed_forward(self, hidden, meta):
        if getattr(self.mlp, "takes_metadata", False):
            return self.mlp(hidden, meta)
        return self.mlp(hidden)

    def _forward_gemv(self, rope, hidden, residual, meta):
        """`forward` at a few tokens, hidden [T, H] with T <= gemv_rows: the norm or activation before a projection
        fused into its kernel where that pays (`kernels.gemv.fuses_prologue`); every Linear takes the plain
        matrix-vector kernel on its own (`Linear.gemv_rows`)."""
        from kernels.gemv import fuses_prologue

        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        if attn.qkv_proj.lora is None and fuses_prologue("rms_norm", attn.qkv_proj.weight):
            qkv, residual = gemv_linear(attn.qkv_proj, hidden, norm, residual)
        else:
            hidden, residual = (norm(hidden), hidden) if residual is None else norm(hidden, residual)
            qkv = attn.qkv_proj(hidden)
        attn.o_proj.lora_residual(residual)
        hidden = attn.o_proj(attn.attend(rope, qkv, meta))
        norm = self.post_attention_layernorm
        if not isinstance(mlp, MLP):
            return self._norm_feed_forward(hidden, residual, meta)
        if mlp.gate_up_proj.lora is None and fuses_prologue("rms_norm", mlp.gate_up_proj.weight):
            gate_up, residual = gemv_linear(mlp.gate_up_proj, hidden, norm, residual)
        else:
            hidden, residual = norm(hidden, residual)
            gate_up = mlp.gate_up_proj(hidden)
        delta = mlp.gate_up_proj.lora_delta()  # a LoRA delta left for the SiLU-and-mul, or None
        if delta is not None or mlp.down_proj.lora is not None or not fuses_prologue("silu_mul", mlp.down_proj.weight):
            mlp.down_proj.lora_residual(residual)
            return mlp.down(gate_up, delta), residual
        return gemv_linear(mlp.down_proj, gate_up, silu_mul=True), residual


def gemv_linear(linear: Linear, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None,
                silu_mul: bool = False):
    """`linear` of a few rows by `kernels.gemv.fused_gemv` with a prologue: `norm` of x [T, in] (+ `residual`;
    returns (y, the residual sum)), or the SiLU-and-mul of x [T, 2 * in]. A row-parallel layer's partial sums
    are all-reduced and its bias added once, as `RowParallelLinear` does (the norm only precedes column-parallel
    layers)."""
    from kernels.gemv import fused_gemv

    if norm is not None:
        return fused_gemv(x, linear.weight, linear.bias, prologue="rms_norm", norm_weight=norm.weight,
                          residual=residual, eps=norm.eps)
    tp = getattr(linear, "tp", None)
    y = fused_gemv(x, linear.weight, linear.bias if tp is None else None, prologue="silu_mul")
    if tp is None:
        return y
    y = tp.all_reduce(y)
    return y if linear.bias is None else y + linear.bias


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The whole model. Build it on the meta device, then `runner.loader.load_weights` fills it."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, [self.make_layer(cfg, backend, tp, i) for i in range(cfg.num_layers)], tp)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)  # [max_pos, head_dim] f32
        self.deterministic = False
        self.gemv_rows = 0  # set_gemv_rows

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend | None, tp: TPGroup | None,
                   index: int) -> DecoderLayer:
        """Layer `index` (a subclass builds its own feed-forward blocks here: runner/models/qwen_moe.py)."""
        return DecoderLayer(cfg, backend, tp)

    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (the KV cache's third dimension)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        """Fill the rotary table (a buffer outside the checkpoint) for positions < max_position."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin_cache = build_cos_sin_cache(inv_freq, max_position).to(device)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give each layer its (k_cache, v_cache) pair."""
        assert len(kv_caches) == len(self.model.layers)
        for layer, (k, v) in zip(self.model.layers, kv_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]. `embeds` (index [E] int64, rows
        [E, hidden]): the input embeddings of tokens `index` are `rows` instead of their tokens' (embedding prompts)."""
        if embeds is None:  # (a subclass's forward_with_aux may predate the argument)
            return self.forward_with_aux(input_ids, positions, meta)[0]
        return self.forward_with_aux(input_ids, positions, meta, embeds=embeds)[0]

    def forward_with_aux(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, aux_layers: tuple[int, ...] = (),
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the residual stream after each layer in `aux_layers`, in layer order (for drafters).

        Returns (final hidden [T, hidden], aux [T, len(aux_layers) * hidden] or None when aux_layers is empty).
        """
        hidden = self.model.embed_tokens(input_ids)
        if embeds is not None:
            hidden.index_copy_(0, *embeds)
        rope = Rotary.make(positions, self.cos_sin_cache, hidden.dtype, dense=False, deterministic=self.deterministic)
        return self._run_layers(hidden, rope, meta, aux_layers)

    def forward_dense(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """Full-sequence forward without a KV cache (training): input_ids [B, T] -> hidden [B, T, hidden].

        Rows are causal and independent; pad on the right so padding never precedes real tokens. With
        `aux_layers`, returns (hidden, aux [B, T, len(aux_layers) * hidden]) as `forward_with_aux` does.
        """
        hidden = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        rope = Rotary.make(positions, self.cos_sin_cache, hidden.dtype, dense=True, deterministic=self.deterministic)
        hidden, aux = self._run_layers(hidden, rope, None, aux_layers)
        return (hidden, aux) if aux_layers else hidden

    def _run_layers(self, hidden, rope, meta, aux_layers: tuple[int, ...]):
        residual = None
        aux = []
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(rope, hidden, residual, meta)
            if i in aux_layers:
                aux.append(hidden + residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden, (torch.cat(aux, dim=-1) if aux else None)

    def set_gemv_rows(self, rows: int) -> None:
        """Forwards of at most `rows` tokens take the fused small-batch kernels (`DecoderLayer`, `Linear`, the LM
        head; the runner sets it for CUDA inference in fast mode only); 0 turns them off."""
        for module in self.modules():  # this model (its LM head), its decoder layers, every Linear
            if hasattr(module, "gemv_rows"):
                module.gemv_rows = rows

    def set_deterministic(self, deterministic: bool) -> None:
        """Batch-invariant kernels everywhere (linears, LM head, norms, attention, MLP) when True: every
        submodule with a deterministic mode is switched through its own `set_deterministic`."""
        self.deterministic = deterministic
        set_deterministic_all(self, deterministic)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype; under TP the rank's shard [N, vocab / P]."""
        if 0 < hidden.shape[0] <= self.gemv_rows and not torch.is_grad_enabled() and hidden.is_contiguous():
            from kernels.gemv import fused_gemv

            return fused_gemv(hidden, self.lm_head_weight())
        return linear(hidden, self.lm_head_weight(), None, self.deterministic)

    def checkpoint_layout(self, tp_rank: int | None = None, tp_size: int | None = None) -> dict[str, CheckpointSlot]:
        """Every checkpoint (Hugging Face) tensor name -> its slot for rank `tp_rank` of `tp_size` (default:
        this model's own rank), composed from the layers' declarations."""
        if tp_rank is None:
            tp_rank, tp_size = rank_and_size(self.tp)
        parts = [("model.embed_tokens.", self.model.embed_tokens), ("model.norm.", self.model.norm),
                 ("lm_head.", self.lm_head)]  # first: the random-checkpoint writer's draw order
        parts += [(f"model.layers.{i}.", layer) for i, layer in enumerate(self.model.layers)]
        layout: dict[str, CheckpointSlot] = {}
        for prefix, module in parts:
            if module is not None:
                layout.update(module_layout(module, tp_rank, tp_size, prefix))
        return layout
