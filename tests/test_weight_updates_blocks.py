"""The block path of patch sessions (`kernels/patch.py`: decode, check, read and write block by block) against
the torch path (per-member indexing), on patches of every gap dtype and kind of values spanning many blocks;
and bad records in a batch of many, refused by name with nothing written, on both paths. The block path runs
compiled on CUDA tensors and under the Triton interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.patch import BLOCK
from weight_updates import Dense, PackedIndices, Patch, TensorDictTarget, WeightReceiver, WeightUpdateError, checksum
from weight_updates.encoding import _GAP_LIMIT, bit_differences, delta_bytes

DEVICES = ["cuda"] if torch.cuda.is_available() else []
if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES.append("cpu")
pytestmark = pytest.mark.skipif(not DEVICES, reason="the block path needs CUDA or TRITON_INTERPRET=1")


def _packed(indices: torch.Tensor, gap_dtype: torch.dtype) -> PackedIndices:
    """``indices`` ([n] int64, strictly increasing) as gaps of ``gap_dtype``, escaping what does not fit."""
    gaps = torch.diff(indices, prepend=indices.new_full((1,), -1))
    if gap_dtype == torch.int32:
        return PackedIndices(gaps=gaps.to(torch.int32), overflow=torch.zeros(0, dtype=torch.int32))
    too_big = gaps > _GAP_LIMIT[gap_dtype]
    return PackedIndices(gaps=gaps.masked_fill(too_big, 0).to(gap_dtype), overflow=gaps[too_big].to(torch.int32))


def _patch(name: str, old: torch.Tensor, new: torch.Tensor, gap_dtype: torch.dtype, delta: bool) -> Patch:
    """The patch from ``old`` to ``new`` (checkpoint-shaped, on the CPU) at the elements whose bits differ."""
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}[old.element_size()]
    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    idx = torch.ne(flat_old.view(int_dtype), flat_new.view(int_dtype)).nonzero().squeeze(1)
    values = flat_new[idx]
    if not delta:
        return Patch(name=name, indices=_packed(idx, gap_dtype), values=values, checksum=checksum(new))
    deltas, escaped = delta_bytes(bit_differences(flat_old[idx], values))
    return Patch(name=name, indices=_packed(idx, gap_dtype), values=deltas, checksum=checksum(new), escapes=values[escaped])


def _changed(t: torch.Tensor, gen: torch.Generator, num: int, spread: int) -> torch.Tensor:
    """``t`` with ``num`` random elements of its first half and its last element changed: most by one or two units
    in the last place, some (escapes) by ``spread`` units (the integer view wraps)."""
    int_dtype = {2: torch.int16, 4: torch.int32}[t.element_size()]
    out = t.clone().reshape(-1)
    idx = torch.randperm(max(1, out.numel() // 2), generator=gen)[: num - 1]
    idx = torch.cat([idx, torch.tensor([out.numel() - 1])])
    num = idx.numel()
    by = torch.randint(1, 3, (num,), generator=gen)
    by[torch.rand(num, generator=gen) < 0.05] = spread
    bits = out.view(int_dtype)
    bits[idx] = (bits[idx].to(torch.int64) + by).to(int_dtype)
    return out.view(t.shape)


# name -> (shape, dtype, changed elements, gap dtype, bit deltas): members of several blocks, every gap dtype
# (uint8 with many escaped gaps, uint16 with a few, int32), delta and plain values, 2- and 4-byte elements,
# an unchanged member and a one-element one.
LAYOUT = {
    "a": ((1000, 1000), torch.bfloat16, 3 * BLOCK + 17, torch.uint8, True),
    "b": ((400, 1000), torch.bfloat16, BLOCK + 5, torch.uint16, True),
    "c": ((64, 64), torch.bfloat16, 0, torch.uint8, True),
    "d": ((50, 90), torch.bfloat16, 2 * BLOCK, torch.int32, True),
    "e": ((70, 70), torch.bfloat16, BLOCK - 1, torch.uint8, False),
    "f": ((40, 100), torch.float32, BLOCK + 300, torch.uint8, True),
    "g": ((900, 100), torch.float32, 700, torch.uint16, False),
    "h": ((2,), torch.bfloat16, 1, torch.uint8, True),
    "i": ((80, 80), torch.float16, BLOCK + 1, torch.uint8, True),
}


def _on(patches: list[Patch], device: str) -> list[Patch]:
    return [Patch(name=p.name, indices=PackedIndices(gaps=p.indices.gaps.to(device), overflow=p.indices.overflow.to(device)),
                  values=p.values.to(device), checksum=p.checksum, escapes=None if p.escapes is None else p.escapes.to(device))
            for p in patches]


def _weights(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(w0, w1) of LAYOUT on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    w0 = {n: (torch.randn(s, generator=gen) * 0.02).to(d) for n, (s, d, *_) in LAYOUT.items()}
    w1 = {n: _changed(w0[n], gen, num, spread=1 << 12 if d == torch.float32 else 300) if num else w0[n].clone()
          for n, (_, d, num, *_) in LAYOUT.items()}
    return w0, w1


def _patches(w0: dict[str, torch.Tensor], w1: dict[str, torch.Tensor], device: str) -> list[Patch]:
    """The patches from ``w0`` to ``w1`` in LAYOUT order (gap dtypes and kinds of values as LAYOUT says), on ``device``."""
    return _on([_patch(n, w0[n], w1[n], gap, delta) for n, (_, _, _, gap, delta) in LAYOUT.items()], device)


def _push(device: str, seed: int = 0):
    """(receiver over w0 on ``device`` with its checksums known, the patches from w0 to w1, w1)."""
    w0, w1 = _weights(seed)
    receiver = WeightReceiver(TensorDictTarget({n: t.to(device) for n, t in w0.items()}))
    for n in LAYOUT:
        receiver.current_checksum(n)
    return receiver, _patches(w0, w1, device), w1


def _state(receiver: WeightReceiver) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in receiver.target.tensors.items()}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for n in want:
        int_dtype = {2: torch.int16, 4: torch.int32}[want[n].element_size()]
        assert torch.equal(got[n].view(int_dtype), want[n].cpu().view(int_dtype)), n


def test_layout_covers_what_it_claims():
    _, patches, _ = _push("cpu")
    by_name = {p.name: p for p in patches}
    assert by_name["a"].indices.overflow.numel() > 10 and by_name["b"].indices.overflow.numel() > 0
    assert {p.indices.gaps.dtype for p in patches} == {torch.uint8, torch.uint16, torch.int32}
    assert all(p.escapes.numel() > 0 for p in patches if p.is_delta and p.indices.num_indices > BLOCK)
    assert by_name["c"].indices.num_indices == 0


@pytest.mark.parametrize("scans", ["int32", "int64"])
@pytest.mark.parametrize("device", DEVICES)
def test_block_path_writes_the_same_bits_as_the_torch_path(device, scans, monkeypatch):
    if scans == "int64":  # the decode of members of 2**31 elements or more, on small ones
        monkeypatch.setattr("kernels.patch.WIDE_NUMEL", 1)
    w0, w1 = _weights()
    for batched in (False, True):
        receiver, patches, _ = _push(device)
        receiver.batched_scatter = batched
        result = receiver.apply(1, patches)
        assert result.num_patch == len(LAYOUT)
        _assert_bitwise(_state(receiver), w1)
        # The carried-forward checksums are the weights' own: the push back from w1 to w0 applies too.
        receiver.apply(2, _patches(w1, w0, device))
        _assert_bitwise(_state(receiver), w0)


def _replace(patches: list[Patch], name: str, **fields) -> list[Patch]:
    import dataclasses

    return [dataclasses.replace(p, **fields) if p.name == name else p for p in patches]


def _gaps_of(p: Patch, change) -> PackedIndices:
    """``p``'s index stream, decoded, changed by ``change`` (in place on [n] int64 indices), re-encoded as int32 gaps."""
    idx = p.indices.decode(torch.device("cpu"))
    change(idx)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)).to(torch.int32)
    return PackedIndices(gaps=gaps.to(p.indices.gaps.device), overflow=torch.zeros(0, dtype=torch.int32, device=p.indices.gaps.device))


