"""Scheduler and KV block pool without a model: hand-built runner outputs drive them."""

from __future__ import annotations

import pytest

from rollout.kv_cache_manager import BlockPool, KVCacheManager
from rollout.request import Request, RequestGroup, RequestStatus
from rollout.sampling_params import SamplingParams
from rollout.scheduler import Scheduler
from runner.messages import RunnerOutput


def make_group(rid: str, prompt: list[int], n: int = 1, max_tokens: int = 8, **kw) -> RequestGroup:
    params = SamplingParams(n=n, max_tokens=max_tokens, **{"ignore_eos": True, **kw})
    group = RequestGroup(rid, None, prompt, params)
    for j in range(n):
        group.members.append(
            Request(req_id=f"{rid}-{j}", group=group, sample_index=j, seed=j, max_tokens=max_tokens,
                    eos_token_ids=frozenset({1}), token_ids=list(prompt), num_prompt_tokens=len(prompt))
        )
    return group


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv_manager=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def fake_run(sched, sched_out, token=7):
    """A runner stand-in: every request that reaches its last known token samples `token`."""
    ids = []
    for rid, n in sched_out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n >= req.num_tokens:
            ids.append(rid)
    return RunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids], logprobs=[[-0.5] for _ in ids])


def run_to_completion(sched, max_steps=1000):
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule()
        steps.append(out)
        sched.update(out, fake_run(sched, out))
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=10)
    for m in make_group("a", list(range(25))).members + make_group("b", list(range(3))).members:
        sched.add_request(m)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a-0": 10}  # 25-token prompt chunked to the budget
    assert first.total_num_scheduled_tokens == 10
    sched.update(first, fake_run(sched, first))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a-0": 10}
    assert second.cached_reqs.req_ids == ["a-0"] and not second.new_reqs
    sched.update(second, fake_run(sched, second))
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a-0": 5, "b-0": 3}  # remainder + next request's prefill
    sched.update(third, fake_run(sched, third))
    fourth = sched.schedule()
    assert fourth.num_scheduled_tokens == {"a-0": 1, "b-0": 1}  # both decode
    assert all(o.total_num_scheduled_tokens <= 10 for o in run_to_completion(sched))


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [m for i in range(5) for m in make_group(str(i), [2, 3, 4]).members]
    for m in reqs:
        sched.add_request(m)
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == 2
    steps = run_to_completion(sched)
    assert max(len(s.num_scheduled_tokens) for s in steps) <= 2
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert not sched.requests  # finished requests are forgotten


def test_preemption_by_recompute_never_deadlocks():
    # 6 blocks of 4 tokens; each request needs up to 3 blocks (4 prompt + 8 output tokens)
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    reqs = [m for i in range(4) for m in make_group(str(i), [10 + i, 11, 12, 13], max_tokens=8).members]
    for m in reqs:
        sched.add_request(m)
    steps = run_to_completion(sched)
    assert sched.stats.num_preemptions > 0
    assert any(s.preempted_req_ids for s in steps)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8
    assert sched.kv.pool.num_used_blocks == 0
    # a preempted request comes back as a new request carrying its generated tokens
    resumed = [n for s in steps for n in s.new_reqs if len(n.token_ids) > 4]
    assert resumed and all(n.num_prompt_tokens == 4 for n in resumed)


def test_n_samples_share_prompt_blocks_once():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(2, 16))  # 14 tokens: 3 full blocks + 2 tokens
    group = make_group("g", prompt, n=4, max_tokens=4)
    for m in group.members:
        sched.add_request(m)
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["g-0"]  # siblings wait for the prompt's blocks
    sched.update(first, fake_run(sched, first))
    second = sched.schedule()
    # the siblings hit the 3 cached prompt blocks and compute only the 2-token tail
    for rid in ("g-1", "g-2", "g-3"):
        assert second.num_scheduled_tokens[rid] == 2
    sched.update(second, fake_run(sched, second))
    blocks = [m.block_ids for m in group.members]
    assert all(b[:3] == blocks[0][:3] for b in blocks)
    pool = sched.kv.pool
    assert all(pool.ref_cnt[b] == 4 for b in blocks[0][:3])
    # 3 shared prompt blocks + one own block per sample (prompt tail and first outputs)
    assert pool.num_used_blocks == 3 + 4
    assert sum(m.num_cached_prompt_tokens for m in group.members) == 3 * 12


