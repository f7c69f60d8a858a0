"""LoRA adapters under speculative decoding: the target verifies each row's drafts with that row's adapter (the
drafter has none: an adapter can only lower acceptance), eagerly and through the static-shape step of
runner/spec_decode/graphs.py (run eagerly on the CPU, with its LoRA variant)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from rollout import Engine, SamplingParams, SpeculativeConfig
from test_lora_engine import config, hf_greedy, peft_model, slot_of, write_adapters

SPEC = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
PROMPTS = [[2, 5, 3], [7, 1, 4, 4, 6], [3, 3], [6, 2, 5, 1]]
LORAS = [None, "a", "b", "a"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Vocabulary 8: random drafts are often accepted, so verification runs over accepted and rejected drafts."""
    return make_checkpoint(tmp_path_factory.mktemp("lora_spec"), "llama", seed=11, vocab_size=8)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return write_adapters(base, tmp_path_factory.mktemp("lora_spec_adapters"), ("a", "b"))


def engine_with(base, adapters, spec: SpeculativeConfig | None, static: bool = False) -> Engine:
    """An engine with adapters a and b loaded; `static`: its uniform speculative steps take graphs.py's
    static-shape path (run eagerly)."""
    engine = Engine(config(base, speculative=spec, max_model_len=64))
    if engine.spec_controller is not None:
        engine.spec_controller.auto_off = False
    if static:
        from runner.spec_decode.graphs import SpecDecodeGraphs

        engine.runner.spec.graphs = SpecDecodeGraphs(engine.runner.spec, capture=False)
    for name in ("a", "b"):
        engine.load_lora(name, str(adapters[name]))
    return engine


@pytest.fixture(scope="module")
def plain(base, adapters):
    return engine_with(base, adapters, None)


def test_greedy_with_adapters_equals_the_plain_engine_and_peft(base, adapters, plain):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, lora=lora) for lora in LORAS]
    spec = engine_with(base, adapters, SPEC)
    got, want = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    for g, w, lora in zip(got, want, LORAS):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].lora == lora
        assert max(abs(u - v) for u, v in zip(g.outputs[0].logprobs, w.outputs[0].logprobs)) < 1e-4
    assert got[1].outputs[0].token_ids == hf_greedy(peft_model(base, adapters["a"]), PROMPTS[1], 16)
    base_tokens = spec.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert base_tokens[0].outputs[0].token_ids != got[1].outputs[0].token_ids  # the adapter changes the tokens
    hist = spec.spec_decode_stats["acceptance_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # drafts were both rejected and accepted under the adapters


def test_sampled_logprobs_are_the_adapters(base, adapters, plain):
    """Temperature-1 samples of a speculative engine report, for every token, its logprob under the row's adapter
    (scored by the plain engine's full-sequence forward with that adapter), accepted drafts and resampled tokens
    alike."""
    spec = engine_with(base, adapters, SPEC)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=40 + i, n=2, lora=lora)
              for i, lora in enumerate(LORAS)]
    for prompt, lora, out in zip(PROMPTS, LORAS, spec.generate(PROMPTS, params)):
        slot = -1 if lora is None else slot_of(plain, lora)
        for sample in out.outputs:
            tokens = prompt + sample.token_ids
            logits = plain.runner.full_sequence_logits(tokens, lora_slot=slot)  # [len, V]
            scored = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1].gather(
                1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), scored, rtol=0, atol=1e-4)
    assert sum(spec.spec_decode_stats["acceptance_histogram"][1:]) > 0


def test_static_step_with_adapters_equals_the_eager_step(base, adapters):
    """Uniform steps with adapter rows take the static path's LoRA variant, steps without take the other, and
    both give the eager speculative runner's tokens and acceptance counts."""
    params = [SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=7 + i, lora=lora)
              for i, lora in enumerate(LORAS)]
    base_only = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3)] * 2

    def run(engine):
        outs = engine.generate(PROMPTS, params) + engine.generate(PROMPTS[:2], base_only)
        return [(o.token_ids, o.spec_decode_stats, o.lora) for r in outs for o in r.outputs]

    static = engine_with(base, adapters, SPEC, static=True)
    got = run(static)
    assert got == run(engine_with(base, adapters, SPEC))
    steps = static.runner.spec.graphs.num_steps
    assert sum(n for (_, _, lora), n in steps.items() if lora) > 0
    assert sum(n for (_, _, lora), n in steps.items() if not lora) > 0
