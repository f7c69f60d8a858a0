"""Weight-update protocol on CPU: checksums, index codec, differ, sessions, wire format.

``FakeTarget`` fuses q/k/v and gate/up like the engine's loaders, so every test goes through a
checkpoint-coordinate -> runtime-row mapping. Other test_weight_updates_* files import its helpers.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from weight_updates import (
    Dense,
    PackedIndices,
    ParamSpec,
    Patch,
    SendResult,
    StagingReceiver,
    TensorDictTarget,
    UpdateResult,
    WeightDiffer,
    WeightReceiver,
    WeightUpdateError,
    checksum,
    patch_checksum_delta,
)
from weight_updates.transports.inprocess import InProcessSender
from weight_updates.transports.protocol import Start, serve_session
from weight_updates.wire import plan_bucket, read_bucket, to_safetensors_prefix, write_bucket

HIDDEN, Q_ROWS, KV_ROWS, INTER, VOCAB = 16, 16, 8, 24, 40
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def checkpoint_shapes(num_layers: int = 2) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (Q_ROWS, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_ROWS, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_ROWS, HIDDEN),
            p + "self_attn.q_proj.bias": (Q_ROWS,),
            p + "self_attn.k_proj.bias": (KV_ROWS,),
            p + "self_attn.v_proj.bias": (KV_ROWS,),
            p + "self_attn.o_proj.weight": (HIDDEN, Q_ROWS),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,),
        }
    return shapes


class FakeTarget:
    """A WeightTarget over runtime tensors with q/k/v fused into ``qkv`` and gate/up into ``gate_up``.

    A checkpoint name maps to (runtime key, first row, rows); flat index i of a 2-D checkpoint
    tensor lands on runtime row ``first_row + i // in_features``, column ``i % in_features``.
    """

    def __init__(self, dtype: torch.dtype, *, num_layers: int = 2, seed: int = 0, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shapes = checkpoint_shapes(num_layers)
        self.runtime: dict[str, torch.Tensor] = {}
        self.loc: dict[str, tuple[str, int]] = {}  # checkpoint name -> (runtime key, first row)
        fused: dict[str, list[str]] = {}
        for name in self.shapes:
            for part, group in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("gate_proj", "gate_up"), ("up_proj", "gate_up")):
                if f".{part}." in name:
                    key = name.replace(f"self_attn.{part}", group).replace(f"mlp.{part}", group)
                    fused.setdefault(key, []).append(name)
                    break
            else:
                fused[name] = [name]
        for key, names in fused.items():
            rows = sum(self.shapes[n][0] for n in names)
            runtime_shape = (rows, *self.shapes[names[0]][1:])
            self.runtime[key] = (torch.randn(runtime_shape, generator=gen) * 0.02).to(device=device, dtype=dtype)
            first = 0
            for n in names:
                self.loc[n] = (key, first)
                first += self.shapes[n][0]
        self.dtype = dtype
        self._device = torch.device(device)

    def checkpoint_specs(self):
        return {n: ParamSpec(shape=s, dtype=self.dtype) for n, s in self.shapes.items()}

    def read_checkpoint_tensor(self, name):
        key, first = self.loc[name]
        return self.runtime[key][first : first + self.shapes[name][0]]

    def write_dense(self, name, tensor):
        self.read_checkpoint_tensor(name).copy_(tensor)

    def writable_views(self, names):  # row ranges of the runtime tensors: contiguous (batched patches on CUDA)
        return [self.read_checkpoint_tensor(n) for n in names]

    def write_patch(self, name, flat_indices, values):
        key, first = self.loc[name]
        shape = self.shapes[name]
        if len(shape) == 1:
            self.runtime[key][first + flat_indices] = values
        else:
            cols = math.prod(shape[1:])
            self.runtime[key].view(self.runtime[key].shape[0], cols)[first + flat_indices // cols, flat_indices % cols] = values

    @property
    def device(self):
        return self._device

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Checkpoint-shaped copies, on the CPU."""
        return {n: self.read_checkpoint_tensor(n).cpu().clone() for n in self.shapes}

    def snapshot_runtime(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self.runtime.items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        view = INT_VIEW[a[name].dtype]
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].contiguous().view(view), b[name].contiguous().view(view)), f"{name} differs"


def adamw_like_step(master: dict[str, torch.Tensor], gen: torch.Generator, *, frac: float = 0.01) -> None:
    """Move a random ``frac`` of each fp32 master tensor by about 1% (enough to change bf16 bits)."""
    for t in master.values():
        mask = torch.rand(t.shape, generator=gen) < frac
        t += mask * (t.abs() * 0.02 + 1e-4) * torch.randn(t.shape, generator=gen).sign()


def new_trainer(target: FakeTarget) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in target.checkpoint_state().items()}


# --- checksum -------------------------------------------------------------------------------------


