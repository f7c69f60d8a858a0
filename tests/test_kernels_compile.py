"""Every Triton kernel of the engine compiles for the H200 (sm_90) and the A100 (sm_80) — checked on the
CPU, where the kernel tests only interpret them. The interpreter runs Python: it cannot catch what only the
compiler rejects (types across branches, constexpr misuse, unsupported ops). Here the public launchers run
once each under the interpreter while their launches are recorded (argument types, constexpr values,
options), and a process without TRITON_INTERPRET compiles each recorded specialization to a cubin, also
with bfloat16 in place of float16 (the interpreter has no bfloat16). Skipped where Triton has no NVIDIA
backend."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records launches under the interpreter (the GPU runs the kernels for real)")

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def _spec(fn, args, kwargs) -> dict:
    """The compile spec of one launch: each parameter's type, or its value for constexprs."""
    params = inspect.signature(fn).parameters
    values = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = values[name]
        if "constexpr" in str(param.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
            "options": {k: v for k, v in kwargs.items() if k in _OPTIONS}}


def _launch_every_kernel() -> None:
    """Each public launcher once (twice where a constexpr flag switches code paths), at tiny shapes."""
    from kernels.activation import silu_and_mul
    from kernels.attention import paged_attention, store_kv
    from kernels.checksum import checksum_many
    from kernels.moe import fused_moe
    from kernels.moe_decode import moe_decode
    from kernels.norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import apply_rotary, rotary_store_kv
    from kernels.rotary_ref import build_cos_sin_cache, rope_inv_freq
    from kernels.routing import route_topk
    from kernels.sampling import sample, sample_untruncated, token_logprobs
    from runner.spec_decode.rejection_kernel import draft_sample, rejection_sample

    g = torch.Generator().manual_seed(0)
    h = torch.float16
    T, Hq, Hkv, D, bs = 4, 4, 2, 16, 4
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(h)
    q, k, v = (qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D),
               qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D))
    positions = torch.arange(T)
    cache = build_cos_sin_cache(rope_inv_freq(D, 10000.0, None), 64)
    k_cache, v_cache = torch.zeros(16, bs, Hkv, D, dtype=h), torch.zeros(16, bs, Hkv, D, dtype=h)
    slots = torch.tensor([0, 1, 2, -1])
    apply_rotary(q, k, positions, cache)
    rotary_store_kv(q.clone(), k, v, positions, cache, k_cache, v_cache, slots)
    rotary_store_kv(q.clone(), k, v, positions, cache, k_cache, v_cache, slots, norms=(torch.ones(D, dtype=h),) * 2 + (1e-6,))
    store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slots)
    block_tables = torch.arange(16, dtype=torch.int32).view(2, 8)
    for q_lens, deterministic, split in (([1, 1], False, None), ([3, 1], False, None), ([1, 1], False, 16),
                                         ([1, 3], True, None)):  # decode, prefill, split KV (+ combine), fixed order
        query = torch.randn(sum(q_lens), Hq, D, generator=g).to(h)
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        paged_attention(query, k_cache, v_cache, qsl, torch.tensor([20, 30], dtype=torch.int32), block_tables,
                        0.25, max(q_lens), 30, deterministic=deterministic, kv_split_size=split)
    x, r, w = torch.randn(T, 32, generator=g).to(h), torch.randn(T, 32, generator=g).to(h), torch.ones(32, dtype=h)
    rms_norm(x, w, 1e-6)
    fused_add_rms_norm(x, r, w, 1e-6)
    silu_and_mul(torch.randn(T, 64, generator=g).to(h))
    from kernels.gemv import fused_gemv  # small-batch projections: each prologue, a bias, one and several rows

    wt = torch.randn(24, 32, generator=g).to(h)
    fused_gemv(x[:1], wt, torch.zeros(24, dtype=h))
    fused_gemv(x[:2], wt, prologue="rms_norm", norm_weight=w, residual=r[:2])
    fused_gemv(torch.randn(4, 64, generator=g).to(h), wt, prologue="silu_mul")
    logits = torch.randn(3, 50, generator=g).to(h)
    temp = torch.tensor([0.0, 1.0, 0.7])
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])
    sample(logits, temp, torch.tensor([0, 5, 0]), torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.1]),
           seeds, pos)
    sample_untruncated(logits, temp, seeds, pos)
    token_logprobs(logits, torch.tensor([1, 2, 3]), temp)
    checksum_many([x, r])
    checksum_many([torch.zeros(10, dtype=torch.int8)])
    R, K, V = 2, 2, 40
    target = torch.randn(R, K + 1, V, generator=g).to(h)
    draft_probs = torch.softmax(torch.randn(R, K, V, generator=g), -1)
    tokens = torch.zeros(R, dtype=torch.int64)
    draft_sample(target[:, 0], temp[:R], seeds[:R], pos[:R], 1, tokens, torch.zeros(R, V), 7, chunk=16)
    rejection_sample(target, torch.randint(0, V, (R, K), generator=g), draft_probs, torch.tensor([2, 1]), temp[:R],
                     seeds[:R], pos[:R], 11, 13, chunk=16)
    E, W = 4, 128  # hidden = intermediate = W: wide enough that every tile config is the one of real widths
    w13, w2 = torch.randn(E, 2 * W, W, generator=g).to(h), torch.randn(E, W, W, generator=g).to(h)
    # T = 4, 24, 48, 600 at k = 2: each BLOCK_M class (600 also takes the two-launch alignment); then the
    # deterministic config, int32 expert ids, and float32 (IEEE dot products)
    for tokens, deterministic, ids_dtype, dtype in ((4, False, torch.int64, h), (24, False, torch.int64, h),
                                                    (48, False, torch.int64, h), (600, False, torch.int64, h),
                                                    (4, True, torch.int64, h), (4, False, torch.int32, h),
                                                    (4, False, torch.int64, torch.float32)):
        ids = torch.randint(0, E, (tokens, 2), generator=g, dtype=ids_dtype)
        fused_moe(torch.randn(tokens, W, generator=g).to(dtype), w13.to(dtype), w2.to(dtype),
                  torch.rand(tokens, 2, generator=g), ids, deterministic=deterministic)
    # expert parallelism: the rank holds experts [2, 4) of 8 (the combine that skips other ranks' rows), with a
    # block per row and with the alignment
    for tokens in (4, 24):
        fused_moe(torch.randn(tokens, W, generator=g).to(h), w13[:2], w2[:2], torch.rand(tokens, 2, generator=g),
                  torch.randint(0, 2 * E, (tokens, 2), generator=g), expert_start=2)
    # routing: top-k with the routing store, and replayed ids (half-precision logits, as the router gives)
    logits = torch.randn(5, 128, generator=g).to(h)
    store = torch.zeros(8, 2, 8, dtype=torch.int32)
    route_topk(logits, 8, True, store=store, slots=torch.tensor([0, 1, -1, 3, 4]), layer=1)
    route_topk(logits, 8, False, ids=torch.randint(0, 128, (5, 8), generator=g, dtype=torch.int32))
    # the small-token MoE block: top-8 of 128 with the store (half precision and float32), expert parallelism
    wide13, wide2 = torch.randn(128, 2 * W, W, generator=g), torch.randn(128, W, W, generator=g)
    for dtype in (h, torch.float32):
        moe_decode(torch.randn(2, W, generator=g).to(dtype), torch.ones(W, dtype=dtype), 1e-6, logits[:2],
                   wide13.to(dtype), wide2.to(dtype), 8, True, store=store, slots=torch.tensor([0, -1]), layer=1)
    moe_decode(torch.randn(1, W, generator=g).to(h), torch.ones(W, dtype=h), 1e-6, logits[:1], w13[:2], w2[:2], 2,
               False, expert_start=2)
    _launch_lora_kernels(g, h)
    _launch_patch_kernels(g)


