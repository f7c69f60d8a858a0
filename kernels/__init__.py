"""Compute kernels of the engine.

Layout, per kernel family `x`:
  - `x.py`      a private Triton kernel (`_x_kernel`) and a typed public launcher that checks shapes,
                dtypes and strides before launching;
  - `x_ref.py`  the plain-torch reference with the same contract. The references are also the engine's
                CPU path, so they import without Triton.
`matmul.py` is the exception: deterministic mode's linear layer is cuBLAS over fixed-shape row blocks
(torch-only; see its docstring). `common.py` holds torch-only helpers the launchers share with their callers. Only the CUDA paths of
`runner/` and `weight_updates/` import the Triton files.

This package's import name is also that of Hugging Face's `kernels` distribution (which transformers >= 5.25
requires); with both installed, whichever comes first on `sys.path` wins. `__getattr__` below turns the other
side's confusing "cannot import name" into an error that says so.
"""
import importlib.metadata
import pathlib

_HERE = pathlib.Path(__file__).parent


def _hub_kernels_installed() -> bool:
    """Whether Hugging Face's `kernels` distribution is installed beside this package."""
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def __getattr__(name: str):
    ours = name.startswith("_") or (_HERE / f"{name}.py").exists()
    if not ours and _hub_kernels_installed():
        raise ImportError(
            f"kernels.{name}: this `kernels` is rollout-engine's ({_HERE}), not Hugging Face's `kernels` "
            "distribution, which is also installed (transformers >= 5.25 requires it); the two share an import "
            "name. Install transformers < 5.25 and `pip uninstall kernels` in this environment.")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
