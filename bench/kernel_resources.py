"""What the one-launch linear + LoRA kernel (kernels/lora_linear.py) asks of an SM at the Llama-3.1-8B decode
shapes, read from the compiler without a GPU: registers per thread, bytes spilled to local memory, shared memory
per program, and how many programs of it one Hopper SM holds at once by those two, for each adapted projection
at the tile the engine picks (`linear_config_for`).

It compiles, never runs: Triton's driver is replaced by one that only names the target (sm_90a by default) and
every launch of the kernel becomes a compile, so it works on a CPU machine with Triton's NVIDIA backend (its
bundled ptxas reports the registers and spills). Its figures say whether a change moved register pressure or
spills, not how fast anything is; time kernels with `bench/lora_kernels.py` on a GPU.

    python bench/kernel_resources.py [--arch 90] [--baseline-linear FILE] [--systems NAME,...]

prints one JSON line per (system, projection); `--baseline-linear` adds another kernels/lora_linear.py (e.g.
`git show REV:kernels/lora_linear.py > bench/lora_linear_baseline.py`) as system "baseline"; `--systems` adds the
configs of `bench/lora_kernels.py`'s systems of that name (e.g. linear_by_shape_b_reshaped) on the current file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_resources compiles kernels: run it without TRITON_INTERPRET=1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.lora_kernels import LAYERS, linear_pickers, load_baseline  # noqa: E402


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: the target to compile for, device 0, stream 0; nothing is launched."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _sm(arch: int) -> str:
    """The name Triton compiles for: Hopper's arch-specific sm_90a (wgmma), sm_80 / sm_89 as they are."""
    return f"sm_{arch}a" if arch == 90 else f"sm_{arch}"


def _ptxas(arch: int) -> str:
    from triton import knobs
    from triton.backends.nvidia import compiler

    tool = compiler.get_ptxas(arch) if hasattr(compiler, "get_ptxas") else knobs.nvidia.ptxas
    return tool.path


def _resources(kernel, arch: int) -> dict:
    """Registers and spill bytes from ptxas -v on the compiled PTX; shared memory from the kernel's metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={_sm(arch)}", str(ptx), "-o",
                               str(Path(tmp, "k.cubin"))], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {done.stderr[-1000:]}")
    regs = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    shared, warps = kernel.metadata.shared, kernel.metadata.num_warps
    # Hopper's SM: 64 Ki registers (allocated per warp in units of 256), 228 KiB of shared memory (1 KiB of it
    # reserved per program), at most 32 programs
    by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps)
    by_shared = 233472 // (shared + 1024)
    return {"registers": regs, "spill_store_bytes": int(spills.group(1)), "spill_load_bytes": int(spills.group(2)),
            "shared_bytes": shared, "num_warps": warps, "programs_per_sm": min(by_regs, by_shared, 32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100 / H200)")
    ap.add_argument("--baseline-linear", default=None, help="another kernels/lora_linear.py, as system baseline")
    ap.add_argument("--systems", default="", help="bench/lora_kernels.py systems whose configs to compile too")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--distinct", type=int, default=16, help="adapters in use in the batch")
    args = ap.parse_args()

    import triton
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled = []
    launch = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = launch(self, *a, grid=grid, warmup=True, **kw)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    driver.set_active(_CompileOnlyDriver(args.arch))
    import kernels.lora_linear as current

    systems = {"current": (current, current.linear_config_for)}
    if args.baseline_linear:
        baseline = load_baseline(args.baseline_linear, "lora_linear_baseline")
        systems["baseline"] = (baseline, baseline.linear_config_for)
    pickers = linear_pickers(list(filter(None, args.systems.split(","))), "--systems")
    systems |= {name: (current, pick) for name, pick in pickers.items()}
    T, S, R = args.tokens, args.slots, args.rank
    idx = (torch.arange(T) % args.distinct).to(torch.int32)
    for system, (module, config_for) in systems.items():
        for layer, (in_features, slices) in LAYERS.items():
            n = sum(slices)
            # uninitialised tensors: nothing runs, only their dtypes, shapes and alignment reach the compiler
            x = torch.empty(T, in_features, dtype=torch.bfloat16)
            weight = torch.empty(n, in_features, dtype=torch.bfloat16)
            A = torch.empty(S, len(slices) * R, in_features, dtype=torch.bfloat16)
            B = torch.empty(S, n, R, dtype=torch.bfloat16)
            compiled.clear()
            module.linear_lora(x, weight, None, A, B, idx, torch.ones(S), slices=slices,
                               config=config_for(in_features, n))
            name, kernel = compiled[-1]
            print(json.dumps({"kind": "kernel_resources", "system": system, "layer": f"{layer}_proj", "kernel": name,
                              "arch": _sm(args.arch), "triton": triton.__version__, **_resources(kernel, args.arch),
                              "tokens": T, "slots": S, "rank": R, "distinct": args.distinct}), flush=True)


if __name__ == "__main__":
    main()
