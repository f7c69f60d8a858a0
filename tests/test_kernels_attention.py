"""Triton store_kv / paged_attention against the torch references (Triton interpreter on CPU, real shapes on CUDA).

Tolerances (max abs error vs the reference, inputs ~N(0, 1)): fp32 2e-5, fp16 2e-3, bf16 1.6e-2 (CUDA only:
bf16 is wrong in the interpreter). Deterministic-mode tests compare with torch.equal (bitwise).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.attention import paged_attention, store_kv  # noqa: E402
from kernels.attention_ref import paged_attention_ref, store_kv_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class Batch:
    """A paged KV cache holding each request's whole context, plus the query tokens of one step.

    Request b has seq_lens[b] context tokens; its q_lens[b] query tokens are the last of them. Blocks are
    handed out in a shuffled order so that block tables are not the identity.
    """

    def __init__(self, q_lens, seq_lens, *, num_kv_heads=2, group=2, head_dim=16, block_size=4,
                 dtype=torch.float32, seed=0, device=DEVICE):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens_list = list(q_lens), list(seq_lens)
        num_reqs = len(q_lens)
        max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
        num_blocks = num_reqs * max_blocks + 1
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_tables = perm[: num_reqs * max_blocks].view(num_reqs, max_blocks).to(torch.int32).to(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(seq_lens)
        self.scale = head_dim**-0.5

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.scale, self.max_query_len, self.max_seq_len)

    def token_rows(self, req: int) -> slice:
        start = sum(self.q_lens[:req])
        return slice(start, start + self.q_lens[req])


def _assert_matches_ref(batch: Batch, out: torch.Tensor, reqs=None) -> None:
    ref = paged_attention_ref(*batch.args())
    for r in range(len(batch.q_lens)) if reqs is None else reqs:
        rows = batch.token_rows(r)
        err = (out[rows].float() - ref[rows].float()).abs().max().item() if batch.q_lens[r] else 0.0
        assert err <= ATOL[out.dtype], f"request {r}: max abs error {err}"


# ---------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_ref_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d = 5, 4, 2, 16
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    key = torch.randn(6, hkv, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(6, hkv, d, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, -1, 19], dtype=torch.int64, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # a strided slot view (a column of a [T, d + 1] table, as speculative drafting passes it)
    table = torch.stack([slots, torch.full_like(slots, 7)], dim=1)  # [6, 2]
    k_strided, v_strided = k_ref.clone(), v_ref.clone()
    store_kv(key * 2, value * 2, k_strided, v_strided, table[:, 0])
    store_kv_ref(key * 2, value * 2, k_ref, v_ref, slots)
    assert torch.equal(k_strided, k_ref) and torch.equal(v_strided, v_ref)


def test_store_kv_rejects_misuse():
    k_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="key and value"):
        store_kv(torch.zeros(3, 1, 16, device=DEVICE), key, k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, k_cache, k_cache.clone(), slots.float())
    with pytest.raises(ValueError, match="share one of"):
        store_kv(key.half(), key.half(), k_cache, k_cache.clone(), slots)


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize(
    "dtype,block_size,head_dim", [(torch.float32, 4, 16), (torch.float16, 16, 32), (torch.float32, 16, 32)]
)
def test_varlen_prefill_over_cached_prefix(dtype, block_size, head_dim):
    # request 0: chunk of 5 over a 7-token cached prefix; 1: plain prefill; 2: decode
    batch = Batch([5, 9, 1], [12, 9, 30], block_size=block_size, head_dim=head_dim, dtype=dtype)
    _assert_matches_ref(batch, paged_attention(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_forced_split_kv(dtype):
    batch = Batch([1, 1, 1], [40, 17, 3], dtype=dtype, seed=2)
    _assert_matches_ref(batch, paged_attention(*batch.args(), kv_split_size=16))


def test_mixed_batch_prefill_decode_and_verification_with_splits():
    # GQA group 3 (padded to 4 in the kernel), speculative verification q_len 4, split-KV forced
    batch = Batch([4, 1, 6, 1], [37, 25, 6, 1], num_kv_heads=2, group=3, seed=3)
    _assert_matches_ref(batch, paged_attention(*batch.args(), kv_split_size=16))
    _assert_matches_ref(batch, paged_attention(*batch.args()))


@pytest.mark.parametrize("kv_split_size", [None, 16])
def test_padding_rows_give_zeros_and_other_rows_are_untouched(kv_split_size):
    # request 1 is graph padding: one query token, no context, garbage block table
    batch = Batch([2, 1, 1], [9, 0, 21], seed=4)
    valid_tables = batch.block_tables.clone()
    batch.block_tables[1] = 10**6
    out = torch.full((batch.query.shape[0] + 2, *batch.query.shape[1:]), 7.0, device=DEVICE)
    query = torch.cat([batch.query, torch.zeros_like(batch.query[:2])])  # 2 tokens outside every request
    args = (query,) + batch.args()[1:]
    paged_attention(*args, out=out, kv_split_size=kv_split_size)
    assert torch.equal(out[batch.token_rows(1)], torch.zeros_like(out[batch.token_rows(1)]))
    assert torch.equal(out[-2:], torch.full_like(out[-2:], 7.0))
    batch.block_tables = valid_tables  # the reference gathers every row's table
    _assert_matches_ref(batch, out, reqs=[0, 2])


def test_deterministic_mode_matches_ref():
    batch = Batch([5, 1, 3], [33, 40, 3], seed=5)
    _assert_matches_ref(batch, paged_attention(*batch.args(), deterministic=True, kv_split_size=16))


def _single(batch: Batch, req: int, q_len: int) -> Batch:
    """A view of request `req` of `batch` alone, as the last `q_len` tokens of its context."""
    view = Batch([q_len], [batch.seq_lens_list[req]], seed=0)
    view.k_cache, view.v_cache = batch.k_cache, batch.v_cache
    view.block_tables = batch.block_tables[req : req + 1].clone()
    view.query = batch.query[batch.token_rows(req)][-q_len:].clone()
    view.scale = batch.scale
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deterministic_mode_is_bitwise_batch_and_chunk_invariant(dtype):
    # request 0: 38 context tokens, all 38 queried (prefill); its last token is compared everywhere
    batch = Batch([3, 38, 1], [20, 38, 45], dtype=dtype, seed=6)
    det = dict(deterministic=True, kv_split_size=16)
    in_batch = paged_attention(*batch.args(), **det)[batch.token_rows(1)][-1]
    alone_prefill = paged_attention(*_single(batch, 1, 38).args(), **det)[-1]
    chunk = paged_attention(*_single(batch, 1, 7).args(), **det)[-1]
    decode = paged_attention(*_single(batch, 1, 1).args(), **det)[-1]
    assert torch.equal(in_batch, alone_prefill)
    assert torch.equal(in_batch, chunk)
    assert torch.equal(in_batch, decode)
    # a token of the prefill that is not the last one: decode view of a shorter context
    early = paged_attention(*batch.args(), **det)[batch.token_rows(1)][20]
    short = _single(batch, 1, 1)
    short.seq_lens = torch.tensor([21], dtype=torch.int32, device=DEVICE)
    short.query = batch.query[batch.token_rows(1)][20:21].clone()
    short.max_seq_len = 21
    assert torch.equal(early, paged_attention(*short.args(), **det)[0])


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 2, 1), (128, 8, 2), (32, 4, 3)])
def test_launch_tuning_keeps_the_result(block_n, num_warps, num_stages):
    """Other KV tiles, warp counts and pipeline depths compute the same attention (decode and a prefill
    chunk over a cached prefix, one request's context longer than a 128-token tile)."""
    batch = Batch([1, 3, 1], [150, 40, 7], group=3, seed=4)
    _assert_matches_ref(batch, paged_attention(*batch.args(), block_n=block_n, num_warps=num_warps,
                                               num_stages=num_stages))


def test_paged_attention_rejects_misuse():
    batch = Batch([2, 1], [5, 9])
    q, kc, vc, qsl, sl, bt, scale, mq, ms = batch.args()
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        paged_attention(q[:, :3], kc, vc, qsl, sl, bt, scale, mq, ms)
    with pytest.raises(ValueError, match="share one of"):
        paged_attention(q.half(), kc, vc, qsl, sl, bt, scale, mq, ms)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, kc, vc, qsl, sl[:1], bt, scale, mq, ms)
    with pytest.raises(ValueError, match="block_tables cover"):
        paged_attention(q, kc, vc, qsl, sl, bt, scale, mq, 10**4)
    with pytest.raises(ValueError, match="kv_split_size"):
        paged_attention(q, kc, vc, qsl, sl, bt, scale, mq, ms, kv_split_size=24)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_attention(q, kc, vc, qsl.float(), sl, bt, scale, mq, ms)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(q, kc, vc, qsl, sl, bt, scale, mq, ms, out=torch.empty_like(q[:1]))
    with pytest.raises(ValueError, match="block_n must be"):
        paged_attention(q, kc, vc, qsl, sl, bt, scale, mq, ms, block_n=48)
    with pytest.raises(ValueError, match="deterministic mode fixes them"):
        paged_attention(q, kc, vc, qsl, sl, bt, scale, mq, ms, deterministic=True, num_warps=8)


