"""Command line: `python -m rollout generate ...`, `python -m rollout serve ...` and `python -m rollout demo`.

`generate` prints one JSON line per sample and a final throughput line; the progress bar goes to stderr.
`serve` runs the HTTP server of `rollout/server.py` until interrupted.
`demo` runs the toy GRPO demo (`trainer_bridge.demo`); its options follow the subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _engine_config(args: argparse.Namespace):
    """The EngineConfig of --config (YAML) with the flags given on top."""
    from rollout import EngineConfig
    from rollout.config import from_mapping, load_yaml

    fields = load_yaml(args.config) if args.config else {}
    flags = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                 max_model_len=args.max_model_len, enforce_eager=args.enforce_eager or None,
                 deterministic=args.deterministic or None)
    fields.update({k: v for k, v in flags.items() if v is not None})  # flags given override the file
    if "model" not in fields:
        raise ValueError("give --model (or `model:` in the --config file)")
    return from_mapping(EngineConfig, fields, args.config or "command line")


def _generate(args: argparse.Namespace) -> int:
    from rollout import Engine, SamplingParams

    engine = Engine(_engine_config(args))
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop or [],
    )
    prompts: list = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split(",")])
    if not prompts:
        raise SystemExit("give at least one --prompt or --prompt-ids")
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for out in outs:
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            print(json.dumps({"request_id": out.request_id, "sample": c.index, "text": c.text,
                              "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "sum_logprob": sum(c.logprobs or [])}))
    print(json.dumps({"num_generated_tokens": num_tokens, "seconds": round(elapsed, 3),
                      "tokens_per_s": round(num_tokens / elapsed, 1)}))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from rollout.async_engine import AsyncEngine
    from rollout.server import serve
    from rollout.server_config import ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = _engine_config(args)
    serve(AsyncEngine(config), ServerConfig(host=args.host, port=args.port))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (--config, --set KEY=VALUE, ...)
        from trainer_bridge.demo import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m rollout")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions from a local Hugging Face model directory")
    s = sub.add_parser("serve", help="serve /generate (SGLang) and /v1/completions (OpenAI) over HTTP")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    for p in (g, s):
        p.add_argument("--model", help="local Hugging Face model directory")
        p.add_argument("--config", help="an EngineConfig YAML (e.g. configs/engine_gpu.yaml); flags override it")
        p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N")
        p.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
        p.add_argument("--max-num-seqs", type=int, default=None)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--deterministic", action="store_true")
    g.add_argument("--prompt", action="append", help="a text prompt (needs tokenizer.json); repeatable")
    g.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeatable")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", help="a stop string (needs tokenizer.json); repeatable")
    sub.add_parser("demo", help="the toy GRPO demo (options: python -m rollout demo --help)")
    args = parser.parse_args(argv)
    try:
        return _serve(args) if args.cmd == "serve" else _generate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
