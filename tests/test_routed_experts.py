"""Routing replay (R3): `SamplingParams(return_routed_experts=True)` gives each completion the experts of its
P + L - 1 input positions, the server sends them base64-encoded, and the trainer bridge hands them to the
trainer's forward.

The plumbing is checked with a probe model: a Llama (registered under its own architecture) that declares
`routed_experts_shape` and whose forward writes a known function of (token id, position, layer) into the bound
routing store, row `slot_mapping[t]`, as a MoE layer writes its top-k expert ids. Every reported row must
therefore equal that function of the token at its position in the final sequence: a row reported from the
wrong slot, a stale row, a rejected draft's row or a missing one is caught. Then end to end with the real
Qwen3-MoE / Qwen2-MoE (tiny random checkpoints written by transformers, fp32 CPU): the routed experts are the
top-k of transformers' router logits for the same tokens, and with them the deterministic trainer's logprobs
equal the engine's bitwise.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.config import SpeculativeConfig
from runner.models import ModelRegistry
from runner.models.llama import DecoderForCausalLM
from runner.testing import write_random_checkpoint

ARCH = "RoutingProbeForCausalLM"
TOP_K = 3


def probe_experts(token_ids, positions, num_layers: int) -> np.ndarray:
    """int32 [T, num_layers, TOP_K]: what the probe's layer l "routes" the token at a position to."""
    t = np.asarray(token_ids, dtype=np.int64)[:, None, None]
    p = np.asarray(positions, dtype=np.int64)[:, None, None]
    layer = np.arange(num_layers)[None, :, None]
    j = np.arange(TOP_K)[None, None, :]
    return ((t * 7919 + p * 104729 + layer * 31 + j * 1009) % 100_003).astype(np.int32)


class RoutingProbe(DecoderForCausalLM):
    """A Llama that writes `probe_experts` into the bound routing store on every paged forward (rows of padding
    tokens, slot -1, skipped) and records the `routed_experts` its dense forward gets."""

    def __init__(self, cfg, backend=None, tp=None) -> None:
        super().__init__(cfg, backend, tp)
        self.routed_store = None
        self.dense_routed = []  # routed_experts of each forward_dense call

    @property
    def routed_experts_shape(self) -> tuple[int, int]:
        return (self.config.num_layers, TOP_K)

    def bind_routed_experts(self, store) -> None:
        self.routed_store = store

    def forward_with_aux(self, input_ids, positions, meta, aux_layers=()):
        out = super().forward_with_aux(input_ids, positions, meta, aux_layers)
        if self.routed_store is not None:
            keep = meta.slot_mapping >= 0
            rows = probe_experts(input_ids.cpu().numpy(), positions.cpu().numpy(), self.config.num_layers)
            self.routed_store[meta.slot_mapping[keep]] = torch.from_numpy(rows).to(self.routed_store.device)[keep]
        return out

    def forward_dense(self, input_ids, aux_layers=(), routed_experts=None):
        self.dense_routed.append(routed_experts)
        return super().forward_dense(input_ids, aux_layers)


ModelRegistry.register_model(ARCH, RoutingProbe)


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("probe"), architecture=ARCH, vocab_size=320,
                                   hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256, std=0.3)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("dense"), vocab_size=320, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256)


def engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(**{"model": str(path), "dtype": "float32", "max_num_seqs": 8, "num_kv_blocks": 64,
                           "block_size": 4, "max_model_len": 128, **kw})


def expected(prompt: list[int], completion: list[int], num_layers: int = 2) -> np.ndarray:
    tokens = list(prompt) + list(completion)
    return probe_experts(tokens[:-1], np.arange(len(tokens) - 1), num_layers)


