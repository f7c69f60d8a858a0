"""bench/kernel_resources.py on the CPU: it compiles the fused linear + LoRA kernel for sm_90a at the 8B decode
shapes without running it and reads registers, spills, shared memory and programs an SM holds; the same source
given as the baseline, and the engine's configs named as a bench system, report the same figures. Skipped where
Triton has no NVIDIA backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_resources_of_each_projection_and_of_the_same_source_as_baseline():
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip(f"triton {triton.__version__} has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--baseline-linear",
                           str(ROOT / "kernels" / "lora_linear.py"), "--distinct", "4", "--systems", "linear_by_shape"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    by_system = {s: {r["layer"]: r for r in records if r["system"] == s}
                 for s in ("current", "baseline", "linear_by_shape")}
    assert sorted(by_system["current"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    for layer, r in by_system["current"].items():
        assert r["arch"] == "sm_90a" and r["kernel"] == "_linear_lora_kernel"
        assert 32 <= r["registers"] <= 255 and r["spill_store_bytes"] >= 0, r
        assert 0 < r["shared_bytes"] <= 227 * 1024, r  # within an H100 / H200 SM's shared memory per program
        assert 1 <= r["programs_per_sm"] <= 32 and r["num_warps"] >= 1, r
        keys = ("registers", "spill_store_bytes", "spill_load_bytes", "shared_bytes")
        for same in ("baseline", "linear_by_shape"):
            assert {k: r[k] for k in keys} == {k: by_system[same][layer][k] for k in keys}, (same, layer)


def test_it_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode != 0 and "without TRITON_INTERPRET" in done.stderr
