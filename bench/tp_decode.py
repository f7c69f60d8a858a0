"""Tensor-parallel decode: throughput and the sampler's peak memory, batch-sharded sampling vs all-gather.

Prints one JSON line per (tp, sampling mode, async scheduling): decode tokens/s over pure-decode steps, and the peak
memory allocated during one sampler call on rank 0 (logits exchange + sampling), measured with
`runner.parallel.memory` (CUDA allocator peak; on the CPU the torch profiler's allocation events). A
tp=1 line gives the single-process baseline. Random-weight models are written locally (no downloads).

    python bench/tp_decode.py --quick                                  # CPU, 2 gloo ranks, tiny model
    python bench/tp_decode.py --device cuda --shape qwen2.5-0.5b --batch 256   # 2 GPUs, NCCL
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import emit  # noqa: E402
from runner.testing import QWEN25_05B, write_random_checkpoint  # noqa: E402

SHAPES = {
    "tiny": dict(family="qwen2", vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "qwen2.5-0.5b": QWEN25_05B,
}


def run(model_dir: str, args, tp: int, mode: str, async_scheduling: bool | None = None) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from runner.parallel.memory import SamplerPeak

    config = EngineConfig(
        model=model_dir, device=args.device, dtype=args.dtype, max_num_seqs=args.batch, enforce_eager=args.enforce_eager,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len), max_model_len=args.prompt_len + args.max_tokens + 1,
        tensor_parallel_size=tp, tp_sampling=mode, num_kv_blocks=args.num_kv_blocks, async_scheduling=async_scheduling,
    )
    with Engine(config) as engine:
        vocab = engine.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=1)
        engine.generate(prompts[: min(4, args.batch)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prefill (the whole batch fits one step's token budget)
        steps = tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            tokens += len(engine.scheduler.running)
            engine.step()
            steps += 1
        seconds = time.perf_counter() - start

        if args.profile:  # rank 0's view of a few decode steps: where its host and device time go
            profile_steps(engine, prompts, tp, mode, config.async_scheduling)
        rank0 = engine.runner
        plain = rank0.sampler
        rank0.sampler = SamplerPeak(plain, rank0.device)
        engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, seed=2))  # prefill + one decode step
        peak, rank0.sampler = rank0.sampler.peak_bytes, plain
        emit(bench="tp_decode", device=args.device, shape=args.shape, dtype=str(rank0.dtype).removeprefix("torch."),
             tp=tp, tp_sampling=mode if tp > 1 else None, async_scheduling=config.async_scheduling, batch=args.batch, vocab=vocab, decode_steps=steps,
             decode_tokens_per_s=round(tokens / seconds, 1), step_ms=round(1e3 * seconds / max(steps, 1), 3),
             sampler_peak_bytes=peak, full_logits_bytes=args.batch * vocab * torch.finfo(rank0.dtype).bits // 8)


def profile_steps(engine, prompts, tp: int, mode: str, async_scheduling: bool, top: int = 8) -> None:
    from rollout import SamplingParams

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True, seed=3))
    engine.step()  # the prefill stays outside the profile
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    events = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total")[: len(activities)]:
        emit(bench="tp_decode_profile", tp=tp, tp_sampling=mode, async_scheduling=async_scheduling, sort=key,
             top=[[e.key[:60], e.count, round(getattr(e, key) / 1e3, 3)] for e in sorted(events, key=lambda e: -getattr(e, key))[:top]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized run: tiny model, batch 16, 16 new tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--model", help="an existing HF model directory instead of a random one of --shape")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized automatically")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--profile", action="store_true", help="also profile a few decode steps on rank 0 (ms per op)")
    args = ap.parse_args()
    if args.quick:
        args.shape, args.batch, args.max_tokens, args.prompt_len = "tiny", 16, 16, 16
        torch.set_num_threads(1)  # the worker ranks use the same count
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_random_checkpoint(
            tmp, dtype="float32" if args.device == "cpu" else "bfloat16", **SHAPES[args.shape]))
        run(model_dir, args, 1, "sharded")
        for mode in ("sharded", "allgather"):
            run(model_dir, args, args.tp, mode, async_scheduling=False)
        run(model_dir, args, args.tp, "sharded", async_scheduling=True)  # the default on CUDA


if __name__ == "__main__":
    main()