class Reports:
    """Every `RunnerOutput.routed_experts` the engine's runner returns, in order: (req_id, start, rows)."""

    def __init__(self, engine) -> None:
        self.items: list[tuple[str, int, np.ndarray]] = []
        real = engine.runner.collect

        def collect(handle):
            out = real(handle)
            for rid, (start, rows) in (out.routed_experts or {}).items():
                self.items.append((rid, start, rows.copy()))
            return out

        engine.runner.collect = collect

    def check(self, prompts, outs) -> dict[str, int]:
        """Every report is the probe's rows of the final tokens at its positions, and each request's reports
        run on from the previous one or restart at 0 (a recompute); every completion was reported through
        position P + L - 2. Returns the restarts per request."""
        final = {f"{o.request_id}-{c.index}": list(p) + c.token_ids for p, o in zip(prompts, outs) for c in o.outputs}
        reached, restarts = {}, {}
        for rid, start, rows in self.items:
            tokens = final[rid]
            end = start + rows.shape[0]
            assert rows.shape[0] > 0 and end <= len(tokens), (rid, start, end, len(tokens))
            if start != reached.get(rid, 0):
                assert start == 0, (rid, start, reached.get(rid))
                restarts[rid] = restarts.get(rid, 0) + 1
            reached[rid] = end
            np.testing.assert_array_equal(rows, probe_experts(tokens[start:end], np.arange(start, end), 2))
        assert {rid: reached.get(rid, 0) >= len(t) - 1 for rid, t in final.items()} == dict.fromkeys(final, True)
        return restarts


PROMPTS = [list(range(3, 3 + 13)), [5, 9, 13, 2, 7], list(range(20, 60))]


def asking(**kw) -> SamplingParams:
    return SamplingParams(return_routed_experts=True, **kw)


def check_completions(prompts, outs) -> None:
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            assert c.routed_experts.dtype == np.int32
            assert c.routed_experts.shape == (len(prompt) + len(c.token_ids) - 1, 2, TOP_K)
            np.testing.assert_array_equal(c.routed_experts, expected(prompt, c.token_ids))


def test_every_completion_carries_the_experts_of_its_input_positions(probe_dir):
    engine = Engine(engine_config(probe_dir))
    reports = Reports(engine)
    params = [asking(n=2, max_tokens=9, seed=1, ignore_eos=True), asking(max_tokens=1, seed=2, ignore_eos=True),
              asking(temperature=0, max_tokens=30, stop_token_ids=list(range(0, 96, 5)))]
    outs = engine.generate(PROMPTS, params)
    check_completions(PROMPTS, outs)
    assert reports.check(PROMPTS, outs) == {}
    assert {len(c.token_ids) for o in outs for c in o.outputs} >= {9, 1}
    # the samples of one prompt share its full blocks, and with them those positions' rows
    a, b = outs[0].outputs
    np.testing.assert_array_equal(a.routed_experts[: len(PROMPTS[0])], b.routed_experts[: len(PROMPTS[0])])


def test_prefix_cache_hits_are_reported_from_the_cached_blocks_on_the_first_step(probe_dir):
    engine = Engine(engine_config(probe_dir))
    engine.generate([PROMPTS[2]], asking(max_tokens=4, seed=3, ignore_eos=True))
    reports = Reports(engine)
    outs = engine.generate([PROMPTS[2] + [7, 8]], asking(max_tokens=5, seed=4, ignore_eos=True))
    cached = outs[0].num_cached_prompt_tokens
    assert cached >= 36  # the whole blocks of the first prompt
    check_completions([PROMPTS[2] + [7, 8]], outs)
    reports.check([PROMPTS[2] + [7, 8]], outs)
    rid, start, rows = reports.items[0]
    assert start == 0 and rows.shape[0] == len(PROMPTS[2]) + 2  # cached positions and the computed ones at once


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=8),  # chunked prefill: steps where nothing samples still report
    dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=16),  # preemption by recompute
    dict(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=12, async_scheduling=True),
])
def test_chunked_prefill_preemption_and_async_scheduling_report_every_position(probe_dir, kw):
    engine = Engine(engine_config(probe_dir, **kw))
    reports = Reports(engine)
    params = [asking(n=2, max_tokens=20, seed=1, ignore_eos=True), asking(max_tokens=25, seed=2, ignore_eos=True),
              asking(max_tokens=20, seed=5, stop_token_ids=list(range(0, 96, 9)))]
    outs = engine.generate(PROMPTS, params)
    check_completions(PROMPTS, outs)
    restarts = reports.check(PROMPTS, outs)
    preempted = {f"{o.request_id}-{c.index}": c.num_preemptions for o in outs for c in o.outputs if c.num_preemptions}
    assert restarts == preempted  # each recompute is sent again from position 0, and only then
    if kw.get("num_kv_blocks"):
        assert preempted
    else:  # the long prompt's chunks were reported before it sampled
        long = f"{outs[2].request_id}-0"
        assert any(start + len(rows) < len(PROMPTS[2]) for rid, start, rows in reports.items if rid == long)


