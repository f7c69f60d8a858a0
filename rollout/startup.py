"""Start-up phase timing: how long each phase of building an engine took, logged once and kept on the engine
(`Engine.startup_times`). Not here: the phases themselves (rollout/engine.py, runner/model_runner.py,
runner/cuda_graph.py)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Seconds of consecutive phases: `mark(name)` ends phase `name`, which began at the previous mark (or when
    the timer was made); `done()` ends the last phase ("other"), adds "total", logs the phases and returns them."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}  # phase -> seconds, in the order the phases ran

    def mark(self, name: str, **inner: float) -> None:
        """End phase `name`. `inner` are sub-phases timed inside it (name -> seconds): reported on their own,
        before it, and not counted in it."""
        now = time.perf_counter()
        assert name not in self.seconds and not inner.keys() & self.seconds.keys(), (name, inner)
        self.seconds.update(inner)
        self.seconds[name] = max(0.0, now - self._last - sum(inner.values()))
        self._last = now

    def done(self) -> dict[str, float]:
        """The phases, "other" (since the last mark) and "total" (their sum: since the timer was made)."""
        self.mark("other")
        self.seconds["total"] = self._last - self._start
        logger.info("start-up %.2f s: %s", self.seconds["total"],
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items() if k != "total"))
        return dict(self.seconds)
