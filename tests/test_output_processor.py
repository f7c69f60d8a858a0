"""The output processor and the incremental detokenizer: output kinds (cumulative, delta, final-only), streamed
text from the first chunk on that concatenates to the final text across multi-byte characters split over
tokens and stop strings that span chunks, and the same through AsyncEngine.stream and /generate streaming.

The texts are made of tokens of a byte-level BPE trained here on ASCII and a little Chinese, so a CJK
character or an emoji outside the merges is several byte tokens. To emit those exact tokens, the runner's
`collect` is wrapped: the model runs as usual, and the tokens it reports are replaced by each sample's script.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections import Counter

import pytest

from conftest import replace_sampled_tokens
from rollout import AsyncEngine, Engine, EngineConfig, RequestOutputKind, SamplingParams
from rollout.detokenizer import IncrementalDetokenizer
from rollout.outputs import RequestOutput

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# 'é', '🙂', '中', '文' and '鸟' are not merged: each is 2-4 byte tokens; ' 你好' is one token
TEXT = "héllo 你好, world 🙂! 中文 ok STOP 鸟鸟 end"
OTHER = "the quick 鸟 fox 🙂🙂 stop here"


def write_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox", "stop here STOP now", "你好世界 你好"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(ckpt_factory, tmp_path_factory):
    src = ckpt_factory("qwen2", vocab_size=320, seed=8)
    dst = tmp_path_factory.mktemp("bpe_model")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    write_tokenizer(dst)
    return dst


class Script:
    """Sample `req_id` reports `tokens[req_id]` in order (then the token of "." once its script is used up);
    a sample without a script of its own ("<request_id>-<j>") reports `default[j]`."""

    def __init__(self, engine: Engine) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.default: list[list[int]] = []
        self._next: Counter = Counter()
        self._filler = engine.tokenizer.encode(".")[0]
        replace_sampled_tokens(engine, self._token)

    def _token(self, req_id: str) -> int:
        j = int(req_id.rsplit("-", 1)[1])
        script = self.tokens.get(req_id, self.default[j] if j < len(self.default) else [])
        k = self._next[req_id]
        self._next[req_id] += 1
        return script[k] if k < len(script) else self._filler


def scripted_engine(model_dir, **kw) -> tuple[Engine, Script]:
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", deterministic=True, max_num_seqs=8,
                                 num_kv_blocks=64, **kw))
    return engine, Script(engine)


@pytest.fixture(scope="module")
def scripted(model_dir):
    return scripted_engine(model_dir)


def run_steps(engine: Engine, prompt, params: SamplingParams, rid: str) -> list[RequestOutput]:
    """Every output step() returns for request `rid` (added with `params`) until it is reported finished."""
    engine.add_request(prompt, params, request_id=rid)
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def folded(deltas: list[RequestOutput]) -> RequestOutput:
    acc = RequestOutput(request_id=deltas[0].request_id, prompt=deltas[0].prompt,
                        prompt_token_ids=deltas[0].prompt_token_ids)
    for d in deltas:
        acc.add(d)
    return acc


def fields(c) -> tuple:
    return (c.index, c.token_ids, c.logprobs, c.policy_versions, c.text, c.top_logprobs, c.finish_reason, c.stop_reason)


def expected_stop(tok, ids: list[int], stop: str, include: bool) -> tuple[int, str]:
    """(tokens kept, text): the first token whose full-prefix decode contains `stop`, and the text cut there."""
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    full = tok.decode(ids[:k])
    return k, full[: full.find(stop) + (len(stop) if include else 0)]


def test_detokenizer_commits_whole_characters_only(model_dir):
    from rollout.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the text does split characters over tokens
    naive = [tok.decode(ids[:k])[len(tok.decode(ids[: k - 1])):] for k in range(1, len(ids) + 1)]
    assert any("\ufffd" in piece for piece in naive)  # decoding prefixes and diffing would emit U+FFFD
    detok = IncrementalDetokenizer(tok.decoder())
    pieces = []
    for k in range(1, len(ids) + 1):
        before = detok.length
        detok.update(ids, 0, k)
        pieces.append(detok.text(before))
        assert detok.text() == TEXT[: detok.length]  # committed text is always a prefix of the whole
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == TEXT and detok.text() == TEXT
    # a sample that ends inside a character: flush commits what the full decode has, U+FFFD included
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    partial = IncrementalDetokenizer(tok.decoder())
    partial.update(ids, 0, cut)
    partial.flush(ids, 0, cut)
    assert partial.text() == tok.decode(ids[:cut])
    fresh = IncrementalDetokenizer(tok.decoder())  # never updated: flush is one full decode
    fresh.flush(ids, 0, len(ids))
    assert fresh.text() == TEXT


def test_detokenizer_decodes_each_window_with_its_context():
    """A SentencePiece-style decoder drops the leading space of a sequence's first token: decoding each new
    token alone would lose every space, so each window is decoded after the previous window's tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world the quick brown fox"] * 20,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False))
    text = "hello world the fox"
    ids = tok.encode(text).ids
    assert "".join(tok.decode([t]) for t in ids) != text  # context-free pieces lose the spaces
    detok = IncrementalDetokenizer(tok.decode)
    for k in range(1, len(ids) + 1):
        detok.update(ids, 0, k)
        assert detok.text() == tok.decode(ids[:k])