# ---------------------------------------------------------------------------------------------- CUDA, real shapes
# Qwen2.5-0.5B attention: 14 query heads, 2 KV heads, head_dim 64, bf16, block_size 16.


def _qwen_batch(q_lens, seq_lens, seed=0):
    return Batch(q_lens, seq_lens, num_kv_heads=2, group=7, head_dim=64, block_size=16, dtype=torch.bfloat16,
                 seed=seed)


@needs_cuda
def test_cuda_decode_batch_256_context_2k():
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 2049, (256,), generator=gen).tolist()
    seq_lens[0] = 2048
    batch = _qwen_batch([1] * 256, seq_lens)
    _assert_matches_ref(batch, paged_attention(*batch.args()))
    _assert_matches_ref(batch, paged_attention(*batch.args(), kv_split_size=256))


@needs_cuda
def test_cuda_small_batch_long_context_decode_uses_splits():
    batch = _qwen_batch([1, 1], [8192, 3000], seed=1)
    _assert_matches_ref(batch, paged_attention(*batch.args()))


@needs_cuda
def test_cuda_chunked_prefill_and_mixed_batch():
    batch = _qwen_batch([2048, 512, 1, 1, 4], [2048, 1500, 2000, 1, 700], seed=2)
    _assert_matches_ref(batch, paged_attention(*batch.args()))
    _assert_matches_ref(batch, paged_attention(*batch.args(), deterministic=True))


