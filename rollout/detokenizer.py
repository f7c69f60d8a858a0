"""Incremental detokenization of one sample's output, and the stop strings found in that text.

`IncrementalDetokenizer` turns a sample's output tokens into text as they arrive, in pieces that never end
inside a character: a byte-level BPE vocabulary splits a multi-byte UTF-8 character (CJK, emoji) over
several tokens, and decoding a prefix that stops inside one gives U+FFFD. It keeps vLLM's prefix / read
offsets: each window of new tokens is decoded together with the previous window's tokens (so a decoder that
treats a sequence's first token specially, like SentencePiece's leading space, sees the context a full decode
sees), and its text is committed only when it does not end in U+FFFD. `flush` (a finished sample) commits
the rest, a trailing partial character too, so the text is `Tokenizer.decode` of all the tokens for
byte-level and SentencePiece-style vocabularies; a sample that never streamed decodes once, in `flush`.
Cost: one decode of a few tokens per token, two when it commits; the token list is never copied.
(`tokenizers.decoders.DecodeStream` windows the same way but offers no flush of a trailing partial
character, so its text can end short of the full decode.)

`StopStrings` finds `SamplingParams.stop` strings in that text as the scheduler appends tokens, and says how
much of the text's end could still begin one (what a streamed output holds back).

Not here: which outputs are built when (rollout/output_processor.py); when a request stops
(rollout/scheduler.py).
"""

from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    """The text of one sample's output tokens, decoded as they arrive. Output tokens are read in place from the
    request's list: `token_ids[start:end]` are the output tokens so far (the caller passes start and end)."""

    __slots__ = ("_decode", "_pieces", "length", "num_tokens", "_prefix", "_read", "_prefix_len")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode  # token ids -> text (skip_special_tokens, spaces_between_special_tokens bound)
        self._pieces: list[str] = []  # committed text, in pieces (joined only when read from far back)
        self.length = 0
        """Characters committed."""
        self.num_tokens = 0
        """Output tokens consumed (committed, or pending until their character completes)."""
        self._prefix = 0  # first token of the decode window: the previous window's tokens, for context
        self._read = 0  # tokens whose text is committed
        self._prefix_len = 0  # len(decode(tokens[_prefix:_read]))

    def update(self, token_ids: list[int], start: int, end: int) -> None:
        """Consume the output tokens up to `end`; commit their text unless it ends inside a character."""
        n = end - start
        if n <= self.num_tokens:
            return
        self.num_tokens = n
        text = self._decode(token_ids[start + self._prefix : end])
        if len(text) > self._prefix_len and not text.endswith("\ufffd"):
            self._commit(text[self._prefix_len :])
            self._prefix, self._read = self._read, n
            self._prefix_len = len(self._decode(token_ids[start + self._prefix : end]))

    def flush(self, token_ids: list[int], start: int, end: int) -> None:
        """Consume the output tokens up to `end` and commit all their text, a trailing partial character too:
        the last call, for a finished sample."""
        n = end - start
        if n > self._read:
            text = self._decode(token_ids[start + self._prefix : end])
            if len(text) > self._prefix_len:
                self._commit(text[self._prefix_len :])
        self.num_tokens = self._read = self._prefix = n
        self._prefix_len = 0

    def text(self, begin: int = 0, end: int | None = None) -> str:
        """Committed text [begin:end] (end defaults to all of it)."""
        end = self.length if end is None else end
        if begin >= end:
            return ""
        pieces, i, pos = self._pieces, len(self._pieces), self.length
        while pos > begin:  # walk back to the piece holding `begin`
            i -= 1
            pos -= len(pieces[i])
        joined = "".join(pieces[i:])
        if i == 0 and len(pieces) > 1:
            self._pieces = [joined]  # read from the start: the next such read joins only the newer pieces
        return joined[begin - pos : end - pos]

    def _commit(self, piece: str) -> None:
        self._pieces.append(piece)
        self.length += len(piece)


class StopStrings:
    """`SamplingParams.stop` strings found in one sample's text (its IncrementalDetokenizer's) as tokens arrive.

    A string counts when an occurrence ends inside the text that the newest token committed: one that lay
    wholly within the first `min_tokens` tokens does not end the sample later, and one whose last character
    is split over several tokens ends it at the token that completes the character. The scheduler calls
    `find` for every token past `min_tokens`, in order; the text is decoded once, and the outputs read it too.
    """

    __slots__ = ("stops", "detokenizer", "_max_len", "match")

    def __init__(self, stops: list[str], detokenizer: IncrementalDetokenizer) -> None:
        self.stops = stops
        self.detokenizer = detokenizer
        self._max_len = max(len(s) for s in stops)
        self.match: tuple[int, int] | None = None
        """Once a string matched: where it starts and ends in the text (character offsets)."""

    def find(self, token_ids: list[int], start: int, end: int) -> str | None:
        """The stop string ending in the text of token ``end - 1`` (output tokens start at ``start``), or None."""
        detok = self.detokenizer
        assert end - start > detok.num_tokens, "each token is checked once, in order"
        detok.update(token_ids, start, end - 1)  # tokens appended while min_tokens held the check off
        before = detok.length
        detok.update(token_ids, start, end)
        if detok.length == before:  # nothing committed: the token ends inside a character
            return None
        lo = max(0, before - self._max_len + 1)
        window = detok.text(lo)
        for s in self.stops:
            at = window.find(s, max(0, before - lo - len(s) + 1))
            if at >= 0:
                self.match = (lo + at, lo + at + len(s))
                return s
        return None

    def held_back(self) -> int:
        """How many characters at the end of the text could still begin a stop string: a streamed output
        leaves them out until later tokens complete the string (and they are cut) or rule it out."""
        detok = self.detokenizer
        tail = detok.text(max(0, detok.length - self._max_len + 1))
        for k in range(len(tail), 0, -1):  # the longest suffix that is a proper prefix of a stop string
            suffix = tail[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self.stops):
                return k
        return 0