def test_separate_requests_with_one_prompt_share_its_blocks_as_samples_do():
    """The same prompt as 4 separate requests (how verl sends a prompt's n samples), admitted in one step: one
    computes the prompt, the others wait and then hit its cached blocks; also under chunked prefill."""
    for budget in (64, 6):
        sched = make_scheduler(num_blocks=64, block_size=4, budget=budget)
        prompt = list(range(2, 16))  # 14 tokens: 3 full blocks + 2 tokens
        groups = [make_group(f"r{i}", prompt, max_tokens=4) for i in range(4)]
        for g in groups:
            sched.add_request(g.members[0])
        first = sched.schedule()
        assert list(first.num_scheduled_tokens) == ["r0-0"]  # the others wait for its prompt blocks
        run_to_completion(sched)
        others = [g.members[0] for g in groups[1:]]
        assert all(r.num_cached_prompt_tokens == 12 for r in others)  # all 3 full prompt blocks were hits
        assert sched.kv.computing == {}


def test_a_waiting_request_goes_on_when_the_request_computing_its_prompt_is_aborted():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=6)
    prompt = list(range(2, 16))
    a, b = make_group("a", prompt, max_tokens=4), make_group("b", prompt, max_tokens=4)
    sched.add_request(a.members[0])
    sched.add_request(b.members[0])
    out = sched.schedule()  # a computes its first 6 prompt tokens (one full block), b waits
    assert list(out.num_scheduled_tokens) == ["a-0"]
    sched.update(out, fake_run(sched, out))
    sched.abort(["a-0"])
    assert sched.kv.computing == {}
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b-0": 6}  # b takes a's registered block as a hit, computes the rest
    assert b.members[0].num_cached_prompt_tokens == 4
    run_to_completion(sched)


def test_different_prompts_or_no_prefix_caching_do_not_wait():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    for i, g in enumerate((make_group("a", list(range(2, 16))), make_group("b", list(range(3, 17))))):
        sched.add_request(g.members[0])
    assert set(sched.schedule().num_scheduled_tokens) == {"a-0", "b-0"}
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = Scheduler(kv_manager=kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    for i in range(2):
        sched.add_request(make_group(f"s{i}", list(range(2, 16))).members[0])
    assert set(sched.schedule().num_scheduled_tokens) == {"s0-0", "s1-0"}


def test_freed_cached_blocks_are_reused_lru():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, ("ka",))
    pool.register(b, ("kb",))
    pool.free([a, b])  # b (the tail) is freed first, so it is evicted first
    assert pool.lookup(("ka",)) == a
    c = pool.allocate(3)  # two never-used blocks, then the least recently freed cached block
    assert c[2] == b and pool.lookup(("kb",)) is None and pool.lookup(("ka",)) == a
    pool.share([a])
    assert pool.ref_cnt[a] == 1 and pool.num_free_blocks == 0


def test_never_used_blocks_go_first_in_id_order_then_freed_ones_lru_and_cost_nothing_up_front():
    pool = BlockPool(6)
    a, b = pool.allocate(2), pool.allocate(2)
    assert (a, b) == ([0, 1], [2, 3]) and pool.num_used_blocks == 4 and pool.num_free_blocks == 2
    pool.free(a)  # tail first: 1, then 0
    assert pool.num_used_blocks == 2 and pool.num_free_blocks == 4
    assert pool.allocate(3) == [4, 5, 1]  # the never-used blocks ahead of the freed ones
    assert pool.allocate(1) == [0] and pool.num_free_blocks == 0
    assert all(pool.ref_cnt[i] == 1 for i in range(6))
    big = BlockPool(10**6)  # no per-block entry until a block is freed
    assert big.num_free_blocks == 10**6 and not big.free_queue and big.allocate(2) == [0, 1]


