"""Compute kernels of the engine.

Layout, per kernel family `x`:
  - `x.py`      a private Triton kernel (`_x_kernel`) and a typed public launcher that checks shapes,
                dtypes and strides before launching;
  - `x_ref.py`  the plain-torch reference with the same contract. The references are also the engine's
                CPU path, so they import without Triton.
`matmul.py` is the exception: deterministic mode's linear layer is cuBLAS over fixed-shape row blocks
(torch-only; see its docstring). `common.py` holds torch-only helpers the launchers share with their callers. Only the CUDA paths of
`runner/` and `weight_updates/` import the Triton files.
"""
