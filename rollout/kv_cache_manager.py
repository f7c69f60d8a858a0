"""KV block pool with a hash-chained prefix cache, and per-request block bookkeeping.

Blocks hold `block_size` tokens. A full block computed under the current weights is registered under
the key (its chain digest, its token ids): the digest is SHA-256 over the previous block's digest and this
block's token ids, and the first block's parent is a digest of the request's extra keys
(`Request.cache_keys`: its cache salt, its LoRA adapter's load, an embedding prompt's bytes), so they are
part of every block's chain. A key names its whole prefix: Python's `hash()` would not (its 64 bits can be
made to collide on purpose, so one client's crafted prompt could be served another's cached KV, as in vLLM's
CVE-2025-25183). Two requests with the same prefix and the same extra keys map to the same
blocks, so the n samples of one prompt hold the prompt's full blocks once; requests with different extra
keys share no block. Freed blocks keep their key and go to the back of an LRU free queue; allocation takes
from the front, evicting the key, so the most recently used cached blocks survive longest. Blocks never
allocated yet stand ahead of that queue, in id order, as a counter (a pool of millions of blocks, a small
model's cache on a large GPU, starts at once).
`reset_prefix_cache()` (after a weight update) forgets all keys. Pure Python: block ids only, no tensors.

Prompt blocks that a running request is computing right now (allocated, not yet registered) are counted by
key (`computing`), so that a waiting request about to compute the same block can wait for it instead of
computing it again: requests with the same prompt admitted together (a framework sending a prompt's n
samples as n requests) then share its blocks as one request's n samples do.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from rollout.request import Request

BlockKey = tuple  # (SHA-256 digest of the chain up to and including this block: 32 bytes, tuple of its token ids)


def chain_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The digest of a block whose chain so far digests to `parent`: SHA-256 of parent + the tokens as int64."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_digest(cache_keys: tuple | None) -> bytes:
    """The parent digest of a request's first block: SHA-256 of its extra keys' repr (plain tuples of str / int)."""
    return hashlib.sha256(repr(cache_keys or ()).encode()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.fresh = 0  # blocks fresh .. num_blocks - 1 were never allocated: free, ahead of free_queue
        self.free_queue: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently used first
        self.cached: dict[BlockKey, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.fresh + len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.fresh - len(self.free_queue)

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key) if self.enable_caching else None

    def allocate(self, count: int) -> list[int]:
        assert count <= self.num_free_blocks, "caller checks free space first"
        fresh = min(count, self.num_blocks - self.fresh)
        out = list(range(self.fresh, self.fresh + fresh))  # no key, no reference yet
        for block_id in out:
            self.ref_cnt[block_id] = 1
        self.fresh += fresh
        for _ in range(count - fresh):
            block_id, _ = self.free_queue.popitem(last=False)
            key = self.block_key[block_id]
            if key is not None:
                if self.cached.get(key) == block_id:
                    del self.cached[key]
                self.block_key[block_id] = None
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def share(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix-cache hits)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop a reference on each block; tail blocks first so they are evicted before the prefix."""
        for b in reversed(block_ids):
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def register(self, block_id: int, key: BlockKey) -> None:
        if not self.enable_caching or self.block_key[block_id] is not None:
            return
        self.block_key[block_id] = key
        self.cached.setdefault(key, block_id)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_key = [None] * self.num_blocks


class KVCacheManager:
    """Which blocks each request holds; prefix-cache lookups and registration."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.epoch = 0  # bumped by reset_prefix_cache; requests computed under older epochs don't register
        self.computing: dict[BlockKey, int] = {}  # key -> running requests computing that prompt block now

    def _keys(self, req: Request, num_blocks: int) -> list[BlockKey]:
        """The chain keys of the request's first `num_blocks` full blocks (memoised on the request)."""
        keys, bs = req.block_keys, self.block_size
        first = req.group.members[0] if req.group is not None and req.group.members else req
        if first is not req and len(keys) < num_blocks:  # a prompt's samples share its full blocks' keys
            shared = min(num_blocks, req.num_prompt_tokens // bs, len(first.block_keys))
            keys.extend(first.block_keys[len(keys) : shared])
        while len(keys) < num_blocks:
            i = len(keys)
            parent = keys[-1][0] if keys else root_digest(req.cache_keys)
            tokens = tuple(req.token_ids[i * bs : (i + 1) * bs])
            keys.append((chain_digest(parent, tokens), tokens))
        return keys[:num_blocks]

    def lookup_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens (never all of them: one token must run)."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in self._keys(req, max_blocks):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def being_computed(self, req: Request, num_hits: int) -> bool:
        """Whether another running request is computing the prompt block `req` would compute next (the one
        after its `num_hits` cached blocks)."""
        if not self.computing or num_hits >= (req.num_tokens - 1) // self.block_size:
            return False
        return self.computing.get(self._keys(req, num_hits + 1)[num_hits], 0) > 0

    def _start_computing(self, req: Request) -> None:
        """Count the request's full prompt blocks past its cached ones as being computed (caching on)."""
        if not self.pool.enable_caching or req.kv_epoch != self.epoch:
            return
        upto = min(len(req.block_ids), (req.num_prompt_tokens - 1) // self.block_size)
        start = max(req.num_cached_blocks, req.computing_upto)
        for key in self._keys(req, upto)[start:]:
            self.computing[key] = self.computing.get(key, 0) + 1
        req.computing_upto = max(upto, req.computing_upto)

    def _stop_computing(self, req: Request, upto: int) -> None:
        """Blocks [num_cached_blocks, upto) of the request are no longer being computed by it."""
        if req.kv_epoch == self.epoch:
            for key in self._keys(req, min(upto, req.computing_upto))[req.num_cached_blocks:]:
                left = self.computing.get(key, 0) - 1
                if left > 0:
                    self.computing[key] = left
                else:
                    self.computing.pop(key, None)
        if upto >= req.computing_upto:
            req.computing_upto = 0

    def blocks_needed(self, req: Request, num_total_tokens: int, num_hit_blocks: int = 0) -> int:
        """New blocks for the request to hold `num_total_tokens` tokens of KV."""
        total = -(-num_total_tokens // self.block_size)
        return max(0, total - len(req.block_ids) - num_hit_blocks)

    def can_allocate(self, req: Request, num_total_tokens: int, hits: list[int] = ()) -> bool:
        evictable_hits = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        need = self.blocks_needed(req, num_total_tokens, len(hits))
        return need <= self.pool.num_free_blocks - evictable_hits

    def allocate(self, req: Request, num_total_tokens: int, hits: list[int] = ()) -> list[int]:
        """Give the request blocks for `num_total_tokens` tokens of KV; returns the newly added block ids."""
        new: list[int] = []
        if hits:
            self.pool.share(list(hits))
            new.extend(hits)
            req.num_cached_blocks = len(hits)
        new.extend(self.pool.allocate(self.blocks_needed(req, num_total_tokens, len(hits))))
        req.block_ids.extend(new)
        if req.num_computed_tokens < req.num_prompt_tokens:
            self._start_computing(req)
        return new

    def register_computed(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if req.kv_epoch != self.epoch:
            return
        num_full = min(req.num_computed_tokens, req.num_tokens - req.num_placeholders) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        if req.computing_upto:
            self._stop_computing(req, num_full)
        for i, key in enumerate(self._keys(req, num_full)):
            if i >= req.num_cached_blocks:
                self.pool.register(req.block_ids[i], key)
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        if req.computing_upto:
            self._stop_computing(req, req.computing_upto)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.epoch += 1
        self.computing = {}  # blocks computed under the old weights are shared with no one
