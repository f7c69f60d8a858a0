"""bench/lora.py --quick on the CPU: the script runs end to end and reports every case it promises (base, slot
engine per distinct-adapter count with the default hooks and with `lora_deferred`, merged engine, adapter pushes
dense then patch, the base push)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_reports_each_case_with_the_merged_and_deferred_engines():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora.py"), "--quick", "--merged", "--deferred"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    decode = {(d["system"], d["distinct"]) for d in lines if d["kind"] == "decode"}
    assert decode == {("base", 0), ("lora", 0), ("lora", 1), ("lora", 4), ("merged", 1)}
    assert all(d["tokens_per_s"] > 0 for d in lines if d["kind"] == "decode")
    slot = [(d["lora_deferred"], d["distinct"]) for d in lines if d["kind"] == "decode" and d["system"] == "lora"]
    assert slot == [(False, 0), (False, 1), (False, 4), (True, 0), (True, 1), (True, 4)]
    for system in (None, "merged"):
        pushes = [d for d in lines if d["kind"] == "lora_push" and d.get("system") == system]
        assert [p["mode"] for p in pushes] == ["dense", "patch"], system
        dense, patch = pushes
        assert dense["payload_bytes"] == dense["tensor_bytes"] and 0 < patch["payload_bytes"] < dense["payload_bytes"]
        assert patch["lora_version"] == dense["lora_version"] + 1
    assert [d["mode"] for d in lines if d["kind"] == "base_push"] == ["dense"]
