"""bench/lora.py --quick on the CPU: the script runs end to end and reports every case it promises (base, slot
engine per distinct-adapter count with the default hooks, with `lora_deferred` and with `lora_fused_linear`, merged
engine, adapter pushes dense then patch, the base push); the stream accounting its `--profile` rows carry
(`stream_use`), on a hand-made trace; `--linear-system` handing the engine a bench system's fused-linear configs."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_reports_each_case_with_the_merged_and_deferred_engines():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora.py"), "--quick", "--merged", "--deferred",
                          "--fused-linear"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    decode = {(d["system"], d["distinct"]) for d in lines if d["kind"] == "decode"}
    assert decode == {("base", 0), ("lora", 0), ("lora", 1), ("lora", 4), ("merged", 1)}
    assert all(d["tokens_per_s"] > 0 for d in lines if d["kind"] == "decode")
    slot = [(d["lora_deferred"], d["lora_fused_linear"], d["distinct"]) for d in lines
            if d["kind"] == "decode" and d["system"] == "lora"]
    assert slot == [(deferred, fused, k) for deferred, fused in ((False, False), (True, False), (False, True))
                    for k in (0, 1, 4)]
    for system in (None, "merged"):
        pushes = [d for d in lines if d["kind"] == "lora_push" and d.get("system") == system]
        assert [p["mode"] for p in pushes] == ["dense", "patch"], system
        dense, patch = pushes
        assert dense["payload_bytes"] == dense["tensor_bytes"] and 0 < patch["payload_bytes"] < dense["payload_bytes"]
        assert patch["lora_version"] == dense["lora_version"] + 1
    assert [d["mode"] for d in lines if d["kind"] == "base_push"] == ["dense"]


class _Trace:
    """A stand-in for a finished torch.profiler run: `export_chrome_trace` writes the given kernel events."""

    def __init__(self, kernels):
        self.kernels = kernels

    def export_chrome_trace(self, path):
        events = [{"cat": "kernel", "name": f"k{s}", "ts": ts, "dur": dur, "args": {"stream": s}}
                  for ts, dur, s in self.kernels]
        events.append({"cat": "cpu_op", "ts": 0, "dur": 1000, "args": {}})  # not a kernel: not counted
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


def test_stream_use_counts_busy_time_and_time_beside_another_stream_per_replay():
    sys.path.insert(0, ROOT)
    from bench.timeline import stream_concurrency

    # two replays of: stream 7 runs [0, 10) and [10, 20) back to back, stream 9 runs [5, 15) and [30, 35)
    kernels = [(0, 10, 7), (10, 10, 7), (5, 10, 9), (30, 5, 9)]
    kernels += [(ts + 100, dur, s) for ts, dur, s in kernels]
    use = stream_concurrency(_Trace(kernels), replays=2)
    assert use["concurrent_us"] == 10.0
    assert use["streams"] == {7: {"launches": 2, "busy_us": 20.0, "beside_others_us": 10.0},
                              9: {"launches": 2, "busy_us": 15.0, "beside_others_us": 10.0}}
    assert use["top_kernels"] == {"k7": {"launches": 2, "us": 20.0, "us_each": 10.0},
                                  "k9": {"launches": 2, "us": 15.0, "us_each": 7.5}}


def test_linear_system_gives_the_engine_a_bench_systems_configs_and_refuses_an_unknown_name(monkeypatch):
    sys.path.insert(0, ROOT)
    import kernels.lora_linear as module
    from bench.lora_kernels import linear_pickers

    engine_own = module.linear_config_for(4096, 6144)
    assert engine_own.expand_b_rows and engine_own.lora.shrink_stages != 2
    own = module.linear_config_for
    pickers = linear_pickers(["linear_by_shape_b_reshaped_shrink_stages2", "linear_bn64", "linear_by_shape"],
                             "--linear-system")
    # what bench/lora.py does before each fused-linear engine (restored after the test)
    monkeypatch.setattr(module, "linear_config_for", pickers["linear_by_shape_b_reshaped_shrink_stages2"])
    chosen = module.linear_config_for(4096, 6144)
    assert not chosen.expand_b_rows and chosen.lora.shrink_stages == 2
    assert chosen.block_n == engine_own.block_n  # the tile of the layer's shape is kept
    assert module.linear_config_for(4096, 28672).block_n == module.WIDE_CONFIG.block_n
    monkeypatch.setattr(module, "linear_config_for", pickers["linear_bn64"])  # a fixed config: every shape
    assert module.linear_config_for(14336, 4096).block_n == 64
    monkeypatch.setattr(module, "linear_config_for", pickers["linear_by_shape"])  # the engine's own
    assert module.linear_config_for is own
    with pytest.raises(SystemExit, match="--linear-system must be one of"):
        linear_pickers(["linear_by_shape", "no_such_system"], "--linear-system")


def test_quick_run_with_two_linear_systems_runs_one_fused_engine_each_against_one_base():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora.py"), "--quick", "--fused-linear", "only",
                          "--linear-system", "linear_by_shape,linear_by_shape_chunk8", "--distinct", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    decode = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    decode = [d for d in decode if d["kind"] == "decode"]
    assert [(d["system"], d.get("linear_system"), d["distinct"]) for d in decode] == [
        ("base", None, 0), ("lora", "linear_by_shape", 0), ("lora", "linear_by_shape", 1),
        ("lora", "linear_by_shape_chunk8", 0), ("lora", "linear_by_shape_chunk8", 1)]


def test_linear_system_without_fused_linear_is_refused_before_any_engine():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora.py"), "--quick", "--linear-system",
                          "linear_by_shape"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0 and "--linear-system needs --fused-linear" in run.stderr, run.stderr[-2000:]
    assert not run.stdout.strip()  # nothing measured