def test_speculative_decoding_reports_only_accepted_positions(probe_dir):
    engine = Engine(engine_config(probe_dir, num_kv_blocks=128,
                                  speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=3)))
    engine.spec_controller.auto_off = False
    reports = Reports(engine)
    prompts = PROMPTS * 2
    outs = engine.generate(prompts, [asking(max_tokens=24, seed=s, ignore_eos=True) for s in range(len(prompts))])
    hist = engine.spec_decode_stats["acceptance_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # rejected drafts (whose rows must not be sent) and accepted ones
    check_completions(prompts, outs)
    assert reports.check(prompts, outs) == {}


def test_requests_that_do_not_ask_get_nothing_and_cost_no_gather(probe_dir):
    engine = Engine(engine_config(probe_dir))
    calls = []
    real = engine.runner.routed_launch
    engine.runner.routed_launch = lambda gather, final=True: calls.append(gather.req_ids) or real(gather, final)
    reports = Reports(engine)
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=5, seed=1, ignore_eos=True))
    assert all(c.routed_experts is None for o in outs for c in o.outputs)
    assert not calls and not reports.items
    outs = engine.generate(PROMPTS[:2], [asking(max_tokens=5, seed=1, ignore_eos=True),
                                         SamplingParams(max_tokens=5, seed=1, ignore_eos=True)])
    assert outs[1].outputs[0].routed_experts is None
    asked = f"{outs[0].request_id}-0"
    assert calls and all(ids == [asked] for ids in calls) and {rid for rid, _, _ in reports.items} == {asked}


