"""Where a decode step's time goes: host phases (schedule, input prep, replay, copy-out, update) and the
device time of one captured decode graph, on a random model of a real shape. Prints JSON lines.

    python bench/profile_decode.py --device cuda --batch 1 --batch 64
    python bench/profile_decode.py --batch 256 --blas cublaslt   # the GEMMs through another BLAS backend
    python bench/profile_decode.py --shape qwen3-30b-a3b --batch 1  # MoE (random weights drawn on the device)
    python bench/profile_decode.py --shape qwen3-8b --batch 1 --fused-gemv-rows 0 --fused-gemv-rows 4  # 8B, dummy weights
    python bench/profile_decode.py --shape qwen3-30b-a3b --batch 1 --moe-decode off --moe-decode on --timeline 40

Host phases per step (synchronous scheduling, so nothing overlaps): schedule, launch (staging, uploads, the graph
launch call, `replay_call_ms` of it), collect (the wait for the device, then the tokens into the slots), update.
Device: `graph_in_step_ms` (from just before the launch call to the graph's end, in the step), `outside_graph_ms`
(step time minus that: host time the device waits for), `graph_replay_ms` (20 replays back to back),
`graph_single_replay_ms` (host time of one replay between syncs: launch latency included), the kernels by total
time, and with `--timeline N` one replay's kernel sum, the device's gaps between kernels and its first N kernels.
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


def _kernel_timeline(runner, size: int, sync, head: int) -> dict:
    """One replay under the profiler: its kernels in launch order (the first `head` names and microseconds), their
    summed time and the device's idle time between them (launch ramps inside the graph)."""
    from torch.autograd import DeviceType

    graph = runner.graphs.graphs[(size, False, False)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        sync()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kernels:
        return {}
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    return dict(replay_kernels_us=round(busy, 1), replay_gaps_us=round(span - busy, 1),
                first_kernels_us=[(e.name[:40], round(e.time_range.elapsed_us(), 1)) for e in kernels[:head]])


def measure(engine, device: str, batch: int, steps: int, timeline: int = 0) -> dict:
    """Per-step host phases and device times of `steps` decode steps of the engine's running batch."""
    sched, runner = engine.scheduler, engine.runner
    times = defaultdict(float)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    graphs = runner.graphs
    events = []  # (start, end) CUDA events around each in-step graph replay
    if graphs is not None:
        real_replay = graphs.replay

        def timed_replay(*args, **kwargs):  # the host's graph-launch call, and the graph's device time in the step
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            t = time.perf_counter()
            out = real_replay(*args, **kwargs)
            times["replay_call_ms"] += time.perf_counter() - t
            done.record()
            events.append((begin, done))
            return out

        graphs.replay = timed_replay
    sync()
    t_all = time.perf_counter()
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            handle = runner.launch(out)
            t2 = time.perf_counter()
            res = runner.collect(handle)
            t3 = time.perf_counter()
            sched.update(out, res)
            t4 = time.perf_counter()
            times["schedule_ms"] += t1 - t0
            times["launch_ms"] += t2 - t1  # staging, uploads and the replay call
            times["collect_ms"] += t3 - t2  # the wait for the device, then the tokens into the slots
            times["execute_ms"] += t3 - t1
            times["update_ms"] += t4 - t3
        total = time.perf_counter() - t_all
    finally:
        if graphs is not None:
            del graphs.replay  # the instance attribute: back to the class's method
    row = {k: round(v / steps * 1e3, 4) for k, v in times.items()}
    row.update(batch=batch, step_ms=round(total / steps * 1e3, 4), tokens_per_s=round(batch * steps / total, 1))
    if events:
        sync()
        in_step = sum(b.elapsed_time(e) for b, e in events) / len(events)
        row["graph_in_step_ms"] = round(in_step, 4)  # device time from before the launch call to the graph's end
        row["outside_graph_ms"] = round(total / steps * 1e3 - in_step, 4)
    if device.startswith("cuda") and graphs is not None:
        size = graphs.padded_size(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.graphs[(size, False, False)].replay()
        end.record()
        sync()
        row["graph_replay_ms"] = round(start.elapsed_time(end) / 20, 4)  # back to back: no launch latency
        sync()
        t = time.perf_counter()
        graphs.graphs[(size, False, False)].replay()
        sync()
        row["graph_single_replay_ms"] = round((time.perf_counter() - t) * 1e3, 4)  # host launch to device done
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graphs.graphs[(size, False, False)].replay()
            sync()
        averages = prof.key_averages()
        kernels = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in averages), key=lambda x: -x[1])[:14]
        row["top_kernels_us_and_launches"] = [(k[:60], round(t, 1), n) for k, t, n in kernels]
        row["launches_per_step"] = sum(e.count for e in averages) // 5
        if timeline:
            row.update(_kernel_timeline(runner, size, sync, timeline))
    return row