def reference_checksum(t: torch.Tensor) -> int:
    """The documented formula, element by element in Python integers."""
    bits = t.reshape(-1).view(INT_VIEW[t.dtype]).tolist()
    total = 0
    for i, s in enumerate(bits):
        h = (i % (1 << 22) * 2654435761) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x45D9F3B) & 0xFFFFFFFF
        h ^= h >> 16
        total += s * (((h & 0x7FFF) | 1) + 2 * (i >> 22))
    total %= 1 << 64
    return total - (1 << 64) if total >= 1 << 63 else total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_checksum_matches_documented_formula(dtype):
    t = torch.randn(37, 11).to(dtype)
    assert checksum(t) == reference_checksum(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_is_the_same_on_cpu_and_cuda(dtype):
    t = torch.randn(9_000_001).to(dtype)
    idx = torch.tensor([3, 1 << 22, 9_000_000])
    new = torch.randn(3).to(dtype)
    assert checksum(t) == checksum(t.cuda())
    assert int(patch_checksum_delta(t[idx], new, idx)) == int(patch_checksum_delta(t[idx].cuda(), new.cuda(), idx.cuda()))


def test_checksum_sees_signed_zero_nan_payload_and_swaps():
    t = torch.zeros(64, dtype=torch.bfloat16)
    neg = t.clone()
    neg[5] = -0.0
    nan1, nan2 = t.clone(), t.clone()
    nan1.view(torch.int16)[3] = 0x7FC0
    nan2.view(torch.int16)[3] = 0x7FC1
    swapped = torch.arange(64, dtype=torch.float32).bfloat16()
    swapped2 = swapped.clone()
    swapped2[[1, 2]] = swapped2[[2, 1]]
    assert checksum(t) != checksum(neg)
    assert checksum(nan1) != checksum(nan2)
    assert checksum(swapped) != checksum(swapped2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_is_linear_across_chunks(dtype):
    """A patch's checksum delta equals the full recomputation, also past the 2**22 chunk."""
    t = torch.randn(5_000_000).to(dtype)
    idx = torch.tensor([0, 7, (1 << 22) - 1, 1 << 22, 4_999_999])
    new = t.clone()
    new[idx] = torch.randn(5).to(dtype)
    predicted = checksum(t) + int(patch_checksum_delta(t[idx], new[idx], idx))
    assert predicted == checksum(new)
    assert checksum(new) != checksum(t)


# --- index codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indices", "gap_dtype"),
    [
        (list(range(0, 1000, 3)), torch.uint8),
        ([0, 1, 2, 300, 301, 302, 303, 304, 305, 306], torch.uint8),  # one escape beats uint16
        ([70_000, 140_000, 210_000], torch.int32),  # every gap escapes: int32 is smaller
        ([10, 1000, 2000, 3000, 4000, 5000], torch.uint16),
        ([], torch.uint8),
        ([(1 << 31) - 2], torch.int32),
    ],
)
def test_packed_indices_roundtrip(indices, gap_dtype):
    idx = torch.tensor(indices, dtype=torch.int64)
    packed = PackedIndices.encode(idx)
    assert packed.gaps.dtype == gap_dtype
    assert torch.equal(packed.decode(torch.device("cpu")), idx)


def test_packed_indices_random_large_gaps():
    gen = torch.Generator().manual_seed(1)
    idx = torch.unique(torch.randint(0, 10_000_000, (300,), generator=gen))  # mean gap ~33k
    packed = PackedIndices.encode(idx)
    assert packed.gaps.dtype == torch.uint16 and packed.overflow.numel() > 0
    assert torch.equal(packed.decode(torch.device("cpu")), idx)


def test_packed_indices_reject_malformed_streams():
    good = PackedIndices.encode(torch.tensor([3, 400, 401, 402, 403, 404]))
    assert good.gaps.dtype == torch.uint8 and good.overflow.numel() == 1
    with pytest.raises(WeightUpdateError, match="malformed index stream"):
        PackedIndices(gaps=good.gaps, overflow=good.overflow[:0]).decode(torch.device("cpu"))
    with pytest.raises(WeightUpdateError, match="malformed index stream"):
        PackedIndices(gaps=good.gaps, overflow=torch.tensor([0], dtype=torch.int32)).decode(torch.device("cpu"))
    with pytest.raises(WeightUpdateError, match="malformed index stream"):
        PackedIndices(gaps=good.gaps, overflow=torch.tensor([5, 6], dtype=torch.int32)).decode(torch.device("cpu"))
    with pytest.raises(WeightUpdateError, match="gaps must be"):
        PackedIndices(gaps=good.gaps.to(torch.int64), overflow=good.overflow).decode(torch.device("cpu"))


# --- differ + session -----------------------------------------------------------------------------


def make_pair(dtype, **differ_kwargs):
    target = FakeTarget(dtype)
    receiver = WeightReceiver(target)
    differ = WeightDiffer(target.checkpoint_specs(), **differ_kwargs)
    master = new_trainer(target)
    return target, receiver, differ, master


def push(differ, sender, version, weights):
    pending = differ.encode(weights)
    sender.send(version, pending.updates)
    differ.commit(pending)
    return pending


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The batched gather / scatter kernels run compiled on CUDA tensors and, under the Triton interpreter, on
# CPU tensors (compiled Triton cannot read host memory).
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_CPU = pytest.mark.skipif(not INTERPRETER, reason="batched kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.mark.parametrize("batched", [False, True], ids=["per_patch", "batched"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_update_sequence_is_bitwise_exact(dtype, device, batched):
    if batched and device == "cpu" and not INTERPRETER:
        pytest.skip("batched kernels on CPU tensors need TRITON_INTERPRET=1")
    target = FakeTarget(dtype, device=device)
    receiver = WeightReceiver(target, batched_scatter=batched)
    differ = WeightDiffer(target.checkpoint_specs(), device=device)
    master = new_trainer(target)
    sender = InProcessSender(receiver)
    gen = torch.Generator().manual_seed(2)
    kinds = []
    for version in range(1, 7):
        adamw_like_step(master, gen)
        if version == 3:  # edge cases: signed zero and NaN payloads must travel as bits
            emb = master["model.embed_tokens.weight"]
            emb[0, 0], emb[0, 1] = 0.0, -0.0
            emb.view(torch.int32)[1, 0] = 0x7FC00001
        if version == 5:
            differ.reset(["model.norm.weight"])  # forces one dense record mid-sequence
        pending = push(differ, sender, version, master)
        kinds.append((pending.stats.num_dense, pending.stats.num_patch))
        assert receiver.version == version
        assert_bitwise_equal(target.checkpoint_state(), {n: t.to(dtype) for n, t in master.items()})
        if version == 3:
            emb = target.read_checkpoint_tensor("model.embed_tokens.weight").float()
            assert emb.view(torch.int32)[0, 1] == -(1 << 31)  # -0.0
            nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32).to(dtype).float()
            assert emb.view(torch.int32)[1, 0] == nan.view(torch.int32)[0]
    assert kinds[0][1] == 0 and kinds[1][1] > 0 and kinds[4][0] >= 1


def test_fp32_master_is_diffed_on_bf16_bits():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ_initial = WeightDiffer(target.checkpoint_specs())
    differ_initial.commit(differ_initial.encode(target.checkpoint_state()))
    master["model.norm.weight"] += 1e-7  # below bf16 resolution near 0.02: no bf16 bit changes
    pending = differ_initial.encode(master)
    assert all(isinstance(u, Patch) for u in pending.updates)
    assert sum(u.indices.num_indices for u in pending.updates) == 0 or pending.stats.changed_fraction < 0.05
    assert all(u.values.dtype == torch.bfloat16 or u.is_delta for u in pending.updates)  # new bits or bit deltas


def test_initial_snapshot_from_shared_checkpoint_gives_patches():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(target.checkpoint_state()))  # both sides loaded the same checkpoint
    adamw_like_step(master, torch.Generator().manual_seed(3))
    pending = differ.encode(master)
    assert pending.stats.num_dense == 0
    receiver.apply(1, pending.updates)
    differ.commit(pending)
    assert_bitwise_equal(target.checkpoint_state(), {n: t.bfloat16() for n, t in master.items()})


def test_patch_bytes_at_one_percent_changed_are_at_most_a_fiftieth_of_dense():
    w = torch.randn(4096, 1024).bfloat16()
    differ = WeightDiffer({"w": ParamSpec(shape=(4096, 1024), dtype=torch.bfloat16)})
    differ.commit(differ.encode({"w": w}))
    new = w.clone()
    idx = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(4))[: w.numel() // 100]
    new.view(-1)[idx] = (new.view(-1)[idx].float() * 1.5 + 0.01).bfloat16()
    pending = differ.encode({"w": new})
    (update,) = pending.updates
    assert isinstance(update, Patch)
    dense_bytes = w.numel() * 2
    assert abs(pending.stats.changed_fraction - 0.01) < 0.001
    assert update.nbytes * 50 <= dense_bytes, (update.nbytes, dense_bytes)


def test_differ_rejects_bad_pushes_and_changes_nothing():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(master))
    generation = differ.generation
    bad_pushes = {
        "unknown parameter": {**master, "lm_head.weight": torch.zeros(VOCAB, HIDDEN)},
        "shape": {**master, "model.norm.weight": torch.zeros(HIDDEN + 1)},
        "not a floating point": {**master, "model.norm.weight": torch.zeros(HIDDEN, dtype=torch.int32)},
    }
    for match, weights in bad_pushes.items():
        with pytest.raises(ValueError, match=match):
            differ.encode(weights)
    with pytest.raises(ValueError, match="twice"):
        differ.encode([("model.norm.weight", master["model.norm.weight"])] * 2)
    assert differ.generation == generation
    assert all(isinstance(u, Patch) and u.indices.num_indices == 0 for u in differ.encode(master).updates)


