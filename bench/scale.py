"""Rollout at real policy sizes, against the device's ceilings, in one run. JSON lines.

    python bench/scale.py --quick                          # CPU, tiny model, end to end
    python bench/scale.py --shapes qwen3-8b                # GPU: one 8B shape per call fits a 10-minute limit
    python bench/scale.py --shapes qwen3-8b,llama-3.1-8b,qwen2.5-0.5b --with-32b

First the device's ceilings, measured in this run: the copy bandwidth (bytes read + written per second by a
large device copy, `bench.generate.copy_bandwidth`, taken as the ceiling on bytes read) and the GEMM rate of
the run's dtype (an 8192^3 matmul on CUDA). Then per shape:

- `checkpoint`: random weights (std 0.02) drawn on the device and streamed to two safetensors shards with an
  index (`runner.testing.write_random_checkpoint(..., device=, shards=2)`), deleted after the shape's runs.
  Where the disk (64 GiB on the GPU machine) cannot hold them, as for Qwen3-32B in bf16, the engine draws its
  weights itself (`load_format="dummy"`) and the load benchmark and transformers are skipped.
- `load` / `load_check`: bench/load.py, the tensor-wise reader against the chunked one (page cache warm).
- `startup`: one engine for all the shape's workloads (max_num_seqs = the largest batch, max_model_len = the
  longest workload + 16, everything else the defaults), `Engine.startup_times` (config/tokenizer, load,
  runner_init, profile = KV sizing, kv_alloc, graph_capture): `start` "first" for the run's engine (its Triton
  kernels compiled then, unless earlier runs on the machine compiled them), and on CUDA "restart": the same
  engine built again in a fresh process after the workloads (kernels in Triton's on-disk cache), as every later
  start on the machine is; `load_parts`: the load's allocation, fill, and the chunked reader's file reads and
  waits for copies (`ModelRunner.load_stats`).
- `generate`, system "engine": decode at batch 1, 64, 256 (prompt 128 + 256 new tokens) and the GRPO shape (32
  prompts x n=16, prompt 256, 512 new); temperature 1, every new token forced (EOS ignored); best of two
  timed calls after an untimed warm-up, each call with prompts of its own (no prefix-cache hits across calls;
  the n samples of a prompt share its blocks, as in RL). Tokens/s counts new tokens over the whole call.
- `generate`, system "hf_dynamic": transformers `generate` (dynamic cache) on the same checkpoint at batch 1
  and 64, with fewer new tokens (`new_tokens` in the row; shorter contexts flatter it a little).

Roofline of a workload: the sum over its forwards (the prefill of the distinct prompt tokens in steps of
max_num_batched_tokens, then each decode step) of max(bytes / bandwidth, FLOPs / GEMM rate), where for a
decode step of B rows at context c
    bytes = the weights it reads (all but an untied input embedding, of which it reads B rows) + B c KV tokens
    FLOPs = 2 x matmul parameters x B + attention 4 B c heads head_dim layers.
`roofline_fraction` = that bound / the measured seconds; `bound` names the term that dominates. The issue's
table counted the untied input embedding as read every step, which makes its fractions about 8% higher at 8B
(`weight_bytes` and `weight_bytes_read` in the `shape` row give either reading), and left the prefill out at
batch 256 (its 41,600 tok/s; with the prefill of 256 x 128 tokens the bound is near 31,000 at 750 TFLOP/s).
Exit status 1 if the two
checkpoint readers did not fill the same parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.generate import bench_hf, copy_bandwidth, emit, load_hf, release_memory, sync, time_generate  # noqa: E402
from bench.load import SHAPES, bench_load, checkpoint_fits, write_shape  # noqa: E402
from runner.testing import write_config  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """What a model's forward reads and computes, from its config and checkpoint layout."""

    params: int  # every checkpoint tensor's elements
    embed: int  # the input embedding's elements
    head: int  # the LM head's elements (the embedding when tied)
    matmul: int  # elements of the matrices a token multiplies by (the layers' linears + the LM head)
    tied: bool
    hidden: int
    layers: int
    heads: int
    head_dim: int
    elem: int  # bytes per element of the weights and the KV cache
    kv_per_token: int  # KV-cache bytes of one token (every layer's K and V)

    @classmethod
    def of(cls, model_dir, elem: int) -> "ModelStats":
        from runner.model_config import ModelConfig
        from runner.models import ModelRegistry

        cfg = ModelConfig.from_dir(model_dir)
        _, model_cls = ModelRegistry.resolve([cfg.architecture])
        with torch.device("meta"):
            layout = model_cls(cfg, None, None).checkpoint_layout(0, 1)
        sizes = {name: math.prod(slot.shape) for name, slot in layout.items()}
        embed = sizes["model.embed_tokens.weight"]
        matrices = sum(n for name, n in sizes.items() if len(layout[name].shape) == 2)
        head = embed if cfg.tie_word_embeddings else sizes["lm_head.weight"]
        return cls(params=sum(sizes.values()), embed=embed, head=head,
                   matmul=matrices - (0 if cfg.tie_word_embeddings else embed), tied=cfg.tie_word_embeddings,
                   hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads, head_dim=cfg.head_dim,
                   elem=elem, kv_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem)

    def weight_bytes_read(self, rows: int) -> int:
        """Weight bytes a decode step of `rows` rows reads: all but an untied input embedding, of which it reads
        the rows' entries."""
        return (self.params - (0 if self.tied else self.embed) + rows * self.hidden) * self.elem


