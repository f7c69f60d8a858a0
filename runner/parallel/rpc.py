"""Plain-data encoding of collective-RPC arguments and results, and the one error a failed call raises.

Arguments travel from rank 0 to every worker rank as one JSON message followed by their tensors, each
broadcast as raw bytes over the control group (`encode(obj, tensors)` puts a tensor's place in the JSON
and the tensor in `tensors`); results travel back in one JSON all-gather, small tensors inline as lists.
Values may be None, bool, int, float, str, lists / tuples, dicts with str keys, torch tensors, and
dataclasses of the project's packages (`runner.`, `weight_updates.`): a dataclass is rebuilt from its
fields by its import path, and no other class is ever instantiated. Nothing is pickled.

`rank_error` turns the per-rank errors of one call into one exception for the caller: the class of the
first failing rank's error (ValueError, WeightUpdateError, torch.OutOfMemoryError, ... when it can be
rebuilt from its name, RuntimeError otherwise), its message naming every failing rank (or, when every
rank raised the same error — a verdict the ranks reached together, such as a rejected update — that
message as it is), and `.rank_errors` {rank: "Type: message"}. Not here: sending the messages (worker.py).
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

_MODULES = ("runner.", "weight_updates.")  # dataclasses from these packages may be rebuilt on a worker


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(obj, tensors: list[torch.Tensor] | None = None):
    """JSON-ready form of `obj`. With `tensors`, each tensor is appended there and referenced by position;
    without, tensors are written inline (values as nested lists)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if tensors is not None:
            tensors.append(t.cpu().contiguous())
            return {"__tensor__": len(tensors) - 1, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        return {"__tensor_values__": t.cpu().float().tolist() if t.is_floating_point() else t.cpu().tolist(),
                "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
    if isinstance(obj, (list, tuple)):
        return [encode(x, tensors) for x in obj]
    if isinstance(obj, dict):
        assert all(isinstance(k, str) for k in obj), "collective RPC dicts need str keys"
        return {"__dict__": {k: encode(v, tensors) for k, v in obj.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        assert cls.__module__.startswith(_MODULES), f"{cls.__module__}.{cls.__qualname__} cannot cross ranks"
        fields = {f.name: encode(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj) if f.init}
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(obj, (set, frozenset)):
        return {"__set__": [encode(x, tensors) for x in sorted(obj)]}
    raise TypeError(f"a collective RPC value cannot hold {type(obj).__name__}")


def tensor_specs(tensors: list[torch.Tensor]) -> list[tuple[str, list[int]]]:
    """(dtype, shape) of each tensor `encode` collected: what a receiving rank allocates before the broadcasts."""
    return [(_dtype_name(t.dtype), list(t.shape)) for t in tensors]


def empty_tensors(specs: list) -> list[torch.Tensor]:
    """Host tensors to receive the broadcasts described by `tensor_specs`."""
    return [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in specs]


def decode(data, tensors: list[torch.Tensor] | None = None):
    """The value `encode` described (`tensors`: the received tensors, in order)."""
    if isinstance(data, list):
        return [decode(x, tensors) for x in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        assert tensors is not None
        return tensors[data["__tensor__"]]
    if "__tensor_values__" in data:
        return torch.tensor(data["__tensor_values__"], dtype=getattr(torch, data["dtype"])).reshape(data["shape"])
    if "__dict__" in data:
        return {k: decode(v, tensors) for k, v in data["__dict__"].items()}
    if "__set__" in data:
        return set(decode(data["__set__"], tensors))
    module, _, name = data["__dataclass__"].partition(":")
    assert module.startswith(_MODULES), module
    cls = getattr(importlib.import_module(module), name)
    assert dataclasses.is_dataclass(cls), data["__dataclass__"]
    return cls(**{k: decode(v, tensors) for k, v in data["fields"].items()})


def describe(e: BaseException) -> dict:
    """A rank's error as plain data."""
    return {"type": type(e).__name__, "message": str(e)}


def _error_class(name: str) -> type[Exception]:
    from weight_updates.errors import WeightUpdateError

    known = {"ValueError": ValueError, "WeightUpdateError": WeightUpdateError, "OutOfMemoryError": torch.OutOfMemoryError,
             "TypeError": TypeError, "KeyError": KeyError, "AssertionError": AssertionError, "RuntimeError": RuntimeError}
    return known.get(name, RuntimeError)


def rank_error(method: str, errors: list[dict | None]) -> Exception:
    """One exception for a call that failed on the ranks whose `errors` entry is set."""
    failed = {rank: f"{e['type']}: {e['message']}" for rank, e in enumerate(errors) if e is not None}
    first = errors[min(failed)]
    if len(failed) == len(errors) and all(e == first for e in errors):  # one verdict the ranks reached together
        error = _error_class(first["type"])(first["message"])
        error.rank_errors = failed
        return error
    detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items())
    error = _error_class(first["type"])(f"{method} failed on rank {', '.join(map(str, failed))} of {len(errors)} ({detail})")
    error.rank_errors = failed
    return error
