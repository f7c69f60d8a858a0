"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a small-batch decode step.

A batch-1 decode step is a chain of a few hundred short kernels, each bound by reading its weights: between
two of them the GPU drains the first kernel's last programs, flushes its writes, then launches and ramps up the
next. A kernel launched with `launch_pdl=True` is launched as soon as every program of the kernel before it
has exited, and waits in `pdl_wait` on the device until that kernel's writes are visible, so its launch
overlaps the flush instead of following it.

The rule every kernel here follows, which keeps the chain correct whatever launches around it: each program
of a kernel launched with PDL calls `pdl_wait` first, before any access to memory, so it finishes only after
the kernel before it did and a later kernel's wait covers every earlier one. None of them signals its
dependents early (`gdc_launch_dependents` at a kernel's start measured 19% slower at the 8B shape: dependents
launched early hold the SMs the multi-wave projections still need). Kernels of other libraries (cuBLAS,
torch) launch as usual and wait for the whole kernel before them.

`set_programmatic_launch` switches it for the process (the model runner does, from
`EngineConfig.programmatic_launch`); `use_pdl(t)` says whether a launch for a tensor on `t`'s device takes
it: only CUDA devices of compute capability 9.0 or more, never the interpreter. PDL changes when kernels
start, never their arithmetic. CUDA graphs capture the launches' programmatic edges, so replays keep it.
Not here: the kernels of the MoE, LoRA and speculative paths, which launch as usual.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_enabled = False


def set_programmatic_launch(enabled: bool) -> bool:
    """Turn PDL on or off for the kernels here; on takes effect only where the current CUDA device supports
    it (compute capability >= 9.0, a compiled Triton backend). Returns whether it is on."""
    global _enabled
    _enabled = bool(enabled) and _supported()
    return _enabled


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a launch over `t`'s device takes PDL (the switch is on and `t` is on CUDA)."""
    return _enabled and t.is_cuda


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0) and hasattr(tl.extra.cuda, "gdc_wait")


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
