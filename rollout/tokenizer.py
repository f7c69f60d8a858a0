"""A thin wrapper over a `tokenizers` tokenizer.json (encode prompts, decode completions; incremental decoding of
streamed outputs is rollout/detokenizer.py)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = HFTokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size()

    @staticmethod
    def find(path: str | Path) -> "Tokenizer | None":
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        return Tokenizer(file) if file.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """`decode` with `skip_special_tokens` bound, without this wrapper's call: what the incremental
        detokenizer calls for every token."""
        return functools.partial(self._tok.decode, skip_special_tokens=skip_special_tokens)