def _bad_cases():
    """(victim, how to break the push, the error it must raise): each in the middle of the batch."""

    def out_of_bounds(patches, receiver):
        numel = receiver.specs["f"].numel
        return _replace(patches, "f", indices=_gaps_of(next(p for p in patches if p.name == "f"),
                                                      lambda idx: idx.__setitem__(-1, numel))), "f", "out of bounds"

    def decreasing(patches, receiver):
        def swap(idx):
            idx[BLOCK + 3], idx[BLOCK + 4] = idx[BLOCK + 4].item(), idx[BLOCK + 3].item()

        return _replace(patches, "a", indices=_gaps_of(next(p for p in patches if p.name == "a"), swap)), "a", "strictly increasing"

    def missing_overflow(patches, receiver):
        p = next(p for p in patches if p.name == "a")
        return _replace(patches, "a", indices=PackedIndices(gaps=p.indices.gaps, overflow=p.indices.overflow[:-1])), "a", \
            "malformed index stream \\(escape count"

    def escape_count(patches, receiver):
        p = next(p for p in patches if p.name == "i")
        return _replace(patches, "i", escapes=p.escapes[1:]), "i", "escaped deltas do not match"

    def flipped_delta(patches, receiver):
        p = next(p for p in patches if p.name == "b")
        values = p.values.clone()
        at = (values != 0).nonzero()[-3]  # in the member's second block
        values[at] = 3 if values[at].item() != 3 else 5
        return _replace(patches, "b", values=values), "b", "checksum mismatch for 1 parameters, first b"

    def wrong_base_checksum(patches, receiver):
        return _replace(patches, "g", checksum=next(p for p in patches if p.name == "g").checksum + 1), "g", "checksum mismatch"

    def wrong_dtype(patches, receiver):
        p = next(p for p in patches if p.name == "e")
        return _replace(patches, "e", values=p.values.to(torch.float16)), "e", "dtype"

    def duplicate(patches, receiver):
        p = next(p for p in patches if p.name == "d")
        return [*patches[:5], p, *patches[5:]], "d", "sent twice"

    def dense_among_patches_bad(patches, receiver):
        t = receiver.target.tensors["h"].clone() + 1
        return [Dense(name="h", tensor=t, checksum=checksum(t) ^ 2) if p.name == "h" else p for p in patches], "h", "checksum mismatch"

    return [out_of_bounds, decreasing, missing_overflow, escape_count, flipped_delta, wrong_base_checksum, wrong_dtype, duplicate,
            dense_among_patches_bad]


