"""Compile recorded Triton kernel specializations for an NVIDIA target, without a GPU (run by
tests/test_kernels_compile.py in a process without TRITON_INTERPRET, so `@triton.jit` gives real
JITFunctions).

stdin: a JSON list of {"module", "kernel", "signature": {param: type}, "constexprs": {param: value},
"options": {...}}; argv: compute capabilities (default 90). stdout: a JSON list of {"kernel", "arch",
"signature", "error"} for the specializations that did not compile (empty when all did).
"""

from __future__ import annotations

import importlib
import json
import sys


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    archs = [int(a) for a in sys.argv[1:]] or [90]  # 90: the H200 (and H100); 80: the A100
    failures = []
    for spec in json.load(sys.stdin):
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        names = list(spec["signature"])
        constexprs = {(names.index(k),): v for k, v in spec["constexprs"].items()}
        for arch in archs:
            try:
                triton.compile(ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs),
                               target=GPUTarget("cuda", arch, 32), options=spec["options"])
            except Exception as e:  # compiler errors come in many types; the message is what matters
                failures.append({"kernel": spec["kernel"], "arch": arch, "signature": spec["signature"],
                                 "error": f"{type(e).__name__}: {e}"[:2000]})
    json.dump(failures, sys.stdout)


if __name__ == "__main__":
    main()