@needs_cuda
def test_cuda_deterministic_prefill_vs_decode_bitwise():
    batch = _qwen_batch([5, 1500, 1] * 8, [700, 1500, 2048] * 8, seed=3)
    det = dict(deterministic=True)
    full = paged_attention(*batch.args(), **det)
    for req in (1, 22):
        rows = full[batch.token_rows(req)]
        assert torch.equal(rows[-1], paged_attention(*_single(batch, req, 1).args(), **det)[-1])
        assert torch.equal(rows[-1], paged_attention(*_single(batch, req, 300).args(), **det)[-1])
        assert torch.equal(rows, paged_attention(*_single(batch, req, 1500).args(), **det))


@needs_cuda
def test_cuda_graph_capture_of_decode():
    batch = _qwen_batch([1] * 64, [1000] * 63 + [0], seed=4)
    out = torch.empty_like(batch.query)
    paged_attention(*batch.args(), out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*batch.args(), out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches_ref(batch, out, reqs=range(63))
    assert torch.equal(out[63], torch.zeros_like(out[63]))


@pytest.mark.parametrize("sms", [4, 64])
def test_decode_splits_each_actual_context_under_a_loose_bound(monkeypatch, sms):
    """Fast mode on a small grid splits the context on its own: the kernel cuts each request's actual context
    into equal runs of whole tiles (some empty), however loose the max_seq_len bound (as in a CUDA graph
    captured for max_model_len). More SMs -> more splits (up to 32)."""
    import kernels.attention as attention

    monkeypatch.setattr(attention, "_num_sms", lambda device: sms)
    batch = Batch([1, 1, 1], [200, 17, 3], dtype=torch.float32, seed=4)
    args = list(batch.args())
    args[-1] = 4096  # max_seq_len: a graph's bound, far above the real contexts
    bt = args[5]
    args[5] = torch.nn.functional.pad(bt, (0, 4096 // batch.k_cache.shape[1] - bt.shape[1]))  # unread columns
    _assert_matches_ref(batch, paged_attention(*args, block_n=16))