def test_uncommitted_push_is_rediffed_and_stale_commit_raises():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(master))
    adamw_like_step(master, torch.Generator().manual_seed(5))
    lost = differ.encode(master)  # never arrived: not committed
    again = differ.encode(master)
    assert [u.checksum for u in lost.updates] == [u.checksum for u in again.updates]
    differ.commit(again)
    with pytest.raises(ValueError, match="stale push"):
        differ.commit(lost)


def test_differ_accepts_module_mapping_and_pairs():
    lin = torch.nn.Linear(4, 3)
    specs = {"weight": ParamSpec(shape=(3, 4), dtype=torch.bfloat16), "bias": ParamSpec(shape=(3,), dtype=torch.bfloat16)}
    from_module = WeightDiffer(specs).encode(lin).updates
    from_mapping = WeightDiffer(specs).encode(dict(lin.named_parameters())).updates
    from_pairs = WeightDiffer(specs).encode(iter([(n, p.detach()) for n, p in lin.named_parameters()])).updates
    assert [u.checksum for u in from_module] == [u.checksum for u in from_mapping] == [u.checksum for u in from_pairs]
    assert {u.name for u in from_module} == {"weight", "bias"}


# --- corrupt updates: each raises, weights and version stay -------------------------------------


def _patch_of(differ, master, name):
    pending = differ.encode({name: master[name]})
    (update,) = pending.updates
    assert isinstance(update, Patch) and update.indices.num_indices > 0
    return update


def corrupt_cases():
    k = "model.layers.0.self_attn.k_proj.weight"

    def out_of_bounds(u, target):
        idx = u.indices.decode(torch.device("cpu"))
        idx[-1] = target.shapes[k][0] * target.shapes[k][1]  # one past the end
        return [Patch(name=k, indices=PackedIndices.encode(idx), values=u.values, checksum=u.checksum, escapes=u.escapes)], "out of bounds"

    def bad_checksum(u, target):
        return [Patch(name=k, indices=u.indices, values=u.values, checksum=u.checksum + 1, escapes=u.escapes)], "checksum mismatch"

    def flipped_value(u, target):
        values = u.values.clone()
        if u.is_delta:  # a different nonzero delta (0 would be an escape)
            values[0] = 3 if values[0] != 3 else 5
        else:
            values.view(torch.int16)[0] ^= 1
        return [Patch(name=k, indices=u.indices, values=values, checksum=u.checksum, escapes=u.escapes)], "checksum mismatch"

    def dense_bad_checksum(u, target):
        t = target.read_checkpoint_tensor(k).clone() + 1
        return [Dense(name=k, tensor=t, checksum=checksum(t) ^ 4)], "checksum mismatch"

    def wrong_shape(u, target):
        return [Dense.of(k, torch.zeros(KV_ROWS + 1, HIDDEN, dtype=torch.bfloat16))], "shape"

    def wrong_dtype(u, target):
        return [Dense.of(k, torch.zeros(KV_ROWS, HIDDEN, dtype=torch.float16))], "dtype"

    def unknown_name(u, target):
        return [Dense.of("lm_head.weight", torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16))], "unknown parameter"

    def bad_overflow(u, target):
        return [Patch(name=k, indices=PackedIndices(gaps=u.indices.gaps, overflow=torch.tensor([7], dtype=torch.int32)), values=u.values, checksum=u.checksum, escapes=u.escapes)], "malformed index stream"

    def values_length(u, target):
        return [Patch(name=k, indices=u.indices, values=u.values[:-1], checksum=u.checksum, escapes=u.escapes)], "indices but values"

    def duplicate(u, target):
        return [u, u], "sent twice"

    return [out_of_bounds, bad_overflow, bad_checksum, flipped_value, dense_bad_checksum, wrong_shape, wrong_dtype, unknown_name, values_length, duplicate]