def test_prefix_cache_reset_on_weight_update():
    sched = make_scheduler(block_size=4)
    for m in make_group("a", list(range(2, 11)), max_tokens=2).members:
        sched.add_request(m)
    run_to_completion(sched)
    for m in make_group("b", list(range(2, 11)), max_tokens=2).members:
        sched.add_request(m)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b-0": 1}  # two cached blocks, only the last token runs
    sched.update(out, fake_run(sched, out))
    run_to_completion(sched)
    sched.on_weights_updated(1)
    for m in make_group("c", list(range(2, 11)), max_tokens=2).members:
        sched.add_request(m)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"c-0": 9}  # nothing reused across weight versions
    sched.update(out, fake_run(sched, out))
    assert sched.requests["c-0"].policy_versions == [1]


def test_abort_frees_blocks_and_reports_to_runner():
    sched = make_scheduler()
    for m in make_group("a", [3, 4, 5, 6, 7]).members:
        sched.add_request(m)
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    sched.abort(["a-0"])
    assert sched.kv.pool.num_used_blocks == 0
    nxt = sched.schedule()
    assert nxt.finished_req_ids == {"a-0"} and nxt.is_empty


@pytest.mark.parametrize("token,reason", [(1, "stop"), (9, "stop"), (5, "length")])
def test_stop_conditions(token, reason):
    sched = make_scheduler()
    group = make_group("a", [3, 4], max_tokens=3, ignore_eos=False, stop_token_ids=[9])
    for m in group.members:
        sched.add_request(m)
    for _ in range(5):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, fake_run(sched, out, token=token))
    req = group.members[0]
    assert req.status.value == reason
    assert req.num_output_tokens == (1 if reason == "stop" else 3)


# ---- the cost of n samples: O(n), counted (not timed) ---------------------------------------------------------------
class CountingRequest(Request):
    """A Request that counts every read of its attributes (all instances together): how often the scheduler or
    the output processor visits samples."""

    reads = 0

    def __getattribute__(self, name):
        CountingRequest.reads += 1
        return object.__getattribute__(self, name)


def counting_group(rid: str, prompt: list[int], n: int, max_tokens: int = 4, **kw) -> RequestGroup:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, **kw)
    group = RequestGroup(rid, None, prompt, params)
    group.members = [CountingRequest(req_id=f"{rid}-{j}", group=group, sample_index=j, seed=j, max_tokens=max_tokens,
                                     eos_token_ids=frozenset({1}), token_ids=list(prompt), num_prompt_tokens=len(prompt))
                     for j in range(n)]
    return group


