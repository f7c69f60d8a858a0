"""Typed engine configuration and a strict loader from YAML/dicts.

Every config is a keyword-only dataclass with a default and a docstring per field; cross-field rules are
checked in `__post_init__` with `ValueError`. `from_mapping` builds nested configs from plain dicts (as
parsed from YAML) and rejects unknown keys, naming the key and the file. Nothing here touches devices.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TypeVar

from runner.config import RunnerConfig, SpeculativeConfig

T = TypeVar("T")

_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything that fixes how one engine runs one model."""

    model: str
    """Local Hugging Face model directory (config.json + *.safetensors, optional tokenizer.json)."""
    tokenizer: str | None = None
    """Directory or tokenizer.json path; defaults to the model directory."""
    device: str = "cpu"
    """"cpu", "cuda" or "cuda:N"."""
    dtype: str = "auto"
    """Compute and weight dtype: float32, bfloat16, float16, or auto (the checkpoint's torch_dtype)."""
    max_model_len: int | None = None
    """Longest prompt + completion, in tokens; defaults to the model's max_position_embeddings capped at 8192."""
    max_num_seqs: int = 256
    """Most sequences (samples) running at once; also the number of persistent runner slots."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step: decode tokens + prefill chunks together."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """KV-cache blocks; None sizes the cache automatically (GPU: from free memory; CPU: kv_cache_bytes)."""
    kv_cache_bytes: int = 1 << 30
    """KV-cache budget on the CPU when num_kv_blocks is None."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory the engine may use, cache included."""
    enable_prefix_caching: bool = True
    """Share full KV blocks between requests with the same prefix (always on for a prompt's n samples)."""
    enforce_eager: bool = False
    """Disable CUDA-graph capture of decode."""
    seed: int = 0
    """Seeds the engine's generator for requests without their own seed."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (rank 0 is the engine's process; the engine spawns the others)."""
    tp_sampling: str = "sharded"
    """With tensor_parallel_size > 1: "sharded" (batch-sharded sampling: one all-to-all turns each rank's
    vocabulary shard of all rows into all of the vocabulary for its share of the rows; per-rank logits memory
    falls by the group size) or "allgather" (every rank gathers all logits and samples every row). Both
    sample the same tokens."""
    deterministic: bool = False
    """Batch-invariant kernels: per-token results independent of batch composition and chunking."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None disables it."""
    async_scheduling: bool | None = None
    """Schedule and stage step t+1 while step t runs on the device (tokens of t reach t+1 on the device);
    hides the host's per-step work behind the GPU's. Not with speculative decoding. None (the default)
    turns it on for CUDA without tensor parallelism (on the CPU the host is the device, so there is nothing
    to overlap and the bookkeeping only costs; under tensor parallelism it is opt-in: every rank stages its
    next step while the current one runs); the tokens are the same either way."""
    gc_freeze: bool = True
    """After start-up, move every object then alive out of the garbage collector's reach (`gc.freeze()`):
    a decode step allocates enough to trigger collections, and a full one would otherwise scan the whole
    heap (torch, the model, ...) for tens of milliseconds, stalling the device. Cycles among frozen
    objects are never collected; `close()` unfreezes them."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EngineConfig.model must name a model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"EngineConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if isinstance(self.speculative, Mapping):
            self.speculative = from_mapping(SpeculativeConfig, self.speculative, "EngineConfig.speculative")
        if self.tp_sampling not in ("sharded", "allgather"):
            raise ValueError(f"EngineConfig.tp_sampling must be 'sharded' or 'allgather', got {self.tp_sampling!r}")
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise ValueError("speculative decoding does not support tensor_parallel_size > 1 yet")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling does not support speculative decoding yet")
        if self.async_scheduling is None:
            self.async_scheduling = self.speculative is None and self.tensor_parallel_size == 1 and self.device != "cpu"


    def runner_config(self) -> RunnerConfig:
        """The fields the runner reads, as the runner's own config."""
        return RunnerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunnerConfig)})


def _resolve_type(tp: Any) -> Any:
    """The dataclass inside `X | None`, else `tp` itself."""
    if isinstance(tp, (types.UnionType,)) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def from_mapping(cls: type[T], data: Mapping[str, Any], source: str = "<dict>") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields.

    Raises ValueError naming the unknown key and `source` (a file path or a dotted location).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        tp = _resolve_type(hints[key])
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            value = from_mapping(tp, value, f"{source}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{source}: {e}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file into a dict; an empty file is an empty dict."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


__all__ = ["EngineConfig", "SpeculativeConfig", "from_mapping", "load_yaml"]
