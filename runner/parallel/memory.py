"""Peak memory allocated while a region of code runs, measured (not computed from shapes).

CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`) above the allocation at entry. CPU: the
torch profiler's allocation events (profile_memory=True), summed in time order; the peak of that running
sum is the most bytes the region held at once beyond what it started with. Not here: host memory that
torch did not allocate.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class PeakMemory:
    """Result holder: `nbytes` is set when the `measure_peak` block exits."""

    nbytes: int = 0


@contextmanager
def measure_peak(device: torch.device):
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.nbytes = torch.cuda.max_memory_allocated(device) - base
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    result.nbytes = peak


class SamplerPeak:
    """Wraps a sampler; `peak_bytes` is the largest allocation peak of any one call, measured."""

    def __init__(self, sampler, device: torch.device) -> None:
        self.sampler, self.device, self.peak_bytes = sampler, device, 0

    def __call__(self, *args, **kwargs):
        with measure_peak(self.device) as peak:
            out = self.sampler(*args, **kwargs)
        self.peak_bytes = max(self.peak_bytes, peak.nbytes)
        return out
