"""Tool calls parsed out of a chat completion's text into OpenAI `tool_calls`, whole or as the text streams.

A `ToolParser` turns a completion's text into a `ParsedMessage`: the content the client sees and the calls
(`ToolCall`: OpenAI's id, function name and arguments as a JSON string). Its `streamer()` does the same for a
text that arrives in deltas: `feed(delta)` returns what is certain so far, in order, as ("content", str) and
("tool_call", ToolCall) events, and `finish()` the rest. A streamer holds back any text that could still be
the start of a call's tag, so content deltas never carry a fragment of one, and emits each call whole once
its closing tag arrives; `parse` is one `feed` of the whole text plus `finish`, so the content deltas of any
split concatenate to the parsed content ("" where that is None) and the calls are the same (ids aside).

`ToolParsers` is the registry: `ToolParsers.get("hermes")` gives a parser, `ToolParsers.register(name, cls)`
adds a format (a `ToolParser` subclass, or "module:Class" imported on first use).

The Hermes / Qwen format (`HermesToolParser`, names "hermes" and "qwen"; Qwen2.5, Qwen3, Hermes 2/3):
    content\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>...
- A call is `<tool_call>` BODY `</tool_call>` (the first closing tag ends it), BODY one JSON object with a
  non-empty string "name" and an object "arguments" (absent: {}); its arguments are re-serialized with
  `json.dumps(..., ensure_ascii=False)` as vLLM does. At the end of the text a call without its closing tag
  counts too when its body is whole (a completion cut by a stop string `</tool_call>`, or whose end token
  came right after the JSON).
- A call whose body is not that (bad JSON, NaN, no name, ...) is kept in the content as it was written,
  tags included: never dropped, never an error.
- Everything else is content, except whitespace that touches a parsed call (the newlines a chat template
  puts before and between calls). The content is None when it is empty and there are calls.
Tool-call ids are vLLM's: "chatcmpl-tool-" + 32 hex digits, new for every call.

Not here: `tool_choice` (with "none" the server does not parse), checking names or arguments against the
request's tool schemas, rendering tools into the prompt (rollout/chat.py), reasoning (`<think>`) parsing.
"""

from __future__ import annotations

import importlib
import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One function call, as OpenAI's `tool_calls` entries carry it."""

    id: str
    """"chatcmpl-tool-<hex>" (vLLM's form)."""
    name: str
    """The function's name."""
    arguments: str
    """The arguments: a JSON object, serialized."""

    def to_openai(self) -> dict:
        """The entry of an OpenAI `message.tool_calls` list."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """A completion's text split into what the client reads and the calls it asked for."""

    content: str | None
    """The text outside the calls; None when that is empty and there are calls."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The calls, in the order they were written."""


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolStreamer:
    """The tool-call parse of one streamed completion (one per choice)."""

    def feed(self, text_delta: str) -> list[tuple[str, object]]:
        """The events `text_delta` makes certain: ("content", str) and ("tool_call", ToolCall), in order."""
        raise NotImplementedError

    def finish(self) -> list[tuple[str, object]]:
        """The events of what is left once the completion has ended."""
        raise NotImplementedError


class ToolParser:
    """A tool-call format. Stateless: `streamer()` holds the state of one stream."""

    def streamer(self) -> ToolStreamer:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedMessage:
        """The whole completion's content and calls (what any split of `text` through `streamer()` gives)."""
        s = self.streamer()
        events = s.feed(text) + s.finish()
        content = "".join(x for kind, x in events if kind == "content")
        calls = [x for kind, x in events if kind == "tool_call"]
        return ParsedMessage(content=None if calls and not content else content, tool_calls=calls)


class TaggedToolStreamer(ToolStreamer):
    """Calls written as `open_tag` BODY `close_tag`, with the rules of the module docstring; `parse_body`
    turns a body into a ToolCall, or None where it is not one (then it stays content)."""

    def __init__(self, open_tag: str, close_tag: str, parse_body) -> None:
        self._open, self._close, self._parse_body = open_tag, close_tag, parse_body
        self._buf = ""  # outside a call: text not emitted yet (held whitespace, a possible tag start); inside: the body
        self._in_call = False
        self._space = ""  # inside a call: the whitespace before its opening tag (content again if the call is bad)
        self._after_call = False  # the last thing was a parsed call: whitespace that follows it is dropped
        self._scan = 0  # inside a call: where to look for the closing tag next

    def feed(self, text_delta: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._buf += text_delta
        while True:
            if self._in_call:
                j = self._buf.find(self._close, self._scan)
                if j < 0:
                    self._scan = max(0, len(self._buf) - len(self._close) + 1)
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(self._close):]
                self._end_call(body, self._close, out)
                continue
            if self._after_call:
                rest = self._buf.lstrip()
                if rest:
                    self._after_call = False
                self._buf = rest
            i = self._buf.find(self._open)
            if i < 0:
                k = _tag_prefix_len(self._buf, self._open)
                head = self._buf[: len(self._buf) - k]
                text = head.rstrip()  # whitespace waits: a call may follow it
                _content(text, out)
                self._buf = self._buf[len(text):]
                return out
            head = self._buf[:i]
            text = head.rstrip()
            _content(text, out)
            self._space = head[len(text):]
            self._buf = self._buf[i + len(self._open):]
            self._in_call, self._scan = True, 0

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self._in_call:
            self._end_call(self._buf, "", out)
        elif not self._after_call or self._buf.strip():
            _content(self._buf, out)
        self._buf, self._after_call = "", False
        return out

    def _end_call(self, body: str, close: str, out: list) -> None:
        call = self._parse_body(body)
        if call is None:
            _content(self._space + self._open + body + close, out)
            self._after_call = False
        else:
            out.append(("tool_call", call))
            self._after_call = True
        self._in_call, self._space = False, ""


def _content(text: str, out: list) -> None:
    if text:
        out.append(("content", text))


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them (Hermes 2/3, Qwen2.5/3)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def streamer(self) -> ToolStreamer:
        return TaggedToolStreamer(self.open_tag, self.close_tag, self.parse_body)

    @staticmethod
    def parse_body(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body, parse_constant=_reject_constant)  # NaN / Infinity are not JSON
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name, arguments = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return ToolCall(id=make_tool_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


class ToolParsers:
    """The registry of tool-call formats by name."""

    _registry: dict[str, type[ToolParser] | str] = {}

    @classmethod
    def register(cls, name: str, parser: type[ToolParser] | str) -> None:
        """Add (or replace) a format: a ToolParser subclass, or "module:Class" imported when first asked for."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool parser's name must be a non-empty string, got {name!r}")
        if isinstance(parser, str):
            if parser.count(":") != 1:
                raise ValueError(f"tool parser {name!r}: expected 'module:Class', got {parser!r}")
        elif not (isinstance(parser, type) and issubclass(parser, ToolParser)):
            raise ValueError(f"tool parser {name!r} must be a ToolParser subclass or 'module:Class', got {parser!r}")
        cls._registry[name] = parser

    @classmethod
    def get(cls, name: str) -> ToolParser:
        """A parser of the format registered as `name`."""
        parser = cls._registry.get(name) if isinstance(name, str) else None
        if parser is None:
            raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(cls.names())}")
        if isinstance(parser, str):
            module, attr = parser.split(":")
            parser = getattr(importlib.import_module(module), attr)
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise ValueError(f"tool parser {name!r}: {cls._registry[name]} is not a ToolParser subclass")
            cls._registry[name] = parser
        return parser()

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)


ToolParsers.register("hermes", HermesToolParser)
ToolParsers.register("qwen", HermesToolParser)
