"""Host-side cost of one prompt with many samples (n up to tens of thousands), on the CPU: adding, scheduling,
building the outputs and aborting them should grow linearly in n. The model and the sampler are replaced by
the stub of bench/host_overhead.py (random tokens), so only the engine's own bookkeeping is timed.
Prints one JSON line per (path, n).

    python bench/many_samples.py                      # n = 16384 and 32768
    python bench/many_samples.py --n 4096 --n 8192

Paths: `generate` (Engine.generate: one final output), `stream` (DELTA outputs after every step, what
AsyncEngine.stream and a streaming HTTP request read), `abort` (add, one step, abort: a client that went away).
`per_sample_us` should stay flat as n grows; a cost quadratic in n doubles it with every doubling of n.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.host_overhead import stub_execute  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.sampling_params import RequestOutputKind  # noqa: E402
from runner.testing import write_random_checkpoint  # noqa: E402


def run_path(engine: Engine, path: str, prompt: list[int], params: SamplingParams) -> int:
    """Run one prompt of `params.n` samples along `path`; returns the number of outputs built."""
    if path == "generate":
        return len(engine.generate(prompt, params)[0].outputs)
    if path == "abort":
        rid = engine.add_request(prompt, params)
        engine.step()
        return len(engine.abort_request(rid).outputs)
    engine.add_request(prompt, SamplingParams(**{**_fields(params), "output_kind": RequestOutputKind.DELTA}))
    built = 0
    while engine.has_unfinished_requests():
        built += sum(len(out.outputs) for out in engine.step())
    return built


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__slots__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, action="append", help="samples of the one prompt (repeatable)")
    ap.add_argument("--path", action="append", choices=("generate", "stream", "abort"))
    ap.add_argument("--prompt-len", type=int, default=40, help="tokens (over one KV block, so the samples share it)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, family="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        prompt = [2 + i % 60 for i in range(args.prompt_len)]
        for n in args.n or [16384, 32768]:
            for path in args.path or ["generate", "stream", "abort"]:
                engine = Engine(EngineConfig(model=d, max_num_seqs=args.max_num_seqs, max_model_len=256,
                                             num_kv_blocks=4 * args.max_num_seqs + 64))
                engine.runner.execute = stub_execute(engine.runner)
                params = SamplingParams(n=n, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
                start = time.perf_counter()
                built = run_path(engine, path, prompt, params)
                elapsed = time.perf_counter() - start
                print(json.dumps({"kind": "many_samples", "path": path, "n": n, "new_tokens": args.new_tokens,
                                  "max_num_seqs": args.max_num_seqs, "seconds": round(elapsed, 3),
                                  "per_sample_us": round(elapsed / n * 1e6, 1), "outputs_built": built}), flush=True)
                engine.close()


if __name__ == "__main__":
    main()
