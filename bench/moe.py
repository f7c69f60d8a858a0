"""Mixture-of-Experts decode at the Qwen3-30B-A3B shape: this engine vs transformers `generate`, routing-replay
overhead, and a dense vs patch weight push, in one run. Prints one JSON line per measurement.

    python bench/moe.py --device cuda                         # Qwen3-30B-A3B shape, bf16, one GPU
    python bench/moe.py --quick                               # CPU, a tiny MoE: a smoke test of the script

The weights are random (`EngineConfig(load_format="dummy")`, drawn on the device; the model directory holds
only config.json), so no 61 GB checkpoint is written. transformers builds the same architecture from the same
config.json with its own random init, after the engine has been closed (both do not fit at once).

Roofline: the device copy bandwidth (read + written) measured in the same run, against the bytes one decode
step must read: the attention and router weights, the LM head, the KV of the live context, and the experts
the step touches — at batch 1 the top-k active experts per layer; at larger batches the distinct experts the
batch's tokens were routed to, counted per layer from the routing the engine returns (`routed_experts`) for
the timed run itself.

`--layer`: one sparse block alone at 1 and 2 tokens, CUDA-graph captured over `--layer-copies` copies of its
weights (more bytes than the L2 holds, as 48 layers are): the unfused small-batch chain (residual add + RMSNorm,
router GEMV, routing kernel, `fused_moe`) against the decode path (router GEMV with the norm, `moe_decode`), and
`moe_decode` under a few tile configs; microseconds per layer and the GB/s of the bytes it must read (the chosen
experts and the router).

Routing replay: the same batch-64 workload with `return_routed_experts=True` against without.
Weight push: the tensors of the first `--push-layers` layers (all their experts, attention, norms, router)
pushed as a patch after about 1% of their elements changed and as a full dense copy, through the engine's
own receiving path (`apply_weight_update`); bytes, milliseconds and the whole-model extrapolation. A first
untimed round compiles the receiver's kernels for these shapes; two timed rounds follow.
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

from bench.generate import best_of, copy_bandwidth, emit, release_memory, sync  # noqa: E402

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643,
    eos_token_id=151645, dtype="bfloat16",
)
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, bos_token_id=0, eos_token_id=1, dtype="float32")


def byte_counts(cfg: dict, elem: int) -> dict:
    """Bytes of each part of the model, by the checkpoint's shapes."""
    h, layers, e = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attention = (h * (q + 2 * kv) + q * h) * elem + 2 * cfg["head_dim"] * elem + 2 * h * elem  # + q/k and layer norms
    router = e * h * elem
    expert = 3 * cfg["moe_intermediate_size"] * h * elem
    return dict(attention=attention, router=router, expert=expert, layers=layers,
                lm_head=cfg["vocab_size"] * h * elem, embedding=cfg["vocab_size"] * h * elem,
                kv_per_token=2 * layers * kv * elem,
                total=layers * (attention + router + e * expert) + 2 * cfg["vocab_size"] * h * elem)


def touched_experts(outs, prompt_len: int, new_tokens: int) -> float:
    """Mean over decode steps and layers of the number of distinct experts the step's tokens used."""
    import numpy as np

    routed = np.stack([c.routed_experts for o in outs for c in o.outputs])  # [B, P + L - 1, layers, k]
    steps = routed[:, prompt_len : prompt_len + new_tokens - 1]  # the decode steps' input positions
    b, s, layers, k = steps.shape
    per = steps.transpose(1, 2, 0, 3).reshape(s, layers, b * k)
    counts = [len(np.unique(per[i, j])) for i in range(s) for j in range(layers)]
    return float(np.mean(counts))


def make_engine(path, args, max_batch: int):
    from rollout import Engine, EngineConfig

    # one engine for every batch size (graphs are captured per padded size); it leaves room for the push's
    # copies of the pushed layers
    return Engine(EngineConfig(model=path, device=args.device, dtype=args.dtype, load_format="dummy",
                               max_num_seqs=max_batch, max_model_len=args.prompt_len + args.new_tokens + 16,
                               gpu_memory_utilization=0.6))


