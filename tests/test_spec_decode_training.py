"""Online drafter training on a toy target: a small model trained on counting patterns, then EAGLE and
MTP drafters distilled from the engine's own rollouts reach a mean acceptance length >= 2 at k = 4."""

from __future__ import annotations

import json

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from runner.spec_decode.training import train_drafter
from bench.toy_target import counting_corpus, train_toy_target

VOCAB = 32


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory):
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on shared CPUs
    return train_toy_target(tmp_path_factory.mktemp("toy"), seconds=12.0, vocab_size=VOCAB)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_online_training_reaches_acceptance_length_2(toy_target, method):
    path, target_loss = toy_target
    assert target_loss < 0.5, target_loss  # the target learned the patterns
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=32, num_kv_blocks=256, block_size=8,
                                 speculative=SpeculativeConfig(method=method, num_speculative_tokens=4)))
    engine.spec_controller.auto_off = False
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)

    def prompts():
        return [row[:3].tolist() for row in counting_corpus(32, 3, VOCAB, gen)]

    before = engine.generate(prompts(), params)
    untrained = _mean_acceptance(before)
    stats = train_drafter(engine, num_steps=80, batch_size=16, lr=5e-3)
    assert stats["loss_last"] < stats["loss_first"]
    after = engine.generate(prompts(), params)
    trained = _mean_acceptance(after)
    print(json.dumps({"method": method, "untrained": untrained, "trained": trained, **stats}))
    assert trained >= 2.0 and trained > untrained


def _mean_acceptance(outs) -> float:
    acc = sum(o.spec_decode_stats["num_accepted_tokens"] for out in outs for o in out.outputs)
    steps = sum(o.spec_decode_stats["num_spec_steps"] for out in outs for o in out.outputs)
    return 1.0 + acc / steps
