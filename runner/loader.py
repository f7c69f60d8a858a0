"""Checkpoint loading and the checkpoint-coordinate view of a live model.

`load_model` builds the model class registered for the config's architecture (`runner.models.ModelRegistry`)
on the meta device, allocates its parameters once on the target device, and copies each safetensors tensor
into its slot of the runtime parameters (a slice of a fused or stacked tensor) — never two copies of the
weights. Two readers fill the same parameters bitwise: on CUDA (by default) each file's bytes stream in large
chunks through two reused pinned host buffers, copied to the device on a side stream while the next chunk is
read (runner/safetensors_io.py); on the CPU (and on request) tensor by tensor from memory-mapped lazy slices.
Under tensor parallelism each rank reads only its slice of each tensor where that slice is contiguous in the
file (the tensor-wise reader: `get_slice` for any slice). Both follow the model's `checkpoint_layout`
(runner/models/layout.py), as does `CheckpointWeights`, which exposes the same map to weight updates: read,
overwrite or patch a checkpoint tensor in place, by its Hugging Face name and flat coordinates. Not here:
filtering full-tensor updates to a rank's slice (runner/parallel/weights.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from runner.model_config import ModelConfig
from runner.models import CausalLM, CheckpointSlot, ModelRegistry
from runner.parallel.layers import is_expert_parallel
from weight_updates.target import ParamSpec

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard file(s): {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors files")
    return files


def _iter_checkpoint(files: list[Path]):
    """(file, name, lazy slice) of every tensor; the slice reads only what is indexed."""
    from safetensors import safe_open

    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read safetensors file {file}: {e}") from None
        for name in names:
            try:
                yield file, name, handle.get_slice(name)
            except Exception as e:
                raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from None


def checkpoint_tensors(model_dir: str | Path, tie_word_embeddings: bool):
    """(file, name, lazy slice) of a checkpoint directory's weight tensors: without the buffers Hugging Face
    saves next to them (rotary inverse frequencies) and without lm_head.weight when it is tied."""
    for file, name, lazy in _iter_checkpoint(safetensors_files(model_dir)):
        if _wanted(name, tie_word_embeddings):
            yield file, name, lazy


def _wanted(name: str, tie_word_embeddings: bool) -> bool:
    """Whether checkpoint tensor `name` is a weight: not a buffer Hugging Face saves next to the weights (rotary
    inverse frequencies), not lm_head.weight when it is tied."""
    return not (name.endswith(_IGNORED_SUFFIXES) or (tie_word_embeddings and name == "lm_head.weight"))


def _read_shard(file: Path, name: str, lazy, slot: CheckpointSlot) -> torch.Tensor:
    """The rank's part of a checkpoint tensor (all of it without tensor parallelism)."""
    start, end = slot.shard
    index = tuple(slice(start, end) if d == slot.dim else slice(None) for d in range(len(slot.shape)))
    try:
        return lazy[index]
    except Exception as e:
        raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from None


