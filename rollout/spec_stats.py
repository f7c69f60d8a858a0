"""Speculative-decoding statistics: per-request counters, the engine's totals, and what auto-off measures.

Counters are plain dicts (`new_spec_stats`), so they copy into outputs as they are: drafts proposed and
accepted, verification steps, and a histogram of accepted drafts per step. `SpecDecodeTotals` adds each
step to the engine's totals and gives the auto-off controller (runner/spec_decode/controller.py) the
tokens and time of each pure decode step. Not here: drafting or verifying (runner/spec_decode/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.messages import RunnerOutput, SchedulerOutput
    from runner.spec_decode.controller import SpecController


def new_spec_stats(num_speculative_tokens: int) -> dict:
    """Empty speculative-decoding counters (per request, and the engine's totals).

    num_draft_tokens / num_accepted_tokens: drafts proposed / accepted; num_spec_steps: verification steps
    (steps with at least one draft); acceptance_histogram[a]: steps that accepted a drafts (each step adds
    a + 1 tokens, the last one resampled or a bonus).
    """
    return {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_spec_steps": 0,
            "acceptance_histogram": [0] * (num_speculative_tokens + 1)}


def spec_stats_summary(stats: dict) -> dict:
    """A copy of the counters plus mean_acceptance_length: tokens added per verification step (1 + accepted)."""
    out = {**stats, "acceptance_histogram": list(stats["acceptance_histogram"])}
    steps = stats["num_spec_steps"]
    out["mean_acceptance_length"] = 1.0 + stats["num_accepted_tokens"] / steps if steps else 0.0
    return out


def record_spec_step(stats: dict, num_drafts: int, num_accepted: int) -> None:
    """Add one verification step to counters made by `new_spec_stats`."""
    stats["num_draft_tokens"] += num_drafts
    stats["num_accepted_tokens"] += num_accepted
    stats["num_spec_steps"] += 1
    hist = stats["acceptance_histogram"]
    hist.extend([0] * (num_accepted + 1 - len(hist)))
    hist[num_accepted] += 1


class SpecDecodeTotals:
    """The engine's counters over every speculative step, fed once per step."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.stats = new_spec_stats(num_speculative_tokens)

    def record_step(self, controller: "SpecController", batch_size: int, speculated: bool, sched: "SchedulerOutput",
                    out: "RunnerOutput", seconds: float) -> None:
        """Count the step's verifications; give the controller the rate of a pure decode step."""
        drafts = out.num_draft_tokens or [0] * len(out.req_ids)
        for d, tokens in zip(drafts, out.sampled_token_ids):
            if d > 0:
                record_spec_step(self.stats, d, len(tokens) - 1)
        if len(out.req_ids) == len(sched.num_scheduled_tokens) and sched.total_num_scheduled_tokens == len(drafts) + sum(drafts):
            num_tokens = sum(len(t) for t in out.sampled_token_ids)  # a pure decode step
            controller.record(batch_size, speculated, num_tokens, seconds)

    def summary(self, controller: "SpecController") -> dict:
        return {**spec_stats_summary(self.stats), "auto_off": controller.stats()}