def test_dense_model_or_store_off_refuses_the_request(probe_dir, dense_dir):
    dense = Engine(engine_config(dense_dir))
    assert dense.routed_experts_shape is None and dense.runner.routed_store is None
    with pytest.raises(ValueError, match="return_routed_experts: .*dense model"):
        dense.add_request([1, 2, 3], asking())
    with pytest.raises(ValueError, match="return_routed_experts: .*dense model"):
        dense.generate([[1, 2, 3], [4, 5]], [SamplingParams(), asking()])
    assert not dense.has_unfinished_requests()  # nothing was queued
    off = Engine(engine_config(probe_dir, enable_return_routed_experts=False))
    assert off.routed_experts_shape is None and off.runner.routed_store is None
    with pytest.raises(ValueError, match="return_routed_experts: .*enable_return_routed_experts is False"):
        off.add_request([1, 2, 3], asking())
    assert not off.has_unfinished_requests()
    with pytest.raises(ValueError, match="SamplingParams.return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts=1)


def test_the_store_lives_with_the_kv_cache_and_is_counted_in_its_sizing(probe_dir):
    on = Engine(engine_config(probe_dir, num_kv_blocks=None, kv_cache_bytes=200_000))
    off = Engine(engine_config(probe_dir, num_kv_blocks=None, kv_cache_bytes=200_000, enable_return_routed_experts=False))
    assert on.routed_experts_shape == (2, TOP_K)
    per_block = on.runner.kv_bytes_per_block()
    assert per_block - off.runner.kv_bytes_per_block() == 4 * 2 * TOP_K * 4  # block_size rows of int32 [L, k]
    assert on.num_kv_blocks == 200_000 // per_block < off.num_kv_blocks
    store = on.runner.routed_store
    assert store.dtype == torch.int32 and store.shape == (on.num_kv_blocks * 4 + 1, 2, TOP_K)
    assert on.runner.model.routed_store is store
    on.sleep(1)
    assert on.runner.routed_store is None and on.runner.model.routed_store is None
    on.wake_up()
    store = on.runner.routed_store
    assert store.shape == (on.num_kv_blocks * 4 + 1, 2, TOP_K) and on.runner.model.routed_store is store
    outs = on.generate(PROMPTS, asking(max_tokens=6, seed=1, ignore_eos=True))
    check_completions(PROMPTS, outs)


def test_a_samples_rows_grow_as_reported_and_a_recompute_overwrites_them():
    from rollout.request import RoutedExperts

    rows = RoutedExperts(2, TOP_K, capacity=2)
    first, again = probe_experts(range(7), range(7), 2), probe_experts(range(50, 57), range(7), 2)
    rows.write(0, first[:2])
    rows.write(2, first[2:7])  # past the capacity: grown, the earlier rows kept
    np.testing.assert_array_equal(rows.first(100), first)
    np.testing.assert_array_equal(rows.first(4), first[:4])
    rows.write(0, again[:3])  # a recompute from 0: the later rows are stale until reported again
    np.testing.assert_array_equal(rows.first(100), again[:3])
    with pytest.raises(AssertionError):
        rows.write(4, again[4:])  # a gap: reports run on or restart lower


def test_cumulative_and_delta_outputs(probe_dir):
    from rollout import RequestOutput
    from rollout.sampling_params import RequestOutputKind

    engine = Engine(engine_config(probe_dir, max_num_batched_tokens=8))
    prompt = PROMPTS[0]
    engine.add_request(prompt, asking(n=2, max_tokens=6, seed=1, ignore_eos=True), request_id="c")
    engine.add_request(prompt, asking(n=2, max_tokens=6, seed=1, ignore_eos=True,
                                      output_kind=RequestOutputKind.DELTA), request_id="d")
    cumulative, deltas = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            (cumulative if out.request_id == "c" else deltas).append(out)
    waited = False
    for out in cumulative:  # every cumulative output: the rows so far
        for c in out.outputs:
            if c.token_ids:
                np.testing.assert_array_equal(c.routed_experts, expected(prompt, c.token_ids))
            else:  # a sample still computing its prompt: the positions computed so far
                waited = True
                rows = c.routed_experts
                assert rows.shape[0] < len(prompt) - 1
                np.testing.assert_array_equal(rows, expected(prompt, [0])[: rows.shape[0]])
    assert waited
    carried = [c.finished for out in deltas for c in out.outputs if c.routed_experts is not None]
    assert carried == [True, True]  # a delta output carries them in each sample's last delta only
    folded = RequestOutput(request_id="d", prompt=None, prompt_token_ids=prompt)
    for out in deltas:
        folded.add(out)
    assert len(folded.outputs) == 2 and len(cumulative[-1].outputs) == 2
    for c, whole in zip(folded.outputs, cumulative[-1].outputs):
        assert c.token_ids == whole.token_ids
        np.testing.assert_array_equal(c.routed_experts, whole.routed_experts)


# ---- the HTTP server ----------------------------------------------------------------------------------------
def decoded(b64: str, shape=(-1, 2, TOP_K)) -> np.ndarray:
    """What a client (slime) does with SGLang's `routed_experts`: base64 -> int32 bytes -> [n, L_moe, k]."""
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(shape)


@pytest.fixture(scope="module")
def chat_probe_dir(probe_dir, tmp_path_factory):
    from server_harness import chat_model_dir

    return chat_model_dir(probe_dir, tmp_path_factory.mktemp("probe_chat"), 320)


def server_events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "[DONE]", events
    return [__import__("json").loads(e) for e in events[:-1]]


def test_server_sends_routed_experts_base64_as_sglang_and_openai_extensions(chat_probe_dir):
    httpx = pytest.importorskip("httpx")
    from rollout import AsyncEngine
    from server_harness import LiveServer

    prompt = PROMPTS[0]
    sampling = {"max_new_tokens": 6, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    with LiveServer(AsyncEngine(engine_config(chat_probe_dir))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/generate", json={"input_ids": prompt, "return_routed_experts": True, "sampling_params": sampling})
        assert r.status_code == 200, r.text
        for result in r.json():
            np.testing.assert_array_equal(decoded(result["meta_info"]["routed_experts"]),
                                          expected(prompt, result["output_ids"]))
        r = client.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
        assert all("routed_experts" not in result["meta_info"] for result in r.json())
        # streamed: the last result carries them, the earlier ones do not
        chunks = server_events(client, "/generate", {"input_ids": prompt, "stream": True, "return_routed_experts": True,
                                                     "sampling_params": {**sampling, "n": 1}})
        assert len(chunks) > 2 and ["routed_experts" in c["meta_info"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
        np.testing.assert_array_equal(decoded(chunks[-1]["meta_info"]["routed_experts"]),
                                      expected(prompt, chunks[-1]["output_ids"]))

        # OpenAI completions: each choice's routed_experts and routed_experts_shape (streamed: its last chunk)
        body = {"prompt": prompt, "max_tokens": 5, "n": 2, "seed": 1, "ignore_eos": True, "return_token_ids": True,
                "return_routed_experts": True}
        choices = client.post("/v1/completions", json=body).json()["choices"]
        assert len(choices) == 2
        for choice in choices:
            assert choice["routed_experts_shape"] == [len(prompt) + 5 - 1, 2, TOP_K]
            np.testing.assert_array_equal(decoded(choice["routed_experts"], choice["routed_experts_shape"]),
                                          expected(prompt, choice["token_ids"]))
        plain = client.post("/v1/completions", json={**body, "return_routed_experts": False}).json()["choices"]
        assert all("routed_experts" not in c and "routed_experts_shape" not in c for c in plain)
        chunks = server_events(client, "/v1/completions", {**body, "n": 1, "stream": True})
        carrying = [c["choices"][0] for c in chunks if "routed_experts" in c["choices"][0]]
        assert len(carrying) == 1 and carrying[0]["finish_reason"] == "length"
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        np.testing.assert_array_equal(decoded(carrying[0]["routed_experts"], carrying[0]["routed_experts_shape"]),
                                      expected(prompt, tokens))

        # OpenAI chat: the rendered prompt's positions first
        messages = [{"role": "user", "content": "what is the weather in Paris today?"}]
        body = {"messages": messages, "max_tokens": 4, "seed": 2, "ignore_eos": True, "return_token_ids": True,
                "return_routed_experts": True}
        response = client.post("/v1/chat/completions", json=body).json()
        (choice,) = response["choices"]
        np.testing.assert_array_equal(decoded(choice["routed_experts"], choice["routed_experts_shape"]),
                                      expected(response["prompt_token_ids"], choice["token_ids"]))
        chunks = server_events(client, "/v1/chat/completions", {**body, "stream": True})
        carrying = [c["choices"][0] for c in chunks if c["choices"] and "routed_experts" in c["choices"][0]]
        assert len(carrying) == 1 and carrying[0]["finish_reason"] == "length"
        np.testing.assert_array_equal(decoded(carrying[0]["routed_experts"], carrying[0]["routed_experts_shape"]),
                                      decoded(choice["routed_experts"], choice["routed_experts_shape"]))

        # refused like any other bad field: 400 in OpenAI's shape, naming the field
        for path, bad in [("/generate", {"input_ids": prompt, "return_routed_experts": "yes"}),
                          ("/v1/completions", {"prompt": prompt, "return_routed_experts": 1}),
                          ("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0,
                                               "return_routed_experts": True})]:
            r = client.post(path, json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts", r.text
            assert "return_routed_experts" in r.json()["error"]["message"]


def test_server_of_a_dense_model_refuses_return_routed_experts(dense_dir):
    httpx = pytest.importorskip("httpx")
    from rollout import AsyncEngine
    from server_harness import LiveServer

    with LiveServer(AsyncEngine(engine_config(dense_dir))) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for path, body in [("/generate", {"input_ids": [1, 2, 3], "return_routed_experts": True}),
                           ("/v1/completions", {"prompt": [1, 2, 3], "return_routed_experts": True})]:
            r = client.post(path, json=body)
            error = r.json()["error"]
            assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
            assert error["param"] == "return_routed_experts" and "dense model" in error["message"]
        r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


# ---- the trainer bridge ------------------------------------------------------------------------------------
def test_bridge_batches_carry_the_experts_aligned_and_padded_and_the_losses_replay_them(probe_dir):
    from trainer_bridge import TrainerBridge, TrainingModel, grpo, ppo
    from trainer_bridge.config import RLConfig

    engine = Engine(engine_config(probe_dir))
    bridge = TrainerBridge(engine)
    assert bridge.routed_experts  # on by default: the engine's model routes
    batch = bridge.rollout(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=1, stop_token_ids=list(range(0, 320, 11))))
    for s in batch.samples:
        np.testing.assert_array_equal(s.routed_experts, probe_experts(s.token_ids[:-1], np.arange(len(s.token_ids) - 1), 2))
    padded = batch.padded()
    b, width = padded.input_ids.shape
    routed = padded.routed_experts
    assert routed.dtype == torch.int32 and routed.shape == (b, width - 1, 2, TOP_K)
    assert min(len(s.token_ids) for s in batch.samples) < width  # some rows are padded
    for i, s in enumerate(batch.samples):
        n = len(s.token_ids)
        assert torch.equal(routed[i, : n - 1], torch.from_numpy(s.routed_experts))
        assert torch.equal(routed[i, n - 1 :], torch.arange(TOP_K, dtype=torch.int32).expand(width - n, 2, TOP_K))

    policy = TrainingModel.from_pretrained(probe_dir)
    logp = policy.token_logprobs(padded.input_ids, routed_experts=routed)
    assert logp.shape == (b, width - 1) and policy.model.dense_routed[-1] is routed
    for bad, what in [(routed[:, :-1], "shape"), (routed.float(), "dtype"), (routed[..., :2], "top_k")]:
        with pytest.raises(ValueError, match=r"routed_experts must be an integer tensor \[B, T - 1, num_moe_layers, top_k\]"):
            policy.token_logprobs(padded.input_ids, routed_experts=bad)
    # the losses hand them to every forward of the batch
    rl = RLConfig()
    policy.model.dense_routed.clear()
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    grpo.update(policy, None, opt, padded, torch.randn(b), rl, bridge)
    assert policy.model.dense_routed and all(r is routed for r in policy.model.dense_routed)
    policy.model.dense_routed.clear()
    model = ppo.PolicyWithValue(policy)
    ppo.update(model, torch.optim.SGD(model.parameters(), lr=0.0), padded, torch.randn(b), rl, bridge)
    assert len(policy.model.dense_routed) == 1 + rl.epochs_per_batch and all(r is routed for r in policy.model.dense_routed)

    off = TrainerBridge(engine, routed_experts=False).rollout(PROMPTS, SamplingParams(max_tokens=3, seed=1))
    assert all(s.routed_experts is None for s in off.samples) and off.padded().routed_experts is None
    policy.model.dense_routed.clear()
    grpo.update(policy, None, opt, off.padded(), torch.randn(len(off.samples)), rl, bridge)
    assert policy.model.dense_routed == [None]


def test_bridge_and_trainer_of_a_dense_model(dense_dir):
    from trainer_bridge import TrainerBridge, TrainingModel

    engine = Engine(engine_config(dense_dir))
    assert not TrainerBridge(engine).routed_experts
    with pytest.raises(ValueError, match="return_routed_experts: .*dense model"):
        TrainerBridge(engine, routed_experts=True).rollout(PROMPTS, SamplingParams(max_tokens=3))
    dense = TrainingModel.from_pretrained(dense_dir)
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(ValueError, match="routed_experts: DecoderForCausalLM has no MoE layers"):
        dense.token_logprobs(ids, routed_experts=torch.zeros(1, 4, 2, TOP_K, dtype=torch.int32))
    assert dense.token_logprobs(ids).shape == (1, 4)


def store_shape(runner):
    return None if runner.routed_store is None else list(runner.routed_store.shape)


def test_tensor_parallel_engine_reports_from_rank_0s_store(probe_dir, single_thread):
    with Engine(engine_config(probe_dir, tensor_parallel_size=2)) as engine:
        assert engine.collective_rpc("test_routed_experts:store_shape") == [[64 * 4 + 1, 2, TOP_K], None]
        outs = engine.generate(PROMPTS, asking(n=2, max_tokens=5, seed=1, ignore_eos=True))
    check_completions(PROMPTS, outs)


# ---- end to end: Qwen3-MoE and Qwen2-MoE against transformers' router ----------------------------------------
MOE_VARIANTS = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "num_hidden_layers": 4, "mlp_only_layers": [1],
                   "decoder_sparse_step": 2}),  # one sparse layer (3) of four
    ("qwen2_moe", {}),
]
MOE_PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [7] * 18]