@pytest.mark.parametrize("batched", [False, True], ids=["torch", "blocks"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda f: f.__name__)
def test_a_bad_record_among_many_is_refused_by_name_and_nothing_is_written(case, device, batched):
    receiver, patches, w1 = _push(device)
    receiver.batched_scatter = batched
    bad, victim, match = case(patches, receiver)
    before = _state(receiver)
    with pytest.raises(WeightUpdateError, match=match) as err:
        receiver.apply(1, bad)
    assert str(err.value).split(":")[0].split(", first ")[-1] == victim  # "name: ..." or "... for k parameters, first name: ..."
    _assert_bitwise(_state(receiver), before)
    assert receiver.version == 0
    receiver.apply(1, patches)  # the intact push still applies afterwards
    _assert_bitwise(_state(receiver), w1)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_engines_weights_take_block_patches_through_their_addresses(ckpt_factory, family):
    """The engine's own target (`CheckpointWeights`: fused q / k / v and gate / up rows, stacked experts) lends its
    live tensors by data pointer (`writable_addresses`, no view per name); patches of about 1% of every tensor's
    elements land bitwise where the torch path puts them, on another engine over the same checkpoint."""
    from rollout import Engine, EngineConfig

    path = ckpt_factory(family)
    engines = [Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=2, num_kv_blocks=16, device=d))
               for d in (DEVICES[0], "cpu")]
    targets = [e.runner.weights for e in engines]
    names = list(targets[0].layout)
    assert targets[0].writable_addresses(names) is not None
    gen = torch.Generator().manual_seed(0)
    w0 = {n: targets[1].read_checkpoint_tensor(n).clone() for n in names}
    w1 = {n: _changed(w0[n], gen, max(1, w0[n].numel() // 100), spread=1 << 12) for n in names}
    patches = [_patch(n, w0[n], w1[n], torch.uint8, delta=i % 2 == 0) for i, n in enumerate(names)]
    for target, batched in zip(targets, (True, False)):
        receiver = WeightReceiver(target, batched_scatter=batched)
        receiver.apply(1, _on(patches, str(target.device)))
        _assert_bitwise({n: target.read_checkpoint_tensor(n).cpu() for n in names}, w1)
    for e in engines:
        e.close()
