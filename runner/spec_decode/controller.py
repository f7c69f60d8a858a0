"""Auto-off: per batch-size bucket, speculate only where it measurably raises tokens per second.

The engine asks `lookahead(batch_size)` before each step and reports the step with `record(...)`. A bucket
(running requests rounded down to a power of two) first measures `probe_steps` decode steps with
speculation and `probe_steps` without, then uses the faster mode; every `reprobe_interval` steps it
measures the other mode again, since acceptance drifts with the policy. Only pure decode steps are
measured (prefill chunks would distort the rates). Pure Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Rate:
    num_tokens: float = 0.0
    seconds: float = 0.0
    num_steps: int = 0

    def add(self, num_tokens: int, seconds: float, decay: float) -> None:
        self.num_tokens = self.num_tokens * decay + num_tokens
        self.seconds = self.seconds * decay + seconds
        self.num_steps += 1

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Bucket:
    spec: _Rate
    plain: _Rate
    num_steps: int = 0


class SpecController:
    def __init__(self, num_speculative_tokens: int, *, auto_off: bool = True, probe_steps: int = 8,
                 reprobe_interval: int = 512, decay: float = 0.9) -> None:
        self.k = num_speculative_tokens
        self.auto_off = auto_off
        """False: always speculate."""
        self.probe_steps = probe_steps
        self.reprobe_interval = reprobe_interval
        self.decay = decay
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return 1 << max(batch_size, 1).bit_length() - 1

    def speculating(self, batch_size: int) -> bool:
        """Whether the next step at this batch size speculates."""
        if not self.auto_off:
            return True
        b = self.buckets.get(self.bucket_of(batch_size))
        if b is None or b.spec.num_steps < self.probe_steps:
            return True
        if b.plain.num_steps < self.probe_steps:
            return False
        better_spec = b.spec.tokens_per_s >= b.plain.tokens_per_s
        # re-measure the losing mode for probe_steps steps every reprobe_interval steps
        if b.num_steps % self.reprobe_interval < self.probe_steps:
            return not better_spec
        return better_spec

    def lookahead(self, batch_size: int) -> int:
        return self.k if self.speculating(batch_size) else 0

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """One pure decode step: tokens produced and wall time."""
        b = self.buckets.setdefault(self.bucket_of(batch_size), _Bucket(_Rate(), _Rate()))
        b.num_steps += 1
        (b.spec if speculated else b.plain).add(num_tokens, seconds, self.decay)

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