def hf_router_probs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), num_moe_layers, E] float32: transformers' router softmax at every position."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits  # per sparse layer [T, E]
    return torch.stack([lg.float().softmax(-1) for lg in logits], dim=1)


def assert_transformers_top_k(hf, tokens: list[int], routed: np.ndarray, top_k: int) -> None:
    """`routed` [len(tokens) - 1, L_moe, k] are the top-k experts of transformers' router for these tokens, most
    probable first: exactly where the router's k + 1 largest probabilities stand apart by more than float32
    noise between two implementations (1e-5), and up to such near-ties everywhere."""
    probs = hf_router_probs(hf, tokens)[: len(tokens) - 1]  # the last token's routing is never an input
    assert routed.shape == (probs.shape[0], probs.shape[1], top_k)
    top = probs.topk(top_k + 1, dim=-1)
    ids = torch.from_numpy(routed).long()
    torch.testing.assert_close(probs.gather(-1, ids), top.values[..., :top_k], atol=1e-5, rtol=0)
    clear = (top.values[..., :-1] - top.values[..., 1:]).min(-1).values > 1e-5  # [T-1, L_moe]
    assert clear.float().mean() > 0.9  # near-ties are rare, so the exact check below covers most positions
    assert torch.equal(ids[clear], top.indices[..., :top_k][clear])


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=lambda v: v[0] + ("-" + "-".join(sorted(v[1])) if v[1] else ""))
@pytest.mark.parametrize("engine_kw", [
    {},
    dict(max_num_batched_tokens=8, num_kv_blocks=20, block_size=4, async_scheduling=True),  # chunks, preemption
], ids=["plain", "chunked-preempted-async"])
def test_moe_routed_experts_are_transformers_router_top_k(ckpt_factory, variant, engine_kw):
    from conftest import load_hf

    family, overrides = variant
    path = ckpt_factory(family, **overrides)
    hf = load_hf(path)
    engine = Engine(EngineConfig(**{"model": str(path), "dtype": "float32", "max_num_seqs": 8, "num_kv_blocks": 64,
                                    **engine_kw}))
    num_moe_layers = 1 if overrides.get("mlp_only_layers") else 2
    assert engine.routed_experts_shape == (num_moe_layers, 2)
    params = [asking(n=2, max_tokens=12, seed=3, ignore_eos=True), asking(temperature=0, max_tokens=16, ignore_eos=True),
              asking(max_tokens=10, seed=4, ignore_eos=True)]
    outs = engine.generate(MOE_PROMPTS, params)
    if engine_kw:
        assert engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(MOE_PROMPTS, outs):
        for c in out.outputs:
            assert_transformers_top_k(hf, prompt + c.token_ids, c.routed_experts, 2)
    engine.close()


