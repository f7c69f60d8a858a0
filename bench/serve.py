"""Serving overhead: generated tokens/s over HTTP (OpenAI completions and chat completions, C concurrent clients)
against the in-process `AsyncEngine` on the same workload, in the same run. Prints one JSON line per
measurement and one per workload with the ratio.

    python bench/serve.py --quick                                   # CPU, tiny model: a smoke test
    python bench/serve.py --device cuda --shape qwen2.5-0.5b        # 64 clients, 512 requests each workload

The model has random weights of the given shape (runner.testing), with a byte-level tokenizer.json of the
model's vocabulary size written here (256 byte tokens, filler tokens, ChatML's special tokens) and a ChatML
chat template. Every request forces its number of new tokens (EOS ignored), temperature 1, its own seed.

In-process: C coroutines share one AsyncEngine and `await engine.generate(ids, params)` (for chat, the ids the
template renders, rendered once beforehand). Over HTTP: `python -m rollout serve` in a subprocess with the
same EngineConfig (one YAML file for both), and C httpx clients, spread over several client processes (one
process of asyncio clients is itself the bottleneck), sending /v1/completions (token ids) and
/v1/chat/completions (the messages, rendered by the server per request). Both are warmed up first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runner.testing import QWEN25_05B, write_random_checkpoint  # noqa: E402

SHAPES = {
    "tiny": dict(family="llama", vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "qwen2.5-0.5b": QWEN25_05B,
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WORDS = ["rollout", "reward", "policy", "gradient", "token", "sample", "episode", "tool", "answer", "step"]


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of exactly `vocab_size` ids: the 256 byte tokens, filler tokens (strings
    of the byte alphabet, decodable, never produced by encoding: there are no merges) and ChatML's special
    tokens last; tokenizer_config.json with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    fillers = ("".join(p) for k in itertools.count(2) for p in itertools.product(alphabet[:64], repeat=k))
    while len(vocab) < vocab_size - len(SPECIAL):
        vocab.setdefault(next(fillers), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))


def workload(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> tuple[list, list]:
    """(token-id prompts of `prompt_len`, chat conversations of about `prompt_len` characters), one per request."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256, vocab_size - len(SPECIAL)) for _ in range(prompt_len)] for _ in range(num_requests)]
    chats = []
    for i in range(num_requests):
        text = f"episode {i}:"
        while len(text) < prompt_len:
            text += " " + rng.choice(WORDS)
        chats.append([{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}])
    return prompts, chats


