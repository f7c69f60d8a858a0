"""Generation throughput: this engine vs transformers `generate`, same model, same run.

Prints one JSON line per measurement. Random-weight models of a given shape are written locally (no
downloads). Every run forces the full number of new tokens (EOS ignored), temperature 1, no top-k/top-p.

    python bench/generate.py                       # CPU, tiny model, batch 32
    python bench/generate.py --device cuda --shape qwen2.5-0.5b --batches 1,64,256 --hf-static --grpo

On CUDA it also measures the device copy bandwidth and reports the roofline fraction: the bytes a decode
step must read (weights + KV of the live context) over that bandwidth, against the measured step time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from runner.testing import QWEN25_05B, write_random_checkpoint  # noqa: E402

SHAPES = {
    "tiny": dict(family="llama", vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "qwen2.5-0.5b": QWEN25_05B,
}


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = 1 << 28 if device.startswith("cuda") else 1 << 24
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def bench_engine(path, device, dtype, batch, prompt_len, new_tokens, n=1, max_num_seqs=None, **engine_kw):
    from rollout import Engine, EngineConfig

    engine = Engine(EngineConfig(model=path, device=device, dtype=dtype,
                                 max_num_seqs=max_num_seqs or max(batch * n, 1),
                                 max_model_len=prompt_len + new_tokens + 16, **engine_kw))
    tps, best = time_generate(engine, device, batch, prompt_len, new_tokens, n=n)
    engine.close()
    return tps, best


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, prompt_len), generator=g).tolist()


def best_of(device: str, run, repeats: int = 2):
    """(the last result, fewest seconds) of `repeats` timed calls `run(r)`, r = 0 .. repeats - 1, each between device
    syncs."""
    best, result = float("inf"), None
    for r in range(repeats):
        sync(device)
        t = time.perf_counter()
        result = run(r)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return result, best


def time_generate(engine, device, batch, prompt_len, new_tokens, n=1, repeats=2, fresh_prompts=False):
    """(new tokens per second, seconds) of the best of `repeats` timed `generate` calls of `batch` random prompts
    x `n` samples, every new token forced, after an untimed warm-up on the same shapes (so that Triton's
    compilation of each kernel specialization stays out of the timing). With `fresh_prompts` every timed call
    has prompts of its own, so that none hits the prefix cache of an earlier call (the samples of one prompt
    still share its blocks); otherwise every call has the warm-up's prompts."""
    from rollout import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=1)
    engine.generate(random_prompts(vocab, batch, prompt_len), SamplingParams(n=n, max_tokens=8, ignore_eos=True))
    batches = [random_prompts(vocab, batch, prompt_len, seed=r + 1 if fresh_prompts else 0) for r in range(repeats)]
    outs, best = best_of(device, lambda r: engine.generate(batches[r], params), repeats)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / best, best


