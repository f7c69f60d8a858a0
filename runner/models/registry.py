"""Which model class serves which architecture: `config.json`'s `architectures` -> a registered class.

`ModelRegistry.register_model("SomeArchForCausalLM", cls)` (vLLM's name and call) makes an architecture
loadable; `cls` may also be a "module.path:ClassName" string, imported when first needed (the built-in
models register so in `runner/models/__init__.py`). `get_supported_archs()` lists what can be loaded;
`resolve(architectures)` is what `runner.model_config.ModelConfig` and the loader use. A class must offer
`runner.models.interface.CausalLM`; the registry checks that its methods exist, not their signatures.

Registrations are per process; the tensor-parallel worker ranks (spawned processes) receive rank 0's as
import paths (`import_paths`), so a model class defined at the top level of any importable module (a
test file included) serves every rank. Not here: building or loading a model (runner/loader.py).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from runner.models.interface import REQUIRED_METHODS

logger = logging.getLogger(__name__)


class _ModelRegistry:
    """Architecture name -> model class; `ModelRegistry` is the one the loader reads."""

    def __init__(self) -> None:
        self._models: dict[str, type | str] = {}  # architecture -> model class, or "module:Class" until imported

    def register_model(self, architecture: str, model_cls: type | str) -> None:
        """Serve checkpoints whose config.json lists `architecture` with `model_cls` (a class, or a
        "module.path:ClassName" string imported on first use); a second registration of the same name
        replaces the first (with a warning)."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
        if isinstance(model_cls, str):
            if model_cls.count(":") != 1 or not all(model_cls.split(":")):
                raise ValueError(f"model_cls for {architecture} must be a class or 'module.path:ClassName', "
                                 f"got {model_cls!r}")
        elif isinstance(model_cls, type):
            _check_methods(architecture, model_cls)
        else:
            raise ValueError(f"model_cls for {architecture} must be a class, got {model_cls!r}")
        old = self._models.get(architecture)
        if old is not None and old != model_cls:
            logger.warning("architecture %s was served by %s; now by %s", architecture, _name(old), _name(model_cls))
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        """Every registered architecture, sorted."""
        return sorted(self._models)

    def import_paths(self) -> dict[str, str]:
        """Every registration as "module:Class", for another process to register the same; classes that no
        other process can import (defined in a function, or in a script run as __main__) are left out."""
        paths = {}
        for arch, model_cls in self._models.items():
            path = _name(model_cls)
            if "<locals>" not in path and not path.startswith("__main__:"):
                paths[arch] = path
        return paths

    def resolve(self, architectures: Sequence[str], source: str = "config.json") -> tuple[str, type]:
        """(architecture, class) of the first registered name in `architectures`; ValueError naming the
        supported list when there is none."""
        for arch in architectures:
            if arch in self._models:
                return arch, self._load(arch)
        raise ValueError(f"{source}: unknown architecture {list(architectures)!r}; "
                         f"supported: {self.get_supported_archs()}")

    def _load(self, arch: str) -> type:
        model_cls = self._models[arch]
        if isinstance(model_cls, str):
            module, name = model_cls.split(":")
            model_cls = getattr(importlib.import_module(module), name)
            _check_methods(arch, model_cls)
            self._models[arch] = model_cls
        return model_cls


def _check_methods(architecture: str, model_cls: type) -> None:
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(model_cls, m, None))]
    if missing:
        raise ValueError(f"{model_cls.__qualname__} cannot serve {architecture}: it lacks {missing} "
                         "(see runner.models.interface.CausalLM)")


def _name(model_cls: type | str) -> str:
    return model_cls if isinstance(model_cls, str) else f"{model_cls.__module__}:{model_cls.__qualname__}"


ModelRegistry = _ModelRegistry()
