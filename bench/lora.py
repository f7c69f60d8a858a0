"""LoRA serving cost: decode at batch 64 with `--loras` adapters of rank 16 loaded, 1 / 4 / 16 distinct adapters in
the batch, against the base model (an engine without LoRA) in the same run; and an adapter push's bytes and
milliseconds against a dense push of the base model. Prints one JSON line per measurement.

    python bench/lora.py --device cuda          # Llama-3.1-8B shape, bf16, one GPU
    python bench/lora.py --device cuda --profile  # and per case the top kernels of one decode graph replay
    python bench/lora.py --device cuda --lora-overlap both  # the LoRA engine with and without the overlap
    python bench/lora.py --device cuda --merged  # and one adapter folded into the base (`lora_merged`)
    python bench/lora.py --device cuda --deferred  # and the deltas left to the next kernels (`lora_deferred`)
    python bench/lora.py --device cuda --fused-linear  # and each decode linear + LoRA in one launch
    python bench/lora.py --device cuda --fused-linear only --linear-system linear_by_shape,linear_by_shape_chunk8
    python bench/lora.py --quick                # CPU, a tiny Llama: a smoke test of the script

The base weights are random (`EngineConfig(load_format="dummy")`; the model directory holds only config.json). One
random adapter of every module (q/k/v/o/gate/up/down) is written once as a PEFT directory and loaded under
`--loras` names (the kernels' cost does not depend on the values). The batch's requests take the distinct adapters
round-robin. `overhead` = base tokens/s / LoRA tokens/s - 1 (the issue's target: <= 0.15 at rank 16); the LoRA
engine with an all-base batch is reported too (its decode steps replay the graphs captured without LoRA). Every
LoRA line says which hook ran: `lora_overlap` (`EngineConfig.lora_overlap`: true, each linear's shrink on a side
stream beside its matmul; false, the default, all of the LoRA work after the matmul); `--lora-overlap both`
measures a LoRA engine of each kind in the same run, against the same base; `--deferred` one more, with
`EngineConfig.lora_deferred` (`lora_deferred: true`: every hook's whole LoRA on a side stream beside its matmul,
added by the residual add, the SiLU-and-mul, or after qkv_proj's matmul); `--fused-linear` one more, with
`EngineConfig.lora_fused_linear` (`lora_fused_linear: true`: each adapted linear of a decode step and its LoRA as one
Triton launch, kernels/lora_linear.py; the engine's default for slot mode on CUDA, which every other LoRA engine
here turns off to measure the hooks after cuBLAS's matmul). `--linear-system NAME[,NAME...]`: one such engine per
name, one after the other against the same base, its fused linears taking the configs of `bench/lora_kernels.py`'s
system NAME ("linear_by_shape": the engine's own, `linear_config_for`; its lines say `linear_system`).

`--merged`: after the slot engines, an engine with `EngineConfig(max_loras=1, lora_merged=True)` serves a batch
whose every request takes its one adapter (`system: merged`, its overhead against the same base), and takes the
same two adapter pushes (each refolds the modules it writes into the base weights).

On CUDA every decode line also says what one decode step costs the device alone: per case one more batch is
started and a few of its decode steps run, then the step's captured decode graph is replayed back to back
(`graph_step_ms`, the best of 3 rounds of 20 replays; no prefill, no host time), and `graph_overhead` = that /
the base's - 1. `tokens_per_s` times whole `generate` calls (best of two, their prompts already in the prefix
cache) and moves by 2-4% between engines of the same kernels; the graph's time is the decode step itself, steadier.

`--profile` (CUDA): per case, that replay also profiled: its device time (`graph_replay_ms`), the kernels it launches
(`launches_per_step`) and the top kernels by device time per replay (`top_kernels_us_and_launches`, LoRA's are
`_lora_*`), like bench/profile_decode.py, and how its kernels used the streams (`stream_use`, per replay: each
stream's launches and busy µs, the µs two streams ran at once, and how much of each stream's time ran beside
another's: the side stream's deltas hidden behind the matmuls; bench/timeline.py's `stream_concurrency`). Those
replays recompute the step in place (its KV rows rewritten).

Pushes: the adapter through `TrainerBridge(engine, lora=...)`, dense (its first push) and as a patch after about 1%
of its elements changed, after the same two pushes of another adapter untimed; the base as one dense push of every
weight (`export_weights` -> `apply_weight_update`), the second of two.
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

from bench.generate import best_of, emit, release_memory, sync  # noqa: E402
from bench.timeline import stream_concurrency  # noqa: E402

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=128000, eos_token_id=128001, dtype="bfloat16",
)
TINY = dict(LLAMA_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=0, eos_token_id=1, dtype="float32")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: str, cfg: dict, rank: int) -> None:
    """A PEFT LoRA directory of rank `rank` on every module of every layer, random A and B (std 0.01)."""
    from safetensors.torch import save_file

    from runner.lora import peft_tensor_name

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg["dtype"])
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (out, inp) in shapes.items():
            tensors[peft_tensor_name(layer, module, "A")] = (0.01 * torch.randn(rank, inp, generator=g)).to(dtype)
            tensors[peft_tensor_name(layer, module, "B")] = (0.01 * torch.randn(out, rank, generator=g)).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES}, f)


def make_engine(path: str, args, max_loras: int, lora_overlap: bool = False, lora_merged: bool = False,
                lora_deferred: bool = False, lora_fused_linear: bool = False):
    from rollout import Engine, EngineConfig

    return Engine(EngineConfig(model=path, device=args.device, dtype=args.dtype, load_format="dummy",
                               max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 16,
                               gpu_memory_utilization=0.6, max_loras=max_loras, max_lora_rank=args.rank,
                               lora_overlap=lora_overlap, lora_merged=lora_merged, lora_deferred=lora_deferred,
                               lora_fused_linear=lora_fused_linear))


def timed_decode(engine, args, loras: list[str | None]) -> float:
    """Best tokens/s of two runs of `args.batch` random prompts (request i with adapter loras[i % len])."""
    from rollout import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.model_config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    params = [SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=i,
                             lora=loras[i % len(loras)]) for i in range(args.batch)]
    engine.generate(prompts, [SamplingParams(max_tokens=4, ignore_eos=True, lora=p.lora) for p in params])
    outs, best = best_of(args.device, lambda _: engine.generate(prompts, params))
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / best


def graph_step_ms(engine, args, loras: list[str | None], profile: bool = False, **labels) -> float:
    """Device ms of one decode step of a batch like `timed_decode`'s, mid-generation: its captured decode graph
    replayed back to back (the best of 3 rounds of 20 replays; no host time, no prefill). With `profile`, also a
    "profile" line: that time, the kernels it launches, the top kernels and how they used the streams (`labels`
    and `common` on it). The replays recompute the step in place (its KV rows rewritten); the batch then finishes."""
    from rollout import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, engine.model_config.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=i,
                                                  lora=loras[i % len(loras)]))
    for _ in range(4):  # the prefill, then decode steps
        engine.step()
    graphs = engine.runner.graphs
    key = (graphs.padded_size(args.batch), False, any(lora is not None for lora in loras))
    assert key in graphs.graphs, (key, sorted(graphs.graphs))
    graph = graphs.graphs[key]
    rounds = []
    for _ in range(3):
        sync(args.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        sync(args.device)
        rounds.append(start.elapsed_time(end) / 20)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            sync(args.device)
        events = prof.key_averages()
        top = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in events), key=lambda k: -k[1])[:args.top]
        emit(kind="profile", graph=list(key), graph_replay_ms=round(min(rounds), 4),
             launches_per_step=sum(e.count for e in events) // 5,
             top_kernels_us_and_launches=[(k[:60], round(t, 1), n) for k, t, n in top],
             stream_use=stream_concurrency(prof, 5, top_kernels=0), **labels)
    while engine.has_unfinished_requests():
        engine.step()
    return min(rounds)


def bench_adapter_push(engine, args, name: str, common: dict, report: bool = True, weights: dict | None = None,
                       **labels) -> None:
    """The adapter's first push (dense) and a patch after about 1% of its elements changed, via TrainerBridge;
    `report=False`: the same pushes untimed (a warm-up that compiles the push kernels). `weights`: the adapter's
    tensors in PEFT names (None: read from its slot)."""
    from trainer_bridge import TrainerBridge

    bridge = TrainerBridge(engine, lora=name, snapshot_device=args.device)
    if weights is None:
        slot = next(info.slot for info in engine.list_loras() if info.name == name)
        weights = {n: v.clone() for n, v in engine.runner.lora.target(slot).views.items()}
    g = torch.Generator(device=args.device).manual_seed(1)
    for mode in ("dense", "patch"):
        for t in weights.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g, device=args.device)
            flat[idx] += 0.001
        result = bridge.push_weights(weights)
        if report:
            emit(kind="lora_push", mode=mode, tensors=len(weights), payload_bytes=result.nbytes,
                 tensor_bytes=result.dense_nbytes, num_patch=result.num_patch,
                 encode_ms=round(1e3 * result.encode_s, 2), apply_ms=round(1e3 * result.apply_s, 2),
                 lora_version=result.lora_version, **labels, **common)


def bench_base_push(engine, args, common: dict) -> None:
    """Every base weight as one dense push (the live tensors written onto themselves: same bytes, same work),
    timed the second time (the first compiles the push kernels)."""
    records = engine.export_weights()
    nbytes = sum(r.tensor.numel() * r.tensor.element_size() for r in records)
    engine.apply_weight_update(engine.policy_version + 1, records)
    sync(args.device)
    t = time.perf_counter()
    engine.apply_weight_update(engine.policy_version + 1, records)
    sync(args.device)
    emit(kind="base_push", mode="dense", tensors=len(records), payload_bytes=nbytes,
         apply_ms=round(1e3 * (time.perf_counter() - t), 2), **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--loras", type=int, default=None, help="adapters loaded (default 64)")
    ap.add_argument("--distinct", default=None, help="comma-separated distinct adapters per batch (default 1,4,16)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a tiny Llama on the CPU")
    ap.add_argument("--profile", action="store_true", help="per case, the device time and top kernels of one decode "
                    "graph replay (CUDA)")
    ap.add_argument("--top", type=int, default=14, help="kernels listed by --profile")
    ap.add_argument("--merged", action="store_true", help="also one adapter merged into the base weights")
    ap.add_argument("--deferred", nargs="?", const="also", choices=("also", "only"), default=None,
                    help="also (or only) a LoRA engine with EngineConfig.lora_deferred")
    ap.add_argument("--fused-linear", nargs="?", const="also", choices=("also", "only"), default=None,
                    help="also (or only) a LoRA engine with EngineConfig.lora_fused_linear")
    ap.add_argument("--linear-system", default=None, help="the fused-linear engines' configs: comma-separated systems "
                    "of bench/lora_kernels.py's, one engine each (e.g. linear_by_shape,linear_by_shape_chunk8; "
                    "default: the engine's own)")
    ap.add_argument("--lora-overlap", choices=("on", "off", "both"), default="off",
                    help="EngineConfig.lora_overlap of the LoRA engine (both: one engine of each, one after the other)")
    ap.add_argument("--carveout", type=int, default=0, help="SMs the LoRA engines' cuBLASLt GEMMs leave to the side "
                    "stream (torch._C._set_sm_carveout_experimental; the base engine runs without)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if args.linear_system and not args.fused_linear:
        raise SystemExit("--linear-system needs --fused-linear (it picks that engine's configs)")
    if args.fused_linear:
        import kernels.lora_linear
        from bench.lora_kernels import linear_pickers

        # name -> the tile picker an engine's fused linears take (the runtime looks up
        # `kernels.lora_linear.linear_config_for` at each call); built before any is set, around the engine's own
        linear_systems = linear_pickers((args.linear_system or "linear_by_shape").split(","), "--linear-system")
    if args.profile and not cuda:
        raise SystemExit("--profile needs --device cuda (it replays a captured decode graph)")
    args.dtype = args.dtype or ("bfloat16" if cuda and not args.quick else "float32")
    args.batch = args.batch or (8 if args.quick else 64)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.new_tokens = args.new_tokens or (8 if args.quick else 128)
    num_loras = args.loras or (4 if args.quick else 64)
    distinct = [int(d) for d in (args.distinct or ("1,4" if args.quick else "1,4,16")).split(",")]
    cfg = dict(TINY if args.quick else LLAMA_8B, dtype=args.dtype)
    common = dict(device=args.device, shape="tiny-llama" if args.quick else "llama-3.1-8b", dtype=args.dtype,
                  batch=args.batch, rank=args.rank, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    with tempfile.TemporaryDirectory() as d:
        model_dir, adapter_dir = os.path.join(d, "model"), os.path.join(d, "adapter")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        write_adapter(adapter_dir, cfg, args.rank)

        engine = make_engine(model_dir, args, max_loras=0)
        base_tps = timed_decode(engine, args, [None])
        base_graph = graph_step_ms(engine, args, [None], args.profile, system="base", distinct=0, **common) if cuda \
            else None
        emit(kind="decode", system="base", loras_loaded=0, distinct=0, tokens_per_s=round(base_tps, 1),
             **({"graph_step_ms": round(base_graph, 4)} if cuda else {}), **common)
        bench_base_push(engine, args, common)
        engine.close()
        del engine
        release_memory()

        overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.lora_overlap]
        alone = "only" in (args.deferred, args.fused_linear)  # no engine of the --lora-overlap hooks
        modes = [] if alone else [(overlap, False, False, None) for overlap in overlaps]
        modes += [(False, True, False, None)] if args.deferred else []
        modes += [(False, False, True, system) for system in linear_systems] if args.fused_linear else []
        if args.carveout:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(args.carveout)
        for run, (overlap, deferred, fused, system) in enumerate(modes):
            if fused:
                kernels.lora_linear.linear_config_for = linear_systems[system]
            if run:
                release_memory()
            engine = make_engine(model_dir, args, max_loras=num_loras, lora_overlap=overlap, lora_deferred=deferred,
                                 lora_fused_linear=fused)
            overlap = engine.runner.lora.overlap  # what the hooks run (the runner's, from the engine's config)
            t = time.perf_counter()
            names = [f"lora{i}" for i in range(num_loras)]
            for name in names:
                engine.load_lora(name, adapter_dir)
            emit(kind="lora_load", adapters=num_loras, ms_each=round(1e3 * (time.perf_counter() - t) / num_loras, 2),
                 **common)
            for k in [0] + distinct:
                loras = names[:k] if k else [None]
                tps = timed_decode(engine, args, loras)
                labels = dict(system="lora", lora_overlap=overlap, lora_deferred=deferred, lora_fused_linear=fused,
                              carveout=args.carveout, **({"linear_system": system} if fused else {}),
                              loras_loaded=num_loras, distinct=k)
                graph = {}
                if cuda:
                    ms = graph_step_ms(engine, args, loras, args.profile, **labels, **common)
                    graph = dict(graph_step_ms=round(ms, 4), graph_overhead=round(ms / base_graph - 1, 4))
                emit(kind="decode", **labels, tokens_per_s=round(tps, 1), overhead=round(base_tps / tps - 1, 4),
                     **graph, **common)
            if run == 0:  # the pushes do not depend on the hook
                if len(names) > 1:
                    bench_adapter_push(engine, args, names[1], common, report=False)
                bench_adapter_push(engine, args, names[0], common)
            engine.close()
            del engine
        if args.merged:
            release_memory()
            engine = make_engine(model_dir, args, max_loras=1, lora_merged=True)
            engine.load_lora("merged", adapter_dir)
            tps = timed_decode(engine, args, ["merged"])
            emit(kind="decode", system="merged", loras_loaded=1, distinct=1, tokens_per_s=round(tps, 1),
                 overhead=round(base_tps / tps - 1, 4), **common)
            from safetensors.torch import load_file

            weights = {n: t.to(args.device) for n, t in load_file(os.path.join(adapter_dir,
                                                                               "adapter_model.safetensors")).items()}
            bench_adapter_push(engine, args, "merged", common, report=False, weights=weights, system="merged")
            bench_adapter_push(engine, args, "merged", common, weights=weights, system="merged")
            engine.close()
            del engine


if __name__ == "__main__":
    main()
