"""Small-batch projections: the fused Triton GEMV (`kernels/gemv.py`) against what it replaces. JSON lines.

    python bench/gemv.py                 # GPU: every shape at 1, 2, 4 and 8 rows, plus a tile sweep at 1 row (about 4 minutes)
    python bench/gemv.py --no-sweep

Per (model shape, projection, rows) one row: `ref_us` for the unfused path the engine runs otherwise (the
norm or activation kernel, then cuBLAS through `F.linear`), `fused_us` for `fused_gemv` with its default
tiles and the prologue inside, `split_us` for the norm or activation kernel followed by the plain `fused_gemv`
(the engine's path for weights above `kernels.gemv.PROLOGUE_MAX_WEIGHT_BYTES`), `best_us` / `best` for the fastest tile choice of the sweep over the engine's path (`engine_path`: fused where
`fuses_prologue`, else split; `default` / `split_default`: the tiles `pick_config` gives each path), and each one's `gbps` = weight bytes /
time (the weights dominate the bytes at these row counts). Times come from a CUDA graph of many calls
that walk through enough weight copies to exceed the L2 cache (as a decode step does: every weight is
read once per step), so they hold no launch gaps a graph replay would not have. The copy bandwidth
measured in the same run is the ceiling. Not here: whole decode steps (bench/profile_decode.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generate import copy_bandwidth  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.gemv import GemvConfig, fused_gemv, fuses_prologue, pick_config  # noqa: E402
from kernels.norm import fused_add_rms_norm  # noqa: E402

# (shape, projection, N, K, prologue, bias)
CASES = [
    ("qwen2.5-0.5b", "qkv", 1152, 896, "rms_norm", True),
    ("qwen2.5-0.5b", "o", 896, 896, "none", False),
    ("qwen2.5-0.5b", "gate_up", 9728, 896, "rms_norm", False),
    ("qwen2.5-0.5b", "down", 896, 4864, "silu_mul", False),
    ("qwen2.5-0.5b", "lm_head", 151936, 896, "none", False),
    ("qwen3-8b", "qkv", 6144, 4096, "rms_norm", False),
    ("qwen3-8b", "o", 4096, 4096, "none", False),
    ("qwen3-8b", "gate_up", 24576, 4096, "rms_norm", False),
    ("qwen3-8b", "down", 4096, 12288, "silu_mul", False),
    ("qwen3-8b", "lm_head", 151936, 4096, "none", False),
    ("qwen3-30b-a3b", "qkv", 5120, 2048, "rms_norm", False),
    ("qwen3-30b-a3b", "o", 2048, 4096, "none", False),
    ("qwen3-30b-a3b", "router", 128, 2048, "rms_norm", False),
]
L2_BYTES = 256 << 20  # walk through at least this many weight bytes per graph (H200's L2: 50 MB)


def graph_us(fn, calls: int) -> float:
    """Microseconds per call of `fn(i)` for i in range(calls), captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up: compiles, workspaces
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def bench_case(shape, proj, n, k, prologue, has_bias, rows, dtype, sweep) -> dict:
    wbytes = n * k * dtype.itemsize
    copies = max(2, -(-L2_BYTES // wbytes))
    calls = max(copies, 32)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
    cols = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    residual = torch.randn(rows, k, device="cuda", dtype=dtype)
    norm_w = torch.randn(k, device="cuda", dtype=dtype)

    def ref(i):
        w = weights[i % copies]
        if prologue == "rms_norm":
            h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        elif prologue == "silu_mul":
            h = silu_and_mul(x)
        else:
            h = x
        return torch.nn.functional.linear(h, w, bias)

    def split(i, cfg=None):  # the engine's path for weights too large for a fused prologue: the kernel, then the plain GEMV
        w = weights[i % copies]
        if prologue == "rms_norm":
            h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        elif prologue == "silu_mul":
            h = silu_and_mul(x)
        else:
            h = x
        return fused_gemv(h, w, bias, config=cfg)

    def fused(cfg):
        kw = dict(norm_weight=norm_w, residual=residual) if prologue == "rms_norm" else {}
        return lambda i: fused_gemv(x, weights[i % copies], bias, prologue=prologue, config=cfg, **kw)

    out = fused(None)(0)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out.float(), ref(0).float(), rtol=2e-2, atol=2e-2)
    row = {"shape": shape, "proj": proj, "rows": rows, "n": n, "k": k, "prologue": prologue,
           "ref_us": round(graph_us(ref, calls), 2), "fused_us": round(graph_us(fused(None), calls), 2),
           "split_us": round(graph_us(split, calls), 2),
           "default": list(vars_of(pick_config(rows, n, k, x.device, prologue))),
           "split_default": list(vars_of(pick_config(rows, n, k, x.device)))}
    # the sweep times the engine's path: the prologue inside the product where `fuses_prologue`, else split
    fuses = prologue == "none" or fuses_prologue(prologue, weights[0])
    row["engine_path"] = "fused" if fuses else "split"
    if sweep:
        timed = []
        for bn, bkk, nw in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096), (2, 4, 8, 16)):
            per_thread = bn * bkk * rows // (32 * nw)  # weight elements each thread holds per K step
            if not 8 <= per_thread <= 64 or bkk > max(triton.next_power_of_2(k), 256):
                continue
            cfg = GemvConfig(block_n=bn, block_k=bkk, num_warps=nw)
            fn = fused(cfg) if fuses else (lambda i, c=cfg: split(i, c))
            timed.append((graph_us(fn, calls), (bn, bkk, nw)))
        timed.sort()
        best_us, best = timed[0]
        row.update(best_us=round(best_us, 2), best=list(best),
                   next_best=[[round(us, 2), *cfg] for us, cfg in timed[1:4]], configs_timed=len(timed))
    for key in ("ref_us", "fused_us", "split_us", "best_us"):
        if key in row:
            row[key.replace("_us", "_gbps")] = round(wbytes / row[key] / 1e3, 1)
    return row


def vars_of(cfg: GemvConfig) -> tuple[int, int, int]:
    return cfg.block_n, cfg.block_k, cfg.num_warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py needs CUDA")
    print(json.dumps({"copy_gbps": round(copy_bandwidth("cuda") / 1e9, 1),
                      "device": torch.cuda.get_device_name()}), flush=True)
    shapes = None if args.shapes is None else set(args.shapes.split(","))
    for case in CASES:
        if shapes is not None and case[0] not in shapes:
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            row = bench_case(*case, rows, torch.bfloat16, sweep=not args.no_sweep and rows == 1)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
