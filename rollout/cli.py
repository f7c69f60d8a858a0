"""Command line: `python -m rollout generate ...`, `python -m rollout serve ...` and `python -m rollout demo`.

`generate` prints one JSON line per sample and a final throughput line; the progress bar goes to stderr.
`serve` runs the HTTP server of `rollout/server.py` until interrupted; its flags (vLLM's names) build the
`rollout.server_config.ServerConfig` (`server_config_from_args`), the engine flags and `--config` YAML the
`EngineConfig`. The API key comes from `--api-key` or else the environment variable ROLLOUT_API_KEY; it is
never printed (argparse errors are redacted, and the parsed namespace is never shown).
`demo` runs the toy GRPO demo (`trainer_bridge.demo`); its options follow the subcommand.

A user error is one line on stderr, `error: ...`, and exit status 2, found before the model loads wherever
it can be. The checks run cheapest first: flag values (a port out of range), the `--config` YAML (malformed:
file, line and column; a value of the wrong type: its key and the type expected), the device (`--device cuda`
without triton or without CUDA), a missing `--chat-template`, the port (bound once, then released: in use,
or not an address of this machine), then the model (a directory, or a hub id found in the Hugging Face cache
or downloaded into it; rollout/model_files.py), and only then is the engine built.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

API_KEY_ENV = "ROLLOUT_API_KEY"
"""The environment variable `serve` reads the API key from when `--api-key` is not given."""

# the serve flags that set the ServerConfig field of their name (--max-n -> max_n)
_SERVER_FIELDS = ("host", "port", "served_model_name", "max_n", "max_prompt_tokens", "max_tokens", "max_body_bytes",
                  "max_pending_requests", "max_cache_salt_chars", "tool_parser", "chat_template")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line and `secrets` cut out of them."""

    def __init__(self, *args, secrets: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.secrets = secrets

    def error(self, message: str):
        """One line on stderr, exit status 2 (argparse's status; without its usage block)."""
        self.exit(2, f"error: {_redact(message, self.secrets)} (see: {self.prog} --help)\n")


def _redact(message: str, secrets) -> str:
    for secret in secrets:
        message = message.replace(secret, "***")
    return message


def _secrets_in(argv: list[str]) -> tuple[str, ...]:
    """The values in `argv` given to a flag whose name ends in "key", "token" or "secret": `--api-key VALUE`,
    `--api-key=VALUE`, and a misspelt `--api_key VALUE` that argparse would echo as unrecognized (not
    `--max-tokens N`)."""
    found = []
    for i, arg in enumerate(argv):
        name, attached, value = arg.partition("=")
        if not arg.startswith("-") or not name.lstrip("-").lower().endswith(("key", "token", "secret")):
            continue
        if attached:
            found.append(value)
        elif i + 1 < len(argv):
            found.append(argv[i + 1])
    return tuple(s for s in found if s)


# ---- checks that run before the model loads ---------------------------------------------------------------------
def check_port(host: str, port: int) -> None:
    """Raise ValueError unless the server could listen on (host, port): in range, resolvable, free. Binds a
    socket (with SO_REUSEADDR, as the server's own does) and releases it at once."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an integer in [0, 65535], got {port!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address of this machine ({e.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            why = {errno.EADDRINUSE: "the port is already in use (another server?); choose another with --port",
                   errno.EACCES: "permission denied (ports below 1024 need root)",
                   errno.EADDRNOTAVAIL: "--host is not an address of this machine"}.get(e.errno, e.strerror or str(e))
            raise ValueError(f"cannot listen on {host}:{port}: {why}") from None


def check_device(device: str) -> None:
    """Raise ValueError unless `device` ("cpu", "cuda", "cuda:N") can run the engine: CUDA needs triton (the
    `gpu` extra) and a CUDA build of torch that sees the GPU."""
    if device == "cpu":
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError(f"device {device!r} needs triton, which is not installed: pip install -e '.[gpu]' "
                         "(or use --device cpu)") from None
    import torch

    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, sees no GPU"
        raise ValueError(f"device {device!r}: CUDA is not available (torch {torch.__version__}: {why}); "
                         "use --device cpu")
    index = device.partition(":")[2] or "0"
    if not index.isdigit() or int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_model(config) -> None:
    """Resolve the model (and tokenizer) as the engine will: a missing one is named now, and a hub id is
    downloaded before the engine starts."""
    from rollout.model_files import resolve_model

    resolve_model(config.model)
    if config.tokenizer:
        resolve_model(config.tokenizer, needs=None)


# ---- configs from flags -----------------------------------------------------------------------------------------
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


def server_fields(args: argparse.Namespace) -> dict:
    """The `ServerConfig` fields that the serve flags (and ROLLOUT_API_KEY) set; fields left out keep
    ServerConfig's defaults. Raises ValueError for a port out of range (naming the flag)."""
    fields = {name: getattr(args, name) for name in _SERVER_FIELDS if getattr(args, name) is not None}
    if "port" in fields and not 0 <= fields["port"] <= 65535:
        raise ValueError(f"--port must be an integer in [0, 65535], got {fields['port']}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None:
        fields["api_key"] = api_key
    if args.disable_admin_endpoints:
        fields["enable_admin"] = False
    return fields


def server_config_from_args(args: argparse.Namespace):
    """The `ServerConfig` of the serve flags (see `server_fields`)."""
    fields = server_fields(args)
    from rollout.server_config import ServerConfig

    return ServerConfig(**fields)


# ---- commands -----------------------------------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    from rollout import SamplingParams

    config = _engine_config(args)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop or [],
    )
    prompts: list = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        try:
            prompts.append([int(t) for t in ids.split(",")])
        except ValueError:
            raise ValueError(f"--prompt-ids takes comma-separated integers, got {ids!r}") from None
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    check_device(config.device)
    _check_model(config)
    from rollout import Engine

    engine = Engine(config)
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

    server_fields(args)  # flag values first (a port out of range)
    config = _engine_config(args)  # then the YAML and the engine flags
    check_device(config.device)
    server_config = server_config_from_args(args)
    if server_config.chat_template is not None and not Path(server_config.chat_template).is_file():
        raise ValueError(f"--chat-template {server_config.chat_template!r}: no such file")
    check_port(server_config.host, server_config.port)
    _check_model(config)

    from rollout.async_engine import AsyncEngine
    from rollout.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(AsyncEngine(config), server_config)
    return 0


def build_parser(secrets: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The command line's parser; `secrets` are cut out of its error messages."""
    parser = _Parser(prog="python -m rollout", secrets=secrets)
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", secrets=secrets,
                       help="generate completions from a Hugging Face model directory or model id")
    s = sub.add_parser("serve", secrets=secrets, help="serve OpenAI's API and SGLang's /generate over HTTP")
    for p in (g, s):
        p.add_argument("--model", help="a Hugging Face model directory, or a model id (found in the local Hugging "
                                       "Face cache, or downloaded into it)")
        p.add_argument("--config", help="an EngineConfig YAML (e.g. configs/engine_gpu.yaml); flags override it")
        p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N")
        p.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
        p.add_argument("--max-num-seqs", type=int, default=None)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--deterministic", action="store_true")
    s.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=None, help="TCP port (default 30000)")
    s.add_argument("--served-model-name", default=None, help="the model id /v1/models lists (default: --model as given)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health; default: the "
                        f"environment variable {API_KEY_ENV} (safer: a flag shows in the process list)")
    s.add_argument("--disable-admin-endpoints", action="store_true",
                   help="do not serve /update_weights_from_disk, release / resume memory, /flush_cache, /abort_request")
    s.add_argument("--max-n", type=int, default=None, help="most samples per prompt (default 1024)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="most tokens per prompt (default: max_model_len - 1)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: max_model_len)")
    s.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 32 MiB)")
    s.add_argument("--max-pending-requests", type=int, default=None,
                   help="most prompts in flight; past it 429 with Retry-After (default 4096)")
    s.add_argument("--max-cache-salt-chars", type=int, default=None, help="longest cache_salt (default 256)")
    s.add_argument("--tool-parser", default=None, help="how chat completions' tool calls are parsed (default hermes)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template overriding the model directory's")
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
    sub.add_parser("demo", secrets=secrets, help="the toy GRPO demo (options: python -m rollout demo --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (--config, --set KEY=VALUE, ...)
        from trainer_bridge.demo import main as demo_main

        return demo_main(argv[1:])
    secrets = tuple(s for s in (*_secrets_in(argv), os.environ.get(API_KEY_ENV)) if s)
    args = build_parser(secrets).parse_args(argv)
    try:
        return _serve(args) if args.cmd == "serve" else _generate(args)
    except ValueError as e:
        print(f"error: {_redact(' '.join(str(e).split()), secrets)}", file=sys.stderr)  # one line
        return 2


if __name__ == "__main__":
    sys.exit(main())
