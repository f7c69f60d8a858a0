"""Sleep and wake: the engine gives its device memory to a trainer that shares the device between batches.

    sleep(1)                    every rank frees its KV cache and CUDA graphs; weight updates still apply
    sleep(2)                    ... and moves its weights to host memory (pinned on CUDA)
    wake_up(["weights"])        weights back on the device, bitwise as they were or as updated meanwhile
    wake_up(["kv_cache"])       every rank allocates its cache again, then every rank captures its graphs

`SleepState` keeps which parts are freed and refuses what needs them (`check_awake`); the work itself is
runner methods run on every rank through `collective_rpc`. Out of memory on any rank leaves the part
asleep on every rank (a cache allocated on the others is freed again), so a retry starts clean. Not here:
what is freed (runner/model_runner.py `sleep`, `wake_weights`, `wake_kv_cache`, `recapture_graphs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

PARTS = ("weights", "kv_cache")


class SleepState:
    def __init__(self, collective_rpc: Callable[..., list], on_kv_freed: Callable[[], None]) -> None:
        self._rpc = collective_rpc
        self._on_kv_freed = on_kv_freed  # the engine empties its prefix cache: the blocks' contents are gone
        self.asleep: set[str] = set()  # "kv_cache" / "weights" while freed

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache and graphs) or 2 (also the weights), got {level!r}")
        freeing = {"kv_cache"} | ({"weights"} if level == 2 else set())
        if freeing <= self.asleep:
            return
        if "kv_cache" in self.asleep:  # asleep at level 1: deepening the sleep in place is not offered
            raise ValueError("already asleep at level 1; wake_up() before sleeping at level 2")
        self._rpc("sleep", level == 2)
        self._on_kv_freed()
        self.asleep = freeing
        logger.info("asleep at level %d: freed %s", level, " and ".join(sorted(freeing)))

    def wake_up(self, tags: Sequence[str] | None) -> None:
        wanted = set(PARTS) if tags is None else set(tags)
        unknown = wanted - set(PARTS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        if "weights" in wanted and "weights" in self.asleep:
            self._wake("weights", ["wake_weights"])
        if "kv_cache" in wanted and "kv_cache" in self.asleep:
            if "weights" in self.asleep:
                raise ValueError("wake_up(['kv_cache']) needs the weights on the device: wake 'weights' first")
            # every rank allocates before any captures graphs (a capture runs collectives)
            self._wake("kv_cache", ["wake_kv_cache", "recapture_graphs"])

    def check_awake(self, what: str, part: str = "kv_cache") -> None:
        """ValueError naming `what` if `part` is freed."""
        if part in self.asleep:
            freed = "KV cache is" if part == "kv_cache" else "weights are"
            raise ValueError(f"{what} while the engine sleeps (its {freed} freed): call wake_up() first")

    def _wake(self, part: str, calls: list[str]) -> None:
        """Run one part's wake on every rank; out of device memory on any rank, the part stays asleep on every
        rank (parameters already moved stay valid) and a ValueError says so: free memory, then retry."""
        import torch

        try:
            for method in calls:
                self._rpc(method)
        except torch.OutOfMemoryError as e:
            if part == "kv_cache":
                self._rpc("free_kv_cache")
            what = "KV cache" if part == "kv_cache" else "weights"
            raise ValueError(f"wake_up: not enough device memory for the {what} ({e}); the engine still sleeps: "
                             "free memory (the trainer's) and call wake_up again") from None
        self.asleep.discard(part)
