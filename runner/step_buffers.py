"""Persistent step inputs: one pinned host staging area and one device area per dtype.

Every field (input ids, positions, KV slots, query offsets, sampling parameters, block tables) is a fixed
view into one of three packed tensors, on the host and on the device. A step fills the host views, then
`upload()` moves each pack with a single non-blocking copy — three copies per step, whatever the batch.
The device views never move, so a captured CUDA graph keeps reading the right memory. On the CPU the
host and device packs are the same tensors and `upload()` does nothing.
"""

from __future__ import annotations

import numpy as np
import torch

_INT_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices",
               "top_k", "seeds", "sample_positions", "sample_slots", "pending_index", "pending_slots")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


class _Views:
    """Named views into packed tensors."""


class StepBuffers:
    """Device views (attributes) and host numpy views (`.host`) of every per-step field.

    input_ids, positions, slot_mapping: [max_tokens] int64
    query_start_loc: [max_num_seqs + 1] int64; seq_lens, logits_indices: [max_num_seqs] int64
    top_k, seeds, sample_positions: [max_num_seqs] int64; temperature, top_p, min_p: [max_num_seqs] f32
    sample_slots: [max_num_seqs] int64, slot of each sampling row (where its token is kept on the device)
    pending_index, pending_slots: [max_tokens] int64, input tokens still in flight and the slots that hold them
    block_tables: [max_num_seqs, max_blocks] int32
    """

    def __init__(self, max_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "query_start_loc": max_num_seqs + 1, "pending_index": max_tokens, "pending_slots": max_tokens}
        int_sizes = [sizes.get(f, max_num_seqs) for f in _INT_FIELDS]
        pin = device.type == "cuda"

        def pack(numel: int, dtype: torch.dtype, shape=None):
            host = torch.zeros(numel, dtype=dtype, pin_memory=pin)
            dev = host if device.type == "cpu" else torch.zeros(numel, dtype=dtype, device=device)
            return (host, dev) if shape is None else (host.view(shape), dev.view(shape))

        self._int = pack(sum(int_sizes), torch.int64)
        self._float = pack(len(_FLOAT_FIELDS) * max_num_seqs, torch.float32)
        self._blocks = pack(max_num_seqs * max_blocks, torch.int32, (max_num_seqs, max_blocks))
        self.host = _Views()
        offset = 0
        for name, n in zip(_INT_FIELDS, int_sizes):
            setattr(self, name, self._int[1][offset : offset + n])
            setattr(self.host, name, self._int[0][offset : offset + n].numpy())
            offset += n
        for i, name in enumerate(_FLOAT_FIELDS):
            setattr(self, name, self._float[1][i * max_num_seqs : (i + 1) * max_num_seqs])
            setattr(self.host, name, self._float[0][i * max_num_seqs : (i + 1) * max_num_seqs].numpy())
        self.block_tables = self._blocks[1]
        self.host.block_tables = self._blocks[0].numpy()

    def upload(self, num_block_rows: int) -> None:
        """Copy the host packs to the device (block tables: the first `num_block_rows` rows)."""
        if self.device.type == "cpu":
            return
        for host, dev in (self._int, self._float):
            dev.copy_(host, non_blocking=True)
        if num_block_rows:
            self._blocks[1][:num_block_rows].copy_(self._blocks[0][:num_block_rows], non_blocking=True)

    def pad_sampling(self, start: int, end: int) -> None:
        """Host staging of rows [start, end): the sampling parameters of padding rows (temperature 1, no
        truncation, seed 0, output position 0), whose samples are dropped."""
        h = self.host
        h.temperature[start:end] = 1.0
        h.top_k[start:end] = 0
        h.top_p[start:end] = 1.0
        h.min_p[start:end] = 0.0
        h.seeds[start:end] = 0
        h.sample_positions[start:end] = 0

    @staticmethod
    def put(dst: np.ndarray, src: np.ndarray) -> None:
        dst[: src.shape[0]] = src
