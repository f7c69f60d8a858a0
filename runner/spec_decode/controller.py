"""Auto-off: per batch-size bucket, speculate only where it measurably raises tokens per second.

The engine asks `lookahead(batch_size)` before each step and reports the step with `record(...)`. A bucket
(running requests rounded down to a power of two) opens with a probe phase: `probe_steps` decode steps
with speculation and `probe_steps` without, alternating, so that whatever the machine is doing at the time
(clocks ramping, a busy host, a warm-up) lands on both modes alike. At the end of the phase the faster mode
is chosen, and it is kept until the next probe phase, every `reprobe_interval` steps (acceptance drifts
with the policy). Decisions come only from such side-by-side measurements: steps of the chosen mode in
between are not compared with the other mode's older ones. A mode's rate is the mean tokens per step over
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

    def __post_init__(self) -> None:
        self.tokens, self.seconds = deque(maxlen=self.window), deque(maxlen=self.window)

    def add(self, num_tokens: int, seconds: float) -> None:
        self.tokens.append(num_tokens)
        self.seconds.append(seconds)

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
    speculate: bool = True  # the choice of the last probe phase
    chosen_from: tuple[float, float] = (0.0, 0.0)  # tokens/s with and without speculation it was made from


class SpecController:
    def __init__(self, num_speculative_tokens: int, *, auto_off: bool = True, probe_steps: int = 8,
                 reprobe_interval: int = 512) -> None:
        self.k = num_speculative_tokens
        self.auto_off = auto_off
        """False: always speculate."""
        if probe_steps < 1 or reprobe_interval <= 2 * probe_steps:
            raise ValueError(f"need probe_steps >= 1 and reprobe_interval > 2 * probe_steps; got {probe_steps}, {reprobe_interval}")
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
        phase = b.num_steps % self.reprobe_interval
        if phase < 2 * self.probe_steps:  # probing: spec, plain, spec, ...
            return phase % 2 == 0
        return b.speculate

    def lookahead(self, batch_size: int) -> int:
        return self.k if self.speculating(batch_size) else 0

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """One pure decode step: tokens produced and wall time."""
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket(_Rate(self.probe_steps), _Rate(self.probe_steps)))
        (b.spec if speculated else b.plain).add(num_tokens, seconds)
        b.num_steps += 1
        if b.num_steps % self.reprobe_interval == 2 * self.probe_steps:  # a probe phase ended: choose
            b.chosen_from = (b.spec.tokens_per_s, b.plain.tokens_per_s)
            b.speculate = b.chosen_from[0] >= b.chosen_from[1]

    def stats(self) -> dict:
        """Per bucket: whether it speculates now, and the tokens/s with and without speculation measured side
        by side in the last completed probe phase (0 before the first one ends)."""
        return {
            bucket: {
                "speculating": self.speculating(bucket),
                "tokens_per_s_spec": round(b.chosen_from[0], 2),
                "tokens_per_s_plain": round(b.chosen_from[1], 2),
                "num_steps": b.num_steps,
            }
            for bucket, b in sorted(self.buckets.items())
        }
