"""transformers' fused expert names, translated to checkpoint names on the sending side of a push.

MoE checkpoints name experts one by one (`...mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H],
`down_proj` [H, I]), and those are the engine's coordinates. transformers 5 holds the same experts fused in
memory, so a trainer's `named_parameters()` yields `...mlp.experts.gate_up_proj` [E, 2I, H] (each expert's
gate rows, then its up rows) and `...mlp.experts.down_proj` [E, H, I]. `fused_expert_aliases(specs)`
derives those fused names from the per-expert ones in the engine's specs, and `expand` turns a fused
tensor into views of its per-expert parts, so pushes (dense or patch, which are diffed after expansion)
accept either naming. Not here: validation of the parts (the caller checks them as any other tensor).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from weight_updates.target import ParamSpec

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True, slots=True)
class FusedAlias:
    """A fused name's full shape and, per checkpoint name, the index of its part in the fused tensor."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, tuple], ...]  # (checkpoint name, index into the fused tensor), in expert order


def fused_expert_aliases(specs: Mapping[str, ParamSpec]) -> dict[str, FusedAlias]:
    """`{prefix}.gate_up_proj` and `{prefix}.down_proj` for every `{prefix}.{e}.*_proj.weight` family in
    `specs` whose experts are 0 .. E-1, each with gate, up and down of consistent shapes."""
    experts: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for name, spec in specs.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = spec.shape
    aliases: dict[str, FusedAlias] = {}
    for prefix, by_expert in experts.items():
        num = len(by_expert)
        first = by_expert.get(0, {})
        if sorted(by_expert) != list(range(num)) or any(p != first for p in by_expert.values()):
            continue
        gate, up, down = first.get("gate_proj"), first.get("up_proj"), first.get("down_proj")
        if gate is None or gate != up or down is None or down != gate[::-1]:
            continue
        inter, hidden = gate
        name = f"{prefix}.{{}}.{{}}.weight".format
        aliases[f"{prefix}.gate_up_proj"] = FusedAlias(
            (num, 2 * inter, hidden),
            tuple(pair for e in range(num) for pair in ((name(e, "gate_proj"), (e, slice(0, inter))),
                                                         (name(e, "up_proj"), (e, slice(inter, 2 * inter))))))
        aliases[f"{prefix}.down_proj"] = FusedAlias((num, hidden, inter),
                                                    tuple((name(e, "down_proj"), (e,)) for e in range(num)))
    return aliases


def expand(name: str, tensor: torch.Tensor, alias: FusedAlias) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert (checkpoint name, view) pairs of fused `tensor`; ValueError if its shape is not the
    alias's."""
    if tuple(tensor.shape) != alias.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {alias.shape} (fused experts)")
    for part, index in alias.parts:
        yield part, tensor[index]