def load_hf(path, device, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def bench_hf(path, device, dtype, batch, prompt_len, new_tokens, static=False, n=1, model=None):
    """transformers `generate`, sampling at temperature 1 with every new token forced.

    static=True uses `cache_implementation="static"`, which transformers compiles; the warm-up runs the
    same shapes so the compilation stays out of the timed run. `model`: one `load_hf` loaded (kept), else
    the model at `path` is loaded and released afterwards.
    """
    owned = model is None
    if owned:
        model = load_hf(path, device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids),
              num_return_sequences=n)
    if static:
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        warm = kw if static else {**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        model.generate(ids, **warm)
        sync(device)
        t = time.perf_counter()
        model.generate(ids, **kw)
        sync(device)
    elapsed = time.perf_counter() - t
    if owned:
        del model
        release_memory()
    return batch * n * new_tokens / elapsed, elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--hf-static", action="store_true", help="also time transformers with a static cache + compile")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--grpo", action="store_true", help="also the GRPO shape: 64 prompts x n=16, prompt 256, 1024 new")
    ap.add_argument("--group", default=None, metavar="PROMPTSxN",
                    help="also prompts x n samples (RL-shaped; transformers gets num_return_sequences=n), "
                         "e.g. 4x8 (default on the CPU)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--sync-scheduling", action="store_true",
                    help="engine runs with EngineConfig(async_scheduling=False) (the default on CUDA overlaps host and device)")
    ap.add_argument("--deterministic", action="store_true",
                    help="also run each batch in deterministic mode and report its throughput against the fast mode")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    batches = [int(b) for b in (args.batches or ("1,64,256" if cuda else "32")).split(",")]
    prompt_len = args.prompt_len or (128 if cuda else 32)
    new_tokens = args.new_tokens or (256 if cuda else 64)
    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    bw = copy_bandwidth(args.device)
    emit(kind="copy_bandwidth", device=args.device, gb_per_s=round(bw / 1e9, 1))
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, family=family, dtype=dtype, std=0.02, **spec)
        from runner.model_config import ModelConfig

        mc = ModelConfig.from_dir(d)
        elem = torch.finfo(getattr(torch, dtype)).bits // 8
        weight_bytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
        sched_kw = {"async_scheduling": False} if args.sync_scheduling else {}
        from rollout import EngineConfig

        async_default = EngineConfig(model="-", device=args.device).async_scheduling
        common = dict(device=args.device, shape=shape, dtype=dtype,
                      async_scheduling=async_default and not args.sync_scheduling)
        engine_tps: dict[str, float] = {}
        # 1. this engine, every workload (the rows that matter most come first)
        for batch in batches:
            tps, secs = bench_engine(d, args.device, dtype, batch, prompt_len, new_tokens,
                                     enforce_eager=args.enforce_eager, **sched_kw)
            # a decode step reads all weights once plus each sequence's KV at its mean context
            step_bytes = weight_bytes + batch * kv_per_token * (prompt_len + new_tokens / 2)
            engine_tps[f"batch{batch}"] = tps
            emit(kind="generate", system="engine", workload=f"batch{batch}", batch=batch, prompt_len=prompt_len,
                 new_tokens=new_tokens, tokens_per_s=round(tps, 1), seconds=round(secs, 3),
                 roofline_fraction=round((step_bytes / bw) / (batch / tps), 3), **common)
            if args.deterministic:
                det_tps, det_secs = bench_engine(d, args.device, dtype, batch, prompt_len, new_tokens,
                                                 enforce_eager=args.enforce_eager, deterministic=True,
                                                 **sched_kw)
                emit(kind="generate", system="engine_deterministic", workload=f"batch{batch}", batch=batch,
                     tokens_per_s=round(det_tps, 1), seconds=round(det_secs, 3),
                     fraction_of_fast_mode=round(det_tps / tps, 3), **common)
        if args.grpo:
            tps, secs = bench_engine(d, args.device, dtype, 64, 256, 1024, n=16, max_num_seqs=1024,
                                     enforce_eager=args.enforce_eager, **sched_kw)
            engine_tps["grpo_64x16"] = tps
            emit(kind="generate", system="engine", workload="grpo_64x16", prompts=64, n=16, prompt_len=256,
                 new_tokens=1024, tokens_per_s=round(tps, 1), seconds=round(secs, 2), **common)
        group = args.group or (None if cuda else "4x8")
        if group:
            num_prompts, n = (int(v) for v in group.lower().split("x"))
            tps, secs = bench_engine(d, args.device, dtype, num_prompts, prompt_len, new_tokens, n=n,
                                     enforce_eager=args.enforce_eager, **sched_kw)
            engine_tps[f"group{group}"] = tps
            emit(kind="generate", system="engine", workload=f"group{group}", prompts=num_prompts, n=n,
                 prompt_len=prompt_len, new_tokens=new_tokens, tokens_per_s=round(tps, 1), seconds=round(secs, 3),
                 **common)
            if not args.no_hf:
                hf_tps, secs = bench_hf(d, args.device, dtype, num_prompts, prompt_len, new_tokens, n=n)
                emit(kind="generate", system="hf_dynamic", workload=f"group{group}", tokens_per_s=round(hf_tps, 1),
                     seconds=round(secs, 3), engine_speedup=round(tps / hf_tps, 2), **common)
        if args.no_hf:
            return
        # 2. transformers on the same model and workloads
        for batch in batches:
            # static cache + compile at batch 1 spends minutes compiling for a baseline that is not in question
            systems = [("hf_dynamic", False)] + ([("hf_static", True)] if args.hf_static and batch > 1 else [])
            for system, static in systems:
                hf_tps, secs = bench_hf(d, args.device, dtype, batch, prompt_len, new_tokens, static=static)
                ratio = engine_tps[f"batch{batch}"] / hf_tps
                emit(kind="generate", system=system, workload=f"batch{batch}", batch=batch, tokens_per_s=round(hf_tps, 1),
                     seconds=round(secs, 3), engine_speedup=round(ratio, 2), **common)
        if args.grpo:
            # transformers has no n-way prefix sharing: the same 1024 sequences as one batch of 1024 rows, dynamic
            # cache, timed over the first 128 new tokens only (its per-token cost grows with the context, so this
            # flatters transformers)
            hf_tps, secs = bench_hf(d, args.device, dtype, 1024, 256, 128)
            emit(kind="generate", system="hf_dynamic", workload="grpo_64x16", note="first 128 new tokens",
                 tokens_per_s=round(hf_tps, 1), seconds=round(secs, 2),
                 engine_speedup=round(engine_tps["grpo_64x16"] / hf_tps, 2), **common)


if __name__ == "__main__":
    main()
