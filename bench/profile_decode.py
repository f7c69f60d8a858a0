"""Where a decode step's time goes: host phases (schedule, input prep, replay, copy-out, update) and the
device time of one captured decode graph, on a random model of a real shape. Prints JSON lines.

    python bench/profile_decode.py --device cuda --batch 1 --batch 64
    python bench/profile_decode.py --batch 256 --blas cublaslt   # the GEMMs through another BLAS backend
    python bench/profile_decode.py --shape qwen3-30b-a3b --batch 1  # MoE (random weights drawn on the device)
    python bench/profile_decode.py --shape qwen3-8b --batch 1 --fused-gemv-rows 0 --fused-gemv-rows 4  # 8B, dummy weights
    python bench/profile_decode.py --shape qwen3-8b --batch 1 --pdl off --pdl on  # without / with kernels/pdl.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import SHAPES  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from runner.testing import MODEL_SHAPES, write_config, write_random_checkpoint  # noqa: E402


def profile(path: str, device: str, dtype: str, batch: int, prompt_len: int, steps: int, eager: bool,
            deterministic: bool = False, load_format: str = "safetensors", fused_gemv_rows: int | None = None,
            programmatic_launch: bool | None = None) -> dict:
    extra = {} if fused_gemv_rows is None else {"fused_gemv_rows": fused_gemv_rows}
    if programmatic_launch is not None:
        extra["programmatic_launch"] = programmatic_launch
    engine = Engine(EngineConfig(model=path, device=device, dtype=dtype, max_num_seqs=batch,
                                 max_model_len=prompt_len + steps + 64, enforce_eager=eager,
                                 deterministic=deterministic, async_scheduling=False, load_format=load_format, **extra))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model_config.vocab_size, (batch, prompt_len), generator=g).tolist()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 32, ignore_eos=True, seed=0))
    for _ in range(8):  # prefill + warm-up decode steps
        engine.step()
    sched, runner = engine.scheduler, engine.runner
    times = defaultdict(float)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t_all = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        res = runner.execute(out)
        t2 = time.perf_counter()
        sched.update(out, res)
        t3 = time.perf_counter()
        times["schedule_ms"] += t1 - t0
        times["execute_ms"] += t2 - t1
        times["update_ms"] += t3 - t2
    total = time.perf_counter() - t_all
    row = {k: round(v / steps * 1e3, 4) for k, v in times.items()}
    row.update(batch=batch, eager=eager, deterministic=deterministic, fused_gemv_rows=engine.config.fused_gemv_rows,
               programmatic_launch=engine.config.programmatic_launch, step_ms=round(total / steps * 1e3, 4),
               tokens_per_s=round(batch * steps / total, 1))
    if device.startswith("cuda") and runner.graphs is not None:
        size = runner.graphs.padded_size(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            runner.graphs.graphs[(size, False, False)].replay()
        end.record()
        sync()
        row["graph_replay_ms"] = round(start.elapsed_time(end) / 20, 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.graphs.graphs[(size, False, False)].replay()
            sync()
        events = prof.key_averages()
        kernels = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in events), key=lambda x: -x[1])[:14]
        row["top_kernels_us_and_launches"] = [(k[:60], round(t, 1), n) for k, t, n in kernels]
        row["launches_per_step"] = sum(e.count for e in events) // 5
    engine.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted({*SHAPES, *MODEL_SHAPES, "qwen3-30b-a3b"}))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="profile the engine in deterministic mode")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="torch.backends.cuda.preferred_blas_library for the run (default: torch's choice)")
    ap.add_argument("--fused-gemv-rows", type=int, action="append",
                    help="EngineConfig.fused_gemv_rows; repeat to profile each (default: the engine's)")
    ap.add_argument("--pdl", choices=["on", "off"], action="append",
                    help="EngineConfig.programmatic_launch; repeat to profile each (default: the engine's)")
    args = ap.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    with tempfile.TemporaryDirectory() as d:
        load_format = "safetensors"
        if args.shape == "qwen3-30b-a3b":
            from bench.moe import QWEN3_30B_A3B

            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(dict(QWEN3_30B_A3B, dtype=args.dtype), f)
            load_format = "dummy"
        elif args.shape not in SHAPES:  # a real policy size: the engine draws its weights on the device
            spec = dict(MODEL_SHAPES[args.shape])
            write_config(d, dtype=args.dtype, **spec)
            load_format = "dummy"
        else:
            spec = dict(SHAPES[args.shape])
            family = spec.pop("family")
            write_random_checkpoint(d, family=family, dtype=args.dtype, std=0.02, **spec)
        for b in args.batch or [1, 64]:
            for rows in args.fused_gemv_rows or [None]:
                for pdl in args.pdl or [None]:
                    row = profile(d, args.device, args.dtype, b, args.prompt_len, args.steps, args.eager,
                                  args.deterministic, load_format, rows, None if pdl is None else pdl == "on")
                    print(json.dumps({**row, "blas": args.blas or "default"}), flush=True)


if __name__ == "__main__":
    main()