def set_moe_decode(engine, on: bool | None) -> None:
    """MoE models: the sparse blocks' decode path on (`SparseMoeBlock.decode_pairs` at its default) or off (0),
    the decode graphs captured again with it; None leaves it as it is."""
    from runner.models.qwen_moe import SparseMoeBlock

    if on is None:
        return
    want = SparseMoeBlock.__dict__["decode_pairs"] if on else 0
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks or all(b.decode_pairs == want for b in blocks):
        return
    for b in blocks:
        b.decode_pairs = want  # an instance attribute: the class default stays
    runner = engine.runner
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None
        runner.capture_graphs()


def profile(path: str, device: str, dtype: str, batch: int, prompt_len: int, steps: int, eager: bool,
            deterministic: bool = False, load_format: str = "safetensors", fused_gemv_rows: int | None = None,
            moe_decode: tuple[bool | None, ...] = (None,), timeline: int = 0) -> list[dict]:
    """One engine, `batch` requests decoding; a row per `moe_decode` setting (MoE models: the decode path on / off,
    the graphs recaptured between them)."""
    extra = {} if fused_gemv_rows is None else {"fused_gemv_rows": fused_gemv_rows}
    engine = Engine(EngineConfig(model=path, device=device, dtype=dtype, max_num_seqs=batch,
                                 max_model_len=prompt_len + len(moe_decode) * (steps + 8) + 64, enforce_eager=eager,
                                 deterministic=deterministic, async_scheduling=False, load_format=load_format, **extra))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model_config.vocab_size, (batch, prompt_len), generator=g).tolist()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=len(moe_decode) * (steps + 8) + 32, ignore_eos=True, seed=0))
    rows = []
    for on in moe_decode:
        set_moe_decode(engine, on)
        for _ in range(8):  # prefill (first setting) + warm-up decode steps
            engine.step()
        row = measure(engine, device, batch, steps, timeline)
        row.update(eager=eager, deterministic=deterministic, fused_gemv_rows=engine.config.fused_gemv_rows,
                   moe_decode="default" if on is None else ("on" if on else "off"))
        rows.append(row)
    engine.close()
    return rows


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
    ap.add_argument("--moe-decode", choices=["on", "off"], action="append",
                    help="MoE models: the sparse blocks' decode path (SparseMoeBlock.decode_pairs) on or off; repeat "
                         "to profile each on one engine (default: as the engine has it)")
    ap.add_argument("--timeline", type=int, default=0,
                    help="also list the first N kernels of one replay in order, with the device's gaps between kernels")
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
        moe = tuple(None if m is None else m == "on" for m in (args.moe_decode or [None]))
        for b in args.batch or [1, 64]:
            for rows in args.fused_gemv_rows or [None]:
                for row in profile(d, args.device, args.dtype, b, args.prompt_len, args.steps, args.eager,
                                   args.deterministic, load_format, rows, moe, args.timeline):
                    print(json.dumps({**row, "shape": args.shape, "blas": args.blas or "default"}), flush=True)


if __name__ == "__main__":
    main()
