"""The interface a model class offers the runner, the loader, weight updates and the trainer.

`CausalLM` is what `ModelRegistry.register_model` accepts (it checks that the methods exist). The model is
an `nn.Module` built on the meta device by `runner.loader.load_model` as `cls(cfg, backend, tp)`, then
allocated, filled through its `checkpoint_layout` and switched by `set_deterministic`. Speculative
decoding's drafters also read the target's token embedding as `model.model.embed_tokens` (EAGLE / MTP
heads share it). Optional: `set_gemv_rows(rows)`, called by the runner on CUDA outside deterministic mode with
`EngineConfig.fused_gemv_rows` (paged forwards of at most that many tokens may take fused small-batch kernels).
Not here: any implementation (runner/models/llama.py is the built-in one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runner.attention import AttentionBackend, AttentionMetadata
    from runner.model_config import ModelConfig
    from runner.models.layout import CheckpointSlot
    from runner.parallel.group import TPGroup


class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache (an `nn.Module`)."""

    config: ModelConfig  # the parsed config.json; `config.hf_config` is the raw dict, for the class's own keys
    deterministic: bool  # set by set_deterministic; the trainer reads it
    num_kv_heads: int  # this rank's KV heads: the KV cache of each of config.num_layers layers is
    #                    [num_blocks, block_size, num_kv_heads, config.head_dim]

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None, tp: TPGroup | None) -> None:
        """Build the layers (on the meta device when loading). `backend` is None for the trainer's dense
        forward; with `tp` the model is rank `tp.rank`'s shard."""

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        """Fill buffers outside the checkpoint (rotary tables) for positions < max_position."""

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        """Give each layer its (k_cache, v_cache) pair (None, None when the cache is released)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden], reading and writing the cache. The runner
        passes `embeds` (index [E] int64, rows [E, hidden] in the model dtype) only in steps with embedding-prompt
        tokens: tokens `index` take `rows` as their input embeddings instead of their token's."""

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` plus the residual stream after each layer in `aux_layers` [T, len(aux_layers) * hidden]
        (None when empty), for drafters."""

    def forward_dense(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """Training forward without a cache: input_ids [B, T] -> hidden [B, T, hidden] (with `aux_layers`:
        (hidden, aux [B, T, len(aux_layers) * hidden])); rows causal and independent."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype (under TP the rank's [N, vocab / P])."""

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab (/ P), hidden] (the embedding's when tied)."""

    def checkpoint_layout(self, tp_rank: int | None = None, tp_size: int | None = None) -> dict[str, CheckpointSlot]:
        """Every checkpoint name -> its `CheckpointSlot` for rank `tp_rank` of `tp_size` (default: this model's
        own rank, or 0 of 1), composed from the layers' declarations (runner/models/layout.py)."""

    def set_deterministic(self, deterministic: bool) -> None:
        """Batch-invariant kernels on (True) or off in every layer (`runner.deterministic.set_deterministic_all`)."""


REQUIRED_METHODS = ("init_rotary", "bind_kv_cache", "forward", "forward_with_aux", "forward_dense", "compute_logits",
                    "lm_head_weight", "checkpoint_layout", "set_deterministic")
