"""Compile recorded Triton kernel specializations for an NVIDIA target, without a GPU (run by
tests/test_kernels_compile.py in a process without TRITON_INTERPRET, so `@triton.jit` gives real
JITFunctions).

stdin: a JSON list of {"module", "kernel", "signature": {param: type}, "constexprs": {param: value},
"options": {...}}. stdout: a JSON list of {"kernel", "signature", "error"} for the specializations that did
not compile (empty when all did).
"""

from __future__ import annotations

import importlib
import json
import sys


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)  # the H200
    failures = []
    for spec in json.load(sys.stdin):
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        names = list(spec["signature"])
        constexprs = {(names.index(k),): v for k, v in spec["constexprs"].items()}
        try:
            triton.compile(ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs),
                           target=target, options=spec["options"])
        except Exception as e:  # compiler errors come in many types; the message is what matters
            failures.append({"kernel": spec["kernel"], "signature": spec["signature"], "error": f"{type(e).__name__}: {e}"[:2000]})
    json.dump(failures, sys.stdout)


if __name__ == "__main__":
    main()
