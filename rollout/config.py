"""Typed engine configuration and a strict loader from YAML/dicts.

Every config is a keyword-only dataclass with a default and a docstring per field; cross-field rules are
checked in `__post_init__` with `ValueError`. `from_mapping` builds nested configs from plain dicts (as
parsed from YAML), rejects unknown keys, naming the key and the file, and checks every value against its
field's annotation (`int | None`, nested configs, `list[int]`, ...; bool is not an int), naming the key and
the expected type. `load_yaml` reports malformed YAML by file, line and column. Nothing here touches devices
or resolves model ids (rollout/model_files.py does, when the engine starts).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from runner.config import RunnerConfig, SpeculativeConfig

T = TypeVar("T")

_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything that fixes how one engine runs one model."""

    model: str
    """Hugging Face model directory (config.json + *.safetensors, optional tokenizer.json), or a model id on the
    Hugging Face hub ("Qwen/Qwen3-8B"), found in the local Hugging Face cache or downloaded into it when the
    engine starts (see rollout/model_files.py)."""
    tokenizer: str | None = None
    """Directory, tokenizer.json path or hub model id; defaults to the model's directory."""
    device: str = "cpu"
    """"cpu", "cuda" or "cuda:N"."""
    dtype: str = "auto"
    """Compute and weight dtype: float32, bfloat16, float16, or auto (the checkpoint's torch_dtype)."""
    load_format: str = "safetensors"
    """"safetensors" reads the checkpoint's weights; "dummy" draws every weight at random on the device
    instead (seeded by `seed`; the model directory needs only config.json): benchmarks at real sizes
    without writing tens of GB of random checkpoint."""
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
    fused_gemv_rows: int = 1
    """CUDA, outside deterministic mode: forwards of at most this many tokens (batch-1 decode by default) run
    every projection and the LM head as Triton matrix-vector kernels, the residual add + RMSNorm before qkv and
    gate_up and the SiLU-and-mul before down folded in (kernels/gemv.py), instead of cuBLAS and separate
    kernels. 0 turns them off; at most 8 (each extra row costs the kernels about a weight read more)."""
    seed: int = 0
    """Seeds the engine's generator for requests without their own seed."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (rank 0 is the engine's process; the engine spawns the others)."""
    tp_sampling: str = "sharded"
    """With tensor_parallel_size > 1: "sharded" (batch-sharded sampling: one all-to-all turns each rank's
    vocabulary shard of all rows into all of the vocabulary for its share of the rows; per-rank logits memory
    falls by the group size) or "allgather" (every rank gathers all logits and samples every row). Both
    sample the same tokens."""
    expert_parallel: bool = False
    """With tensor_parallel_size=P > 1 and a MoE model: each MoE layer's experts are split over the ranks
    (rank r holds experts [r * E / P, (r + 1) * E / P) whole; P must divide num_experts) instead of every
    expert's intermediate dimension; attention stays tensor-parallel and the router replicated, so routing is
    the same. Each rank computes its experts' terms for every token and the block output is summed over the
    ranks (one all-reduce, as without it). Refused for a dense model."""
    deterministic: bool = False
    """Batch-invariant kernels: per-token results independent of batch composition and chunking."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None disables it."""
    enable_return_routed_experts: bool = True
    """MoE models: keep a routing store next to the KV cache (int32 [KV slots, MoE layers, top_k], counted in
    the cache's sizing), so that requests may ask for `SamplingParams.return_routed_experts`; False leaves it
    out (such requests are then refused). Dense models have no store either way."""
    max_loras: int = 0
    """LoRA adapters the engine can hold at once (`Engine.load_lora`): one preallocated device slot each, for
    every decoder layer's adapted linears, so adapters are loaded, swapped and pushed in place and CUDA graphs stay
    valid. 0 turns LoRA off at no cost (no slots, no per-token index, the graphs of a plain engine). Not yet with
    tensor_parallel_size > 1 or speculative decoding."""
    max_lora_rank: int = 16
    """Largest adapter rank r the slots hold (a smaller rank is zero-padded, which adds exact zeros)."""
    lora_target_modules: tuple[str, ...] | None = None
    """Which checkpoint modules get adapter slots (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj; a fused layer gets slots for all of its modules); None: every one the model supports (MoE models:
    the attention projections). An adapter of another module is refused at load. In merged mode: the modules
    whose base weights are kept (see `lora_merged`)."""
    lora_overlap: bool = False
    """CUDA, slot mode: each adapted linear starts its adapters' shrink (x @ A^T, which needs only the layer's input)
    on a second CUDA stream before the base matmul, so the two run at once and only the expand (and its add into
    the base output) follows the matmul, in eager steps and in the captured decode graphs alike. False runs all of
    the LoRA work after the matmul (the default: measured at the Llama-3.1-8B shape, batch
    64, rank 16, the overlap took 15% off the hooks' time in a graph of the layers' matmuls alone but made the
    engine 1% faster with one adapter in the batch and 3-6% slower with 4 or 16: the matmuls leave the shrink little
    room beside them). The outputs are bitwise the same either way."""
    lora_deferred: bool = False
    """Slot mode: every adapted linear computes its delta beside its base matmul (on CUDA on a second stream), so
    its LoRA kernels leave the step's critical path: `o_proj` and `down_proj`, whose outputs only join the
    residual sum, add it to that sum (the residual add after the layer then sums the two); `gate_up_proj` leaves
    it in float32 to the SiLU-and-mul that reads its output; `qkv_proj` adds the float32 delta to its output after
    the matmul (one elementwise add). The sums are rounded in another order than the default's, so the outputs
    differ from it in the last bits. Not with `lora_overlap`, which it replaces."""
    lora_fused_linear: bool | None = None
    """CUDA, slot mode: a forward with adapter tokens and at most 64 tokens (a decode step) runs each adapted linear
    as one Triton launch, the base GEMM and the adapters' deltas together (`kernels.lora_linear.linear_lora`: the
    shrink's programs first, then the GEMM's, which add each row's delta in their epilogue; each layer with the tile
    of its shape, `kernels.lora_linear.linear_config_for`), in place of cuBLAS's GEMM and the LoRA kernel after it.
    The base GEMM then rounds as the Triton kernel does, not as cuBLAS does, so the outputs differ from the
    default's in the last bits. Not in deterministic mode (its linears stay batch-invariant; True beside
    `deterministic=True` is refused) and not with `lora_overlap` or `lora_deferred`. None (the default) turns it on
    for slot mode on CUDA outside deterministic mode, without `lora_overlap` / `lora_deferred`, at
    tensor_parallel_size 1 (measured at the Llama-3.1-8B shape, batch 64, rank 16, one H100: faster than the hooks
    after cuBLAS's GEMM at 1 and 4 distinct adapters in the batch, about even at 16; README, LoRA); False keeps
    cuBLAS's GEMM and the LoRA kernels after it."""
    lora_merged: bool = False
    """Merged mode: one adapter at a time, folded into the base weights (W = W_base + scaling * B @ A, computed in
    float32 from a kept copy of the base and rounded once to the weights' dtype, so bfloat16 weights are the
    merged weights rounded to bfloat16), so its requests run the plain model path at full speed: no slots, no
    LoRA kernels, no per-token adapter index, the graphs of a plain engine. Same API as slot mode
    (`Engine.load_lora` / `unload_lora` / `apply_lora_update`, `SamplingParams(lora=name)`), with these rules:
    needs max_loras=1; while an adapter is merged the base weights are not served (a request with
    `SamplingParams.lora=None` and a base weight update are refused), and a load is refused while base requests
    are unfinished. Costs a copy of the base weights of every `lora_target_modules` module of every decoder
    layer (default: all seven of a dense model, about the size of its decoder layers' linear weights), allocated
    at start-up on the model's device so the KV cache is sized with it counted; a push recomputes the merged
    weights of the modules it touched from that copy, and an unload restores the base bitwise (`export_weights`
    and the checksums see the weights as they are: merged). `max_lora_rank` (the slots' size) does not apply."""
    async_scheduling: bool | None = None
    """Schedule and stage step t+1 while step t runs on the device (tokens of t reach t+1 on the device);
    hides the host's per-step work behind the GPU's. Not with speculative decoding. None (the default)
    turns it on for CUDA, tensor parallelism included, where every rank stages its next step while the current
    one runs (two H200s, 0.5B shape, batch 256: 55,480 tok/s against 46,653 synchronous); off on the CPU, where
    the host is the device, so there is nothing to overlap and the bookkeeping only costs. The tokens are the
    same either way."""
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
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"EngineConfig.load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
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
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError("EngineConfig.expert_parallel needs tensor_parallel_size > 1 (the experts are split "
                             f"over the tensor-parallel ranks), got tensor_parallel_size={self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise ValueError("speculative decoding does not support tensor_parallel_size > 1 yet")
        if isinstance(self.fused_gemv_rows, bool) or not isinstance(self.fused_gemv_rows, int) \
                or not 0 <= self.fused_gemv_rows <= 8:
            raise ValueError(f"EngineConfig.fused_gemv_rows must be an integer in [0, 8], got {self.fused_gemv_rows!r}")
        for name, low in (("max_loras", 0), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {value!r}")
        if self.lora_target_modules is not None:
            modules = self.lora_target_modules
            if isinstance(modules, str) or not modules or not all(isinstance(m, str) and m for m in modules):
                raise ValueError(f"EngineConfig.lora_target_modules must be a non-empty list of module names or None, "
                                 f"got {modules!r}")
            self.lora_target_modules = tuple(modules)
        if self.tensor_parallel_size > 1 and self.lora_merged:
            raise ValueError("EngineConfig.lora_merged does not support tensor_parallel_size > 1 yet (adapters are "
                             "served from slots under tensor parallelism: leave lora_merged off)")
        if self.tensor_parallel_size > 1 and self.lora_deferred:
            raise ValueError("EngineConfig.lora_deferred does not support tensor_parallel_size > 1 (a rank's partial "
                             "delta of o_proj / down_proj would join the replicated residual sum): leave it off")
        if self.lora_fused_linear and (self.lora_overlap or self.lora_deferred):
            raise ValueError("EngineConfig.lora_fused_linear runs each adapted linear and its LoRA in one launch: "
                             "leave lora_overlap and lora_deferred off with it")
        if self.lora_fused_linear and self.deterministic:
            raise ValueError("EngineConfig.lora_fused_linear is not batch-invariant (its Triton GEMM rounds as no "
                             "deterministic linear does): leave it off (None or False) with deterministic=True")
        if self.lora_fused_linear is None:
            self.lora_fused_linear = (self.device != "cpu" and self.max_loras > 0 and not self.lora_merged
                                      and not self.lora_overlap and not self.lora_deferred and not self.deterministic
                                      and self.tensor_parallel_size == 1)
        if self.lora_deferred and self.lora_overlap:
            raise ValueError("EngineConfig.lora_deferred replaces lora_overlap (every hook's delta is computed beside "
                             "its matmul); set one of them")
        if self.lora_merged and self.max_loras != 1:
            raise ValueError(f"EngineConfig.lora_merged holds one adapter at a time: it needs max_loras=1, got "
                             f"max_loras={self.max_loras}")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling does not support speculative decoding yet")
        if self.async_scheduling is None:
            self.async_scheduling = self.speculative is None and self.device != "cpu"


    def runner_config(self, model_dir: str | None = None) -> RunnerConfig:
        """The fields the runner reads, as the runner's own config; `model_dir`: the directory `model` resolved
        to (rollout.model_files.resolve_model), where the runner reads the checkpoint (default: `model`)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunnerConfig)}
        if self.lora_merged:  # the merged adapter is in the weights: the runner has no slots and no hooks
            fields["max_loras"] = 0
        if model_dir is not None:
            fields["model"] = model_dir
        return RunnerConfig(**fields)


class _WrongType(Exception):
    """A value that does not fit an annotation: `expected` says what would, in words."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


def _expected(tp: Any) -> str:
    """An annotation in words, as a YAML writer thinks of it."""
    if tp is Any:
        return "anything"
    if _is_union(tp):
        args = typing.get_args(tp)
        words = [_expected(a) for a in args if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a finite number"
    if tp is str:
        return "a string"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, Sequence):
        item = args[0] if args and args[0] is not Any else None
        return "a list" + (f" (each item {_expected(item)})" if item is not None else "")
    if origin in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _typed(tp: Any, value: Any, where: str, source: str) -> Any:
    """`value` checked against annotation `tp` (nested configs built, integers and numeric strings as floats for
    float fields: YAML 1.1 reads `1e-3` as a string); raises _WrongType, or ValueError from a nested config."""
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _typed(arg, value, where, source)
            except _WrongType:
                pass
        raise _WrongType(_expected(tp))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _WrongType(_expected(tp))
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise _WrongType(_expected(tp))
    if tp is float:
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise _WrongType(_expected(tp)) from None
        if isinstance(number, numbers.Real) and not isinstance(number, bool) and math.isfinite(number):
            return float(number)
        raise _WrongType(_expected(tp))
    if tp is str:
        if isinstance(value, str):
            return value
        raise _WrongType(_expected(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if not isinstance(value, bool):
            try:
                return tp(value)
            except (ValueError, TypeError):
                pass
        raise _WrongType(_expected(tp))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _build(tp, value, source, where + ".")
        raise _WrongType(_expected(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise _WrongType(_expected(tp))
        if origin is tuple and args and not (len(args) == 2 and args[1] is ...):
            return value  # a fixed-length tuple: its own class checks it
        item = args[0] if args else Any
        out = []
        for i, x in enumerate(value):
            try:
                out.append(_typed(item, x, f"{where}[{i}]", source))
            except _WrongType as e:
                raise ValueError(f"{source}: {where}[{i}] must be {e.expected}, got {_shown(x)}") from None
        return out if origin is list else type(value)(out)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _WrongType(_expected(tp))
        key_tp, value_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            try:
                k = _typed(key_tp, k, where, source)
            except _WrongType as e:
                raise ValueError(f"{source}: the keys of {where} must be {e.expected}, got {_shown(k)}") from None
            try:
                out[k] = _typed(value_tp, v, f"{where}.{k}", source)
            except _WrongType as e:
                raise ValueError(f"{source}: {where}.{k} must be {e.expected}, got {_shown(v)}") from None
        return out
    if isinstance(tp, type) and not isinstance(value, tp):
        raise _WrongType(_expected(tp))
    return value


def _shown(value: Any) -> str:
    """A value as an error message shows it: its repr (cut short) and its YAML-ish type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
            type(None): "null"}.get(type(value), type(value).__name__)
    return f"{text} ({kind})"


def _build(cls: type[T], data: Mapping[str, Any], source: str, prefix: str) -> T:
    """from_mapping of a config nested at `prefix` ("engine.speculative.", or "" at the top)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: {prefix or ''}expected a mapping for {cls.__name__}, got {_shown(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in data if k not in names)
    if unknown:
        where = f"{prefix.rstrip('.')}: " if prefix else ""
        raise ValueError(f"{source}: {where}unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        try:
            kwargs[key] = _typed(hints[key], value, prefix + key, source)
        except _WrongType as e:
            raise ValueError(f"{source}: {prefix}{key} must be {e.expected}, got {_shown(value)}") from None
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{source}: {prefix}{e}") from None


def from_mapping(cls: type[T], data: Mapping[str, Any], source: str = "<dict>") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields.

    Each value is checked against its field's annotation before `cls` sees it. Raises ValueError naming
    `source` (a file path or a dotted location) and the key: an unknown key (with the known ones), or a value of
    the wrong type (with the type expected, e.g. "max_num_seqs must be an integer, got '8' (string)").
    """
    return _build(cls, data, source, "")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file into a dict; an empty file is an empty dict. Malformed YAML is a ValueError naming the
    file, line and column ("engine.yaml:3:14: malformed YAML: ...")."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ValueError(f"{where}: malformed YAML: {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping of keys, got {_shown(data)}")
    return data


__all__ = ["EngineConfig", "SpeculativeConfig", "from_mapping", "load_yaml"]