def test_delta_outputs_concatenate_to_the_cumulative_and_final_ones(scripted):
    with pytest.raises(ValueError, match="SamplingParams.output_kind"):
        SamplingParams(output_kind=3)
    engine, script = scripted
    tok = engine.tokenizer
    scripts = [tok.encode(TEXT), tok.encode(OTHER) + [1]]  # sample 1 ends early, at EOS (1)
    assert len(scripts[1]) < len(scripts[0])
    reasons = ["length", "stop"]
    params = SamplingParams(n=2, max_tokens=len(scripts[0]), seed=5, top_logprobs=2)
    results = {}
    for kind in (DELTA, CUMULATIVE, FINAL_ONLY):
        rid = f"kinds-{kind.name}"
        for j, ids in enumerate(scripts):
            script.tokens[f"{rid}-{j}"] = ids
        results[kind] = run_steps(engine, [5, 6, 7], dataclasses.replace(params, output_kind=kind), rid)
    deltas, cumulative, final = results[DELTA], results[CUMULATIVE], results[FINAL_ONLY]
    # final-only: one output, when every sample has finished
    assert len(final) == 1 and final[0].finished
    # cumulative: every step's output holds both samples, the text so far is never None and only grows
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    for before, after in zip(cumulative, cumulative[1:]):
        for b, a in zip(before.outputs, after.outputs):
            assert isinstance(b.text, str) and a.text.startswith(b.text)
            assert a.token_ids[: len(b.token_ids)] == b.token_ids
    # delta: text from the first output on, no partial character, each sample's finish in its last delta only
    assert len(deltas) == len(cumulative) and [o.finished for o in deltas] == [o.finished for o in cumulative]
    for j, ids in enumerate(scripts):
        mine = [c for o in deltas for c in o.outputs if c.index == j]
        assert all(isinstance(c.text, str) and "\ufffd" not in c.text for c in mine)
        assert mine[0].text != ""  # 'h' and 't' are whole characters: text from the first token on
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [reasons[j]]
        assert "".join(c.text for c in mine) == tok.decode(ids) and [t for c in mine for t in c.token_ids] == ids
    assert any(len(o.outputs) == 1 for o in deltas)  # once the shorter sample is done, deltas hold the other only
    whole = folded(deltas)
    assert whole.finished and [fields(c) for c in whole.outputs] == [fields(c) for c in cumulative[-1].outputs]
    assert [fields(c) for c in final[0].outputs] == [fields(c) for c in cumulative[-1].outputs]
    # generate returns the final-only output, the text of finished samples decoded as a whole
    script.default = scripts
    generated = engine.generate([[5, 6, 7]], params)[0]
    script.default = []
    assert [fields(c) for c in generated.outputs] == [fields(c) for c in final[0].outputs]
    assert [c.text for c in generated.outputs] == [tok.decode(c.token_ids) for c in generated.outputs]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["ok ST", "鸟鸟", "中文 ok"])  # ASCII tokens; split characters last; first
