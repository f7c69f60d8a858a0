"""The token-budget scheduler.

There are no prefill and decode phases. Every request has `num_computed_tokens`, which chases
`num_tokens` (prompt + output so far); each step gives requests a number of tokens to compute so that,
in total, at most `max_num_batched_tokens` run. A request whose computed count reaches its token count
this step gets one token sampled. Prefill, chunked prefill, prefix-cache hits, preemption by recompute
and multi-token (speculative) steps all follow from that rule.

Order: running requests first, oldest first, one step each; if the KV cache cannot hold a running
request's new tokens, the newest running request is preempted (its blocks are freed and it is re-queued
at the front, to be recomputed later) until it fits — never an error, never a deadlock, as long as one
request fits in the cache alone (checked when a request is added). Then waiting requests are admitted,
first come first served, while budget, slots and blocks last; a sample of an n>1 prompt waits while a
sibling is still computing the prompt, so the n samples share the prompt's blocks, and any request waits
while another running request computes the prompt block it would compute next (the same prompt sent as
separate requests).

Cost: adding, scheduling and aborting the n samples of a prompt is O(n) overall, never a scan of the group
per sample: the group counts its running members (`RequestGroup.num_running`), the waiting queue is an
insertion-ordered dict (O(1) removal of an aborted sample anywhere in it), and an abort rebuilds the
running list once per call.

Speculation: a decoding request (one uncomputed token) of a speculating request gets up to
`num_lookahead_tokens` extra slots (and their blocks) for draft tokens; the runner says how many it
drafted (`RunnerOutput.num_draft_tokens`) and `update` rolls the computed count back past the rejected
ones. Their blocks stay with the request and are overwritten by later steps.

Input and output are the step messages of `runner.messages`: new requests travel to the runner in full,
running ones as columns of diffs, and finished or preempted ids tell the runner to free slots. Pure
Python; testable with no model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rollout.kv_cache_manager import KVCacheManager
from rollout.request import Request, RequestStatus
from rollout.spec_stats import record_spec_step
from runner.messages import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0  # requests preempted (each recomputes from scratch)
    num_steps: int = 0  # schedule() calls


class Scheduler:
    def __init__(
        self,
        *,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # first come first served; an ordered dict (values unused) so that any request leaves it in O(1)
        self.waiting: OrderedDict[Request, None] = OrderedDict()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.policy_version = 0
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self._in_runner: set[str] = set()
        self.num_lookahead_tokens = 0  # draft slots per decoding request this step (set by the engine; 0 = off)

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, req.req_id
        req.token_limit = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        self.requests[req.req_id] = req
        self.waiting[req] = None

    def abort(self, req_ids: list[str]) -> list[Request]:
        """Finish these requests as aborted (unknown or finished ids are skipped); O(len(req_ids)) plus one
        pass over the running list when some of them run."""
        aborted: dict[str, Request] = {}  # by id: an id given twice is aborted once
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished or rid in aborted:
                continue
            self.waiting.pop(req, None)
            aborted[rid] = req
        if any(req.status is RequestStatus.RUNNING for req in aborted.values()):
            self.running = [r for r in self.running if r.req_id not in aborted]
        for req in aborted.values():
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return list(aborted.values())

    @property
    def has_removals_to_send(self) -> bool:
        """Whether finished or preempted requests wait for the next step to leave the runner."""
        return bool(self._finished_ids or self._preempted_ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def on_weights_updated(self, version: int) -> None:
        """New weights: forget cached prefixes so no new request reuses KV of older weights."""
        self.policy_version = version
        self.kv.reset_prefix_cache()

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        preempted_now = False

        # 1. running requests, oldest first
        kv, block_size = self.kv, self.kv.block_size
        running, pool, in_runner = self.running, kv.pool, self._in_runner
        lookahead = self.num_lookahead_tokens
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.token_ids)
            if req.num_placeholders and num_tokens >= req.token_limit:  # its last token is already in flight
                i += 1
                continue
            num_new = num_tokens - req.num_computed_tokens
            if lookahead:
                num_new += self._lookahead(req)
            if num_new > budget:
                num_new = budget
            assert num_new > 0, (req.req_id, num_tokens, req.num_computed_tokens)
            need = -(-(req.num_computed_tokens + num_new) // block_size) - len(req.block_ids)
            while need > 0 and need > pool.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            else:
                if need > 0:
                    new_blocks = kv.pool.allocate(need)
                    req.block_ids.extend(new_blocks)
                else:
                    new_blocks = []
                num_scheduled[req.req_id] = num_new
                budget -= num_new
                if req.req_id in in_runner:
                    cached_reqs.append(req.req_id, new_blocks, req.num_computed_tokens)
                else:
                    new_reqs.append(self._new_data(req))
                i += 1
                continue
            # req itself was preempted (it was the newest); nothing after it remains
            break

        # 2. waiting requests, first come first served
        skipped: list[Request] = []
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted_now:
            req = next(iter(waiting))
            if self._must_wait_for_sibling(req):
                del waiting[req]
                skipped.append(req)
                continue
            hits = self.kv.lookup_prefix(req) if req.num_computed_tokens == 0 else []
            if req.num_computed_tokens == 0 and self.kv.being_computed(req, len(hits)):
                del waiting[req]  # another request is computing its next prompt block: take it cached later
                skipped.append(req)
                continue
            num_cached = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.can_allocate(req, num_cached + num_new, hits):
                break
            del waiting[req]
            if req.num_computed_tokens == 0:
                req.kv_epoch = self.kv.epoch
                req.num_computed_tokens = num_cached
                cached_prompt = min(num_cached, req.num_prompt_tokens)
                req.num_cached_prompt_tokens += cached_prompt
                req.group.num_cached_prompt_tokens += cached_prompt
            self.kv.allocate(req, num_cached + num_new, hits)
            req.status = RequestStatus.RUNNING
            req.group.num_running += 1
            self.running.append(req)
            num_scheduled[req.req_id] = num_new
            budget -= num_new
            new_reqs.append(self._new_data(req))
        for req in reversed(skipped):  # back at the front, in their order
            self._requeue_front(req)

        for data in new_reqs:
            self._in_runner.add(data.req_id)
        out = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
        )
        self._finished_ids, self._preempted_ids = set(), set()
        self.stats.num_steps += 1
        return out

    def advance(self, sched: SchedulerOutput) -> None:
        """Async scheduling: account for `sched` before it has run. Computed counts advance now, and each
        request that samples in it gets a placeholder token (-1), so the next step can be scheduled while
        this one runs on the device. `update(sched, out, advanced=True)` puts the real tokens in."""
        self._advance_computed(sched, sched.placeholders)

    def _advance_computed(self, sched: SchedulerOutput, placeholders: dict[str, int] | None = None) -> None:
        """Computed counts advance by the step's tokens; with `placeholders`, each request that now samples
        gets its placeholder (recorded there: req_id -> its index)."""
        requests, block_size, kv = self.requests, self.kv.block_size, self.kv
        running = RequestStatus.RUNNING
        for req_id, n in sched.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is None or req.status is not running:  # aborted meanwhile
                continue
            computed = req.num_computed_tokens + n
            req.num_computed_tokens = computed
            if computed // block_size > req.num_cached_blocks:
                kv.register_computed(req)
            group = req.group
            if not group.prompt_blocks_ready and computed >= len(group.prompt_token_ids):
                group.prompt_blocks_ready = True
            if placeholders is not None and computed >= len(req.token_ids):
                placeholders[req_id] = len(req.token_ids)
                req.token_ids.append(-1)
                req.num_placeholders += 1

    def update(self, sched: SchedulerOutput, out: RunnerOutput, advanced: bool = False) -> list[Request]:
        """Advance computed counts (unless `advance` did), append sampled tokens (or fill their
        placeholders), finish requests. Returns the requests that got tokens."""
        requests, block_size = self.requests, self.kv.block_size
        if not advanced:
            self._advance_computed(sched)
        if out.routed_experts:  # MoE routing replay: rows of the positions that became final, by position
            for req_id, (start, rows) in out.routed_experts.items():
                req = requests.get(req_id)
                if req is not None and req.status is RequestStatus.RUNNING and req.routed_experts is not None:
                    req.routed_experts.write(start, rows)
        changed: list[Request] = []
        finished: list[tuple[Request, RequestStatus]] = []
        version, running = self.policy_version, RequestStatus.RUNNING
        logprobs, top_logprobs, placeholders = out.logprobs, out.top_logprobs, sched.placeholders
        for idx, req_id in enumerate(out.req_ids):
            req = requests.get(req_id)
            if req is None or req.status is not running:
                continue
            tokens = out.sampled_token_ids[idx]
            if out.num_draft_tokens is not None:
                # rejected draft positions were computed but hold no accepted token: roll back
                req.num_computed_tokens -= out.num_draft_tokens[idx] + 1 - len(tokens)
                if out.num_draft_tokens[idx] > 0 and req.spec_stats is not None:
                    record_spec_step(req.spec_stats, out.num_draft_tokens[idx], len(tokens) - 1)
            if advanced:  # one token per step: it fills the placeholder `advance` made
                where = placeholders[req_id]
                req.token_ids[where] = tokens[0]
                req.num_placeholders -= 1
                end = where + 1
            for pos, token in enumerate(tokens):
                if not advanced:
                    req.token_ids.append(token)
                    end = len(req.token_ids)
                req.policy_versions.append(version)
                if logprobs is not None:
                    req.logprobs.append(logprobs[idx][pos])
                if top_logprobs is not None:
                    req.top_logprobs.append(top_logprobs[idx][pos])
                # most tokens end nothing: only a stop token, stop strings or the length limit need the check
                if end < req.token_limit and token not in req.stop_ids and req.stop_strings is None:
                    continue
                status = self._check_stop(req, token, end)
                if status is not None:
                    del req.token_ids[end:]  # tokens of later steps in flight are dropped
                    req.num_placeholders = 0
                    finished.append((req, status))
                    break
            if advanced and req.num_computed_tokens // block_size > req.num_cached_blocks:
                self.kv.register_computed(req)  # blocks that the filled placeholder completed
            changed.append(req)
        if finished:
            done = {id(req) for req, _ in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req, status in finished:
                self._finish(req, status)
        return changed

    # ---- helpers -------------------------------------------------------------------------------------
    def _lookahead(self, req: Request) -> int:
        """Draft slots for a decoding request: none while prefilling, and never past max_model_len. Near
        max_tokens a request still drafts the full count (its tokens past max_tokens are dropped by
        `update`), so every row of a decode batch drafts alike and the step can replay a CUDA graph."""
        if self.num_lookahead_tokens == 0 or not req.params.speculative or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - req.num_tokens - 1))

    def _check_stop(self, req: Request, token: int, num_tokens: int) -> RequestStatus | None:
        """The request's status once `token`, its `num_tokens`-th token, is appended."""
        num_output = num_tokens - req.num_prompt_tokens
        if num_output > req.params.min_tokens:
            if token in req.stop_ids:
                req.stop_reason = token if token in req.params.stop_token_ids else None
                return RequestStatus.FINISHED_STOPPED
            if req.stop_strings is not None:
                req.stop_reason = req.stop_strings.find(req.token_ids, req.num_prompt_tokens, num_tokens)
                if req.stop_reason is not None:
                    return RequestStatus.FINISHED_STOPPED
        if num_tokens >= req.token_limit:  # max_tokens or max_model_len reached
            return RequestStatus.FINISHED_LENGTH
        return None

    def _must_wait_for_sibling(self, req: Request) -> bool:
        """Whether waiting `req` should let a running sibling finish computing the prompt first (O(1))."""
        group = req.group
        if group.prompt_blocks_ready or len(group.members) == 1 or req.num_computed_tokens > 0:
            return False
        if len(group.prompt_token_ids) <= self.kv.block_size:
            return False  # no full prompt block to share
        return group.num_running > 0  # a waiting request is not running itself

    def _requeue_front(self, req: Request) -> None:
        self.waiting[req] = None
        self.waiting.move_to_end(req, last=False)

    def _new_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.req_id,
            token_ids=list(req.token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            block_ids=list(req.block_ids),
            num_computed_tokens=req.num_computed_tokens,
            sampling=req.params.runner_sampling(req.seed, req.lora_slot),
            prompt_embeds=req.prompt_embeds,
        )

    def _drop_placeholders(self, req: Request) -> None:
        if req.num_placeholders:
            del req.token_ids[-req.num_placeholders :]
            req.num_placeholders = 0

    def _preempt(self, req: Request) -> None:
        self._drop_placeholders(req)  # tokens in flight are dropped and sampled again after recompute
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.group.num_running -= 1
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._requeue_front(req)
        if req.req_id in self._in_runner:
            self._in_runner.discard(req.req_id)
            self._preempted_ids.add(req.req_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Free the request's blocks and forget it (its RequestGroup still holds it for the caller)."""
        self._drop_placeholders(req)
        if req.status is RequestStatus.RUNNING:
            req.group.num_running -= 1
        req.status = status
        req.group.num_finished += 1
        self.kv.free(req)
        del self.requests[req.req_id]
        if req.req_id in self._in_runner:
            self._in_runner.discard(req.req_id)
            self._finished_ids.add(req.req_id)