def roofline(m: ModelStats, bandwidth: float, gemm: float, prompts: int, n: int, prompt_len: int, new_tokens: int,
             prefill_step_tokens: int) -> dict:
    """The bound of a generate call (see the module docstring), and the mean decode step's bytes and FLOPs."""
    rows = prompts * n
    pair = 4 * m.layers * m.heads * m.head_dim  # FLOPs of one (query, key) pair in every layer and head: QK^T, PV
    tokens = prompts * prompt_len  # the distinct prompt tokens (the n samples share them)
    steps = -(-tokens // prefill_step_tokens)
    forwards = [(steps * m.params * m.elem + tokens * m.kv_per_token,
                 2 * (m.matmul - m.head) * tokens + 2 * m.head * rows + pair * prompts * prompt_len**2 // 2)]
    for s in range(1, new_tokens):  # the prefill samples the first new token; each decode step one more
        context = prompt_len + s  # the step's token attends to the prompt, the earlier new tokens and itself
        forwards.append((m.weight_bytes_read(rows) + rows * context * m.kv_per_token,
                         2 * m.matmul * rows + pair * rows * context))
    memory = [b / bandwidth for b, _ in forwards]
    compute = [f / gemm for _, f in forwards]
    seconds = sum(max(a, b) for a, b in zip(memory, compute))
    decode = forwards[1:] or forwards
    return dict(roofline_seconds=seconds, bound="memory" if sum(memory) >= sum(compute) else "compute",
                bound_memory_s=round(sum(memory), 4), bound_compute_s=round(sum(compute), 4),
                decode_step_bytes=round(sum(b for b, _ in decode) / len(decode)),
                decode_step_flops=round(sum(f for _, f in decode) / len(decode)))


def gemm_rate(device: str, dtype: torch.dtype) -> float:
    """FLOPs per second of a square matmul (8192 on CUDA, 512 on the CPU) in `dtype`."""
    size, reps = (8192, 20) if device.startswith("cuda") else (512, 5)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - t)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The workloads of one run (the same for every shape, except Qwen3-32B: batch 1 alone)."""

    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    grpo: tuple[int, int, int, int] | None  # prompts, n, prompt_len, new tokens
    hf_batches: tuple[int, ...]
    hf_new_tokens: int
    repeats: int
    load: bool
    chunk_bytes: int


def restart_times(config) -> tuple[dict[str, float], dict[str, float]]:
    """`Engine.startup_times` and the runner's `load_stats` of the same engine built again in a fresh process: what
    every start after the first on a machine costs (the compiled Triton kernels are in their on-disk cache)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name in ("model", "device", "dtype", "max_num_seqs", "max_model_len", "load_format")}
    code = ("import json, sys; from rollout import Engine, EngineConfig; "
            "e = Engine(EngineConfig(**json.loads(sys.argv[1]))); "
            "print(json.dumps([e.startup_times, e.runner.load_stats])); e.close()")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code, json.dumps(fields)], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    times, parts = json.loads(done.stdout.strip().splitlines()[-1])
    return times, parts


