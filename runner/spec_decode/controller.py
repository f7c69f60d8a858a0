"""Auto-off: per batch-size bucket, speculate only where it measurably raises tokens per second.

The engine asks `lookahead(batch_size)` before each step and reports the step with `record(...)`. A bucket
(running requests rounded down to a power of two) first measures `probe_steps` decode steps with
speculation and `probe_steps` without, alternating the two so that a drift of the machine (clocks ramping
up, a warm-up) lands on both; then it uses the faster mode. Every `reprobe_interval` steps it measures the
losing mode again, since acceptance drifts with the policy. A mode's rate is the mean tokens per step over
its last `probe_steps` steps divided by their median step time, so one slow step (a collector pause, a
page fault) does not decide. Only pure decode steps are measured (prefill chunks would distort the rates).
Pure Python, no tensors.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Rate:
    window: int
    tokens: deque = field(init=False)  # tokens produced by each of the last `window` steps
    seconds: deque = field(init=False)  # wall time of each of those steps
    num_steps: int = 0

    def __post_init__(self) -> None:
        self.tokens, self.seconds = deque(maxlen=self.window), deque(maxlen=self.window)

    def add(self, num_tokens: int, seconds: float) -> None:
        self.tokens.append(num_tokens)
        self.seconds.append(seconds)
        self.num_steps += 1

    @property
    def tokens_per_s(self) -> float:
        if not self.seconds:
            return 0.0
        step = statistics.median(self.seconds)
        return statistics.fmean(self.tokens) / step if step > 0 else 0.0


@dataclass(slots=True)
class _Bucket:
    spec: _Rate
    plain: _Rate
    num_steps: int = 0


class SpecController:
    def __init__(self, num_speculative_tokens: int, *, auto_off: bool = True, probe_steps: int = 8,
                 reprobe_interval: int = 512) -> None:
        self.k = num_speculative_tokens
        self.auto_off = auto_off
        """False: always speculate."""
        self.probe_steps = probe_steps
        self.reprobe_interval = reprobe_interval
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(batch_size, 1).bit_length() - 1

    def speculating(self, batch_size: int) -> bool:
        """Whether the next step at this batch size speculates."""
        if not self.auto_off:
            return True
        b = self.buckets.get(self.bucket_of(batch_size))
        if b is None:
            return True
        if min(b.spec.num_steps, b.plain.num_steps) < self.probe_steps:  # probing: alternate, spec first
            return b.spec.num_steps <= b.plain.num_steps
        better_spec = b.spec.tokens_per_s >= b.plain.tokens_per_s
        # re-measure the losing mode for probe_steps steps every reprobe_interval steps
        if b.num_steps % self.reprobe_interval < self.probe_steps:
            return not better_spec
        return better_spec

    def lookahead(self, batch_size: int) -> int:
        return self.k if self.speculating(batch_size) else 0

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """One pure decode step: tokens produced and wall time."""
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket(_Rate(self.probe_steps), _Rate(self.probe_steps)))
        b.num_steps += 1
        (b.spec if speculated else b.plain).add(num_tokens, seconds)

    def stats(self) -> dict:
        """Per bucket: measured tokens/s with and without speculation and whether it speculates now."""
        return {
            bucket: {
                "speculating": self.speculating(bucket),
                "tokens_per_s_spec": round(b.spec.tokens_per_s, 2),
                "tokens_per_s_plain": round(b.plain.tokens_per_s, 2),
                "num_steps": b.num_steps,
            }
            for bucket, b in sorted(self.buckets.items())
        }
