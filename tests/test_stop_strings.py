"""Stop strings: a completion ends at the first token whose text completes one of `SamplingParams.stop`
(after min_tokens); tokens and logprobs keep that token, the text ends before the string. Checked against
an oracle that detokenizes every output prefix in full, on the toy task's character tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.tokenizer import Tokenizer
from trainer_bridge import toy_task

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+55="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return toy_task.write_model(tmp_path_factory.mktemp("stop_toy"), hidden_size=32, num_layers=2, seed=3)


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=16, num_kv_blocks=64, **kw))


def oracle_stop(tok: Tokenizer, ids: list[int], stops: list[str], min_tokens: int) -> tuple[int, str] | None:
    """(number of tokens kept, matched string): the first k > min_tokens whose full-prefix text has an
    occurrence ending within token k's text."""
    for k in range(min_tokens + 1, len(ids) + 1):
        text, before = tok.decode(ids[:k]), len(tok.decode(ids[: k - 1]))
        for s in stops:
            if text.find(s, max(0, before - len(s) + 1)) >= 0:
                return k, s
    return None


def stops_from(texts: list[str]) -> list[str]:
    """Two-character strings that occur in the unconstrained completions, some early and some late."""
    found = {t[i : i + 2] for t in texts for i in (3, 9) if len(t) >= i + 2}
    return sorted(found)[:3]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_strings_end_completions_like_the_full_prefix_oracle(model_dir, async_scheduling):
    engine = engine_for(model_dir, async_scheduling=async_scheduling)
    tok = engine.tokenizer
    free = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)
    unconstrained = engine.generate(PROMPTS, free)
    stops = stops_from([c.text for o in unconstrained for c in o.outputs])
    assert stops
    for min_tokens in (0, 6):
        params = dataclasses.replace(free, stop=stops, min_tokens=min_tokens)
        outs = engine.generate(PROMPTS, params)
        num_stopped = 0
        for base, out in zip(unconstrained, outs):
            for b, c in zip(base.outputs, out.outputs):
                hit = oracle_stop(tok, b.token_ids, stops, min_tokens)
                if hit is None:  # seeded: the same tokens as without stop strings
                    assert (c.token_ids, c.finish_reason, c.stop_reason) == (b.token_ids, "length", None)
                    continue
                k, s = hit
                num_stopped += 1
                assert c.token_ids == b.token_ids[:k] and c.logprobs == b.logprobs[:k]
                assert (c.finish_reason, c.stop_reason) == ("stop", s)
                full = tok.decode(c.token_ids)
                assert c.text == full[: full.find(s)] and s not in c.text
        assert num_stopped >= 3


def test_include_stop_str_in_output_and_validation(model_dir, ckpt_factory):
    engine = engine_for(model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text = engine.generate(PROMPTS[:1], greedy)[0].outputs[0].text
    stop = text[4:6]
    out = engine.generate(PROMPTS[:1], dataclasses.replace(greedy, stop=stop, include_stop_str_in_output=True))
    c = out[0].outputs[0]
    assert c.stop_reason == stop and c.text.endswith(stop) and text.startswith(c.text)
    assert SamplingParams(stop="ab").stop == ["ab"]
    for bad in ([""], [3], ["ok", None]):
        with pytest.raises(ValueError, match="SamplingParams.stop"):
            SamplingParams(stop=bad)
    no_tokenizer = Engine(EngineConfig(model=str(ckpt_factory("llama", seed=2)), dtype="float32", num_kv_blocks=16))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        no_tokenizer.generate([[3, 4, 5]], SamplingParams(stop=["x"]))
