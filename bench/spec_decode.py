"""Speculative decoding: acceptance length and tokens/s with and without speculation, EAGLE and MTP.

Trains a toy target on a learnable counting corpus (bench/toy_target.py), then for each
drafter method starts a speculating engine from a fresh drafter, fills its rollout buffer, trains the
drafter online (`train_drafter`), and measures decode throughput at each batch size without speculation
(the same engine with look-ahead 0, so both pay the same bookkeeping), with speculation forced on, and
with the engine's auto-off controller deciding (`over_plain`: the ratio to the first).
On CUDA, uniform decode steps (with and without drafts) replay CUDA graphs (runner/spec_decode/graphs.py),
all captured before the timed runs; --enforce-eager runs every step eagerly. Each decode line reports
`cuda_graphs` and how many of the timed run's engine steps replayed a graph (`graph_steps` of `steps`).
Prints one JSON line per measurement.

    python bench/spec_decode.py --quick                 # CPU, a couple of minutes
    python bench/spec_decode.py --device cuda           # bigger toy target, batches 1,16,64,256
    python bench/spec_decode.py --device cuda --enforce-eager
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402
from bench.toy_target import counting_corpus, train_toy_target  # noqa: E402
from runner.spec_decode.training import train_drafter  # noqa: E402


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def measure(engine, batch: int, new_tokens: int, vocab: int, mode: str, seed: int, repeats: int) -> dict:
    """Decode `batch` prompts `repeats` times after a warm-up; the median run's tokens/s, and the acceptance
    and step counts of all timed runs. mode: "spec" (always speculate), "plain" (look-ahead 0) or "auto"
    (the engine's auto-off controller, which starts the row without measurements, probes both modes per
    batch-size bucket during the warm-up and keeps the faster; the row reports its bucket's rates)."""
    ctl = engine.spec_controller
    ctl.auto_off = mode == "auto"
    if ctl.auto_off:
        ctl.buckets.clear()  # decide from this row's own probing, as a fresh engine would
    ctl.k = 0 if mode == "plain" else engine.config.speculative.num_speculative_tokens
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=seed)
    engine.generate([r[:3].tolist() for r in counting_corpus(batch, 3, vocab, gen)], params)  # warm-up
    graphs = engine.runner.spec.graphs
    graph_steps, engine_steps = sum(graphs.num_steps.values()) if graphs else 0, engine.scheduler.stats.num_steps
    seconds, stats = [], []
    for _ in range(repeats):
        prompts = [r[:3].tolist() for r in counting_corpus(batch, 3, vocab, gen)]
        if engine.config.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        stats += [o.outputs[0].spec_decode_stats for o in outs]
    steps = sum(s["num_spec_steps"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    bucket = ctl.stats().get(ctl.bucket_of(batch)) if mode == "auto" else None
    return dict(tokens_per_s=round(batch * new_tokens / statistics.median(seconds), 1),
                tokens_per_s_runs=[round(batch * new_tokens / t, 1) for t in seconds],
                mean_acceptance_length=round(1 + accepted / steps, 3) if steps else None,
                cuda_graphs=graphs is not None,
                graph_steps=(sum(graphs.num_steps.values()) if graphs else 0) - graph_steps,
                steps=engine.scheduler.stats.num_steps - engine_steps,
                **({"auto_off": bucket} if bucket else {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="small target, short training, batches 1,16")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64,256)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--methods", default="eagle,mtp")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median is reported")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (they are used by default on CUDA)")
    ap.add_argument("--target-layers", type=int, default=12, help="decoder layers of the full run's target")
    ap.add_argument("--drafter-steps", type=int, default=None, help="online drafter training steps (default 80 quick, 1000)")
    ap.add_argument("--target-seconds", type=float, default=None, help="target training time (default 12 quick, 180)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    quick = args.quick
    # the full run's target is deep enough that a one-layer drafter is cheap next to it (as with real models)
    vocab, hidden, layers = (32, 64, 2) if quick else (256, 256, args.target_layers)
    batches = [int(b) for b in (args.batches or ("1,16" if quick else "1,16,64,256")).split(",")]
    new_tokens = args.new_tokens or (24 if quick else 128)
    tmp = tempfile.mkdtemp(prefix="spec_bench_")
    start = time.perf_counter()
    path, loss = train_toy_target(tmp, seconds=args.target_seconds or (12.0 if quick else 180.0), vocab_size=vocab, hidden_size=hidden,
                                  num_layers=layers, seq_len=32 if quick else 64, device=args.device)
    emit(stage="target", loss=round(loss, 4), seconds=round(time.perf_counter() - start, 1), vocab=vocab,
         hidden=hidden, layers=layers)
    for method in args.methods.split(","):
        engine = Engine(EngineConfig(
            model=str(path), device=args.device, dtype="float32", max_num_seqs=max(batches),
            max_num_batched_tokens=max(batches) * (args.k + 1) + 512, block_size=16,
            num_kv_blocks=max(batches) * (-(-(new_tokens + 3 + args.k) // 16)) + 64,
            speculative=SpeculativeConfig(method=method, num_speculative_tokens=args.k),
            enforce_eager=args.enforce_eager,
        ))
        gen = torch.Generator().manual_seed(0)
        rollouts = [r[:3].tolist() for r in counting_corpus(64, 3, vocab, gen)]
        engine.generate(rollouts, SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=1))
        train = train_drafter(engine, num_steps=args.drafter_steps or (80 if quick else 1000), batch_size=16, lr=5e-3)
        emit(stage="train_drafter", method=method, **{k: round(v, 4) for k, v in train.items()})
        graphs = engine.runner.spec.graphs
        if graphs is not None:  # every shape the timed runs can meet, so no capture is timed
            seconds = graphs.capture_all(max(batches), list(range(args.k + 1)))
            emit(stage="capture", method=method, num_graphs=len(graphs.graphs), seconds=round(seconds, 1))
        for batch in batches:
            plain = None
            for mode in ("plain", "spec", "auto"):
                row = measure(engine, batch, new_tokens, vocab, mode, seed=batch, repeats=args.repeats)
                plain = plain or row["tokens_per_s"]
                emit(stage="decode", method=method, mode=mode, k=0 if mode == "plain" else args.k, batch=batch,
                     new_tokens=new_tokens, device=args.device, over_plain=round(row["tokens_per_s"] / plain, 3),
                     **row)


if __name__ == "__main__":
    main()
