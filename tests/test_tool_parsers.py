"""Tool-call parsing (the Hermes / Qwen format): single and several calls, content before and after them, malformed
calls left as content, and the streamer, split at every character boundary (and into random chunks), giving what
`parse` gives with no tag fragment in any content delta; the registry."""

from __future__ import annotations

import json
import random
import re

import pytest

from rollout.tool_parsers import HermesToolParser, ParsedMessage, ToolCall, ToolParser, ToolParsers, ToolStreamer

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'


def calls(parsed: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.fixture
def parser():
    return ToolParsers.get("hermes")


# (text, expected content, expected calls): the rules of rollout/tool_parsers.py, case by case
CASES = [
    ("no tools here", "no tools here", []),
    ("", "", []),
    (PARIS, None, [("get_weather", {"city": "Paris"})]),
    (PARIS + "\n" + ROME, None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "C"})]),
    ("Let me check.\n" + PARIS + "\n" + ROME, "Let me check.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "C"})]),
    (PARIS + "\n\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),  # no arguments: {}
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_"}}</tool_call>', None, [("f", {"s": "</tool_"})]),
    ('<tool_call>{"name": "café", "arguments": {"q": "中文 🙂"}}</tool_call>', None,
     [("café", {"q": "中文 🙂"})]),
    # a call without its closing tag at the very end (cut by a stop string or the end token) still counts
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', "Sure.", [("f", {"x": 1})]),
    # malformed calls stay in the content, as written
    ("A <tool_call>{not json}</tool_call> B", "A <tool_call>{not json}</tool_call> B", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("x <tool_call>{\"name\": \"f\", \"argu", "x <tool_call>{\"name\": \"f\", \"argu", []),  # cut mid-call
    (PARIS + "\n<tool_call>[1, 2]</tool_call>\n" + ROME, "<tool_call>[1, 2]</tool_call>",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "C"})]),
    # things that look like tags but are not
    ("a < b and <tool_> and </tool_call> and <tool_call", "a < b and <tool_> and </tool_call> and <tool_call", []),
    ("ends with <tool_c", "ends with <tool_c", []),
    ("trailing space kept  \n", "trailing space kept  \n", []),
]


@pytest.mark.parametrize("text,content,expected", CASES)
def test_parse(parser, text, content, expected):
    parsed = parser.parse(text)
    assert parsed.content == content
    assert calls(parsed) == expected
    for c in parsed.tool_calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id)
        assert c.to_openai() == {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


def test_arguments_are_serialized_as_json(parser):
    (c,) = parser.parse('<tool_call>{"name":"f","arguments":{"b":[1,2],"a":"é"}}</tool_call>').tool_calls
    assert c.arguments == '{"b": [1, 2], "a": "é"}'  # json.dumps(..., ensure_ascii=False), as vLLM


def stream(parser: ToolParser, pieces: list[str]) -> list[tuple[str, object]]:
    s = parser.streamer()
    events = []
    for p in pieces:
        events += s.feed(p)
    return events + s.finish()


def check_stream(parser, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    events = stream(parser, pieces)
    expected = parser.parse(text)
    contents = [x for kind, x in events if kind == "content"]
    assert all(contents), "no empty content deltas"
    # a tag fragment sent as content and then completed into a call would make this differ from the parse
    assert "".join(contents) == (expected.content or "")
    assert [(c.name, c.arguments) for kind, c in events if kind == "tool_call"] == \
        [(c.name, c.arguments) for c in expected.tool_calls]


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_streaming_split_at_every_boundary(parser, text):
    for i in range(len(text) + 1):
        check_stream(parser, text, [text[:i], text[i:]])
    check_stream(parser, text, list(text))  # one character at a time


def test_streaming_random_chunks(parser):
    rng = random.Random(0)
    texts = [c[0] for c in CASES]
    for _ in range(300):
        text = "".join(rng.choice(texts + [" ", "\n", "<", "<tool", "</tool_call>"]) for _ in range(rng.randint(1, 5)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        check_stream(parser, text, pieces)


def test_streamer_emits_content_early_and_each_call_once_closed(parser):
    s = parser.streamer()
    assert s.feed("Let me ") == [("content", "Let me")]  # the space waits: a call may follow it
    assert s.feed("check.\n<tool_") == [("content", " check.")]
    assert s.feed('call>\n{"name": "get_weather", ') == []
    assert s.feed('"arguments": {"city": "Paris"}}\n</tool_') == []
    (event,) = s.feed("call>")
    assert event[0] == "tool_call" and isinstance(event[1], ToolCall) and event[1].name == "get_weather"
    assert s.feed("\n") == []
    assert s.feed("Bye") == [("content", "Bye")]
    assert s.finish() == []


def test_registry():
    assert {"hermes", "qwen"} <= set(ToolParsers.names())
    assert isinstance(ToolParsers.get("qwen"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: .*hermes"):
        ToolParsers.get("nope")

    class Upper(ToolParser):
        def streamer(self) -> ToolStreamer:
            class S(ToolStreamer):
                def feed(self, text_delta):
                    return [("content", text_delta.upper())] if text_delta else []

                def finish(self):
                    return []

            return S()

    ToolParsers.register("test-upper", Upper)
    try:
        assert ToolParsers.get("test-upper").parse("abc") == ParsedMessage(content="ABC", tool_calls=[])
        ToolParsers.register("test-lazy", "rollout.tool_parsers:HermesToolParser")
        assert isinstance(ToolParsers.get("test-lazy"), HermesToolParser)
        with pytest.raises(ValueError, match="ToolParser subclass"):
            ToolParsers.register("test-bad", dict)
    finally:
        ToolParsers._registry.pop("test-upper", None)
        ToolParsers._registry.pop("test-lazy", None)