def timed_generate(engine, args, batch: int, routed: bool):
    """(outputs, best seconds of two runs) of `batch` random prompts, every new token forced."""
    from rollout import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, engine.model_config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=1,
                            return_routed_experts=routed)
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, return_routed_experts=routed))
    return best_of(args.device, lambda _: engine.generate(prompts, params))


def bench_hf(path, args, batch, new_tokens):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (batch, args.prompt_len), generator=g).to(args.device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        sync(args.device)
        t = time.perf_counter()
        model.generate(ids, **kw)
        sync(args.device)
    elapsed = time.perf_counter() - t
    del model
    release_memory()
    return batch * new_tokens / elapsed


def bench_push(engine, args, common) -> None:
    """Dense and patch pushes of the first `push_layers` layers' tensors through the engine's receiver."""
    from weight_updates import Dense
    from weight_updates.differ import WeightDiffer

    specs = engine.weight_specs()
    prefixes = tuple(f"model.layers.{i}." for i in range(args.push_layers))
    names = [n for n in specs if n.startswith(prefixes)]
    sub = {n: specs[n] for n in names}
    weights = engine.runner.weights
    w0 = {n: weights.view(n).clone() for n in names}
    differ = WeightDiffer(sub, device=args.device)
    differ.commit(differ.encode(w0))  # the trainer starts from what the engine holds
    g = torch.Generator(device=args.device).manual_seed(3)

    def changed(state: dict) -> dict:
        """`state` with about 1% of each tensor's elements moved."""
        out = {}
        for n, t in state.items():
            new = t.clone().view(-1)
            idx = torch.randint(0, new.numel(), (max(1, new.numel() // 100),), generator=g, device=args.device)
            new[idx] += 0.01
            out[n] = new.view(t.shape)
        return out

    nbytes = sum(t.numel() * t.element_size() for t in w0.values())
    total = byte_counts(QWEN3_30B_A3B if not args.quick else TINY, torch.finfo(getattr(torch, args.dtype)).bits // 8)["total"]
    version, state = engine.policy_version, w0
    for round_ in range(3):  # the first round compiles the receiver's kernels for these shapes; two timed rounds
        timed = round_ > 0
        state = changed(state)
        for mode in ("patch", "dense"):
            sync(args.device)
            t0 = time.perf_counter()
            if mode == "patch":
                push = differ.encode(state)
                records, payload = push.updates, push.stats.nbytes
            else:
                records = [Dense.of(n, t) for n, t in state.items()]
                payload = nbytes
            sync(args.device)
            t1 = time.perf_counter()
            version += 1
            engine.apply_weight_update(version, records)
            sync(args.device)
            t2 = time.perf_counter()
            if mode == "patch":  # (the dense push then rewrites the same values: the snapshot stays right)
                differ.commit(push)
            if not timed:
                continue
            ok = all(torch.equal(weights.view(n), state[n]) for n in names)
            emit(kind="weight_push", mode=mode, round=round_, tensors=len(names), layers=args.push_layers, tensor_bytes=nbytes,
                 payload_bytes=payload, encode_ms=round(1e3 * (t1 - t0), 2), apply_ms=round(1e3 * (t2 - t1), 2),
                 bitwise_equal=ok, whole_model_apply_ms_estimate=round(1e3 * (t2 - t1) * total / nbytes, 1),
                 whole_model_payload_bytes_estimate=int(payload * total / nbytes), **common)


LAYER_CONFIGS = {  # moe_decode tile variants the --layer run times (DecodeConfig fields; {} is the default)
    "default": {}, "up_n16": {"up_block_n": 16}, "up_k128": {"up_block_k": 128, "up_stages": 4},
    "down_cols64": {"down_columns": 64}, "down_cols256": {"down_columns": 256, "down_stages": 2},
    "down_k256": {"down_block_k": 256, "down_stages": 2}, "warps8": {"num_warps": 8},
    "up_s2": {"up_stages": 2}, "up_n64": {"up_block_n": 64, "up_stages": 2},
    "up_n16_k512": {"up_block_n": 16, "up_block_k": 512, "up_stages": 2}, "up_k512_s2": {"up_block_k": 512, "up_stages": 2},
    "down_cols64_k256": {"down_columns": 64, "down_block_k": 256, "down_stages": 2}, "down_s4": {"down_stages": 4},
}


def bench_layer(args, common) -> None:
    """One sparse block of the model's shape at 1 and 2 tokens (see the module docstring)."""
    from kernels.gemv import fused_gemv
    from kernels.moe import fused_moe
    from kernels.moe_decode import DecodeConfig, moe_decode
    from kernels.norm import fused_add_rms_norm
    from kernels.routing import route_topk

    cfg = TINY if args.quick else QWEN3_30B_A3B
    h, e, k, inter = cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    dtype, dev, eps = getattr(torch, args.dtype), args.device, 1e-6
    cuda = dev.startswith("cuda")  # elsewhere only under TRITON_INTERPRET=1 (a smoke test of the script)
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(args.layer_copies):
        layers.append(dict(
            w13=(torch.randn(e, 2 * inter, h, device=dev, generator=g) * h**-0.5).to(dtype),
            w2=(torch.randn(e, h, inter, device=dev, generator=g) * inter**-0.5).to(dtype),
            gate=(torch.randn(e, h, device=dev, generator=g) * h**-0.5).to(dtype),
            norm=(1 + 0.1 * torch.randn(h, device=dev, generator=g)).to(dtype)))
    expert_bytes = 3 * inter * h * torch.finfo(dtype).bits // 8

    def unfused(x, r, w):
        xn, s = fused_add_rms_norm(x, r, w["norm"], eps)
        weights, ids = route_topk(fused_gemv(xn, w["gate"]), k, True)
        return fused_moe(xn, w["w13"], w["w2"], weights, ids), ids

    def decode(x, r, w, config=None):
        logits, s = fused_gemv(x, w["gate"], prologue="rms_norm", norm_weight=w["norm"], residual=r, eps=eps)
        out, _, ids = moe_decode(s, w["norm"], eps, logits, w["w13"], w["w2"], k, True, config=config)
        return out, ids

    paths = {"unfused": unfused, **{f"decode_{name}": (lambda x, r, w, c=DecodeConfig(**over): decode(x, r, w, c))
                                   for name, over in LAYER_CONFIGS.items()}}
    for tokens in (1, 2):
        x = torch.randn(tokens, h, device=dev, generator=g).to(dtype)
        r = torch.randn(tokens, h, device=dev, generator=g).to(dtype)
        for name, fn in paths.items():
            def chain():
                return [fn(x, r, w) for w in layers]

            outs = chain()  # compiles
            sync(args.device)
            if name == "unfused":
                reference = [out.float() for out, _ in outs]
            worst = max(float((out.float() - ref).norm() / ref.norm()) for (out, _), ref in zip(outs, reference))
            distinct = sum(int(torch.unique(ids).numel()) for _, ids in outs) / len(outs)
            if cuda:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain()
                run = graph.replay
            else:
                run = chain
            run()
            sync(args.device)
            reps = 20 if cuda else 1
            t = time.perf_counter()
            for _ in range(reps):
                run()
            sync(args.device)
            us = (time.perf_counter() - t) / reps / len(layers) * 1e6
            read = distinct * expert_bytes + e * h * torch.finfo(dtype).bits // 8
            emit(kind="moe_layer", path=name, tokens=tokens, us_per_layer=round(us, 2),
                 experts_read=round(distinct, 2), gb_per_s=round(read / us / 1e3, 1),
                 relative_difference_to_unfused=round(worst, 5), **common)
    layers.clear()
    release_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64,256)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--hf-new-tokens", type=int, default=None, help="new tokens of the transformers runs")
    ap.add_argument("--hf-batches", default=None, help="transformers batch sizes (default 1,64)")
    ap.add_argument("--push-layers", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a tiny MoE on the CPU")
    ap.add_argument("--layer", action="store_true", help="only the one-layer comparison of the decode paths")
    ap.add_argument("--layer-copies", type=int, default=None, help="weight copies of the --layer run (default 8)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda and not args.quick else "float32")
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.new_tokens = args.new_tokens or (16 if args.quick else 256)
    args.push_layers = args.push_layers or (1 if args.quick else 8)
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,64,256")).split(",")]
    hf_batches = [int(b) for b in (args.hf_batches or ("1,4" if args.quick else "1,64")).split(",")]
    hf_new = args.hf_new_tokens or (8 if args.quick else 32)
    cfg = dict(TINY if args.quick else QWEN3_30B_A3B, dtype=args.dtype)
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    sizes = byte_counts(cfg, elem)
    bw = copy_bandwidth(args.device)
    shape = "tiny-moe" if args.quick else "qwen3-30b-a3b"
    common = dict(device=args.device, shape=shape, dtype=args.dtype)
    emit(kind="copy_bandwidth", gb_per_s=round(bw / 1e9, 1), **common)
    if args.layer:
        args.layer_copies = args.layer_copies or (2 if args.quick else 8)
        bench_layer(args, common)
        return
    emit(kind="model_bytes", total_gb=round(sizes["total"] / 1e9, 2),
         active_gb_batch1=round((sizes["layers"] * (sizes["attention"] + sizes["router"]
                                                    + cfg["num_experts_per_tok"] * sizes["expert"])
                                 + sizes["lm_head"]) / 1e9, 3), **common)
    tps: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        t = time.perf_counter()
        engine = make_engine(d, args, max(batches))
        emit(kind="startup", seconds=round(time.perf_counter() - t, 2), num_kv_blocks=engine.num_kv_blocks,
             note="random weights drawn on the device, KV sizing, graph capture", **common)
        for batch in batches:
            outs, secs = timed_generate(engine, args, batch, routed=True)
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            tps[batch] = tokens / secs
            touched = touched_experts(outs, args.prompt_len, args.new_tokens)
            step_bytes = (sizes["layers"] * (sizes["attention"] + sizes["router"] + touched * sizes["expert"])
                          + sizes["lm_head"] + batch * sizes["kv_per_token"] * (args.prompt_len + args.new_tokens / 2))
            emit(kind="generate", system="engine", batch=batch, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, tokens_per_s=round(tps[batch], 1), seconds=round(secs, 3),
                 experts_touched_per_layer=round(touched, 2), step_bytes_gb=round(step_bytes / 1e9, 3),
                 roofline_fraction=round((step_bytes / bw) / (batch / tps[batch]), 3), **common)
        # routing replay's cost: the same batch without returning the experts
        replay_batch = 64 if 64 in tps else batches[-1]
        outs, secs = timed_generate(engine, args, replay_batch, routed=False)
        plain = sum(len(c.token_ids) for o in outs for c in o.outputs) / secs
        emit(kind="routing_replay_overhead", batch=replay_batch, tokens_per_s_with=round(tps[replay_batch], 1),
             tokens_per_s_without=round(plain, 1), overhead=round(1 - tps[replay_batch] / plain, 4), **common)
        bench_push(engine, args, common)
        engine.close()
        del engine, outs
        release_memory()
        if not args.no_hf:
            for batch in hf_batches:
                hf_tps = bench_hf(d, args, batch, hf_new)
                mine = tps.get(batch)
                emit(kind="generate", system="hf_dynamic", batch=batch, new_tokens=hf_new,
                     tokens_per_s=round(hf_tps, 2),
                     engine_speedup=None if mine is None else round(mine / hf_tps, 1), **common)


if __name__ == "__main__":
    main()
