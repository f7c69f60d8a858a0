"""Micro-benchmarks of the Triton kernels at Qwen2.5-0.5B shapes; prints one JSON line per case.

Needs CUDA. Times are medians of `triton.testing.do_bench` (ms); `gbps` counts the bytes each kernel must
read and write at least (KV cache and queries for attention, logits for the sampler), so it is a lower
bound on the memory traffic. Not here: end-to-end engine throughput (see the engine benchmarks).

    python bench/kernels.py
    python bench/kernels.py --sweep-attention     # fast-mode launch choices at the decode benchmarks' shapes
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention import paged_attention  # noqa: E402
from kernels.norm import fused_add_rms_norm  # noqa: E402
from kernels.rotary import apply_rotary  # noqa: E402
from kernels.sampling import sample  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, HIDDEN, VOCAB = 14, 2, 64, 16, 896, 151936
DTYPE = torch.bfloat16


def _emit(name: str, ms: float, nbytes: int, **extra) -> None:
    print(json.dumps({"kernel": name, "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 1), **extra}), flush=True)


def bench_attention(num_reqs: int, q_len: int, seq_len: int, deterministic: bool, **tuning) -> None:
    blocks_per_req = triton.cdiv(seq_len, BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(num_reqs, blocks_per_req)
    query = torch.randn(num_reqs * q_len, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qsl = torch.arange(0, num_reqs + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((num_reqs,), seq_len, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)
    ms = triton.testing.do_bench(lambda: paged_attention(
        query, k_cache, v_cache, qsl, seq_lens, block_tables, HEAD_DIM**-0.5, q_len, seq_len, out=out,
        deterministic=deterministic, **tuning))
    nbytes = 2 * k_cache.numel() * k_cache.element_size() + 2 * query.numel() * query.element_size()
    _emit("paged_attention", ms, nbytes, num_reqs=num_reqs, q_len=q_len, seq_len=seq_len,
          deterministic=deterministic, **tuning)


def sweep_attention() -> None:
    """Fast-mode launch choices at the decode shapes of the batch-1 and batch-256 benchmarks (context
    up to 384 tokens): KV tile, warps, pipeline stages and a forced KV split."""
    for num_reqs, seq_len in ((256, 256), (256, 384), (1, 384)):
        bench_attention(num_reqs, 1, seq_len, False)
        for block_n in (32, 64, 128):
            for num_warps in (2, 4, 8):
                for num_stages in (1, 2, 3):
                    bench_attention(num_reqs, 1, seq_len, False, block_n=block_n, num_warps=num_warps,
                                    num_stages=num_stages)
        for split in (64, 128):
            bench_attention(num_reqs, 1, seq_len, False, kv_split_size=split)


def bench_sampler(num_rows: int, top_k: int, top_p: float) -> None:
    logits = torch.randn(num_rows, VOCAB, device="cuda", dtype=DTYPE) * 3
    params = (
        torch.ones(num_rows, device="cuda"),
        torch.full((num_rows,), top_k, device="cuda", dtype=torch.int64),
        torch.full((num_rows,), top_p, device="cuda"),
        torch.zeros(num_rows, device="cuda"),
        torch.arange(num_rows, device="cuda", dtype=torch.int64),
        torch.zeros(num_rows, device="cuda", dtype=torch.int64),
    )
    ms = triton.testing.do_bench(lambda: sample(logits, *params))
    _emit("sample", ms, logits.numel() * logits.element_size(), num_rows=num_rows, top_k=top_k, top_p=top_p)


def bench_norm_and_rotary(num_tokens: int) -> None:
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
    ms = triton.testing.do_bench(lambda: fused_add_rms_norm(x, residual, weight, 1e-6))
    _emit("fused_add_rms_norm", ms, 4 * x.numel() * x.element_size(), num_tokens=num_tokens)
    query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cache = torch.randn(4096, HEAD_DIM, device="cuda")
    ms = triton.testing.do_bench(lambda: apply_rotary(query, key, positions, cache, inplace=True))
    _emit("apply_rotary", ms, 2 * (query.numel() + key.numel()) * query.element_size(), num_tokens=num_tokens)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device")
    if "--sweep-attention" in sys.argv[1:]:
        sweep_attention()
        return
    for deterministic in (False, True):
        bench_attention(256, 1, 2048, deterministic)
        bench_attention(4, 1, 16384, deterministic)
        bench_attention(1, 2048, 2048, deterministic)
        bench_attention(64, 5, 2048, deterministic)
    for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.9), (50, 0.9)):
        bench_sampler(256, top_k, top_p)
    bench_norm_and_rotary(256)
    bench_norm_and_rotary(8192)


if __name__ == "__main__":
    main()
