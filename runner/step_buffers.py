"""Persistent step inputs: one pinned host staging area and one device area per dtype.

Every field (input ids, positions, KV slots, query offsets, sampling parameters, block tables) is a fixed
view into one of three packed tensors, on the host and on the device. A step fills the host views, then
`upload()` moves each pack with a single non-blocking copy — three copies per step, whatever the batch.
The device views never move, so a captured CUDA graph keeps reading the right memory. On the CPU the
host and device packs are the same tensors and `upload()` does nothing.

The sampling fields are those of `runner.sampling_tensors.SamplingTensors` (their dtypes and padding
values are declared there, not here); `sampling(R)` hands them out as that struct for the first R rows.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.sampling_tensors import SamplingTensors

_INT_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices",
               "sample_slots", "pending_index", "pending_slots")
_SAMPLING_FIELDS = SamplingTensors.row_fields()  # (name, dtype, pad), [max_num_seqs] each
_PACK_DTYPES = (torch.int64, torch.float32)


class _Views:
    """Named views into packed tensors."""


class StepBuffers:
    """Device views (attributes) and host numpy views (`.host`) of every per-step field.

    input_ids, positions, slot_mapping: [max_tokens] int64
    query_start_loc: [max_num_seqs + 1] int64; seq_lens, logits_indices: [max_num_seqs] int64
    sample_slots: [max_num_seqs] int64, slot of each sampling row (where its token is kept on the device)
    pending_index, pending_slots: [max_tokens] int64, input tokens still in flight and the slots that hold them
    block_tables: [max_num_seqs, max_blocks] int32
    sampling parameters: [max_num_seqs] each, one per `SamplingTensors` per-row field; on the device through
    `sampling(R)`, on the host as `host.sampling.<field>`
    lora_idx: [max_tokens] int64, each token's LoRA adapter slot (-1: none); only with `lora=True`
    """

    def __init__(self, max_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device,
                 lora: bool = False) -> None:
        self.device = device
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "query_start_loc": max_num_seqs + 1, "pending_index": max_tokens, "pending_slots": max_tokens,
                 "lora_idx": max_tokens}
        for name, dtype, _ in _SAMPLING_FIELDS:
            assert dtype in _PACK_DTYPES, f"sampling field {name}: StepBuffers packs only {_PACK_DTYPES}, not {dtype}"
        int_fields = _INT_FIELDS + (("lora_idx",) if lora else ())
        # (name, numel, is a sampling field) per pack: the int64 pack, then the float32 pack
        layout = {torch.int64: [(f, sizes.get(f, max_num_seqs), False) for f in int_fields], torch.float32: []}
        for name, dtype, _ in _SAMPLING_FIELDS:
            layout[dtype].append((name, max_num_seqs, True))
        pin = device.type == "cuda"

        def pack(numel: int, dtype: torch.dtype, shape=None):
            host = torch.zeros(numel, dtype=dtype, pin_memory=pin)
            dev = host if device.type == "cpu" else torch.zeros(numel, dtype=dtype, device=device)
            return (host, dev) if shape is None else (host.view(shape), dev.view(shape))

        self._int, self._float = (pack(sum(n for _, n, _ in layout[d]), d) for d in _PACK_DTYPES)
        self._blocks = pack(max_num_seqs * max_blocks, torch.int32, (max_num_seqs, max_blocks))
        self.host = _Views()
        self.host.sampling = _Views()
        self._sampling: dict[str, torch.Tensor] = {}  # sampling field -> [max_num_seqs] device view
        for dtype, (host_pack, dev_pack) in zip(_PACK_DTYPES, (self._int, self._float)):
            offset = 0
            for name, n, is_sampling in layout[dtype]:
                dev, host = dev_pack[offset : offset + n], host_pack[offset : offset + n].numpy()
                if is_sampling:
                    self._sampling[name] = dev
                    setattr(self.host.sampling, name, host)
                else:
                    setattr(self, name, dev)
                    setattr(self.host, name, host)
                offset += n
        self.block_tables = self._blocks[1]
        self.host.block_tables = self._blocks[0].numpy()

    def sampling(self, num_rows: int, uses: tuple[bool, bool, bool] | None = None,
                 num_top_logprobs: int = 0) -> SamplingTensors:
        """The sampling tensors of the first `num_rows` rows: views of the persistent device buffers (a
        graph that captures a sampler over them reads each step's uploaded values)."""
        return SamplingTensors(**{name: view[:num_rows] for name, view in self._sampling.items()}, uses=uses,
                               num_top_logprobs=num_top_logprobs)

    def upload(self, num_block_rows: int) -> None:
        """Copy the host packs to the device (block tables: the first `num_block_rows` rows)."""
        if self.device.type == "cpu":
            return
        for host, dev in (self._int, self._float):
            dev.copy_(host, non_blocking=True)
        if num_block_rows:
            self._blocks[1][:num_block_rows].copy_(self._blocks[0][:num_block_rows], non_blocking=True)

    def pad_sampling(self, start: int, end: int) -> None:
        """Host staging of rows [start, end): the sampling parameters of padding rows (each field's pad
        value: temperature 1, no truncation, seed 0, output position 0), whose samples are dropped."""
        for name, _, pad in _SAMPLING_FIELDS:
            getattr(self.host.sampling, name)[start:end] = pad

    @staticmethod
    def put(dst: np.ndarray, src: np.ndarray) -> None:
        dst[: src.shape[0]] = src