def _launch_patch_kernels(g: torch.Generator) -> None:
    """A patch session on the block path (kernels/patch.py): uint8 / uint16 / int32 gaps with escapes, plain
    values and bit deltas with an escape, 2- and 4-byte elements; it writes and reads back."""
    from weight_updates import PackedIndices, Patch, TensorDictTarget, WeightReceiver, checksum

    idx = torch.tensor([3, 9, 400, 69999])
    gaps = torch.diff(idx, prepend=torch.tensor([-1]))
    for dtype, int_dtype in ((torch.float16, torch.int16), (torch.float32, torch.int32)):
        old = torch.randn(70000, generator=g).to(dtype)
        new = old.clone()
        new.view(int_dtype)[idx] += 1
        receiver = WeightReceiver(TensorDictTarget({f"p{i}": old.clone() for i in range(6)}), batched_scatter=True)
        deltas = torch.tensor([0, 1, 1, 1], dtype=torch.int8)  # the first escaped
        records = []
        for i, limit in enumerate((255, 65535, None)):
            escape = gaps > (limit or gaps.max())
            gap_dtype = {255: torch.uint8, 65535: torch.uint16, None: torch.int32}[limit]
            packed = PackedIndices(gaps=gaps.masked_fill(escape, 0).to(gap_dtype), overflow=gaps[escape].to(torch.int32))
            records += [Patch(name=f"p{2 * i}", indices=packed, values=new[idx], checksum=checksum(new)),
                        Patch(name=f"p{2 * i + 1}", indices=packed, values=deltas, checksum=checksum(new), escapes=new[idx[:1]])]
        receiver.apply(1, records)