def run_shape(shape: str, plan: Plan, device: str, dtype: str, ceilings: tuple[float, float], workdir,
              force_dummy: bool) -> bool:
    """Every row of one shape; returns whether the checkpoint readers agreed (True when not compared)."""
    from rollout import Engine, EngineConfig

    bandwidth, gemm = ceilings
    common = dict(device=device, shape=shape, dtype=dtype)
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    identical = True
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        spec = dict(SHAPES[shape])
        write_config(d, family=spec.pop("family"), dtype=dtype, **spec)
        stats = ModelStats.of(d, elem)
        dummy = force_dummy or not checkpoint_fits(d, stats.params * elem)
        emit(kind="shape", params=stats.params, weight_bytes=stats.params * elem,
             weight_bytes_read=stats.weight_bytes_read(1), kv_bytes_per_token=stats.kv_per_token,
             weights="dummy (drawn by the engine)" if dummy else "checkpoint", **common)
        if not dummy:
            emit(**{**write_shape(d, shape, device, dtype), **common})
            if plan.load:
                for row in bench_load(d, device, dtype, repeats=plan.repeats, chunked=((plan.chunk_bytes, 4),)):
                    identical &= row.get("readers_identical", True)
                    emit(**row, **common)
        workloads = [(f"batch{b}", b, 1, plan.prompt_len, plan.new_tokens) for b in plan.batches]
        if plan.grpo is not None:
            prompts, n, prompt_len, new = plan.grpo
            workloads.append((f"grpo_{prompts}x{n}", prompts, n, prompt_len, new))
        max_rows = max(p * n for _, p, n, _, _ in workloads)
        max_len = max(p + t for *_, p, t in workloads) + 16
        config = EngineConfig(model=d, device=device, dtype=dtype, max_num_seqs=max_rows, max_model_len=max_len,
                              load_format="dummy" if dummy else "safetensors")
        engine = Engine(config)
        graphs = engine.runner.graphs
        startup = dict(num_kv_blocks=engine.num_kv_blocks, max_num_seqs=max_rows, max_model_len=max_len,
                       num_graphs=0 if graphs is None else len(graphs.sizes), weights="dummy" if dummy else "checkpoint",
                       **common)
        emit(kind="startup", start="first", **{k: round(v, 3) for k, v in engine.startup_times.items()},
             load_parts={k: round(v, 3) for k, v in engine.runner.load_stats.items()}, **startup)
        engine_tps = {}
        for name, prompts, n, prompt_len, new in workloads:
            tps, secs = time_generate(engine, device, prompts, prompt_len, new, n=n, repeats=plan.repeats,
                                      fresh_prompts=True)
            engine_tps[name] = tps
            roof = roofline(stats, bandwidth, gemm, prompts, n, prompt_len, new, config.max_num_batched_tokens)
            bound = roof.pop("roofline_seconds")
            emit(kind="generate", system="engine", workload=name, prompts=prompts, n=n, prompt_len=prompt_len,
                 new_tokens=new, tokens_per_s=round(tps, 1), seconds=round(secs, 3),
                 roofline_tokens_per_s=round(prompts * n * new / bound, 1), roofline_fraction=round(bound / secs, 3),
                 **roof, **common)
        engine.close()
        del engine
        release_memory()
        if device.startswith("cuda"):
            times, parts = restart_times(config)
            emit(kind="startup", start="restart", **{k: round(v, 3) for k, v in times.items()},
                 load_parts={k: round(v, 3) for k, v in parts.items()}, **startup)
        if dummy or not plan.hf_batches:
            return identical
        model = load_hf(d, device, dtype)
        for batch in plan.hf_batches:
            tps, secs = bench_hf(d, device, dtype, batch, plan.prompt_len, plan.hf_new_tokens, model=model)
            ours = engine_tps.get(f"batch{batch}")
            emit(kind="generate", system="hf_dynamic", workload=f"batch{batch}", prompts=batch, n=1,
                 prompt_len=plan.prompt_len, new_tokens=plan.hf_new_tokens, tokens_per_s=round(tps, 1),
                 seconds=round(secs, 3), engine_speedup=None if ours is None else round(ours / tps, 2), **common)
        del model
        release_memory()
    return identical


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a tiny shape on the CPU, small workloads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="comma-separated, of " + ", ".join(sorted(SHAPES)) +
                    " (default: qwen3-8b,llama-3.1-8b,qwen2.5-0.5b)")
    ap.add_argument("--with-32b", action="store_true", help="also qwen3-32b, at batch 1 only")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --quick)")
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes (default 1,64,256)")
    ap.add_argument("--hf-batches", default=None, help="transformers' batch sizes (default 1,64; empty: none)")
    ap.add_argument("--hf-new-tokens", type=int, default=None, help="transformers' new tokens (default 64)")
    ap.add_argument("--no-grpo", action="store_true")
    ap.add_argument("--no-load", action="store_true", help="skip the checkpoint-reader comparison")
    ap.add_argument("--dummy", action="store_true", help="no checkpoint: the engine draws its weights")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per workload, best kept (default 2)")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: the temp dir)")
    args = ap.parse_args()
    device = "cpu" if args.quick else args.device
    dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    if args.quick:
        shapes = ["tiny"]
        plan = Plan(batches=ints(args.batches or "1,8"), prompt_len=16, new_tokens=16, grpo=(4, 4, 32, 16),
                    hf_batches=ints(args.hf_batches if args.hf_batches is not None else "1,8"),
                    hf_new_tokens=args.hf_new_tokens or 8, repeats=args.repeats or 1, load=not args.no_load,
                    chunk_bytes=64 << 10)
    else:
        shapes = (args.shapes or "qwen3-8b,llama-3.1-8b,qwen2.5-0.5b").split(",")
        plan = Plan(batches=ints(args.batches or "1,64,256"), prompt_len=128, new_tokens=256, grpo=(32, 16, 256, 512),
                    hf_batches=ints(args.hf_batches if args.hf_batches is not None else "1,64"),
                    hf_new_tokens=args.hf_new_tokens or 64, repeats=args.repeats or 2, load=not args.no_load,
                    chunk_bytes=256 << 20)
    if args.no_grpo:
        plan = dataclasses.replace(plan, grpo=None)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
    bandwidth, gemm = copy_bandwidth(device), gemm_rate(device, getattr(torch, dtype))
    emit(kind="device", device=device, name=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
         copy_gb_per_s=round(bandwidth / 1e9, 1), gemm_tflops=round(gemm / 1e12, 2), gemm_dtype=dtype,
         torch=torch.__version__)
    identical = True
    runs = [(s, plan) for s in shapes]
    if args.with_32b:
        runs.append(("qwen3-32b", dataclasses.replace(plan, batches=(1,), grpo=None, hf_batches=(), load=False)))
    for shape, shape_plan in runs:
        identical &= run_shape(shape, shape_plan, device, dtype, (bandwidth, gemm), args.workdir, args.dummy)
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
