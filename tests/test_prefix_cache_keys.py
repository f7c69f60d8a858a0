"""Prefix-cache extra keys: requests share KV blocks only if their `cache_keys` (the cache salt) are equal.

The scheduler tests run without a model (hand-built runner outputs, as in test_scheduler.py); the engine
test checks `num_cached_prompt_tokens` and that a salt does not change what is generated.
"""

from __future__ import annotations

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kv_cache_manager import KVCacheManager
from rollout.request import Request, RequestGroup
from rollout.scheduler import Scheduler
from test_scheduler import fake_run, run_to_completion

BLOCK = 4
PROMPT = list(range(2, 16))  # 14 tokens: 3 full blocks of 4 and a 2-token tail


def salted_group(rid: str, salt: str | None, n: int = 1, prompt=PROMPT) -> RequestGroup:
    """A group built the way `Engine.add_request` builds one (cache_keys from the salt)."""
    params = SamplingParams(n=n, max_tokens=4, ignore_eos=True, cache_salt=salt)
    group = RequestGroup(rid, None, list(prompt), params)
    keys = () if salt is None else (("cache_salt", salt),)
    for j in range(n):
        group.members.append(
            Request(req_id=f"{rid}-{j}", group=group, sample_index=j, seed=j, max_tokens=4,
                    eos_token_ids=frozenset({1}), token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    cache_keys=keys)
        )
    return group


def scheduler() -> Scheduler:
    return Scheduler(kv_manager=KVCacheManager(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256)


def run_group(sched: Scheduler, group: RequestGroup) -> dict[str, int]:
    """Add `group` after everything before it finished; returns its first step's scheduled tokens."""
    for m in group.members:
        sched.add_request(m)
    first = sched.schedule()
    scheduled = dict(first.num_scheduled_tokens)
    sched.update(first, fake_run(sched, first))
    run_to_completion(sched)
    return scheduled


@pytest.mark.parametrize("first,second", [("a", "b"), (None, "a"), ("a", None)])
def test_different_salts_share_no_block(first, second):
    sched = scheduler()
    a = salted_group("a", first)
    run_group(sched, a)
    cached_a = set(sched.kv.pool.cached)
    assert len(cached_a) == 4  # a's 3 prompt blocks and the block its outputs filled, freed but still cached
    b = salted_group("b", second)
    assert run_group(sched, b) == {"b-0": len(PROMPT)}  # the whole prompt runs again
    assert b.members[0].num_cached_prompt_tokens == 0
    # no key of b's chain (not only the first block's) is one of a's
    assert not set(sched.kv._keys(b.members[0], 3)) & cached_a


@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_equal_salts_share(salt):
    sched = scheduler()
    a = salted_group("a", salt)
    run_group(sched, a)
    b = salted_group("b", salt)
    assert run_group(sched, b) == {"b-0": 2}  # 3 cached prompt blocks, only the tail runs
    assert b.members[0].num_cached_prompt_tokens == 3 * BLOCK


def test_samples_of_a_salted_prompt_share_their_prompt_blocks():
    sched = scheduler()
    run_group(sched, salted_group("other", "b"))  # the same prompt under another salt is cached already
    group = salted_group("g", "a", n=4)
    for m in group.members:
        sched.add_request(m)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"g-0": len(PROMPT)}  # nothing from "other"; siblings wait
    sched.update(first, fake_run(sched, first))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"g-0": 1, "g-1": 2, "g-2": 2, "g-3": 2}  # siblings: the tail only
    sched.update(second, fake_run(sched, second))
    blocks = [m.block_ids[:3] for m in group.members]
    assert all(b == blocks[0] for b in blocks)
    assert all(sched.kv.pool.ref_cnt[b] == 4 for b in blocks[0])
    assert sum(m.num_cached_prompt_tokens for m in group.members) == 3 * 3 * BLOCK


def test_cache_salt_is_checked():
    for bad in ("", 3, b"salt"):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


@pytest.fixture(scope="module")
def engine(ckpt_factory):
    return Engine(EngineConfig(model=str(ckpt_factory("qwen2")), dtype="float32", max_num_seqs=8, num_kv_blocks=64))


def test_engine_salts_the_prefix_cache_without_changing_outputs(engine):
    prompt = [(7 * i + 3) % 120 + 2 for i in range(40)]  # 2 full blocks of 16 before the last token

    def run(salt, n=1):
        params = SamplingParams(n=n, max_tokens=5, temperature=0.0, ignore_eos=True, cache_salt=salt)
        (out,) = engine.generate([prompt], params)
        return out

    first = run("a")
    assert first.num_cached_prompt_tokens == 0
    other = run("b")
    assert other.num_cached_prompt_tokens == 0  # same prompt, other salt: nothing reused
    assert run(None).num_cached_prompt_tokens == 0
    again = run("a")
    assert again.num_cached_prompt_tokens == 32
    assert again.outputs[0].token_ids == other.outputs[0].token_ids == first.outputs[0].token_ids
    group = run("c", n=3)  # a fresh salt: the first sample computes the prompt, the other two share it
    assert group.num_cached_prompt_tokens == 2 * 32
    assert all(c.token_ids == first.outputs[0].token_ids for c in group.outputs)


def test_block_keys_are_sha256_chains_over_the_whole_prefix():
    """A block's key is (SHA-256 over its parent's digest and its tokens as int64, its tokens), the first block's
    parent the digest of the extra keys' repr: it names the whole prefix, so prompts that differ only before a
    block never share it (Python's hash() chain could be made to collide). Computed here independently."""
    import hashlib
    from array import array

    kv = KVCacheManager(64, BLOCK)
    tail = [7, 7, 7, 7]
    a = salted_group("a", "s", prompt=[2, 3, 4, 5] + tail + [9]).members[0]
    b = salted_group("b", "s", prompt=[2, 3, 4, 6] + tail + [9]).members[0]
    keys_a, keys_b = kv._keys(a, 2), kv._keys(b, 2)
    digest = hashlib.sha256(repr((("cache_salt", "s"),)).encode()).digest()
    for i, key in enumerate(keys_a):
        tokens = tuple(a.token_ids[i * BLOCK : (i + 1) * BLOCK])
        digest = hashlib.sha256(digest + array("q", tokens).tobytes()).digest()
        assert key == (digest, tokens)
    assert keys_a[1][1] == keys_b[1][1] and keys_a[1] != keys_b[1]  # same tokens, different prefix: different key


def test_samples_share_their_prompt_keys_and_compute_their_own_after_it():
    """A prompt's samples take the first sample's keys of the prompt's full blocks (computed once), and their own
    keys for blocks that hold generated tokens."""
    kv = KVCacheManager(64, BLOCK)
    first, second = salted_group("g", None, n=2).members
    prompt_keys = kv._keys(first, 3)  # PROMPT: 3 full blocks
    assert kv._keys(second, 3) == prompt_keys and second.block_keys[0] is prompt_keys[0]
    first.token_ids += [40, 41]
    second.token_ids += [50, 51]
    assert kv._keys(first, 4)[3] != kv._keys(second, 4)[3]
    assert kv._keys(second, 4)[3][1] == (14, 15, 50, 51)
