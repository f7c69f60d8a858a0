"""Weight-sync benchmark: dense vs sparse patch vs rank-local IPC, on Qwen2.5 shapes and Qwen3-8B's. JSON lines.

::

    bf16 weights w0 (HF names, plain dict)  --AdamW step (lr 1e-6) on fp32 master, cast-->  w1
    both sides start from w0 with their checksums known (as after any earlier push), then
    in-process:  v1 patch(w0 -> w1), v2 dense(w1), v3 dense(w1) without the rollback copy
                 (run twice; the first round is a warm-up)
    IPC:         v1 patch(w0 -> w1), v2 dense(w1)    to a spawned rollout process (/dev/shm or CUDA IPC)

Per push: changed fraction, payload bytes, and seconds for encode (sender), transfer (sender's
total minus the receiver's work), validate / apply / verify (receiver); the bytes the receiver's session
keeps for rollback (``rollback_bytes``: the old values of densely written parameters unless the receiver
skips that copy, and the old values of patched elements) and, on CUDA, the most device memory the session
allocated beyond what was allocated before it (``session_peak_extra_bytes``: staging, indices, old and new
values, the rollback copy). Also the device's copy bandwidth from a big clone in the same run, the three
target ratios, and the memory of each choice (``memory`` event): the trainer bridge's snapshot (one copy of
the pushed weights, on the GPU or, ``TrainerBridge(snapshot_device="cpu")``, on the host), the receiver's
dense rollback copy (or none: ``WeightReceiver(dense_rollback=False)``) and a patch's old values. With
``--host-snapshot`` the trainer side also diffs against a snapshot in host memory (``host_patch``: encode on
the CPU, records staged from the host by the session), timed the same way. No model code: the
weights are random tensors of the checkpoint's shapes (norms = 1), which is all the sync path sees.

With ``--profile``: one more in-process round under the torch profiler (top operators), and op counts of
the trainer's encode and the receiver's side of a patch push and a dense push (``event="op_counts"``:
kernel-like aten ops, i.e. all but views and allocations, the per-op counts that grow with the number of
parameters when a path is per-parameter, ``host_syncs``, and on CUDA the runtime's launches, copies and
syncs). ``host_syncs`` counts, on any device, what makes the host wait for a CUDA device: reads of tensor
values (``tolist``, ``item``, ``int`` / ``float`` / ``bool`` of a tensor) and ops whose output size depends
on the data (``nonzero``, also inside boolean indexing; ``masked_select``). ``--batched-scatter`` uses the
multi-tensor gather / scatter kernels on the CPU too (run it with TRITON_INTERPRET=1), so that the CPU
counts show the CUDA path's structure.

Usage: python bench/weight_sync.py [--model 0.5b|1.5b|8b|records] [--device cpu|cuda] [--quick] [--host-snapshot]
       [--profile [--batched-scatter]] [--patch-sweep BLOCK:WARPS,...]
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weight_updates import ParamSpec, TensorDictTarget, WeightDiffer, WeightReceiver  # noqa: E402
from weight_updates.transports.inprocess import InProcessSender  # noqa: E402
from weight_updates.transports.ipc import IpcReceiver, IpcSender  # noqa: E402

MODELS = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab (tied embeddings)
    "0.5b": (896, 24, 14, 2, 64, 4864, 151936),
    "1.5b": (1536, 28, 12, 2, 128, 8960, 151936),
    "8b": (4096, 36, 32, 8, 128, 12288, 151936),  # Qwen3-8B: untied LM head, q/k norms, no biases (QWEN3_LAYOUT)
    "quick": (64, 2, 4, 2, 16, 128, 1000),
    "records": (64, 24, 4, 2, 16, 512, 4000),  # the 0.5B model's 290 records, tiny: a session's host overhead
}


QWEN3_LAYOUT = {"8b"}


def qwen2_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint names -> shapes: Qwen2's layout (tied embedding, q/k/v biases), or Qwen3's for QWEN3_LAYOUT."""
    hidden, layers, heads, kv_heads, head_dim, inter, vocab = MODELS[model]
    qwen3 = model in QWEN3_LAYOUT
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if qwen3:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if qwen3:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        else:
            shapes |= {p + f"self_attn.{n}_proj.bias": (h * head_dim,) for n, h in (("q", heads), ("k", kv_heads),
                                                                                    ("v", kv_heads))}
    return shapes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def init_weights(shapes: dict[str, tuple[int, ...]], device: torch.device) -> dict[str, torch.Tensor]:
    """bf16 weights: norms 1, the rest U(-a, a) with std 0.02 (Qwen2's initializer_range)."""
    gen = torch.Generator(device=device).manual_seed(0)
    bound = 0.02 * 3**0.5
    weights = {}
    for name, shape in shapes.items():
        w = torch.empty(shape, dtype=torch.bfloat16, device=device)
        weights[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.uniform_(-bound, bound, generator=gen)
    return weights


def adamw_step(weights: dict[str, torch.Tensor], *, block: int = 1 << 22) -> dict[str, torch.Tensor]:
    """One real AdamW step (``torch.optim.adamw.adamw``: lr 1e-6, weight decay 0.01, fresh state)
    with U(-1, 1) gradients on fp32 master copies, cast back to bf16. Runs in blocks through four
    reused fp32 buffers, so the benchmark does not spend its time allocating optimizer state."""
    from torch.optim.adamw import adamw

    device = next(iter(weights.values())).device
    gen = torch.Generator(device=device).manual_seed(1)
    master, grad, exp_avg, exp_avg_sq = (torch.empty(block, device=device) for _ in range(4))  # [block] fp32
    new = {}
    for name, w in weights.items():
        out = torch.empty_like(w)
        flat_w, flat_out = w.view(-1), out.view(-1)
        for start in range(0, flat_w.numel(), block):
            n = min(block, flat_w.numel() - start)
            p, g, m, v = master[:n], grad[:n], exp_avg[:n], exp_avg_sq[:n]
            p.copy_(flat_w[start : start + n])
            g.uniform_(-1.0, 1.0, generator=gen)
            m.zero_()
            v.zero_()
            adamw([p], [g], [m], [v], [], [torch.zeros(())], foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-6, weight_decay=0.01, eps=1e-8, maximize=False)
            flat_out[start : start + n].copy_(p)
        new[name] = out
    return new


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by cloning a 512 MiB tensor (best of 3)."""
    x = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        y = x.clone()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        del y
    return 2 * x.numel() / best


def warm_receiver(weights: dict[str, torch.Tensor], batched_scatter: bool | None = None) -> WeightReceiver:
    """A receiver over ``weights`` whose checksums are already known, as after any earlier push."""
    receiver = WeightReceiver(TensorDictTarget(weights), batched_scatter=batched_scatter)
    for name in weights:
        receiver.current_checksum(name)
    return receiver


def rollout_process(conn, shapes: dict[str, tuple[int, ...]], device: str) -> None:
    """Spawned rollout rank: loads w0 (the same seeded init), then serves four IPC sessions."""
    ipc = IpcReceiver(conn, warm_receiver(init_weights(shapes, torch.device(device))), timeout_s=300)
    conn.send_bytes(b"ready")
    for _ in range(4):
        ipc.serve_one(start_timeout_s=300)


def rollback_bytes(pending, dense_rollback: bool) -> int:
    """Bytes a session keeps to undo ``pending``: the dense parameters' old values (with the rollback copy) and
    the patched elements' old values."""
    total = 0
    for p, u in zip(pending.stats.params, pending.updates):
        itemsize = (u.tensor if p.encoding == "dense" else u.escapes if u.is_delta else u.values).element_size()
        total += p.numel * itemsize * dense_rollback if p.encoding == "dense" else p.num_changed * itemsize
    return total


def push_record(mode: str, version: int, pending, encode_s: float, total_s: float, result: dict, quiet: bool,
                dense_rollback: bool = True, peak_extra: int | None = None) -> dict:
    receiver_s = result["validate_s"] + result["apply_s"] + result["verify_s"]
    stats = pending.stats
    record = dict(
        event="push",
        mode=mode,
        version=version,
        num_dense=stats.num_dense,
        num_patch=stats.num_patch,
        changed_fraction=round(stats.changed_fraction, 6) if stats.num_patch else None,
        bytes=stats.nbytes,
        dense_bytes=stats.dense_nbytes,
        encode_s=round(encode_s, 6),
        transfer_s=round(max(0.0, total_s - receiver_s), 6),
        validate_s=round(result["validate_s"], 6),
        apply_s=round(result["apply_s"], 6),
        verify_s=round(result["verify_s"], 6),
        apply_verify_s=round(receiver_s, 6),
        rollback_bytes=rollback_bytes(pending, dense_rollback),
        session_peak_extra_bytes=peak_extra,
    )
    if not quiet:
        emit(**record)
    return record


def timed_push(mode: str, differ: WeightDiffer, send, version: int, weights, device: torch.device,
               quiet: bool = False, dense_rollback: bool = True, local: bool = True) -> dict:
    """Encode, send and commit one push; ``device``: where the weights are; ``local``: the receiver is in this
    process (on CUDA its session's peak memory is measured)."""
    measure = local and device.type == "cuda"
    sync(device)
    t0 = time.perf_counter()
    pending = differ.encode(weights)
    sync(device)
    t1 = time.perf_counter()
    if measure:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    result = send(version, pending.updates).received[0].to_json()
    t2 = time.perf_counter()
    peak_extra = torch.cuda.max_memory_allocated(device) - before if measure else None
    differ.commit(pending)
    return push_record(mode, version, pending, t1 - t0, t2 - t1, result, quiet, dense_rollback, peak_extra)


def in_process_round(specs, w0, w1, device: torch.device, quiet: bool):
    """Receiver and trainer in this process, both starting from w0: patch to w1, dense, dense without the
    rollback copy. Returns the three records, whether the receiver ended bitwise equal to w1 after the patch,
    and the trainer's snapshot bytes."""
    receiver = warm_receiver({n: t.clone() for n, t in w0.items()})
    sender = InProcessSender(receiver)
    differ = WeightDiffer(specs, device=device)
    differ.commit(differ.encode(w0))
    snapshot_bytes = differ.snapshot_nbytes
    patch = timed_push("patch", differ, sender.send, 1, w1, device, quiet)
    equal = all(torch.equal(receiver.target.tensors[n].view(torch.int16), w1[n].view(torch.int16)) for n in w1)
    differ.reset()
    dense = timed_push("dense", differ, sender.send, 2, w1, device, quiet)
    receiver.dense_rollback = False  # the same push without the rollback copy of the old weights
    differ.reset()
    dense_nr = timed_push("dense_no_rollback", differ, sender.send, 3, w1, device, quiet, dense_rollback=False)
    return patch, dense, dense_nr, equal, snapshot_bytes


def sweep_pairs(spec: str) -> list[tuple[int, int]]:
    """``--patch-sweep``'s "BLOCK:WARPS,..." as pairs of positive ints (argparse's type: bad input is a usage error)."""
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in spec.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected BLOCK:WARPS pairs of positive ints, comma-separated; got {spec!r}")
    return pairs


def patch_sweep(pairs: list[tuple[int, int]], specs, w0, w1, device: torch.device, dense_update_s: float) -> None:
    """The in-process patch push with each (elements per program, decode warps) of ``pairs``: a warm-up round,
    then the best of two, against the dense update of the main rounds (``dense_update_s``)."""
    import kernels.patch as kp

    default = kp.BLOCK, kp.DECODE_WARPS
    try:
        for block, warps in pairs:
            kp.BLOCK, kp.DECODE_WARPS = block, warps
            rounds = [in_process_round(specs, w0, w1, device, quiet=True) for _ in range(3)][1:]
            best = min((r[0] for r in rounds), key=lambda r: r["apply_verify_s"])
            emit(event="patch_sweep", block=kp.BLOCK, decode_warps=kp.DECODE_WARPS, bitwise_equal=all(r[3] for r in rounds),
                 **{k: best[k] for k in ("validate_s", "apply_s", "verify_s", "apply_verify_s")},
                 over_dense_update=round(best["apply_verify_s"] / dense_update_s, 4))
    finally:
        kp.BLOCK, kp.DECODE_WARPS = default


def host_snapshot_round(specs, w0, w1, device: torch.device) -> dict:
    """The trainer's snapshot in host memory (``TrainerBridge``'s default ``snapshot_device="cpu"``): the weights
    (on ``device``) are diffed on the CPU against it and the patch's records, in host memory, are staged onto
    ``device`` by the receiver's session (inside its validation time). A warm-up patch first (w0 to w1, then
    a dense push back to w0), then the reported patch."""
    receiver = warm_receiver({n: t.clone() for n, t in w0.items()})
    sender = InProcessSender(receiver)
    differ = WeightDiffer(specs, device="cpu")
    t0 = time.perf_counter()
    differ.commit(differ.encode(w0))
    emit(event="host_snapshot", first_dense_encode_s=round(time.perf_counter() - t0, 3), snapshot_bytes=differ.snapshot_nbytes)
    timed_push("host_patch", differ, sender.send, 1, w1, device, quiet=True)
    differ.reset()
    timed_push("host_dense", differ, sender.send, 2, w0, device, quiet=True)
    return timed_push("host_patch", differ, sender.send, 3, w1, device)


def profile_round(specs, w0, w1, device: torch.device, top: int = 15) -> None:
    """One more in-process round under the torch profiler: the operators with the most self time (host and
    device), one JSON line each, to show where a session's time goes."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        in_process_round(specs, w0, w1, device, quiet=True)
    events = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total") if device.type == "cuda" else ("self_cpu_time_total",):
        for e in sorted(events, key=lambda e: -getattr(e, key))[:top]:
            emit(event="profile", sort=key, op=e.key[:80], calls=e.count, self_ms=round(getattr(e, key) / 1e3, 3))


# Aten ops that launch no kernel: views, allocations, dtype/device no-ops.
_NOT_KERNELS = {"as_strided", "view", "reshape", "_reshape_alias", "slice", "narrow", "select", "unsqueeze", "squeeze",
                "split", "split_with_sizes", "unbind", "expand", "alias", "detach", "detach_", "lift_fresh", "t", "flatten",
                "unflatten", "resolve_conj", "resolve_neg", "empty", "empty_strided", "empty_like", "to", "_to_copy",
                "contiguous", "resize_", "as_strided_", "_index_put_impl_", "numpy_T", "set_", "pin_memory", "_pin_memory",
                "is_pinned", "result_type"}
_WATCH = ("copy_", "cat", "nonzero", "repeat_interleave", "arange", "index_select", "index", "index_put_", "cumsum",
          "_local_scalar_dense", "stack", "sum", "zeros", "searchsorted", "nonzero_static")
_RUNTIME = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")


_HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
_SIZED_BY_DATA = ("nonzero", "masked_select")


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of tensor values by the host (``_HOST_READS``), whatever the device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in _HOST_READS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(device: torch.device):
    """Profile the block (``prof``) and count its host reads (``reads.count``)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof, HostReads() as reads:
        yield prof, reads


def op_counts(events, host_reads: int) -> dict:
    counts = {e.key: e.count for e in events}
    aten = {k[len("aten::"):]: v for k, v in counts.items() if k.startswith("aten::")}
    return dict(
        kernel_like_ops=sum(v for k, v in aten.items() if k not in _NOT_KERNELS),
        aten_ops=sum(aten.values()),
        host_syncs=host_reads + sum(aten.get(k, 0) for k in _SIZED_BY_DATA),
        **{k: aten.get(k, 0) for k in _WATCH},
        **{k: counts[k] for k in _RUNTIME if k in counts},
    )


def count_round(specs, w0, w1, device: torch.device, batched_scatter: bool | None) -> None:
    """Op counts (JSON lines) of the trainer's encode and the receiver's session, for a patch push and a
    dense push, after a warm-up round."""
    for counted in (False, True):
        receiver = warm_receiver({n: t.clone() for n, t in w0.items()}, batched_scatter)
        differ = WeightDiffer(specs, device=device)
        differ.commit(differ.encode(w0))
        for mode, version in (("patch", 1), ("dense", 2)):
            if mode == "dense":
                differ.reset()
            sync(device)
            with counting(device) as (encode_prof, encode_reads):
                pending = differ.encode(w1)
                sync(device)
            with counting(device) as (receive_prof, receive_reads):
                receiver.apply(version, pending.updates)
            differ.commit(pending)
            if counted:
                emit(event="op_counts", mode=mode, side="encode", num_records=len(pending.updates),
                     **op_counts(encode_prof.key_averages(), encode_reads.count))
                events = receive_prof.key_averages()
                emit(event="op_counts", mode=mode, side="receive", num_records=len(pending.updates),
                     batched_scatter=receiver.batched_scatter, **op_counts(events, receive_reads.count))
                if device.type == "cuda":  # where the receiver's device time goes
                    emit(event="receive_device_time", mode=mode, total_ms=round(sum(e.self_device_time_total for e in events if not e.key.startswith("aten::")) / 1e3, 3),
                         top=[[e.key[:60], e.count, round(e.self_device_time_total / 1e3, 3)]
                              for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["0.5b", "1.5b", "8b", "records"], default="0.5b",
                        help="records: the 0.5B layout's 290 parameters with tiny tensors (per-record host overhead)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke test")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one more in-process round and print its top operators and op counts (JSON lines)")
    parser.add_argument("--batched-scatter", action="store_true",
                        help="use the block kernels of patch sessions on the CPU too (needs TRITON_INTERPRET=1)")
    parser.add_argument("--patch-sweep", type=sweep_pairs, default=None, metavar="BLOCK:WARPS,...",
                        help="also time the patch push with the block kernels' elements per program and decode warps "
                             "set to each pair (kernels.patch.BLOCK / DECODE_WARPS; CUDA), e.g. 1024:4,2048:8")
    parser.add_argument("--host-snapshot", action="store_true",
                        help="also time a patch push diffed against a trainer snapshot in host memory")
    args = parser.parse_args()
    model = "quick" if args.quick else args.model
    device = torch.device(args.device)
    shapes = qwen2_shapes(model)
    specs = {n: ParamSpec(shape=s, dtype=torch.bfloat16) for n, s in shapes.items()}
    numel = sum(ParamSpec(shape=s, dtype=torch.bfloat16).numel for s in shapes.values())
    emit(event="config", model=model, device=str(device), num_params=numel, dense_bytes=2 * numel, threads=torch.get_num_threads())

    bandwidth = copy_bandwidth(device)
    emit(event="copy_bandwidth", bytes_per_s=round(bandwidth), gb_per_s=round(bandwidth / 1e9, 2))

    t0 = time.perf_counter()
    w0 = init_weights(shapes, device)
    w1 = adamw_step(w0)
    sync(device)
    emit(event="weights", init_and_adamw_s=round(time.perf_counter() - t0, 2))

    # In-process, twice: the first round pays one-time costs (kernel compilation, allocator growth) that an
    # RL loop pays once, not per step; the second is reported.
    in_process_round(specs, w0, w1, device, quiet=True)
    patch, dense, dense_nr, bitwise_equal, snapshot_bytes = in_process_round(specs, w0, w1, device, quiet=False)
    emit(event="memory", bridge_snapshot_bytes=snapshot_bytes,
         bridge_snapshot_where=f"{device} (this run's trainer side); or the host: TrainerBridge(snapshot_device='cpu')",
         receiver_dense_rollback_bytes=dense["rollback_bytes"], receiver_dense_no_rollback_bytes=dense_nr["rollback_bytes"],
         receiver_patch_rollback_bytes=patch["rollback_bytes"],
         session_peak_extra_bytes={m: r["session_peak_extra_bytes"] for m, r in
                                   (("patch", patch), ("dense", dense), ("dense_no_rollback", dense_nr))})
    if args.patch_sweep:
        patch_sweep(args.patch_sweep, specs, w0, w1, device, dense["apply_verify_s"])
    host_patch = host_snapshot_round(specs, w0, w1, device) if args.host_snapshot else None
    if args.profile:
        profile_round(specs, w0, w1, device)
        count_round(specs, w0, w1, device, True if args.batched_scatter else None)

    # Rank-local IPC to a spawned rollout process that also starts from w0 (the rounds' memory given back first).
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    trainer_end, rollout_end = ctx.Pipe()
    proc = ctx.Process(target=rollout_process, args=(rollout_end, shapes, args.device))
    proc.start()
    rollout_end.close()
    trainer_end.recv_bytes()  # the rollout process has its weights
    ipc = IpcSender(trainer_end, device=device, timeout_s=300)
    differ = WeightDiffer(specs, device=device)
    differ.commit(differ.encode(w0))
    for version in (1, 3):  # the first pair (patch to w1, dense back to w0) warms the rollout process up
        quiet = version == 1
        ipc_patch = timed_push("ipc_patch", differ, ipc.send, version, w1, device, quiet, local=False)
        differ.reset()
        timed_push("ipc_dense", differ, ipc.send, version + 1, w0 if quiet else w1, device, quiet, local=False)
    proc.join(60)

    dense_update_s = dense["apply_verify_s"]
    dense_update_bw = 2 * dense["dense_bytes"] / dense["apply_s"]  # the update's own bytes read + written
    emit(
        event="summary",
        model=model,
        device=str(device),
        bitwise_equal=bitwise_equal,
        ipc_rollout_exitcode=proc.exitcode,
        changed_fraction=patch["changed_fraction"],
        patch_over_dense_bytes=round(patch["bytes"] / dense["bytes"], 5),
        patch_over_dense_bytes_target=1 / 50,
        patch_apply_verify_over_dense_update=round(patch["apply_verify_s"] / dense_update_s, 4),  # with validation
        patch_write_and_verify_over_dense_update=round((patch["apply_s"] + patch["verify_s"]) / dense_update_s, 4),
        patch_apply_verify_over_dense_update_target=0.2,
        ipc_patch_apply_verify_s=ipc_patch["apply_verify_s"],
        patch_bytes_per_changed_element=round(patch["bytes"] / max(1, patch["changed_fraction"] * patch["dense_bytes"] / 2), 3),
        dense_update_bandwidth_gb_per_s=round(dense_update_bw / 1e9, 2),
        dense_update_bw_over_copy_bw=round(dense_update_bw / bandwidth, 3),
        # The apply phase also copies the old tensor for rollback: 4 bytes moved per payload byte.
        dense_apply_bw_incl_rollback_copy_over_copy_bw=round(2 * dense_update_bw / bandwidth, 3),
        dense_no_rollback_update_bw_over_copy_bw=round(2 * dense_nr["dense_bytes"] / dense_nr["apply_s"] / bandwidth, 3),
        dense_update_bw_over_copy_bw_target_gpu=0.5,
        **({} if host_patch is None else dict(host_snapshot_patch_encode_s=host_patch["encode_s"],
                                              host_snapshot_patch_apply_verify_s=host_patch["apply_verify_s"])),
    )


if __name__ == "__main__":
    main()