def test_moe_replay_makes_the_deterministic_trainer_equal_the_engine_bitwise(ckpt_factory, record_property):
    """Deterministic mode, a batched engine run (chunks, preemption) against the trainer's padded batch forward
    with the rollout's experts: logprobs equal bitwise. Without replay the trainer routes by itself; how many
    (position, layer) pairs then pick other experts than the engine did is reported (`routed_differently`)."""
    from trainer_bridge import TrainerBridge, TrainingModel

    path = ckpt_factory("qwen3_moe", seed=5)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", deterministic=True, max_num_seqs=6,
                                 max_num_batched_tokens=7, block_size=4, num_kv_blocks=16))
    bridge = TrainerBridge(engine)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
    batch = bridge.rollout(prompts, SamplingParams(n=2, max_tokens=16, seed=7, ignore_eos=True))
    assert engine.scheduler.stats.num_preemptions > 0
    padded = batch.padded()
    trainer = TrainingModel.from_pretrained(path, dtype="float32", deterministic=True)
    mask = padded.loss_mask[:, 1:].bool()
    with torch.no_grad():
        replayed = trainer.token_logprobs(padded.input_ids, routed_experts=padded.routed_experts)
        own = []
        hooks = [b.register_forward_hook(lambda m, a, o: own.append(m.route(a[0].reshape(-1, a[0].shape[-1]),
                                                                              tuple(a[0].shape[:-1]))[1]))
                 for b in trainer.model.sparse_blocks]
        trainer.token_logprobs(padded.input_ids)
        for h in hooks:
            h.remove()
    assert torch.equal(replayed[mask], padded.logprobs[:, 1:][mask])
    b, t = padded.input_ids.shape
    trainer_routing = torch.stack([ids.view(b, t, -1) for ids in own], dim=2)[:, :-1]  # [B, T-1, L_moe, k]
    valid = torch.zeros(b, t - 1, dtype=torch.bool)
    for i, s in enumerate(batch.samples):
        valid[i, : len(s.token_ids) - 1] = True
    differ = (trainer_routing.to(torch.int32) != padded.routed_experts).any(-1)[valid]  # [positions, L_moe]
    record_property("routed_differently", f"{int(differ.sum())} of {differ.numel()} (position, layer) pairs")
    print(f"without replay: {int(differ.sum())} of {differ.numel()} (position, layer) pairs route differently")
