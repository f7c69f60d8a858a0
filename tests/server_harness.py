"""Test helpers for the HTTP server: a real uvicorn server on 127.0.0.1 (a free port) in a thread, and tiny
model directories with a byte-level BPE tokenizer and a ChatML chat template (with Hermes-style tools)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from conftest import make_checkpoint, replace_sampled_tokens
from rollout.async_engine import AsyncEngine
from rollout.server import bind, build_app, uvicorn_server
from rollout.server_config import ServerConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML as Qwen2.5 writes it, tools in a <tools> block and calls as <tool_call>{json}</tool_call>
CHATML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog", "what is the weather in Paris today?",
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
          "You may call one or more functions to assist with the user query.", "12+34=46 7+8=15 sunny, 21 C"]


def write_chat_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE (vocab_size - 3 entries trained here, then the 3 ChatML special tokens) whose
    post-processor adds nothing, and tokenizer_config.json with the ChatML template; <|im_end|> ends a turn.
    Its pre-tokenizer is Qwen2's (transformers' Qwen2Tokenizer imposes it on a qwen2 model directory, so
    every reader of the directory splits text alike)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def chat_checkpoint(root: Path, *, seed: int, vocab_size: int = 320) -> Path:
    """A tiny random Qwen2 checkpoint with the ChatML tokenizer (`chat_model_dir`), in root / "chat"."""
    src = make_checkpoint(root / "src", "qwen2", vocab_size=vocab_size, seed=seed)
    (root / "chat").mkdir()
    return chat_model_dir(src, root / "chat", vocab_size)


def chat_model_dir(src: Path, dst: Path, vocab_size: int) -> Path:
    """A copy of the checkpoint `src` (vocab_size entries) with the ChatML tokenizer, EOS = <|im_end|>."""
    from tokenizers import Tokenizer

    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    write_chat_tokenizer(dst, vocab_size)
    eos = Tokenizer.from_file(str(dst / "tokenizer.json")).token_to_id("<|im_end|>")
    for name in ("config.json", "generation_config.json"):
        if (dst / name).is_file():
            cfg = json.loads((dst / name).read_text())
            cfg["eos_token_id"] = eos
            (dst / name).write_text(json.dumps(cfg))
    return dst


class LiveServer:
    """`build_app(engine, config)` on uvicorn at 127.0.0.1:<free port>, in a thread; `url` once entered."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.app = build_app(engine, config or ServerConfig())
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn_server(self.app, self.sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class ScriptedTokens:
    """Makes `engine` (an `Engine`) report `tokens[k]` as the k-th token of every sample, then `tokens[-1]`
    forever (`conftest.replace_sampled_tokens`)."""

    def __init__(self, engine, tokens: list[int]) -> None:
        from collections import Counter

        self.tokens = tokens
        self._next: Counter = Counter()
        replace_sampled_tokens(engine, self._token)

    def _token(self, req_id: str) -> int:
        k = self._next[req_id]
        self._next[req_id] += 1
        return self.tokens[min(k, len(self.tokens) - 1)]
