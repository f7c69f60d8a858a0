"""Where a whole `generate` call's time goes on the GPU: wall time against device-busy time, and the device
time split by kernel family, for one batch of the generation benchmark's workload. Prints JSON lines.

    python bench/timeline.py --batch 256                 # prompt 128 + 256 new, as bench/generate.py
    python bench/timeline.py --batch 1 --batch 256 --sync-scheduling

Rows: `host` (two unprofiled runs: the host's time per step by phase, `launch` including the graph
`replay` call, `wait` the host blocked on the device in `collect`, and the garbage collector's time),
`prefill` (a `generate` with max_tokens=1: the prompts' forward and one sample), `generate` (the full
workload) with `busy_ms` (union of kernel intervals), `idle_ms` (wall - busy: the device waiting on the
host) and `by_family_ms` (summed kernel time; families overlap nothing, streams are not concurrent here).
The profiler adds host overhead of its own, so compare rows of one run, not with bench/generate.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import SHAPES  # noqa: E402
from runner.testing import write_random_checkpoint  # noqa: E402

_FAMILIES = (  # (family, substrings of the kernel name); first match wins
    ("attention", ("attention", "flash", "fmha")),
    ("sampler", ("_sample",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "splitk")),
    ("norm", ("rms_norm",)),
    ("rotary_kv_store", ("rotary", "kv_store", "store_kv")),
    ("activation", ("silu", "act_and_mul", "gelu")),
    ("copy", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in _FAMILIES if any(k in low for k in keys)), "other")


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def stream_concurrency(prof, replays: int, top_kernels: int = 6) -> dict:
    """How the CUDA kernels `prof` recorded over `replays` replays of a graph used the device's streams, per replay:
    each stream's kernels (`launches`) and busy time (`busy_us`, the union of its kernels), the time kernels of two
    or more streams ran at once (`concurrent_us`), and for each stream the part of its busy time during which
    another stream ran too (`beside_others_us`): a side stream's work that the main stream's kernels hid; and the
    `top_kernels` kernel names by device time (launches and µs per replay, µs per launch; 0: none)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)  # the only export that names each kernel's stream
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    events = [e for e in events if e.get("cat") == "kernel"]
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"]["stream"])) for e in events]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e["name"][:50], []).append(float(e["dur"]))
    points = sorted([(start, 1, s) for start, _, s in kernels] + [(end, -1, s) for _, end, s in kernels])
    active: dict[int, int] = {}
    busy: dict[int, float] = {}
    beside: dict[int, float] = {}
    concurrent, last = 0.0, None
    for t, step, s in points:  # ends sort before starts at one time: touching kernels are not concurrent
        if last is not None and t > last:
            running = [k for k, n in active.items() if n > 0]
            for k in running:
                busy[k] = busy.get(k, 0.0) + t - last
                if len(running) > 1:
                    beside[k] = beside.get(k, 0.0) + t - last
            if len(running) > 1:
                concurrent += t - last
        active[s] = active.get(s, 0) + step
        last = t
    launches = Counter(s for _, _, s in kernels)
    per = {s: dict(launches=launches[s] // replays, busy_us=round(busy.get(s, 0.0) / replays, 1),
                   beside_others_us=round(beside.get(s, 0.0) / replays, 1)) for s in sorted(active)}
    use = dict(concurrent_us=round(concurrent / replays, 1), streams=per)
    if top_kernels:
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_kernels]
        use["top_kernels"] = {name: dict(launches=len(d) // replays, us=round(sum(d) / replays, 1),
                                         us_each=round(sum(d) / len(d), 2)) for name, d in top}
    return use