@pytest.mark.parametrize("make_corrupt", corrupt_cases(), ids=lambda f: f.__name__)
def test_corrupt_update_raises_and_leaves_weights_and_version(make_corrupt):
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(master))
    receiver.apply(1, [Dense.of("model.norm.weight", master["model.norm.weight"].bfloat16())])
    adamw_like_step(master, torch.Generator().manual_seed(6), frac=0.1)
    good = _patch_of(differ, master, "model.layers.0.self_attn.k_proj.weight")
    updates, match = make_corrupt(good, target)
    before = target.snapshot_runtime()
    fine = Dense.of("model.layers.0.self_attn.q_proj.weight", torch.ones(Q_ROWS, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(WeightUpdateError, match=match):
        receiver.apply(2, [fine, *updates])  # a valid record first: it must not be written either
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 1
    result = receiver.apply(2, [good])  # the receiver is still usable afterwards
    assert result.version == 2 and result.num_patch == 1


def _with_indices(u, gaps, overflow=None):
    packed = PackedIndices(gaps=gaps, overflow=torch.zeros(0, dtype=torch.int32) if overflow is None else overflow)
    return Patch(name=u.name, indices=packed, values=u.values, checksum=u.checksum, escapes=u.escapes)


def _out_of_bounds(u, numel):
    idx = u.indices.decode(torch.device("cpu"))
    idx[-1] = numel + 5
    return Patch(name=u.name, indices=PackedIndices.encode(idx), values=u.values, checksum=u.checksum, escapes=u.escapes), "out of bounds"


def _missing_overflow(u, numel):
    gaps = torch.diff(u.indices.decode(torch.device("cpu")), prepend=torch.tensor([-1])).to(torch.int32)
    gaps[len(gaps) // 2] = 0  # an escape without its overflow value
    return _with_indices(u, gaps), "malformed index stream \\(escape count"


def _decreasing(u, numel):
    gaps = torch.diff(u.indices.decode(torch.device("cpu")), prepend=torch.tensor([-1])).to(torch.int32)
    gaps[-1] = -gaps[-1]  # a 32-bit gap may be negative: indices would go back
    return _with_indices(u, gaps), "strictly increasing"


def _escape_count(u, numel):
    assert u.is_delta
    values = u.values.clone()
    values[(values != 0).nonzero()[0]] = 0  # one more escaped delta than escape values
    return Patch(name=u.name, indices=u.indices, values=values, checksum=u.checksum, escapes=u.escapes), "escape"


@pytest.mark.parametrize("batched", [False, pytest.param(True, marks=TRITON_CPU)], ids=["per_patch", "batched"])
@pytest.mark.parametrize("corrupt", [_out_of_bounds, _missing_overflow, _decreasing, _escape_count], ids=lambda f: f.__name__[1:])
def test_corrupt_index_in_the_middle_of_a_multi_parameter_batch_names_it_and_writes_nothing(corrupt, batched):
    target, _, differ, master = make_pair(torch.bfloat16)
    receiver = WeightReceiver(target, batched_scatter=batched)
    differ.commit(differ.encode(master))
    receiver.apply(1, differ.encode(master).updates)
    adamw_like_step(master, torch.Generator().manual_seed(8), frac=0.2)
    push = differ.encode(master)
    candidates = [i for i, u in enumerate(push.updates) if isinstance(u, Patch) and u.is_delta and u.indices.num_indices > 1]
    assert len(candidates) > 10 and len(push.updates) > len(candidates)  # some dense records ride along
    middle = candidates[len(candidates) // 2]
    victim = push.updates[middle]
    bad, match = corrupt(victim, target.checkpoint_specs()[victim.name].numel)
    updates = [*push.updates[:middle], bad, *push.updates[middle + 1 :]]
    before = target.snapshot_runtime()
    with pytest.raises(WeightUpdateError, match=match) as err:
        receiver.apply(2, updates)
    assert str(err.value).startswith(victim.name)
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 1
    receiver.apply(2, push.updates)  # the intact push still applies
    assert_bitwise_equal(target.checkpoint_state(), {n: t.to(torch.bfloat16) for n, t in master.items()})


def _three_dtype_push(gen):
    """A receiver over bf16, fp32 and fp16 parameters holding w0, a differ committed to w0, and a push to w1
    where every parameter changes a few bits: delta patches with escapes, and plain patches where no change
    fits in a byte (fp16, and one bf16 parameter)."""
    shapes = {f"p{i}.{d}": ((16 + 8 * i, 24), dtype) for i in range(5) for d, dtype in
              (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float16))}
    specs = {n: ParamSpec(shape=s, dtype=d) for n, (s, d) in shapes.items()}
    w0 = {n: (torch.randn(s, generator=gen) * 0.02).to(d) for n, (s, d) in shapes.items()}
    w1 = {}
    for n, t in w0.items():
        idx = torch.randperm(t.numel(), generator=gen)[:40]
        by = torch.randint(1, 4, (40,), generator=gen)
        by[: 40 if n.endswith("fp16") or n == "p3.bf16" else 2] = 1 << 12 if t.element_size() == 4 else 300  # escapes
        w1[n] = _bump(t, idx, by)
    receiver = WeightReceiver(TensorDictTarget({n: t.clone() for n, t in w0.items()}))
    differ = WeightDiffer(specs)
    differ.commit(differ.encode(w0))
    for n in specs:
        receiver.current_checksum(n)
    return receiver, differ.encode(w1), w1


@pytest.mark.parametrize("batched", [False, pytest.param(True, marks=TRITON_CPU)], ids=["per_patch", "batched"])
@pytest.mark.parametrize("corrupt", [_out_of_bounds, _missing_overflow, _decreasing, _escape_count], ids=lambda f: f.__name__[1:])
def test_corrupt_index_in_one_of_several_dtype_groups_names_it_and_writes_nothing(corrupt, batched):
    receiver, push, w1 = _three_dtype_push(torch.Generator().manual_seed(9))
    receiver.batched_scatter = batched
    assert {u.values.dtype for u in push.updates} == {torch.int8, torch.float16, torch.bfloat16}  # delta and plain patches
    victim_at = next(i for i, u in enumerate(push.updates) if u.name == "p2.fp32")
    victim = push.updates[victim_at]
    assert victim.is_delta and victim.escapes.numel()
    bad, match = corrupt(victim, receiver.specs[victim.name].numel)
    target = receiver.target
    before = {n: t.clone() for n, t in target.tensors.items()}
    for _ in range(2):  # the session's per-record state starts afresh: the same push is refused twice
        with pytest.raises(WeightUpdateError, match=match) as err:
            receiver.apply(receiver.version + 1, [*push.updates[:victim_at], bad, *push.updates[victim_at + 1 :]])
        assert str(err.value).startswith(victim.name)
        assert_bitwise_equal(target.tensors, before)
    receiver.apply(receiver.version + 1, push.updates)
    assert_bitwise_equal(target.tensors, w1)


def test_index_stream_dtypes_are_checked_at_add():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    packed = PackedIndices.encode(torch.tensor([1, 5]))
    update = Patch(name="model.norm.weight", indices=PackedIndices(gaps=packed.gaps.to(torch.int64), overflow=packed.overflow),
                   values=torch.zeros(2, dtype=torch.bfloat16), checksum=0)
    session = receiver.session()
    session.start(1)
    with pytest.raises(WeightUpdateError, match="gaps must be"):
        session.add([update])
    assert session.state == "failed"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_terms_with_a_known_bound_match_the_general_weights(dtype):
    from weight_updates.checksum import delta_terms

    g = torch.Generator().manual_seed(3)
    for positions, bound in ((torch.tensor([0, 1, 77, 12345, (1 << 22) - 1]), 1 << 22),
                             (torch.tensor([5, 1 << 22, (1 << 22) + 3, 5 << 22]), 6 << 22)):
        old, new = (torch.randn(len(positions), generator=g).to(dtype) for _ in range(2))
        assert torch.equal(delta_terms(old, new, positions, bound=bound), delta_terms(old, new, positions))


def test_more_indices_than_elements_is_refused_at_add():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    norm = receiver.specs["model.norm.weight"]
    packed = PackedIndices.encode(torch.arange(norm.numel + 1))
    update = Patch(name="model.norm.weight", indices=packed, values=torch.zeros(norm.numel + 1, dtype=torch.bfloat16), checksum=0)
    session = receiver.session()
    session.start(1)
    with pytest.raises(WeightUpdateError, match="indices for 16 elements"):
        session.add([update])
    assert session.state == "failed"


def test_stream_cut_short_raises():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    before = target.snapshot_runtime()
    session = receiver.session()
    session.start(1, expected_names=["model.norm.weight", "model.embed_tokens.weight"])
    session.add([Dense.of("model.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))])
    with pytest.raises(WeightUpdateError, match="stream cut short.*embed_tokens"):
        session.finish()
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 0


@pytest.mark.parametrize("mode", ["invalidated", "untrusted_cache"])
def test_patch_against_another_base_is_rejected(mode):
    target, receiver, differ, master = make_pair(torch.bfloat16)
    receiver.trust_cached_checksums = mode != "untrusted_cache"
    differ.commit(differ.encode(master))
    k = "model.layers.1.self_attn.k_proj.weight"
    receiver.current_checksum(k)  # cache the checksum ...
    target.read_checkpoint_tensor(k)[0, 0] = 5.0  # ... then change weights outside a session
    if mode == "invalidated":
        receiver.invalidate_checksums([k])
    adamw_like_step(master, torch.Generator().manual_seed(7), frac=0.1)
    update = _patch_of(differ, master, k)
    assert 0 not in update.indices.decode(torch.device("cpu")).tolist()
    before = target.snapshot_runtime()
    with pytest.raises(WeightUpdateError, match="different base version"):
        receiver.apply(1, [update])
    assert_bitwise_equal(target.snapshot_runtime(), before)


class FlakyTarget(FakeTarget):
    """Flips a bit in the first patch it writes (a transient fault): only read-back can notice."""

    flipped = False

    def write_patch(self, name, flat_indices, values):
        if not self.flipped and values.numel():
            values = values.clone()
            values.view(torch.int16)[0] ^= 1
            self.flipped = name
        super().write_patch(name, flat_indices, values)


FlakyTarget.writable_views = None  # its fault lives in write_patch, which the batched path would bypass


class FailingTarget(FakeTarget):
    """Raises on the second write of a session."""

    writes = 0

    def write_dense(self, name, tensor):
        self.writes += 1
        if self.writes == 2:
            raise RuntimeError("device lost")
        super().write_dense(name, tensor)


def test_faulty_write_fails_verification_and_rolls_back():
    target = FlakyTarget(torch.bfloat16)
    receiver = WeightReceiver(target)
    differ = WeightDiffer(target.checkpoint_specs())
    master = new_trainer(target)
    differ.commit(differ.encode(master))
    adamw_like_step(master, torch.Generator().manual_seed(8), frac=0.2)
    updates = differ.encode(master).updates
    before = target.snapshot_runtime()
    with pytest.raises(WeightUpdateError, match="verification after write failed") as err:
        receiver.apply(1, updates)
    assert f"failed for [{target.flipped!r}]" in str(err.value)  # exactly the tensor whose bit flipped
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 0


def test_without_dense_rollback_a_failed_read_back_says_what_was_not_restored():
    class FlakyDense(FakeTarget):
        def write_dense(self, name, tensor):
            tensor = tensor.clone()
            tensor.view(-1).view(torch.int16)[0] ^= 1
            super().write_dense(name, tensor)

    target = FlakyDense(torch.bfloat16)
    receiver = WeightReceiver(target, dense_rollback=False)
    name, shape = next(iter(target.shapes.items()))
    receiver.current_checksum(name)
    with pytest.raises(WeightUpdateError, match="without a rollback copy"):
        receiver.apply(1, [Dense.of(name, torch.full(shape, 3.0, dtype=torch.bfloat16))])
    assert receiver.version == 0
    assert not receiver.has_checksum(name)  # a patch against the unknown state cannot pass as valid


def test_dense_rollback_off_writes_the_same_bits():
    for rollback in (True, False):
        target = TensorDictTarget({"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)})
        new = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(5)}
        WeightReceiver(target, dense_rollback=rollback).apply(1, [Dense.of(n, t) for n, t in new.items()])
        assert_bitwise_equal(target.tensors, new)


def test_failed_write_rolls_back_earlier_writes():
    target = FailingTarget(torch.bfloat16)
    receiver = WeightReceiver(target)
    before = target.snapshot_runtime()
    updates = [Dense.of(n, torch.full(s, 3.0, dtype=torch.bfloat16)) for n, s in list(target.shapes.items())[:3]]
    with pytest.raises(WeightUpdateError, match="device lost"):
        receiver.apply(1, updates)
    assert_bitwise_equal(target.snapshot_runtime(), before)


def test_session_misuse_raises():
    receiver = WeightReceiver(TensorDictTarget({"w": torch.zeros(4)}))
    record = Dense.of("w", torch.ones(4))
    session = receiver.session()
    with pytest.raises(WeightUpdateError, match="add\\(\\) on a session that is new"):
        session.add([record])
    with pytest.raises(WeightUpdateError, match="finish\\(\\) on a session that is new"):
        session.finish()
    session.start(1)
    with pytest.raises(WeightUpdateError, match="start\\(\\) on a session that is started"):
        session.start(2)
    with pytest.raises(WeightUpdateError, match="another session is open"):
        receiver.session().start(2)
    session.add([record])
    assert session.finish().version == 1
    with pytest.raises(WeightUpdateError, match="finish\\(\\) on a session that is finished"):
        session.finish()
    with pytest.raises(WeightUpdateError, match="version must be an int > the current version 1"):
        receiver.session().start(1)
    assert torch.equal(receiver.target.tensors["w"], torch.ones(4))


def test_parameters_keep_their_storage():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    ptrs = {k: v.data_ptr() for k, v in target.runtime.items()}
    adamw_like_step(master, torch.Generator().manual_seed(9))
    push(differ, InProcessSender(receiver), 1, master)
    adamw_like_step(master, torch.Generator().manual_seed(10))
    push(differ, InProcessSender(receiver), 2, master)
    assert {k: v.data_ptr() for k, v in target.runtime.items()} == ptrs


def test_in_process_send_reports_what_it_sent_and_what_was_applied():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(master))
    differ.reset(["model.norm.weight"])  # one dense record among the patches
    adamw_like_step(master, torch.Generator().manual_seed(12), frac=0.1)
    pending = differ.encode(master)
    sent = InProcessSender(receiver).send(1, pending.updates)
    stats = pending.stats
    assert (sent.version, sent.num_receivers, sent.num_dense, sent.num_patch, sent.nbytes) == (1, 1, 1, stats.num_patch, stats.nbytes)
    (got,) = sent.received
    assert (got.version, got.num_dense, got.num_patch, got.nbytes) == (1, 1, stats.num_patch, stats.nbytes)
    assert sent.seconds >= got.validate_s + got.apply_s + got.verify_s
    assert SendResult.of(1, [], 0.0).received == () and json.loads(json.dumps(sent.to_json()))["received"][0] == got.to_json()


def test_a_session_may_keep_the_dense_rollback_copy_its_receiver_skips():
    class FlakyOnce(FakeTarget):
        """Flips a bit of its first dense write only (a transient fault; the restore writes true bits)."""

        flipped = False

        def write_dense(self, name, tensor):
            if not self.flipped:
                tensor = tensor.clone()
                tensor.view(-1).view(torch.int16)[0] ^= 1
                self.flipped = True
            super().write_dense(name, tensor)

    target = FlakyOnce(torch.bfloat16)
    receiver = WeightReceiver(target, dense_rollback=False)
    name, shape = next(iter(target.shapes.items()))
    before = target.snapshot_runtime()
    session = receiver.session(dense_rollback=True)
    session.start(1)
    session.add([Dense.of(name, torch.full(shape, 3.0, dtype=torch.bfloat16))])
    with pytest.raises(WeightUpdateError, match="verification after write failed.*weights restored"):
        session.finish()
    assert_bitwise_equal(target.snapshot_runtime(), before)
    assert receiver.version == 0


# --- the session loop every receiver runs ---------------------------------------------------------


class ListSource:
    """A message source over in-memory chunks; ``bad`` chunks fail to read, ``break_at`` breaks the stream."""

    def __init__(self, version, chunks, *, names=None, bad=(), break_at=None):
        self.version, self.chunk_list, self.names, self.bad, self.break_at = version, chunks, names, set(bad), break_at
        self.read = []  # positions of the chunks the stream delivered
        self.replies = []

    def start(self):
        return Start(version=self.version, names=self.names)

    def chunks(self):
        for i, chunk in enumerate(self.chunk_list):
            if i == self.break_at:
                raise WeightUpdateError("timed out after 1 s waiting for the next chunk")
            self.read.append(i)
            yield (lambda: (_ for _ in ()).throw(KeyError("header"))) if i in self.bad else (lambda chunk=chunk: chunk)

    def reply(self, result, error):
        self.replies.append((result, error))


def _three_chunks(target):
    records = [Dense.of(n, torch.full(s, 1.0, dtype=torch.bfloat16)) for n, s in list(target.shapes.items())[:3]]
    return [[r] for r in records], [r.name for r in records]


def test_serve_session_reads_every_chunk_after_a_bad_one_and_reports_the_first_error():
    target = FakeTarget(torch.bfloat16)
    receiver = WeightReceiver(target)
    chunks, names = _three_chunks(target)
    before = target.snapshot_runtime()
    source = ListSource(1, chunks, names=names, bad={1})
    with pytest.raises(WeightUpdateError, match="malformed message: KeyError\\('header'\\)"):
        serve_session(receiver, source)
    assert source.read == [0, 1, 2]  # the sender got to its end
    assert source.replies == [(None, "malformed message: KeyError('header')")]
    assert_bitwise_equal(target.snapshot_runtime(), before)
    source = ListSource(1, chunks, names=names)
    assert serve_session(receiver, source).version == 1 == receiver.version  # the receiver is free again
    assert source.replies[0][0].num_dense == 3 and source.replies[0][1] is None


def test_serve_session_stops_at_a_broken_stream_and_still_answers():
    target = FakeTarget(torch.bfloat16)
    receiver = WeightReceiver(target)
    chunks, names = _three_chunks(target)
    before = target.snapshot_runtime()
    source = ListSource(1, chunks, names=names, break_at=1)
    with pytest.raises(WeightUpdateError, match="timed out"):
        serve_session(receiver, source)
    assert source.read == [0] and source.replies == [(None, "timed out after 1 s waiting for the next chunk")]
    assert_bitwise_equal(target.snapshot_runtime(), before)
    source = ListSource(0, chunks, names=names)  # a refused start: the chunks are still read, then refused
    with pytest.raises(WeightUpdateError, match="version must be an int > the current version 0"):
        serve_session(receiver, source)
    assert source.read == [0, 1, 2] and receiver.version == 0


# --- a staging receiver (weights out of reach) ----------------------------------------------------


class _Remote:
    """Remote sessions that record the steps driven on them; `fail` makes that step raise."""

    def __init__(self, calls: list, fail: dict[str, str] | None = None) -> None:
        self.calls, self.fail, self.version = calls, fail or {}, None

    def _step(self, name: str, *args):
        self.calls.append((name, *args))
        if name in self.fail:
            raise WeightUpdateError(self.fail[name])

    def prepare(self, version, records, dense_rollback):
        self.version = version
        self._step("prepare", version, [r.name for r in records], dense_rollback)

    def commit(self):
        self._step("commit")

    def publish(self):
        self._step("publish")
        return UpdateResult(version=self.version, num_dense=0, num_patch=0, nbytes=0, validate_s=0.0, apply_s=0.0,
                            verify_s=0.0)

    def rollback(self):
        self._step("rollback")
        return "restored on every rank"


def _staging(calls: list, fail: dict[str, str] | None = None) -> StagingReceiver:
    specs = {"a": ParamSpec((2, 3), torch.bfloat16), "b": ParamSpec((4,), torch.float32)}
    return StagingReceiver(specs, _Remote(calls, fail), version=3)


def test_staging_receiver_checks_records_at_add_and_drives_the_remote_sessions():
    calls = []
    receiver = _staging(calls)
    good = [Dense.of("a", torch.ones(2, 3, dtype=torch.bfloat16)), Dense.of("b", torch.ones(4))]
    for bad, match in [(Dense.of("c", torch.ones(4)), "unknown parameter 'c'"),
                       (Dense.of("a", torch.ones(3, 2, dtype=torch.bfloat16)), "shape \\(3, 2\\) != checkpoint shape"),
                       (Dense.of("b", torch.ones(4, dtype=torch.bfloat16)), "dtype torch.bfloat16 != engine dtype")]:
        session = receiver.session()
        session.start(4)
        with pytest.raises(WeightUpdateError, match=match):
            session.add([good[1] if bad.name == "a" else good[0], bad])  # a good record first: nothing may stay held
        assert session.state == "failed"
    session = receiver.session()
    session.start(4, expected_names=["a", "b"])
    session.add(good[:1])
    with pytest.raises(WeightUpdateError, match="stream cut short"):
        session.prepare()
    assert calls == [] and receiver.version == 3  # nothing reached the weights
    session = receiver.session(dense_rollback=True)
    session.start(4)
    session.add(good)
    session.prepare()
    assert calls == [("prepare", 4, ["a", "b"], True)]
    session.commit()
    assert calls[-1] == ("commit",) and receiver.version == 3  # written; the version moves at publish
    assert session.publish().version == 4 == receiver.version and calls[-1] == ("publish",)
    with pytest.raises(WeightUpdateError, match="version must be an int > the current version 4"):
        receiver.session().start(4)


@pytest.mark.parametrize("step", ["prepare", "commit"])
def test_staging_receiver_drops_every_remote_session_when_a_step_fails(step):
    calls = []
    receiver = _staging(calls, fail={step: f"{step} failed on rank 1"})
    session = receiver.session()
    session.start(4)
    session.add([Dense.of("b", torch.ones(4))])
    with pytest.raises(WeightUpdateError, match=f"{step} failed on rank 1"):
        session.prepare()
        session.commit()
    assert session.state == "failed" and receiver.version == 3
    assert [c[0] for c in calls] == (["prepare"] if step == "prepare" else ["prepare", "commit"]) + ["rollback"]


def test_staging_receiver_rollback_after_commit_is_the_remote_sessions():
    calls = []
    receiver = _staging(calls)
    session = receiver.session()
    session.start(4)
    session.add([Dense.of("b", torch.ones(4))])
    assert session.rollback() == "nothing written" and calls == []  # nothing left this process yet
    session = receiver.session()
    session.start(4)
    session.add([Dense.of("b", torch.ones(4))])
    session.prepare()
    session.commit()
    assert session.rollback() == "restored on every rank" and calls[-1] == ("rollback",) and receiver.version == 3

def _mixed_updates():
    target, receiver, differ, master = make_pair(torch.bfloat16)
    differ.commit(differ.encode(master))
    differ.reset(["model.norm.weight"])
    adamw_like_step(master, torch.Generator().manual_seed(11), frac=0.1)
    return differ.encode(master).updates


def test_bucket_roundtrip_is_a_valid_safetensors_file():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    updates = _mixed_updates()
    plan = plan_bucket(updates)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    write_bucket(plan, buf)
    decoded = read_bucket(plan.header, buf)
    assert [u.name for u in decoded] == [u.name for u in updates]
    for a, b in zip(updates, decoded):
        assert type(a) is type(b) and a.checksum == b.checksum
        if isinstance(a, Dense):
            assert torch.equal(a.tensor.view(torch.int16), b.tensor.view(torch.int16))
        else:
            assert torch.equal(a.indices.gaps, b.indices.gaps) and torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
    loaded = safetensors_torch.load(to_safetensors_prefix(plan.header) + buf.numpy().tobytes())
    dense = next(u for u in updates if isinstance(u, Dense))
    assert torch.equal(loaded[dense.name], dense.tensor)


def test_truncated_bucket_raises():
    updates = _mixed_updates()
    plan = plan_bucket(updates)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    write_bucket(plan, buf)
    with pytest.raises(WeightUpdateError, match="truncated bucket"):
        read_bucket(plan.header, buf[: plan.nbytes - 3])


def test_import_is_cheap():
    code = "import sys, weight_updates, weight_updates.transports; print(sorted(m for m in ('nixl', 'nixl._api', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_small_changes_travel_as_one_byte_bit_deltas():
    from weight_updates import DiffConfig, TensorDictTarget, WeightDiffer, WeightReceiver

    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)
    target = TensorDictTarget({"w": w0.clone()})
    receiver = WeightReceiver(target)
    results = {}
    for use_deltas in (True, False):
        differ = WeightDiffer(target.checkpoint_specs(), config=DiffConfig(bit_deltas=use_deltas))
        first = differ.encode({"w": target.read_checkpoint_tensor("w").clone()})
        receiver.apply(receiver.version + 1, first.updates)
        differ.commit(first)
        # a small optimizer-like step on 1% of the weights: a few ulps each, some sign/exponent crossings
        master = target.read_checkpoint_tensor("w").float()
        idx = torch.randperm(4096, generator=g)[:41]
        master[idx] += torch.randn(41, generator=g) * 1e-4
        master[idx[:3]] = -master[idx[:3]]  # large bit jumps: these need the full-width encoding
        push = differ.encode({"w": master})
        (patch,) = push.updates
        receiver.apply(receiver.version + 1, push.updates)
        differ.commit(push)
        assert torch.equal(target.read_checkpoint_tensor("w").view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
        results[use_deltas] = patch
    # the sign flips do not fit in a byte: they travel as escapes, the rest as one-byte deltas
    assert results[True].is_delta and not results[False].is_delta
    assert 1 <= results[True].escapes.numel() <= 5
    assert results[True].nbytes < results[False].nbytes
    differ = WeightDiffer(target.checkpoint_specs())
    base = differ.encode({"w": target.read_checkpoint_tensor("w").clone()})
    receiver.apply(receiver.version + 1, base.updates)
    differ.commit(base)
    master = target.read_checkpoint_tensor("w").float()
    master[:40] = (master[:40].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()  # +1 ulp
    push = differ.encode({"w": master})
    (patch,) = push.updates
    assert patch.is_delta and patch.values.dtype == torch.int8 and patch.escapes.numel() == 0
    assert patch.nbytes == 40 + 40  # one byte of delta and one byte of gap per change
    receiver.apply(receiver.version + 1, push.updates)
    differ.commit(push)
    assert torch.equal(target.read_checkpoint_tensor("w"), master.to(torch.bfloat16))
    # a delta patch against the wrong base is refused before anything is written
    bits = master.to(torch.bfloat16).view(torch.int16).clone()
    bits[100:140] += 1
    stale = differ.encode({"w": bits.view(torch.bfloat16)})
    assert stale.updates[0].is_delta
    target.write_dense("w", torch.zeros(4096, dtype=torch.bfloat16))
    receiver.invalidate_checksums()
    before = target.read_checkpoint_tensor("w").clone()
    with pytest.raises(ValueError, match="checksum mismatch"):
        receiver.apply(receiver.version + 1, stale.updates)
    assert torch.equal(target.read_checkpoint_tensor("w"), before)
    # a delta patch whose escape count is wrong is refused too
    from weight_updates import Patch

    bad = Patch(name="w", indices=patch.indices, values=patch.values.masked_fill(torch.arange(40) == 0, 0),
                escapes=patch.escapes, checksum=patch.checksum)
    with pytest.raises(ValueError, match="escape"):
        receiver.apply(receiver.version + 1, [bad])
    assert torch.equal(target.read_checkpoint_tensor("w"), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_deltas_add_modulo_the_dtype_width_and_take_escapes_in_order(dtype):
    from weight_updates.encoding import apply_bit_deltas

    ints = INT_VIEW[dtype]
    info = torch.iinfo(ints)
    old = torch.tensor([info.max, info.min, 0, -1, 5, info.max - 3, 8], dtype=ints)
    delta = torch.tensor([1, -1, 0, 127, -128, 0, 0], dtype=torch.int8)  # three escapes, two values: the last repeats
    escapes = torch.tensor([7, 9], dtype=ints)
    escaped = delta == 0
    got = apply_bit_deltas(old.view(dtype), delta, escapes.view(dtype), escaped, torch.cumsum(escaped, 0))
    span = 1 << (8 * old.element_size())
    want = (old.to(torch.int64) + delta.to(torch.int64) - info.min) % span + info.min
    want[escaped] = torch.tensor([7, 9, 9])
    assert torch.equal(got.view(ints).to(torch.int64), want)


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1, 0, 7], [0, 0, 4], [6], [2, 0], [0, 0]])
def test_segment_sums_and_ids_match_index_add_with_empty_segments_and_wraparound(lengths):
    from weight_updates.encoding import segment_ids, segment_sums

    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor(lengths)
    values = torch.randint(-2**62, 2**62, (3, int(lengths.sum())), generator=g)  # sums wrap modulo 2**64
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    assert torch.equal(segment_ids(lengths, int(lengths.sum())), segment)
    expected = torch.zeros(len(lengths), 3, dtype=torch.int64).index_add_(0, segment, values.t())
    assert torch.equal(segment_sums(values, lengths), expected)
    assert torch.equal(segment_sums(values[0], lengths), expected[:, 0])


# --- batched encode vs a per-parameter reference ---------------------------------------------------


def reference_encode(snapshot: dict[str, torch.Tensor], checks: dict[str, int], specs, weights, config) -> list:
    """The encoder one parameter at a time (a nonzero, a PackedIndices.encode and a checksum per parameter):
    what ``WeightDiffer.encode`` must produce byte for byte."""
    from weight_updates.encoding import MAX_PATCH_NUMEL, bit_differences, delta_bytes

    updates = []
    for name, tensor in weights.items():
        new = tensor.detach().to(dtype=specs[name].dtype).contiguous()
        old = snapshot.get(name)
        if old is None:
            updates.append(Dense(name=name, tensor=new, checksum=checksum(new)))
            continue
        view = INT_VIEW[new.dtype]
        indices = torch.ne(new.view(-1).view(view), old.view(-1).view(view)).nonzero().squeeze(1)
        esize = new.element_size()
        budget = new.numel() * esize * config.max_patch_ratio
        values_bytes = indices.numel() * esize
        update = Dense(name=name, tensor=new, checksum=checksum(new))
        if new.numel() < MAX_PATCH_NUMEL and values_bytes <= budget:
            packed = PackedIndices.encode(indices)
            if packed.nbytes + values_bytes <= budget:
                values, old_values = new.view(-1)[indices], old.view(-1)[indices]
                check = int(checks[name] + patch_checksum_delta(old_values, values, indices))
                update = Patch(name=name, indices=packed, values=values, checksum=check)
                if config.bit_deltas:
                    deltas, escaped = delta_bytes(bit_differences(old_values, values))
                    escapes = values[escaped]
                    delta = Patch(name=name, indices=packed, values=deltas, escapes=escapes, checksum=check)
                    update = delta if delta.nbytes < update.nbytes else update
        updates.append(update)
    return updates


def assert_same_records(got: list, want: list) -> None:
    def same(a, b, what):
        assert (a is None) == (b is None), what
        if a is not None:
            assert (a.dtype, tuple(a.shape), a.device) == (b.dtype, tuple(b.shape), b.device), what
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), what

    assert [(type(u).__name__, u.name, u.checksum) for u in got] == [(type(u).__name__, u.name, u.checksum) for u in want]
    for g, w in zip(got, want):
        if isinstance(w, Dense):
            same(g.tensor, w.tensor, f"{w.name} tensor")
        else:
            same(g.indices.gaps, w.indices.gaps, f"{w.name} gaps")
            same(g.indices.overflow, w.indices.overflow, f"{w.name} overflow")
            same(g.values, w.values, f"{w.name} values")
            same(g.escapes, w.escapes, f"{w.name} escapes")


def _bump(t: torch.Tensor, idx, by: int | torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose bits at flat ``idx`` are moved by ``by`` (as integers of the dtype's width)."""
    out = t.clone()
    bits = out.view(-1).view(INT_VIEW[t.dtype])
    bits[idx] += by
    return out


@pytest.mark.parametrize("config", [{}, {"bit_deltas": False}, {"max_patch_ratio": 0.9}, {"max_patch_ratio": 0.0}],
                         ids=["default", "no_deltas", "ratio_0.9", "ratio_0"])
def test_batched_encode_matches_per_parameter_reference(config):
    """Several dtypes; parameters unchanged, fully changed (dense), sparse (patch) with uint8 gaps (with and
    without escapes), uint16 gaps with escapes, int32 gaps, bit deltas with escapes; a parameter without a
    snapshot amid others that have one; fp32 master input; a non-contiguous input; a push of a subset out of
    spec order. Every record must be byte-identical to the per-parameter reference, and the receiver must
    end bitwise equal."""
    from weight_updates import DiffConfig

    config = DiffConfig(**config)
    shapes = {
        "a.u8": ((64, 64), torch.bfloat16),
        "b.u8_escape": ((4096,), torch.bfloat16),
        "c.u16": ((300_000,), torch.bfloat16),
        "d.int32": ((1_000_000,), torch.float32),
        "e.full": ((32, 32), torch.float16),
        "f.same": ((128,), torch.bfloat16),
        "g.deltas": ((4096,), torch.float32),
        "h.fresh": ((48, 8), torch.bfloat16),
        "i.master": ((40, 24), torch.float16),
        "j.transposed": ((24, 40), torch.bfloat16),
        "k.empty": ((0,), torch.bfloat16),
    }
    specs = {n: ParamSpec(shape=s, dtype=d) for n, (s, d) in shapes.items()}
    gen = torch.Generator().manual_seed(7)
    w0 = {n: (torch.randn(s, generator=gen) * 0.02).to(d) for n, (s, d) in shapes.items()}
    w0["f.same"] = torch.ones(128, dtype=torch.bfloat16)
    w0["i.master"] = w0["i.master"].float()  # an fp32 master weight, cast by the differ
    target = TensorDictTarget({n: (t.to(specs[n].dtype)).clone() for n, t in w0.items()})
    receiver = WeightReceiver(target)
    differ = WeightDiffer(specs, config=config)

    w1 = dict(w0)
    w1["a.u8"] = _bump(w0["a.u8"], torch.arange(0, 4096, 7), 1)
    w1["b.u8_escape"] = _bump(w0["b.u8_escape"], torch.tensor([0, 1, 2, 300, 301, 302, 303, 304, 305, 306, 4000]), 3)
    c_idx = torch.cat([torch.arange(10, 200_000, 900), torch.tensor([270_000, 299_999])])  # gaps 900, two > 65535
    w1["c.u16"] = _bump(w0["c.u16"], c_idx, -2)
    w1["d.int32"] = _bump(w0["d.int32"], torch.tensor([70_000, 140_000, 210_000, 999_999]), 5)
    w1["e.full"] = -w0["e.full"]
    g_idx = torch.randperm(4096, generator=gen)[:60]
    w1["g.deltas"] = _bump(_bump(w0["g.deltas"], g_idx, 2), g_idx[:4], 1 << 20)  # four jumps too big for a byte
    w1["h.fresh"] = _bump(w0["h.fresh"], [3], 1)
    w1["i.master"] = w0["i.master"] * (1 + 1e-2 * (torch.rand(40, 24, generator=gen) < 0.05))
    w1["j.transposed"] = _bump(w0["j.transposed"], torch.arange(0, 960, 97), 1).t().contiguous().t()  # non-contiguous
    assert not w1["j.transposed"].is_contiguous()
    w2 = {n: w1[n] for n in ("g.deltas", "c.u16", "h.fresh", "a.u8")}  # a subset, out of spec order
    w2["c.u16"] = _bump(w1["c.u16"], torch.arange(5, 300_000, 40_000), 1)
    w2["h.fresh"] = _bump(w1["h.fresh"], torch.arange(0, 384, 2), -1)

    snapshot: dict[str, torch.Tensor] = {}
    checks: dict[str, int] = {}
    sent = []
    pushes = [w0, w1, w2, w2, w1]  # w1 again: every parameter pushed, every one with a snapshot
    for step, weights in enumerate(pushes):
        if step in (1, 2):
            differ.reset(["h.fresh"])
            snapshot.pop("h.fresh", None)
        want = reference_encode(snapshot, checks, specs, weights, config)
        push = differ.encode(weights)
        assert_same_records(push.updates, want)
        sent += push.updates
        receiver.apply(receiver.version + 1, push.updates)
        differ.commit(push)
        for name, t in weights.items():
            snapshot[name] = t.to(specs[name].dtype).contiguous().clone()
            checks[name] = checksum(snapshot[name])
        assert_bitwise_equal({n: target.read_checkpoint_tensor(n) for n in weights}, {n: snapshot[n] for n in weights})
    repeated = sent[-len(w1) - len(w2) : -len(w1)]
    assert all(isinstance(u, Patch) and u.indices.num_indices == 0 for u in repeated)
    patches = [u for u in sent if isinstance(u, Patch)]
    assert sum(isinstance(u, Dense) for u in sent) > len(shapes)  # the first push, "e.full", "h.fresh" twice
    if config.max_patch_ratio == 0.0:
        assert all(u.indices.num_indices == 0 for u in patches)  # every changed parameter goes dense
        return
    for gap_dtype, escaped in [(torch.uint8, False), (torch.uint8, True), (torch.uint16, True), (torch.int32, False)]:
        assert any(u.indices.gaps.dtype == gap_dtype and (u.indices.overflow.numel() > 0) == escaped and u.indices.num_indices
                   for u in patches), (gap_dtype, escaped)
    assert any(u.is_delta and u.escapes.numel() for u in patches) == config.bit_deltas


def test_concat_to_joins_adjacent_views_without_a_copy():
    from weight_updates.checksum import concat_to

    base = torch.arange(100, dtype=torch.int16)
    other = torch.arange(7, dtype=torch.int16) + 1000
    parts = [base[0:10], base[10:25], base[25:40], other, base[60:70], base[70:71], base[71:71], base[80:90].to(torch.int8)]
    want = torch.cat([p.to(torch.int64) for p in parts])
    assert torch.equal(concat_to(parts, torch.int64, "cpu"), want)
    joined = concat_to([*parts[:3], base[40:40]], torch.int16, "cpu")  # slices end to end: one view, no copy
    assert torch.equal(joined, base[:40]) and joined.data_ptr() == base.data_ptr()
    for gapped in ([base[0:10], base[11:20]], [base[0:10], other]):  # a hole, another tensor: copied
        copied = concat_to(gapped, torch.int16, "cpu")
        assert torch.equal(copied, torch.cat(gapped)) and copied.data_ptr() != base.data_ptr()
    strided = torch.arange(20, dtype=torch.int16)
    parts = [strided[0:8:2], strided[4:8]]  # end to end by address, but the first is not contiguous: copied
    assert torch.equal(concat_to(parts, torch.int16, "cpu"), torch.cat(parts))
    assert concat_to([base[0:0], other[0:0]], torch.int64, "cpu").shape == (0,)
    # adjacent addresses in two different storages are not joined (allocations may sit back to back)
    a, b = torch.empty(4096, dtype=torch.int16), torch.empty(4096, dtype=torch.int16)
    if b.data_ptr() == a.data_ptr() + a.numel() * 2:
        assert concat_to([a, b], torch.int16, "cpu").data_ptr() not in (a.data_ptr(), b.data_ptr())