def reads_of_one_schedule_while_a_sibling_prefills(n: int, sibling: int) -> int:
    """Attribute reads of the schedule() in which sample `sibling` of an n-sample prompt finishes the prompt and
    the n - 1 others, waiting, are each checked (and must keep waiting: the prompt's blocks are not ready)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=n + 1, budget=8)
    group = counting_group("g", list(range(2, 14)), n)  # 12 tokens: 3 full blocks
    first = group.members[sibling]
    sched.add_request(first)
    for m in group.members:
        if m is not first:
            sched.add_request(m)
    out = sched.schedule()  # the sibling's first 8 prompt tokens; budget spent, nobody else looked at
    assert out.num_scheduled_tokens == {first.req_id: 8}
    sched.update(out, fake_run(sched, out))
    CountingRequest.reads = 0
    out = sched.schedule()  # its last 4 tokens; 4 tokens of budget left for the waiting samples
    reads = CountingRequest.reads
    assert out.num_scheduled_tokens == {first.req_id: 4}
    assert len(sched.waiting) == n - 1 and list(sched.waiting) == [m for m in group.members if m is not first]
    return reads


@pytest.mark.parametrize("sibling", ["first", "last"])
def test_scheduling_n_waiting_samples_visits_each_a_bounded_number_of_times(sibling):
    # linear work grows at most 4096 / 256 = 16x between the two sizes; a scan of the group for each waiting
    # sample (the sibling-wait check did one) grows about 256x once the running sibling is the last member
    reads = {n: reads_of_one_schedule_while_a_sibling_prefills(n, 0 if sibling == "first" else n - 1)
             for n in (256, 4096)}
    assert reads[4096] < 2 * 16 * reads[256], reads
    assert reads[4096] < 64 * 4096, reads  # and a small constant per sample


def test_a_delta_output_of_one_changed_sample_visits_no_other_sample():
    from rollout.output_processor import OutputProcessor
    from rollout.sampling_params import RequestOutputKind

    reads = {}
    for n in (256, 4096):
        processor = OutputProcessor(None)
        group = counting_group("g", [3, 4, 5], n)
        processor.add(group, RequestOutputKind.DELTA)
        req = group.members[n // 2]
        req.token_ids.append(7)
        req.logprobs.append(-0.5)
        req.policy_versions.append(0)
        CountingRequest.reads = 0
        (out,) = processor.process([req])
        reads[n] = CountingRequest.reads
        assert [(c.index, c.token_ids) for c in out.outputs] == [(n // 2, [7])] and not out.finished
    assert reads[4096] == reads[256], reads  # the same work whatever n


def test_delta_outputs_list_each_changed_sample_once_in_index_order():
    from rollout.output_processor import OutputProcessor
    from rollout.sampling_params import RequestOutputKind

    processor = OutputProcessor(None)
    group = make_group("g", [3, 4, 5], n=5)
    processor.add(group, RequestOutputKind.DELTA)
    for j in (3, 1):
        group.members[j].token_ids.append(7)
        group.members[j].policy_versions.append(0)
        group.members[j].logprobs.append(-0.5)
    (out,) = processor.process([group.members[3], group.members[1], group.members[3]])
    assert [(c.index, c.token_ids) for c in out.outputs] == [(1, [7]), (3, [7])]
    assert processor.process([]) == []  # nothing changed since
    group.members[1].token_ids.append(8)
    group.members[1].policy_versions.append(0)
    group.members[1].logprobs.append(-0.5)
    (out,) = processor.process([group.members[1]])
    assert [(c.index, c.token_ids) for c in out.outputs] == [(1, [8])]


def test_group_counts_follow_their_members_through_preemption_and_abort():
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=6, budget=16)
    groups = [make_group(str(i), [10 + i] + list(range(20, 29)), n=3, max_tokens=8) for i in range(4)]  # 10 tokens
    for g in groups:
        for m in g.members:
            sched.add_request(m)

    def check():
        for g in groups:
            assert g.num_running == sum(m.status is RequestStatus.RUNNING for m in g.members)
            assert g.num_cached_prompt_tokens == sum(m.num_cached_prompt_tokens for m in g.members)
            assert g.num_finished == sum(m.status.finished for m in g.members)

    for step in range(400):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check()
        sched.update(out, fake_run(sched, out))
        check()
        if step == 6:  # abort a group part-way, its ids in reverse order and one twice
            ids = [m.req_id for m in groups[1].members]
            sched.abort(ids[::-1] + ids[:1])
            check()
    assert not sched.has_unfinished() and sched.stats.num_preemptions > 0
    assert all(m.status is RequestStatus.FINISHED_ABORTED for m in groups[1].members)
    assert all(m.status is RequestStatus.FINISHED_LENGTH for g in groups if g is not groups[1] for m in g.members)
    assert sched.kv.pool.num_used_blocks == 0 and not sched.waiting and not sched.running
    assert sum(g.num_cached_prompt_tokens for g in groups) > 0


def test_abort_removes_waiting_samples_anywhere_in_the_queue():
    sched = make_scheduler(max_num_seqs=1)
    groups = [make_group(name, [3, 4, 5], n=3) for name in "abc"]
    for g in groups:
        for m in g.members:
            sched.add_request(m)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["a-0"]
    aborted = sched.abort(["b-2", "b-0", "b-1", "b-1", "nope"])
    assert [r.req_id for r in aborted] == ["b-2", "b-0", "b-1"]
    assert [r.req_id for r in sched.waiting] == ["a-1", "a-2", "c-0", "c-1", "c-2"]
    sched.update(out, fake_run(sched, out))
    run_to_completion(sched)
    assert all(m.status is RequestStatus.FINISHED_LENGTH for g in (groups[0], groups[2]) for m in g.members)
    assert sched.kv.pool.num_used_blocks == 0