async def run_clients(num_clients: int, jobs: list, call) -> tuple[int, float, list[float]]:
    """`num_clients` workers taking jobs in order; `call(job)` returns its generated tokens. (tokens, seconds,
    per-request latencies)."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    total, latencies = 0, []

    async def worker():
        nonlocal total
        while not queue.empty():
            job = queue.get_nowait()
            t = time.perf_counter()
            tokens = await call(job)  # (not `total += await ...`: that reads total before the await)
            total += tokens
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(num_clients)))
    return total, time.perf_counter() - start, latencies


def in_process(config: dict, jobs: dict, args) -> dict:
    """tokens/s of each workload with coroutines awaiting one AsyncEngine."""
    from rollout import AsyncEngine, EngineConfig, SamplingParams
    from rollout.chat import ChatTemplate
    from rollout.config import from_mapping

    engine = AsyncEngine(from_mapping(EngineConfig, config, "bench"))
    template = ChatTemplate.from_model_dir(config["model"])
    rendered = {"completions": jobs["completions"], "chat": [template.render(c) for c in jobs["chat"]]}
    results = {}

    async def main():
        async def call(job):
            i, ids = job
            params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=i, temperature=1.0)
            out = await engine.generate(ids, params)
            return len(out.outputs[0].token_ids)

        for name, prompts in rendered.items():
            await run_clients(args.clients, list(enumerate(prompts[: args.clients])), call)  # warm-up
            results[name] = await run_clients(args.clients, list(enumerate(prompts)), call)

    try:
        asyncio.run(main())
        results["engine"] = {"num_kv_blocks": engine.engine.num_kv_blocks,
                             "num_preemptions": engine.engine.scheduler.stats.num_preemptions}
    finally:
        engine.close()
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_process(url: str, jobs: dict, num_clients: int, args_dict: dict, barrier, results) -> None:
    """One client process: `num_clients` httpx clients over its share of each workload, warmed up first; every
    process starts a workload at the same barrier. Puts {workload: (tokens, start, end, latencies)}."""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
            common = {"max_tokens": args_dict["new_tokens"], "ignore_eos": True, "temperature": 1.0}

            async def completion(job):
                i, ids = job
                r = await client.post("/v1/completions", json={"prompt": ids, "seed": i, **common})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            async def chat(job):
                i, messages = job
                r = await client.post("/v1/chat/completions", json={"messages": messages, "seed": i, **common})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            out = {}
            for name, call in (("completions", completion), ("chat", chat)):
                await run_clients(num_clients, jobs[name][:num_clients], call)  # warm-up
                await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
                start = time.time()
                tokens, _, latencies = await run_clients(num_clients, jobs[name], call)
                out[name] = (tokens, start, time.time(), latencies)
            return out

    results.put(asyncio.run(main()))


def over_http(config_path: Path, jobs: dict, args) -> dict:
    """tokens/s of each workload with httpx clients against `python -m rollout serve` in a subprocess. The C
    clients are spread over `--client-processes` processes: one Python process of asyncio httpx clients
    saturates a core before the server does (on the CPU, one process of 64 clients delivered 0.56 of the
    server's throughput, four processes 0.86)."""
    import multiprocessing as mp

    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rollout", "serve", "--config", str(config_path),
                               "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {args.startup_timeout} s")
            time.sleep(0.2)
        procs = max(1, min(args.client_processes, args.clients))
        ctx = mp.get_context("spawn")
        barrier, queue = ctx.Barrier(procs), ctx.Queue()
        shares = [{name: [job for k, job in enumerate(enumerate(items)) if k % procs == p]
                   for name, items in jobs.items()} for p in range(procs)]
        clients = [args.clients // procs + (p < args.clients % procs) for p in range(procs)]
        workers = [ctx.Process(target=_client_process, args=(url, shares[p], clients[p], vars(args), barrier, queue))
                   for p in range(procs)]
        for w in workers:
            w.start()
        parts = [queue.get() for _ in workers]
        for w in workers:
            w.join()
        results = {}
        for name in jobs:
            tokens = sum(part[name][0] for part in parts)
            seconds = max(part[name][2] for part in parts) - min(part[name][1] for part in parts)
            results[name] = (tokens, seconds, [x for part in parts for x in part[name][3]])
        info = httpx.get(url + "/server_info", timeout=10).json()
        results["engine"] = {k: info[k] for k in ("num_kv_blocks", "num_preemptions")}
        return results
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (default 64)")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--client-processes", type=int, default=None,
                    help="processes the HTTP clients are spread over (default 8 on CUDA, 4 on the CPU)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="a small CPU run (8 clients, 32 requests, tiny model)")
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.clients = args.clients or (8 if args.quick else 64)
    args.client_processes = args.client_processes or (2 if args.quick else 8 if cuda else 4)
    args.requests = args.requests or (32 if args.quick else 512 if cuda else 128)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128 if cuda else 32)
    args.new_tokens = args.new_tokens or (16 if args.quick else 256 if cuda else 32)
    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        write_random_checkpoint(model, family=family, dtype=dtype, std=0.02, **spec)
        write_tokenizer(model, spec["vocab_size"])
        config = {"model": str(model), "device": args.device, "dtype": dtype,
                  "max_num_seqs": args.max_num_seqs or max(args.clients, 8),
                  "max_model_len": args.prompt_len * 2 + args.new_tokens + 64}
        config_path = Path(d) / "engine.yaml"
        config_path.write_text(json.dumps(config))  # JSON is YAML
        prompts, chats = workload(args.requests, args.prompt_len, spec["vocab_size"], seed=0)
        jobs = {"completions": prompts, "chat": chats}
        common = dict(device=args.device, shape=shape, dtype=dtype, clients=args.clients, requests=args.requests,
                      prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        measured = {"in_process": in_process(config, jobs, args)}
        if cuda:
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()  # the server process sizes its KV cache from the free memory
        measured["http"] = over_http(config_path, jobs, args)
        for system, results in measured.items():
            emit(kind="serve_engine", system=system, **results.pop("engine"), **common)
            for workload_name, (tokens, seconds, latencies) in results.items():
                latencies.sort()
                emit(kind="serve", system=system, workload=workload_name, tokens_per_s=round(tokens / seconds, 1),
                     seconds=round(seconds, 3), generated_tokens=tokens,
                     p50_request_s=round(latencies[len(latencies) // 2], 4),
                     p99_request_s=round(latencies[max(0, int(len(latencies) * 0.99) - 1)], 4), **common)
        for workload_name in ("completions", "chat"):
            http_tps = measured["http"][workload_name][0] / measured["http"][workload_name][1]
            local_tps = measured["in_process"][workload_name][0] / measured["in_process"][workload_name][1]
            emit(kind="serve_overhead", workload=workload_name, http_over_in_process=round(http_tps / local_tps, 3),
                 overhead=round(1 - http_tps / local_tps, 3), **common)


if __name__ == "__main__":
    main()
