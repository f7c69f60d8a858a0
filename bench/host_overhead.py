"""Host-side cost of an engine step: scheduling, slot bookkeeping, input staging and output handling,
with the model and sampler replaced by a stub that returns random tokens. Prints JSON lines.

    python bench/host_overhead.py --batch 256 --batch 1024

On a GPU with async scheduling (the default there) this work overlaps the device's step, so it bounds
the decode throughput once it is the longer of the two: tokens/s <= batch / max(host time, device time)
(`bench/timeline.py` measures both on the GPU).
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

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from runner.messages import RunnerOutput  # noqa: E402
from runner.testing import write_random_checkpoint  # noqa: E402


def stub_execute(runner):
    """`ModelRunner.execute` without the forward and the sampler."""

    def execute(sched):
        runner.input_batch.apply(sched)
        if sched.is_empty:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = runner.input_batch.gather(sched)
        runner._stage(inputs)
        runner._upload(inputs, len(inputs.slots))
        runner._metadata(inputs)
        rows = len(inputs.sample_rows)
        return runner.collect(runner._handle(inputs, torch.randint(2, 60, (rows,)), torch.zeros(rows)))

    return execute


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", help="running sequences (prompts x n)")
    ap.add_argument("--n", type=int, default=16, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, family="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        for batch in args.batch or [256, 1024]:
            n = min(args.n, batch)
            total = args.prompt_len + args.new_tokens
            engine = Engine(EngineConfig(model=d, max_num_seqs=batch, max_model_len=total + 8,
                                         num_kv_blocks=batch * (total // 16 + 2)))
            engine.runner.execute = stub_execute(engine.runner)
            prompts = torch.randint(2, 60, (batch // n, args.prompt_len)).tolist()
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(n=n, max_tokens=args.new_tokens, ignore_eos=True, seed=0))
            elapsed = time.perf_counter() - start
            print(json.dumps({"kind": "host_overhead", "batch": batch, "n": n, "steps": args.new_tokens,
                              "ms_per_step": round(elapsed / args.new_tokens * 1e3, 3),
                              "us_per_sequence_step": round(elapsed / args.new_tokens / batch * 1e6, 2)}), flush=True)


if __name__ == "__main__":
    main()