READERS = ("auto", "chunked", "tensorwise")


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend, max_position: int,
    deterministic: bool = False, tp=None, random_seed: int | None = None, reader: str = "auto",
    chunk_bytes: int = 256 << 20, read_threads: int = 4, stats: dict[str, float] | None = None,
) -> CausalLM:
    """Build the registered class of `cfg.architecture` on meta, allocate once on `device` in `dtype`, fill
    from the checkpoint, check completeness. On a CUDA device the weights are in place when it returns.

    With `tp` (a `runner.parallel.group.TPGroup`) the model is the rank's shard and only its slices are read.
    With `random_seed` nothing is read: every checkpoint slot is drawn on `device` (`fill_random`).
    `reader` picks how the files are read: "chunked" (`_load_chunked`: each file's bytes in chunks of
    `chunk_bytes`, each read by `read_threads` threads, through two reused host buffers, pinned for CUDA, the
    copies to the device overlapped with the next read),
    "tensorwise" (`_load_tensorwise`: tensor by tensor from memory-mapped safetensors slices), "auto": chunked
    on CUDA (an 8B checkpoint in 1.6 s against 3.0 s tensor-wise, page cache warm, `bench/scale.py`), tensor-wise
    on the CPU (where the chunks would be one more copy). Both fill the same parameters bitwise.
    `stats`, when given, is filled with seconds: "allocate" (the parameters on the device), "fill" (reading and
    copying them in), and for the chunked reader "fill_read" (files into the host buffers) and "fill_wait"
    (waiting for the copies to the device to free a buffer).
    """
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    _, model_cls = ModelRegistry.resolve([cfg.architecture])
    if is_expert_parallel(tp) and not hasattr(model_cls, "sparse_blocks"):
        raise ValueError(f"EngineConfig.expert_parallel needs a Mixture-of-Experts model; {cfg.architecture} is dense")
    start = time.perf_counter()
    with torch.device("meta"):
        model = model_cls(cfg, backend, tp)
    _materialize(model, dtype, device)
    model.init_rotary(max_position, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = {} if stats is None else stats
    stats["allocate"] = time.perf_counter() - start
    weights = CheckpointWeights(model)
    if random_seed is not None:
        fill_random(weights, random_seed)
        if weights.device.type == "cuda":
            torch.cuda.synchronize(weights.device)
        model.set_deterministic(deterministic)
        return model.eval()
    chunked = reader == "chunked" or (reader == "auto" and weights.device.type == "cuda")
    start = time.perf_counter()
    with torch.no_grad():
        if chunked:
            loaded, nbytes = _load_chunked(model_dir, cfg, weights, chunk_bytes, read_threads, stats)
        else:
            loaded, nbytes = _load_tensorwise(model_dir, cfg, weights)
    if weights.device.type == "cuda":
        torch.cuda.synchronize(weights.device)
    seconds = time.perf_counter() - start
    stats["fill"] = seconds
    missing = sorted(set(weights.layout) - loaded)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {model_dir} is missing tensor(s) {missing[:5]}{more}")
    logger.info("loaded %d tensors (%.2f GB) in %.2f s (%.2f GB/s, %s reader; %s)", len(loaded), nbytes / 1e9, seconds,
                nbytes / 1e9 / max(seconds, 1e-9), "chunked" if chunked else "tensorwise",
                ", ".join(f"{k} {v:.2f} s" for k, v in stats.items()))
    model.set_deterministic(deterministic)
    model.eval()
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialized storage on `device`, floating
    ones in `dtype`; a tensor two modules share stays shared. (`Module.to_empty` does the same through
    `torch.empty_like` of meta tensors, whose first call imports sympy: ~3.5 s of an 8B start-up on the GPU machine.)"""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a meta tensor -> (it, kept alive; its replacement)

    def real(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            data = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = t, torch.nn.Parameter(data, t.requires_grad) if parameter else data
        return made[id(t)][1]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = real(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = real(b, False)


def _check_tensor(file: Path, name: str, dtype: str, shape: tuple[int, ...], slot: CheckpointSlot) -> None:
    """A checkpoint tensor (safetensors dtype code, shape) fits its slot: a float dtype, the slot's full shape."""
    if not dtype.startswith(("F", "BF")):
        raise ValueError(f"checkpoint tensor {name} in {file} has non-float dtype {dtype}")
    if tuple(shape) != slot.shape:
        raise ValueError(f"shape mismatch for {name} in {file}: checkpoint {tuple(shape)}, "
                         f"config.json implies {slot.shape}")


def _load_tensorwise(model_dir, cfg: ModelConfig, weights: "CheckpointWeights") -> tuple[set[str], int]:
    """Copy each checkpoint tensor (the rank's slice of it) from its memory-mapped safetensors slice into its slot.
    Returns the names loaded and the bytes read."""
    loaded: set[str] = set()
    nbytes = 0
    for file, name, lazy in checkpoint_tensors(model_dir, cfg.tie_word_embeddings):
        if name not in weights.layout:
            logger.warning("ignoring checkpoint tensor %s (%s): not part of the model", name, file.name)
            continue
        slot = weights.layout[name]
        _check_tensor(file, name, lazy.get_dtype(), tuple(lazy.get_shape()), slot)
        loaded.add(name)
        if slot.is_empty:  # another rank's expert (expert parallelism): nothing to read
            continue
        part = _read_shard(file, name, lazy, slot)
        weights.view(name).copy_(part)
        nbytes += part.numel() * part.element_size()
    return loaded, nbytes


def _load_chunked(model_dir, cfg: ModelConfig, weights: "CheckpointWeights", chunk_bytes: int,
                  read_threads: int, stats: dict[str, float]) -> tuple[set[str], int]:
    """Every file's needed bytes in chunks of `chunk_bytes` through a `ChunkStager` (runner/safetensors_io.py);
    each tensor straight into its slot when the slot is a contiguous tensor of the checkpoint's dtype holding
    the bytes read (a whole tensor, or a rank's rows), else through a device staging tensor (dtype conversion,
    a rank's columns: narrowed with `CheckpointSlot.own_part`). Every header is checked before any byte is read.
    Returns the names loaded and the bytes read; adds "fill_read" and "fill_wait" (`ChunkStager`) to `stats`."""
    from runner.safetensors_io import ChunkStager, read_header

    plans: list[tuple[Path, list]] = []  # (file, its targets)
    loaded: set[str] = set()
    for file in safetensors_files(model_dir):
        targets = []
        for entry in read_header(file):
            if not _wanted(entry.name, cfg.tie_word_embeddings):
                continue
            if entry.name not in weights.layout:
                logger.warning("ignoring checkpoint tensor %s (%s): not part of the model", entry.name, file.name)
                continue
            slot = weights.layout[entry.name]
            _check_tensor(file, entry.name, entry.dtype, entry.shape, slot)
            loaded.add(entry.name)
            if not slot.is_empty:  # an empty part (another rank's expert) reads nothing
                targets.append(_chunked_target(entry, slot, weights.view(entry.name)))
        plans.append((file, targets))
    largest = max((sum(t.nbytes for t in targets) for _, targets in plans), default=0)
    nbytes = 0
    chunk_bytes = max(1, min(chunk_bytes, largest))  # no bigger buffers than the largest file needs
    with ChunkStager(weights.device, chunk_bytes=chunk_bytes, read_threads=read_threads) as stager:
        for file, targets in plans:
            nbytes += stager.read_file(file, targets)
    stats.update(fill_read=stager.read_seconds, fill_wait=stager.wait_seconds)
    return loaded, nbytes


def _chunked_target(entry, slot: CheckpointSlot, view: torch.Tensor):
    """Where the bytes of checkpoint tensor `entry` (a `TensorEntry`) go for `slot`, whose live view is `view`:
    only the rank's part of the file's range when that part is contiguous in it (no dimension before the
    split one holds more than one index), else all of the tensor, narrowed on the device."""
    from runner.safetensors_io import DTYPES, DirectTarget, StagedTarget

    src = DTYPES[entry.dtype]
    start, end = slot.shard
    if slot.is_whole:
        begin, stop, shape, narrow = entry.begin, entry.end, slot.shape, False
    elif math.prod(slot.shape[: slot.dim]) == 1:
        inner = math.prod(slot.shape[slot.dim + 1 :]) * src.itemsize  # bytes per index of the split dimension
        begin, stop, shape, narrow = entry.begin + start * inner, entry.begin + end * inner, slot.shard_shape, False
    else:
        begin, stop, shape, narrow = entry.begin, entry.end, slot.shape, True
    if not narrow and src == view.dtype and view.is_contiguous():
        return DirectTarget(begin, stop, view)

    def finish(raw: torch.Tensor) -> None:  # raw: uint8 [stop - begin] on the device
        tensor = raw.view(src).view(shape)
        view.copy_(slot.own_part(tensor) if narrow else tensor)

    return StagedTarget(begin, stop, view.device, finish)


def fill_random(weights: "CheckpointWeights", seed: int, std: float = 0.02) -> None:
    """Every checkpoint slot of the model drawn on its device: N(0, std^2), norm weights 1 + N(0, 0.01^2).
    Under tensor parallelism each rank draws its own part (the ranks' parts are not one consistent tensor
    drawn whole: for benchmarks, where only the shapes matter)."""
    g = torch.Generator(device=weights.device).manual_seed(seed)
    with torch.no_grad():
        for name, slot in weights.layout.items():
            view = weights.view(name)
            noise = torch.randn(view.shape, generator=g, device=weights.device, dtype=torch.float32)
            view.copy_(1.0 + 0.01 * noise if slot.init == "ones" else std * noise)


class CheckpointWeights:
    """The live model seen through checkpoint names: each name is a view of a parameter, as its
    `CheckpointSlot` says (a slice of a fused or stacked tensor; under tensor parallelism the rank's part).

    Writes are in place (`copy_` / `index_put_`), so parameters keep their storage and captured CUDA
    graphs stay valid. Callers validate before writing; this class only asserts its own invariants.
    """

    def __init__(self, model: CausalLM) -> None:
        self.layout: dict[str, CheckpointSlot] = model.checkpoint_layout()
        self._params = dict(model.named_parameters())
        self.device = next(iter(self._params.values())).device
        self._places: dict[str, tuple[str, int] | None] = {}  # name -> (parameter, element offset), `writable_addresses`

    def view(self, name: str) -> torch.Tensor:
        slot = self.layout[name]
        return slot.view(self._params[slot.param].data)

    def checkpoint_specs(self) -> dict[str, ParamSpec]:
        return {n: ParamSpec(s.shape, self._params[s.param].dtype) for n, s in self.layout.items()}

    def read_checkpoint_tensor(self, name: str) -> torch.Tensor:
        return self.view(name)

    def _own_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint-shaped tensor (all of it without tensor parallelism)."""
        return self.layout[name].own_part(tensor)

    def write_dense(self, name: str, tensor: torch.Tensor) -> None:
        self.view(name).copy_(self._own_part(name, tensor))

    def write_dense_many(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """`write_dense` of every pair, batched into a few multi-tensor copy kernels."""
        torch._foreach_copy_([self.view(name) for name, _ in pairs], [self._own_part(n, t) for n, t in pairs])

    def writable_views(self, names: list[str]) -> list[torch.Tensor] | None:
        """The live views of `names` for patches scattered straight into them (flat indices are checkpoint
        coordinates); None unless each view is a whole, contiguous checkpoint tensor (not a TP shard)."""
        views = [self.view(name) for name in names]
        return views if all(self._lends(n, v) for n, v in zip(names, views)) else None

    def _lends(self, name: str, view: torch.Tensor) -> bool:
        """Whether `view` (of `name`) can be lent for flat checkpoint indices: whole and contiguous."""
        return view.is_contiguous() and self.layout[name].is_whole

    def writable_addresses(self, names: list[str]) -> tuple[list[torch.Tensor], np.ndarray] | None:
        """What `writable_views` lends, without making a view per name: (the parameters' data holding them, to keep
        alive while they are written; [k] int64 data pointers of the views), or None where it gives None. Each
        name's offset into its parameter is found once (the layout is fixed; the parameters stay contiguous when
        their data moves, as `sleep` moves it)."""
        places = []
        for name in names:
            if name not in self._places:
                view, base = self.view(name), self._params[self.layout[name].param].data
                lends = base.is_contiguous() and self._lends(name, view)
                self._places[name] = (self.layout[name].param, view.storage_offset() - base.storage_offset()) if lends else None
            places.append(self._places[name])
        if any(p is None for p in places):
            return None
        data: dict[str, torch.Tensor] = {}
        addresses = np.empty(len(names), dtype=np.int64)
        for i, (param, offset) in enumerate(places):
            tensor = data.get(param)
            if tensor is None:
                tensor = data[param] = self._params[param].data
                assert tensor.is_contiguous(), param
            addresses[i] = tensor.data_ptr() + offset * tensor.element_size()
        return list(data.values()), addresses

    def write_patch(self, name: str, flat_indices: torch.Tensor, values: torch.Tensor) -> None:
        view = self.view(name)
        scatter_flat(view, flat_indices.to(view.device, torch.int64), values.to(view.device, view.dtype))


def scatter_flat(view: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> None:
    """view.reshape(-1)[flat] = values, in place, also for a view that is not contiguous (a column slice)."""
    if view.is_contiguous():
        view.view(-1).index_put_((flat,), values)
    else:
        view.index_put_(torch.unravel_index(flat, view.shape), values)
