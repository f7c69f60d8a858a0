"""Qwen3-MoE and Qwen2-MoE: the dense decoder (runner/models/llama.py) with sparse Mixture-of-Experts blocks.

A sparse block routes each token to `top_k` of `num_experts` experts: router logits from `gate` [E, H], a
softmax in float32, the top-k (torch.topk order: descending probability), renormalised when
`norm_topk_prob` (one kernel on CUDA: `kernels.routing`); the experts' SiLU MLPs are stacked (`experts.w13` [E, 2I, H] gate|up rows, `experts.w2`
[E, H, I]) and run by one fused kernel (`kernels.moe.fused_moe` on CUDA, `kernels.moe_ref.fused_moe_ref`
otherwise and for gradients). Qwen2-MoE adds a dense shared expert scaled by sigmoid(`shared_expert_gate`).
Which layers are sparse follows transformers: layer i unless i is in `mlp_only_layers`, and only when
(i + 1) % `decoder_sparse_step` == 0; the other layers hold a dense MLP of `intermediate_size`.

Checkpoints name experts one by one (`mlp.experts.{e}.gate_proj.weight` ...); the layout puts each at its
expert's index of the stacked tensors (and, under tensor parallelism, the rank's rows of the expert's
intermediate dimension; the block's output is all-reduced). Expert parallelism (`TPGroup.expert_parallel`,
from EngineConfig.expert_parallel) splits the experts instead: rank r of P holds experts [r * E / P,
(r + 1) * E / P) whole and declares an empty part (shard (0, 0) along dim 0) of every other expert, so every
rank has a slot for every name; the router is replicated, each rank adds its experts' terms for every token
(`fused_moe(..., expert_start=...)`) and the block's output is all-reduced, as under TP. Qwen2-MoE's shared
expert stays tensor-parallel either way. transformers 5's in-memory fused names
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are accepted by weight pushes through
`weight_updates.aliases`, not here.

Decode (a paged CUDA forward in fast mode of at most `SparseMoeBlock.decode_pairs` (token, choice) pairs, no
shared expert): the layer's post-attention norm goes into the router's GEMV (`kernels.gemv.fused_gemv` with
the RMSNorm prologue, which also returns the residual sum) and the rest of the block is `kernels.moe_decode`:
three launches for norm, router, top-k, experts and combine instead of six (`MoEDecoderLayer`).

Routing replay: with a routing store bound (`bind_routed_experts`), every paged forward writes each token's
expert ids at its KV slot, so the runner can report the experts of every position, prefix-cache hits
included. `forward_dense(..., routed_experts=...)` makes the trainer's forward use given experts, their
weights recomputed from its own router (gradients reach the router). Not here: all-to-all dispatch of
tokens to the ranks of their experts (every rank sees every token: its hidden states are replicated).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.moe_ref import fused_moe_ref
from kernels.routing_ref import routing_weights_ref, topk_ids_ref
from runner.deterministic import kernel_forward
from runner.layers import Linear
from runner.model_config import ModelConfig
from runner.models.layout import CheckpointSlot, part
from runner.models.llama import MLP, DecoderForCausalLM, DecoderLayer, RMSNorm
from runner.parallel.layers import even_partition, is_expert_parallel, rank_and_size

if TYPE_CHECKING:
    from runner.attention import AttentionBackend, AttentionMetadata
    from runner.parallel.group import TPGroup


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """The sparse-block keys of config.json."""

    num_experts: int  # `num_experts` (published) or `num_local_experts` (transformers 5's Qwen3-MoE)
    top_k: int  # `num_experts_per_tok`
    moe_intermediate_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # indices of the layers with a sparse block
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, shared_expert: bool) -> "MoEConfig":
        raw, source = cfg.hf_config, f"config.json ({cfg.architecture})"

        def need(*keys: str) -> int:
            for key in keys:
                if raw.get(key) is not None:
                    return int(raw[key])
            raise ValueError(f"{source}: missing required field {keys[0]!r}")

        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
        num_experts, top_k = need("num_experts", "num_local_experts"), need("num_experts_per_tok")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{source}: num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        step = int(1 if raw.get("decoder_sparse_step") is None else raw["decoder_sparse_step"])
        if step < 1:
            raise ValueError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(cfg.num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(num_experts=num_experts, top_k=top_k, moe_intermediate_size=need("moe_intermediate_size"),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse,
                   shared_expert_intermediate_size=need("shared_expert_intermediate_size") if shared_expert else 0)


class FusedExperts(nn.Module):
    """Every expert's SiLU MLP, stacked: w13 [E, 2 * I_rank, H] (gate rows, then up rows, of the rank's part
    of the intermediate dimension), w2 [E, H, I_rank]. With expert parallelism, the rank's experts
    [expert_start, expert_start + E / P) whole: w13 [E / P, 2 * I, H], w2 [E / P, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup | None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.expert_parallel = is_expert_parallel(tp)
        if self.expert_parallel:
            self.expert_start, end = even_partition(num_experts, *rank_and_size(tp), "num_experts")
            local, inter = end - self.expert_start, intermediate
        else:
            self.expert_start, local = None, num_experts  # None: every expert here (fused_moe's default)
            start, end = even_partition(intermediate, *rank_and_size(tp), "moe_intermediate_size")
            inter = end - start
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))

    def checkpoint_layout(self, tp_rank: int, tp_size: int) -> dict[str, CheckpointSlot]:
        """{e}.gate_proj / up_proj [I, H]: the rank's rows, at expert e of w13 (gate then up);
        {e}.down_proj [H, I]: the rank's columns, at expert e of w2. With expert parallelism: the rank's
        experts whole (at e - expert_start), every other expert an empty part (shard (0, 0) along dim 0)."""
        shape = (self.intermediate, self.hidden)
        if self.expert_parallel:
            start, end = even_partition(self.num_experts, tp_rank, tp_size, "num_experts")
            layout: dict[str, CheckpointSlot] = {}
            for e in range(self.num_experts):
                mine = start <= e < end
                rows, index = (None, (e - start,)) if mine else ((0, 0), (0,))
                layout[f"{e}.gate_proj.weight"] = part("w13", shape, shard=rows, index=index, at=0)
                layout[f"{e}.up_proj.weight"] = part("w13", shape, shard=rows, index=index, at=self.intermediate)
                layout[f"{e}.down_proj.weight"] = part("w2", shape[::-1], shard=rows, index=index)
            return layout
        rows = even_partition(self.intermediate, tp_rank, tp_size, "moe_intermediate_size")
        n = rows[1] - rows[0]
        layout = {}
        for e in range(self.num_experts):
            layout[f"{e}.gate_proj.weight"] = part("w13", shape, shard=rows, index=(e,), at=0)
            layout[f"{e}.up_proj.weight"] = part("w13", shape, shard=rows, index=(e,), at=n)
            layout[f"{e}.down_proj.weight"] = part("w2", shape[::-1], dim=1, shard=rows, index=(e,))
        return layout


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ Qwen2-MoE's gated shared expert). x [..., H] -> [..., H]."""

    takes_metadata = True  # called as mlp(hidden, meta): the paged forward records its routing per KV slot
    decode_pairs = 16
    """Paged CUDA forwards (fast mode) of at most this many (token, choice) pairs run `forward_decode` (batch 1-2
    at top-8): it reads each token's experts on their own, so beyond a few tokens experts chosen by several
    tokens would be read repeatedly, where the aligned `kernels.moe.fused_moe` reads them once. 0 turns it off."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, moe_index: int, tp: TPGroup | None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.moe_index = moe_index  # this block's index among the sparse layers (the store's second dimension)
        self.gate = Linear(cfg.hidden_size, moe.num_experts)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, tp)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)
        self.tp = tp
        self.deterministic = False
        self.store: torch.Tensor | None = None  # [num_kv_slots + 1, num_moe_layers, top_k] int32 routing store
        self.replay: torch.Tensor | None = None  # [B, T', top_k] experts to use in the dense forward

    def set_deterministic(self, deterministic: bool) -> None:
        self.deterministic = deterministic

    def route(self, x: torch.Tensor, lead: tuple[int, ...], meta: AttentionMetadata | None = None):
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k]): the router's top-k, or the replayed
        experts (positions t < T' of each row) with their probabilities under this router. A paged forward
        with a routing store bound also records the ids at each token's KV slot."""
        logits = self.gate(x)  # [N, E] model dtype
        k, norm = self.top_k, self.norm_topk_prob
        record = meta is not None and self.store is not None
        if logits.is_cuda and (self.deterministic or not torch.is_grad_enabled()):
            from kernels.routing import route_topk

            kw = dict(store=self.store, slots=meta.slot_mapping, layer=self.moe_index) if record else {}
            if self.replay is None and not (torch.is_grad_enabled() and logits.requires_grad):
                return route_topk(logits, k, norm, **kw)  # the engine: one kernel
            with torch.no_grad():
                ids = self._with_replay(route_topk(logits, k, norm, **kw)[1], lead)
            weights = kernel_forward(lambda lg: route_topk(lg, k, norm, ids=ids)[0],
                                     lambda lg: routing_weights_ref(lg, ids, norm), logits)
            return weights, ids
        ids = self._with_replay(topk_ids_ref(logits, k), lead)
        if record:
            self.store[meta.slot_mapping, self.moe_index] = ids.to(torch.int32)  # padding (slot -1): the spare row
        return routing_weights_ref(logits, ids, norm), ids

    def _with_replay(self, ids: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """ids [N, k] with the replayed experts in place at positions t < T' of each row (dense forward)."""
        if self.replay is None:
            return ids
        ids = ids.view(*lead, self.top_k).clone()
        ids[:, : self.replay.shape[1]] = self.replay.to(ids.device, ids.dtype)
        return ids.view(-1, self.top_k)

    def takes_decode(self, hidden: torch.Tensor, meta: AttentionMetadata | None) -> bool:
        """Whether the post-attention norm of `hidden` [T, H] and this block run as `forward_decode`: a paged CUDA
        forward without autograd in fast mode, of at most `decode_pairs` (token, choice) pairs and at most
        `kernels.gemv.MAX_ROWS` tokens, with no shared expert and no LoRA hook on the router."""
        if not (meta is not None and hidden.is_cuda and hidden.dim() == 2 and not self.deterministic
                and not torch.is_grad_enabled() and self.replay is None and self.shared_expert is None
                and self.gate.lora is None and 0 < hidden.shape[0] * self.top_k <= self.decode_pairs):
            return False
        from kernels.gemv import MAX_ROWS

        return hidden.shape[0] <= MAX_ROWS

    def forward_decode(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm` of hidden + residual ([T, H] each), then this block -> (out [T, H], the residual sum [T, H]), in
        three launches: the norm inside the router's GEMV, then `kernels.moe_decode.moe_decode` (top-k, the
        norm again inside the experts' gate_up, down + combine; the routing store written as `route` does)."""
        from kernels.gemv import fused_gemv
        from kernels.moe_decode import moe_decode

        logits, summed = fused_gemv(hidden, self.gate.weight, self.gate.bias, prologue="rms_norm",
                                    norm_weight=norm.weight, residual=residual, eps=norm.eps)  # [T, E], [T, H]
        record = self.store is not None
        out, _, _ = moe_decode(summed, norm.weight, norm.eps, logits, self.experts.w13, self.experts.w2, self.top_k,
                               self.norm_topk_prob, expert_start=self.experts.expert_start,
                               store=self.store if record else None, slots=meta.slot_mapping if record else None,
                               layer=self.moe_index)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out, summed

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        lead = tuple(hidden.shape[:-1])
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = self.route(x, lead, meta)
        w13, w2, det = self.experts.w13, self.experts.w2, self.deterministic
        start = self.experts.expert_start  # expert parallelism: this rank's first expert; None: all here

        def reference(a, b, c, w):
            return fused_moe_ref(a, b, c, w, ids, deterministic=det, expert_start=start)

        if x.is_cuda and (det or not torch.is_grad_enabled()):
            from kernels.moe import fused_moe

            out = kernel_forward(lambda a, b, c, w: fused_moe(a, b, c, w, ids, deterministic=det, expert_start=start),
                                 reference, x, w13, w2, weights)
        else:
            out = reference(x, w13, w2, weights)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(hidden.shape)


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer with a sparse block: at a few tokens (`SparseMoeBlock.takes_decode`) the post-attention
    norm goes into the block's decode path."""

    def _norm_feed_forward(self, hidden, residual, meta):
        if self.mlp.takes_decode(hidden, meta):
            return self.mlp.forward_decode(hidden, residual, self.post_attention_layernorm, meta)
        return super()._norm_feed_forward(hidden, residual, meta)


class MoEForCausalLM(DecoderForCausalLM):
    """The decoder with sparse blocks in `MoEConfig.sparse_layers`; `shared_expert` is the class's flavour."""

    shared_expert = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, tp: TPGroup | None = None) -> None:
        self.moe = MoEConfig.from_model_config(cfg, self.shared_expert)
        super().__init__(cfg, backend, tp)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend | None, tp: TPGroup | None,
                   index: int) -> DecoderLayer:
        if index not in self.moe.sparse_layers:
            return DecoderLayer(cfg, backend, tp)
        return MoEDecoderLayer(cfg, backend, tp, SparseMoeBlock(cfg, self.moe, self.moe.sparse_layers.index(index), tp))

    @property
    def sparse_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    @property
    def routed_experts_shape(self) -> tuple[int, int]:
        """(num_moe_layers, top_k): the last two dimensions of the routing store and of routed_experts."""
        return len(self.moe.sparse_layers), self.moe.top_k

    def bind_routed_experts(self, store: torch.Tensor | None) -> None:
        """Give every sparse block the routing store [num_kv_slots + 1, num_moe_layers, top_k] int32 (the last
        row takes padding tokens' writes), or None to stop recording."""
        if store is not None:
            assert store.dtype == torch.int32 and tuple(store.shape[1:]) == self.routed_experts_shape, store.shape
        for block in self.sparse_blocks:
            block.store = store

    def forward_dense(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = (),
                      routed_experts: torch.Tensor | None = None):
        """`DecoderForCausalLM.forward_dense`; with routed_experts [B, T', num_moe_layers, top_k] (T' <= T,
        normally T - 1) positions t < T' use those experts, weighted by this forward's router."""
        with self._replaying(input_ids, routed_experts):
            return super().forward_dense(input_ids, aux_layers)

    @contextmanager
    def _replaying(self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None):
        if routed_experts is None:
            yield
            return
        b, t = input_ids.shape
        want = (b, "T' <= " + str(t), *self.routed_experts_shape)
        shape = tuple(routed_experts.shape)
        if (routed_experts.dim() != 4 or shape[0] != b or shape[1] > t or shape[2:] != self.routed_experts_shape
                or routed_experts.dtype.is_floating_point):
            raise ValueError(f"routed_experts must be an integer tensor of shape {want}, got {shape} "
                             f"{routed_experts.dtype}")
        if routed_experts.numel() and (int(routed_experts.min()) < 0 or int(routed_experts.max()) >= self.moe.num_experts):
            raise ValueError(f"routed_experts: expert ids must be in [0, {self.moe.num_experts})")
        blocks = self.sparse_blocks
        try:
            for j, block in enumerate(blocks):
                block.replay = routed_experts[:, :, j]
            yield
        finally:
            for block in blocks:
                block.replay = None


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: q/k norms, no qkv bias, no shared expert."""


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: qkv bias, a shared expert gated by sigmoid(shared_expert_gate)."""

    shared_expert = True