def test_stop_strings_that_span_chunks(scripted, stop, include):
    engine, script = scripted
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    k, text = expected_stop(tok, ids, stop, include)
    assert k < len(ids) and len(tok.encode(stop)) > 1  # it stops early, on a string of several tokens
    params = SamplingParams(max_tokens=len(ids), seed=1, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    outs = {}
    for kind in (DELTA, CUMULATIVE, FINAL_ONLY):
        rid = f"stop-{stop}-{include}-{kind.name}"
        script.tokens[f"{rid}-0"] = ids
        outs[kind] = run_steps(engine, [5, 6, 7], dataclasses.replace(params, output_kind=kind), rid)
    final = outs[FINAL_ONLY][0].outputs[0]
    assert (final.finish_reason, final.stop_reason, final.token_ids, final.text) == ("stop", stop, ids[:k], text)
    deltas = [o.outputs[0].text for o in outs[DELTA]]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    streamed = ""
    for d, c in zip(deltas, outs[CUMULATIVE]):  # what a client has seen is never more than the final text
        streamed += d
        assert text.startswith(streamed) and c.outputs[0].text == streamed
    assert outs[CUMULATIVE][-1].outputs[0].text == text


def test_stop_string_within_min_tokens_does_not_cut_the_text(scripted):
    """A stop string among the first min_tokens tokens neither ends the sample nor truncates its text: the
    text is cut at the occurrence that ended it."""
    engine, script = scripted
    tok = engine.tokenizer
    text = "ab xx ab yy"
    ids = tok.encode(text)
    params = SamplingParams(max_tokens=len(ids), min_tokens=3, seed=1, ignore_eos=True, stop=["ab"])
    got = {}
    for kind in (DELTA, FINAL_ONLY):
        rid = f"min-{kind.name}"
        script.tokens[f"{rid}-0"] = ids
        got[kind] = run_steps(engine, [5, 6], dataclasses.replace(params, output_kind=kind), rid)
    final = got[FINAL_ONLY][0].outputs[0]
    assert final.stop_reason == "ab" and final.text == "ab xx " and tok.decode(final.token_ids) == "ab xx ab"
    assert "".join(o.outputs[0].text for o in got[DELTA]) == "ab xx "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_in_streamed_text(scripted, skip):
    engine, script = scripted
    tok = engine.tokenizer
    ids = tok.encode("hello ") + [1] + tok.encode(" 鸟 world")  # 1 = "</s>", the model's EOS (ignored here)
    rid = f"special-{skip}"
    script.tokens[f"{rid}-0"] = ids
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip, output_kind=DELTA)
    text = "".join(o.outputs[0].text for o in run_steps(engine, [5, 6], params, rid))
    assert text == tok.decode(ids, skip_special_tokens=skip) and ("</s>" in text) is not skip


def test_async_scheduling_outputs_hold_no_placeholders(model_dir):
    engine, script = scripted_engine(model_dir, async_scheduling=True)
    ids = engine.tokenizer.encode(TEXT)
    script.tokens["a-0"] = script.tokens["d-0"] = ids
    params = SamplingParams(max_tokens=len(ids), seed=2, ignore_eos=True)
    for out in run_steps(engine, [5, 6, 7], params, "a"):  # cumulative, mid-stream too
        c = out.outputs[0]
        assert -1 not in c.token_ids and len(c.token_ids) == len(c.policy_versions) == len(c.logprobs)
        assert c.token_ids == ids[: len(c.token_ids)] and TEXT.startswith(c.text)
    deltas = run_steps(engine, [5, 6, 7], dataclasses.replace(params, output_kind=DELTA), "d")
    assert [t for o in deltas for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in deltas) == TEXT


