"""The model's tokenizer: prompts encoded and completions decoded as the model's own tokenizer does.

What it reads from a model directory (or from the directory of a tokenizer.json path):
- `tokenizer.json` (needed for text prompts, text outputs and stop strings): the `tokenizers` pipeline, its
  post-processor included, so `encode(text)` adds the special tokens that post-processor adds (BOS for
  Llama-style tokenizers), as `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]` does;
  `add_special_tokens=False` encodes the text alone.
- `tokenizer_config.json` (optional): the tokens of its `added_tokens_decoder` and its named special tokens
  (`bos_token`, `eos_token`, ..., `additional_special_tokens`) that tokenizer.json lacks are added, as
  transformers adds them, and `bos_token` / `eos_token` name `bos_token_id` / `eos_token_id`. Its
  `add_bos_token` / `add_eos_token` are not read: with a tokenizer.json, transformers ignores them too and the
  post-processor decides. Its `chat_template` (or `chat_template.jinja`) is rollout/chat.py's.

Decoding: `skip_special_tokens` drops the tokens the vocabulary marks special. `spaces_between_special_tokens`
(vLLM's flag, default True) matters only when they are kept: each special token is then set apart from the
text around it by one space, as transformers' slow (Python) tokenizers and vLLM's slow detokenizer join their
pieces: the runs of ordinary tokens between special tokens are decoded one by one and the pieces (runs and
special tokens) joined with " " (empty runs left out). False gives the `tokenizers` decode of all the ids as
they are, which is what vLLM's fast detokenizer gives whatever the flag. Non-special added tokens (Qwen's
`<tool_call>`, `<think>`) are decoded as ordinary text either way, unlike vLLM's slow path, which spaces them
too.

Not here: incremental decoding of streamed outputs (rollout/detokenizer.py); chat templates (rollout/chat.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = HFTokenizer.from_file(str(file))
        config = _read_config(file.parent / "tokenizer_config.json")
        self._add_config_tokens(config)
        self.bos_token_id: int | None = self._named_id(config, "bos_token")
        """The id of tokenizer_config.json's `bos_token` (None without one)."""
        self.eos_token_id: int | None = self._named_id(config, "eos_token")
        """The id of tokenizer_config.json's `eos_token` (None without one)."""
        self.vocab_size = self._tok.get_vocab_size()
        # id -> text of every token the vocabulary marks special (what skip_special_tokens drops)
        self._special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @staticmethod
    def find(path: str | Path) -> "Tokenizer | None":
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        return Tokenizer(file) if file.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the special tokens the post-processor adds unless `add_special_tokens` is False."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return self.decoder(skip_special_tokens, spaces_between_special_tokens)(ids)

    def decoder(self, skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """`decode` with its flags bound, without this wrapper's call where it can: what the incremental
        detokenizer calls for every token."""
        if skip_special_tokens or not spaces_between_special_tokens or not self._special:
            return functools.partial(self._tok.decode, skip_special_tokens=skip_special_tokens)
        return self._decode_spaced

    def _decode_spaced(self, ids: list[int]) -> str:
        """Special tokens kept, each set apart by a space: the runs between them decoded one by one."""
        special, decode = self._special, self._tok.decode
        pieces: list[str] = []
        start = 0
        for i, t in enumerate(ids):
            s = special.get(t)
            if s is not None:
                if i > start and (run := decode(ids[start:i], skip_special_tokens=False)):
                    pieces.append(run)
                pieces.append(s)
                start = i + 1
        if start < len(ids) and (run := decode(ids[start:], skip_special_tokens=False)):
            pieces.append(run)
        return " ".join(pieces)

    def _add_config_tokens(self, config: dict) -> None:
        """Add tokenizer_config.json's added and named special tokens that tokenizer.json lacks (in id order)."""
        from tokenizers import AddedToken

        entries = config.get("added_tokens_decoder") or {}
        if not isinstance(entries, dict):
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder must be an object, got {entries!r}")
        for key, e in entries.items():
            if not (key.isdigit() and isinstance(e, dict) and isinstance(e.get("content"), str)):
                raise ValueError(f"tokenizer_config.json: added_tokens_decoder[{key!r}] must be a token object with a "
                                 f"'content' string under its id, got {e!r}")
        wanted = []
        for key in sorted(entries, key=int):
            e = entries[key]
            wanted.append(AddedToken(e["content"], single_word=e.get("single_word", False),
                                     lstrip=e.get("lstrip", False), rstrip=e.get("rstrip", False),
                                     normalized=e.get("normalized", not e.get("special", False)),
                                     special=e.get("special", False)))
        named = [config.get(k) for k in _NAMED_SPECIAL]
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        named += list(extra.values() if isinstance(extra, dict) else extra)  # transformers 5 also names them
        for value in named:
            content = _token_content(value)
            if content is not None:
                wanted.append(AddedToken(content, special=True, normalized=False))
        for token in wanted:
            if self._tok.token_to_id(token.content) is None:
                if token.special:
                    self._tok.add_special_tokens([token])
                else:
                    self._tok.add_tokens([token])

    def _named_id(self, config: dict, key: str) -> int | None:
        content = _token_content(config.get(key))
        return None if content is None else self._tok.token_to_id(content)


def _read_config(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def _token_content(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken object with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