def _launch_lora_kernels(g: torch.Generator, h: torch.dtype) -> None:
    """The tile plan; the one-launch shrink + expand (split-K partials summed by the expand) over fused q|k|v
    slices, and the same as two launches (`lora_shrink_partials` + `lora_expand_partials`, what the overlapped hook
    and `fused=False` run); a plain shrink (one split), and an expand that replaces."""
    from kernels.lora import add_lora, lora_expand, lora_expand_partials, lora_shrink, lora_shrink_partials

    S, r, width = 3, 8, 600  # width > one shrink split
    idx = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    x, scaling = torch.randn(4, width, generator=g).to(h), torch.rand(S, generator=g)
    A, B = torch.randn(S, 3 * r, width, generator=g).to(h), torch.randn(S, 32, r, generator=g).to(h)
    add_lora(torch.zeros(4, 32, dtype=h), x, A, B, idx, scaling, slices=(16, 8, 8))
    lora_expand_partials(torch.zeros(4, 32, dtype=h), lora_shrink_partials(x, A, idx), B, scaling, slices=(16, 8, 8))
    idx = torch.arange(70, dtype=torch.int32) % (S + 1) - 1
    y = lora_shrink(torch.randn(70, 16, generator=g).to(h), A[:, :r, :16].contiguous(), idx)
    lora_expand(y, B[:, :16], idx, scaling, torch.zeros(70, 16, dtype=h), False)
    _launch_linear_lora_kernels(g, h)


def _launch_linear_lora_kernels(g: torch.Generator, h: torch.dtype) -> None:
    """The one-launch linear + LoRA (kernels/lora_linear.py, the engine's CUDA default for LoRA decode linears) at
    the tile of each layer shape: fused q|k|v slices with a bias and a ragged `in`, the expand by slot (three slots
    in use: the pipelined loop and the unpipelined one are both compiled) at rank 8 and at rank 32 (two steps of
    the dot's K), the gathered expand, and the launch-wide count in place of the step's."""
    from kernels.lora_linear import DEFAULT_LINEAR_CONFIG, LONG_CONFIG, WIDE_CONFIG, linear_lora

    S, r = 3, 8
    idx = torch.tensor([1, -1, 0, 2, 1, 0], dtype=torch.int32)
    for width, slices, config, rank in ((200, (16, 8, 8), DEFAULT_LINEAR_CONFIG, r),
                                        (128, (64,), WIDE_CONFIG, 32),
                                        (256, (32,), LONG_CONFIG, r),
                                        (256, (32,), replace(DEFAULT_LINEAR_CONFIG, expand_by_slot=False), r),
                                        (128, (64,), replace(WIDE_CONFIG, step_count=False), 32)):
        x = torch.randn(6, width, generator=g).to(h)
        n = sum(slices)
        A = torch.randn(S, len(slices) * rank, width, generator=g).to(h)
        B, scaling = torch.randn(S, n, rank, generator=g).to(h), torch.rand(S, generator=g)
        weight = torch.randn(n, width, generator=g).to(h)
        bias = torch.randn(n, generator=g).to(h) if len(slices) == 3 else None
        linear_lora(x, weight, bias, A, B, idx, scaling, slices=slices, config=config)


def test_every_kernel_compiles_for_sm90_and_sm80(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip(f"triton {triton.__version__} has no NVIDIA backend here")
    specs: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        spec = _spec(self.fn, args, kwargs)
        variants = [spec]
        if spec["constexprs"].get("ASM") is False:  # the GPU's variant: inline PTX in place of the interpreter's path
            variants.append({**spec, "constexprs": {**spec["constexprs"], "ASM": True}})
        for variant in list(variants):
            if any(t == "*fp16" for t in variant["signature"].values()):  # the GPU's bfloat16 variant
                variants.append({**variant, "signature": {n: "*bf16" if t == "*fp16" else t
                                                          for n, t in variant["signature"].items()}})
        specs.update((json.dumps(v, sort_keys=True), v) for v in variants)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    _launch_every_kernel()
    kernels = {s["kernel"] for s in specs.values()}
    assert len(kernels) >= 22, sorted(kernels)  # every launcher reached its kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_compile_check.py")), "90", "80"],
                          input=json.dumps(list(specs.values())), capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout)
    assert failures == [], json.dumps(failures, indent=1)[:4000]
