"""The per-row sampling parameters every sampler takes, as one struct.

`SamplingTensors` holds one tensor per per-row sampling parameter (`[R]` each, row r = the r-th row that
samples) and the few facts about those rows that the caller knows on the host (which truncations any row
uses, how many top logprobs any row wants), so that a sampler never has to read them from the device.
The plain and graph-captured samplers (`runner/sampler.py`, `runner/cuda_graph.py`), speculative draft
sampling and verification (`runner/spec_decode/rejection.py`) and batch-sharded sampling under tensor
parallelism (`runner/parallel/sampling.py`) all take it; the Triton launchers of `kernels/` keep their
typed tensor arguments and get them unpacked at the call.

Each per-row field declares its dtype and its padding value (the value of a row whose sample is dropped:
temperature 1, no truncation, seed 0, position 0) next to it. `runner/step_buffers.py` allocates its
persistent staging for exactly these fields and pads with these values, so adding a per-row field is: the
field here, with its pad value, and the line of `ModelRunner._stage` that fills it from the InputBatch.

Slicing (`s[:R]`, `s[rows]`) applies to every per-row tensor at once; a slice is a view, so a struct made
of the persistent step buffers' views reads the same memory on every step (what a CUDA graph captures).
Not here: how the values are computed (InputBatch, `kernels/sampling_ref.py` for what they mean).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

NO_TRUNCATION = (False, False, False)
"""`SamplingTensors.uses` of rows none of which uses top-k, top-p or min-p."""


def _row(dtype: torch.dtype, pad) -> dataclasses.Field:
    """A per-row tensor field of dtype `dtype` whose padding rows hold `pad`."""
    return field(metadata={"dtype": dtype, "pad": pad})


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingTensors:
    """Per-row sampling parameters of R rows, on the logits' device, and what the host knows about them."""

    temperature: torch.Tensor = _row(torch.float32, 1.0)
    """[R] f32; <= 0 marks greedy rows."""
    top_k: torch.Tensor = _row(torch.int64, 0)
    """[R] int64; 0 (or >= vocab size) keeps every token."""
    top_p: torch.Tensor = _row(torch.float32, 1.0)
    """[R] f32 in (0, 1]; 1 keeps every token."""
    min_p: torch.Tensor = _row(torch.float32, 0.0)
    """[R] f32 in [0, 1]; 0 keeps every token."""
    seeds: torch.Tensor = _row(torch.int64, 0)
    """[R] int64 holding uint32 values: each row's noise seed."""
    positions: torch.Tensor = _row(torch.int64, 0)
    """[R] int64: output position of the token each row samples (0 = the first generated token)."""
    uses: tuple[bool, bool, bool] | None = None
    """Whether any row uses (top-k, top-p, min-p), as the host knows it; None: not known (a sampler then
    takes the path that handles every row, or reads the tensors). A subset of the rows (`s[rows]`) keeps
    the value of the whole (it may claim a truncation no row of the subset uses: still correct, maybe
    slower); give a subset its own with `replace(uses=...)`."""
    num_top_logprobs: int = 0
    """Top (token id, logprob) pairs to return per row: the most any row asks for; 0 returns none."""

    @classmethod
    def row_fields(cls) -> tuple[tuple[str, torch.dtype, float | int], ...]:
        """(name, dtype, padding value) of every per-row tensor field, in declaration order."""
        return _ROW_FIELDS

    @property
    def truncates(self) -> bool:
        """Whether any row may use top-k, top-p or min-p (True when not known)."""
        return self.uses != NO_TRUNCATION

    def __getitem__(self, rows) -> "SamplingTensors":
        """The struct of rows `rows` (a slice: views; an index tensor: new tensors); host facts kept."""
        return dataclasses.replace(self, **{name: getattr(self, name)[rows] for name, _, _ in _ROW_FIELDS})

    def replace(self, **changes) -> "SamplingTensors":
        """A copy with some fields changed (e.g. the host facts of a subset: `s[rows].replace(uses=...)`)."""
        return dataclasses.replace(self, **changes)

    def padded(self, num_pad: int) -> "SamplingTensors":
        """The rows followed by `num_pad` padding rows (each field's pad value); self when num_pad is 0.
        Padding rows use no truncation, so the host facts stay as they are."""
        if not num_pad:
            return self
        return dataclasses.replace(self, **{
            name: torch.cat([getattr(self, name), getattr(self, name).new_full((num_pad,), pad)])
            for name, _, pad in _ROW_FIELDS
        })


_ROW_FIELDS = tuple(
    (f.name, f.metadata["dtype"], f.metadata["pad"]) for f in dataclasses.fields(SamplingTensors) if "pad" in f.metadata
)