def test_abort_ends_a_delta_stream_with_what_is_new(scripted):
    engine, script = scripted
    ids = engine.tokenizer.encode(TEXT)
    script.tokens["ab-0"] = ids
    engine.add_request([5, 6], SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind=DELTA), "ab")
    deltas = []
    while len(deltas) < 7:
        deltas += [o for o in engine.step() if o.request_id == "ab"]
    deltas.append(engine.abort_request("ab"))
    last = deltas[-1].outputs[0]
    assert deltas[-1].finished and last.finish_reason == "abort" and last.token_ids == []
    assert engine.abort_request("ab") is None and "ab" not in engine.output_processor
    kept = [t for o in deltas for t in o.outputs[0].token_ids]
    assert kept == ids[:7] and "".join(o.outputs[0].text for o in deltas) == engine.tokenizer.decode(ids[:7])


def test_generate_keeps_other_callers_outputs_for_the_next_step(scripted):
    """A prompt added with add_request that finishes while generate runs is reported by the next step()."""
    engine, script = scripted
    ids = engine.tokenizer.encode(OTHER)
    script.tokens["side-0"] = ids
    engine.add_request([4, 5], SamplingParams(max_tokens=3, ignore_eos=True, output_kind=DELTA), request_id="side")
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.has_unfinished_requests()  # its output is still to be reported
    outs = [o for o in engine.step() if o.request_id == "side"]
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == ids[:3]
    assert outs[0].outputs[0].text == engine.tokenizer.decode(ids[:3])
    assert not engine.has_unfinished_requests()


def test_async_engine_stream_and_generate_stream_text(model_dir):
    engine, script = scripted_engine(model_dir)
    tok = engine.tokenizer
    ids = tok.encode(TEXT)
    for rid in ("s", "g"):
        script.tokens[f"{rid}-0"] = ids
    stop = "鸟鸟"
    params = SamplingParams(max_tokens=len(ids), seed=3, ignore_eos=True, stop=[stop])
    _, text = expected_stop(tok, ids, stop, False)

    async def main():
        with AsyncEngine(engine) as aengine:
            deltas = [o async for o in aengine.stream([5, 6], params, request_id="s")]
            whole = await aengine.generate([5, 6], params, request_id="g")
            return deltas, whole

    deltas, whole = asyncio.run(main())
    assert all(isinstance(o.outputs[0].text, str) for o in deltas) and deltas[0].outputs[0].text == "h"
    assert "".join(o.outputs[0].text for o in deltas) == whole.outputs[0].text == text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.outputs[0].token_ids


def test_generate_endpoint_streams_text_so_far(model_dir):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")

    from rollout.server import build_app
    from rollout.server_config import ServerConfig

    engine, script = scripted_engine(model_dir)
    tok = engine.tokenizer
    scripts = [tok.encode(TEXT), tok.encode(OTHER) + [1]]  # sample 1 ends at EOS (1)
    for j, ids in enumerate(scripts):
        script.tokens[f"http-{j}"] = ids
    stop = "ld 🙂"
    texts = [expected_stop(tok, scripts[0], stop, False)[1], tok.decode(scripts[1])]

    async def main():
        with AsyncEngine(engine) as aengine:
            transport = httpx.ASGITransport(app=build_app(aengine, ServerConfig()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                r = await client.post("/generate", json={"text": "hi", "rid": "http", "stream": True, "sampling_params": {
                    "n": 2, "max_new_tokens": len(scripts[0]), "stop": [stop]}})
                return r.status_code, r.text

    status, body = asyncio.run(main())
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 5 and all(isinstance(c, list) and len(c) == 2 for c in chunks)
    for j, text in enumerate(texts):
        seen = [c[j]["text"] for c in chunks]
        assert all(isinstance(t, str) and text.startswith(t) for t in seen)  # never null, never past the end
        assert seen[-1] == text and seen[0] != ""
    assert chunks[-1][0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert chunks[-1][1]["output_ids"] == scripts[1]