def host_row(engine, prompts, params, batch: int) -> dict:
    """One unprofiled `generate` with the host's time split by phase: `wait` is the host blocked on the
    device in `collect` (near zero per step means the device waits on the host instead: host-bound)."""
    runner, scheduler = engine.runner, engine.scheduler
    phases = {"wait": [], "collect": [], "launch": [], "replay": [], "schedule": [], "update": []}
    originals = {"collect": runner.collect, "launch": runner.launch, "schedule": scheduler.schedule,
                 "update": scheduler.update, "replay": runner.graphs.replay}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            phases[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    def timed_collect(handle):
        t0 = time.perf_counter()
        if handle.event is not None:
            handle.event.synchronize()
        phases["wait"].append(time.perf_counter() - t0)
        return originals["collect"](handle)

    gc_ms = {0: 0.0, 1: 0.0, 2: 0.0}
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms[info["generation"]] += (time.perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(on_gc)
    runner.launch = timed("launch", originals["launch"])
    runner.graphs.replay = timed("replay", originals["replay"])
    runner.collect = timed("collect", timed_collect)
    scheduler.schedule = timed("schedule", originals["schedule"])
    scheduler.update = timed("update", originals["update"])
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    gc.callbacks.remove(on_gc)
    runner.launch, runner.collect = originals["launch"], originals["collect"]
    del runner.graphs.replay  # the instance attribute shadowed the method
    scheduler.schedule, scheduler.update = originals["schedule"], originals["update"]
    waits = sorted(phases["wait"])
    steps = max(len(waits), 1)
    per_step = {f"{k}_ms": round(sum(v) / steps * 1e3, 3) for k, v in phases.items()}
    per_step["collect_ms"] = round(per_step["collect_ms"] - per_step["wait_ms"], 3)  # collect's own work
    return dict(kind="host", batch=batch, gc_freeze=engine.config.gc_freeze, wall_ms=round(wall * 1e3, 2),
                steps=len(waits),
                host_per_step_ms=round((wall - sum(waits)) / steps * 1e3, 3), per_step=per_step,
                wait_median_ms=round(waits[len(waits) // 2] * 1e3, 3) if waits else None,
                steps_waiting_under_50us=sum(x < 50e-6 for x in waits),
                gc_ms_by_generation={k: round(v, 1) for k, v in gc_ms.items()})


def run(path: str, dtype: str, batch: int, prompt_len: int, new_tokens: int, sync_scheduling: bool,
        gc_freeze: bool = True) -> list[dict]:
    from rollout import Engine, EngineConfig, SamplingParams

    kw = {"async_scheduling": False} if sync_scheduling else {}
    kw["gc_freeze"] = gc_freeze
    engine = Engine(EngineConfig(model=path, device="cuda", dtype=dtype, max_num_seqs=batch,
                                 max_model_len=prompt_len + new_tokens + 16, **kw))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model_config.vocab_size, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=1)
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up (compilation)
    rows = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, seed=1))
    torch.cuda.synchronize()
    rows.append(dict(kind="prefill", batch=batch, prompt_len=prompt_len, wall_ms=round((time.perf_counter() - t) * 1e3, 2)))
    for _ in range(2):  # the first full-length run may still meet one-off costs
        rows.append(host_row(engine, prompts, params, batch))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    engine.close()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]  # microseconds
    busy = busy_union(intervals) / 1e3
    by_family: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        fam = family(e.name)
        by_family[fam] = by_family.get(fam, 0.0) + e.time_range.elapsed_us() / 1e3
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3
    rows.append(dict(kind="generate", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                     sync_scheduling=sync_scheduling, wall_ms=round(wall * 1e3, 2), busy_ms=round(busy, 2),
                     idle_ms=round(wall * 1e3 - busy, 2), tokens_per_s=round(batch * new_tokens / wall, 1),
                     by_family_ms={k: round(v, 2) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
                     top_kernels_ms=[(k, round(v, 2)) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--sync-scheduling", action="store_true")
    ap.add_argument("--no-gc-freeze", action="store_true", help="EngineConfig(gc_freeze=False)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/timeline.py needs CUDA")
    spec = dict(SHAPES[args.shape])
    fam = spec.pop("family")
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, family=fam, dtype=args.dtype, std=0.02, **spec)
        for b in args.batch or [256]:
            for row in run(d, args.dtype, b, args.prompt_len, args.new_tokens, args.sync_scheduling,
                           not args.no_gc_freeze):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
