"""Shared fixtures: tiny random-weight checkpoints written by transformers (the oracle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _blas_free_interpreter_dot() -> None:
    """Under TRITON_INTERPRET=1, `tl.dot` of floats without BLAS. The interpreter computes a dot with numpy's
    matmul, whose BLAS picks its kernels by the operands' shapes and alignment (OpenBLAS on some AVX-512 CPUs), so
    a row's bits could change with the rows beside it; on the GPU an mma's row depends on that row alone, which the
    batch-invariance tests of the kernels rely on. Here the products are summed in float64 in a fixed order
    (`np.einsum` without BLAS), then rounded to the accumulator's dtype and added to it as before."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (np.issubdtype(a.data.dtype, np.floating) and np.issubdtype(d.data.dtype, np.floating)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.einsum("...ik,...kj->...ij", a.data.astype(np.float64), b.data.astype(np.float64), optimize=False)
        return interpreter.TensorHandle(exact.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _blas_free_interpreter_dot()

_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # tiny sparse blocks


def make_checkpoint(path: Path, family: str = "llama", *, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Write a random-weight transformers model of `family` to `path`; returns the path."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in _FAMILIES[family])
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    if family in ("qwen3", "mistral", "qwen3_moe"):
        kwargs["head_dim"] = 16
    if family.endswith("_moe"):
        kwargs.update(_MOE, norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = 48
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.save_pretrained(path)
    return path


def load_hf(path: Path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def variant_id(variant) -> str:
    """A readable pytest id of a (family, overrides) model variant."""
    family, overrides = variant
    return family + ("-" + "-".join(sorted(overrides)) if overrides else "")


def assert_engine_holds(engine, state: dict[str, torch.Tensor]) -> None:
    """The engine's weights equal `state` (checkpoint name -> tensor, cast to the engine dtype) bit for bit."""
    for name, t in state.items():
        view = engine.runner.weights.view(name)
        bits = {2: torch.int16, 4: torch.int32}[view.element_size()]
        assert torch.equal(view.reshape(-1).view(bits), t.to(view.dtype).reshape(-1).view(bits)), name


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(family: str = "llama", **overrides) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt_{family}")
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return factory


# A weight update touching every kind of tensor placement under tensor parallelism: sharded by rows,
# sharded by columns, vocab-sharded (tied embedding), replicated kv heads, replicated.
TP_DENSE_NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                  "model.embed_tokens.weight", "model.norm.weight")
TP_PATCH_NAMES = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight",
                  "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.bias")


def update_records(weights, *, as_dtype: torch.dtype | None = None, seed: int = 0) -> list:
    """Dense records moving TP_DENSE_NAMES by 0.05 * N(0, 1) and patches moving a random quarter of each
    TP_PATCH_NAMES tensor by 0.2 * N(0, 1), in full checkpoint coordinates, from a single-process engine's
    `CheckpointWeights`. New values are computed in float32 and rounded to the weights' dtype; `as_dtype`
    states the same update in another dtype (for an engine that holds the weights in it)."""
    from weight_updates import Dense, PackedIndices, Patch, checksum

    def rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = values.to(dtype)
        return values if as_dtype is None else values.to(as_dtype)

    g = torch.Generator().manual_seed(seed)
    records = []
    for name in TP_DENSE_NAMES:
        old = weights.view(name).cpu()
        records.append(Dense.of(name, rounded(old.float() + 0.05 * torch.randn(old.shape, generator=g), old.dtype)))
    for name in TP_PATCH_NAMES:
        old = weights.view(name).cpu().reshape(-1)
        new = old.float()
        idx = torch.randperm(new.numel(), generator=g)[: new.numel() // 4].sort().values
        new[idx] += 0.2 * torch.randn(idx.numel(), generator=g)
        new = rounded(new, old.dtype)
        records.append(Patch(name=name, indices=PackedIndices.encode(idx), values=new[idx].clone(), checksum=checksum(new)))
    return records


# ---- tensor parallelism on the CPU (gloo): one small model and engine config for the TP test files ----------
TP_MODEL = dict(family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    from runner.testing import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tp_qwen2"), **TP_MODEL)


@pytest.fixture(scope="module")
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers use the engine process's thread count
    yield
    torch.set_num_threads(before)


def tp_config(model_dir, **kw):
    from rollout import EngineConfig

    return EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=8, num_kv_blocks=64, max_model_len=128, **kw)


def sampler_peaks(engines: dict, prompts, params) -> tuple[dict, dict]:
    """Per named TP engine: rank 0's peak sampler memory (bytes, `SamplerPeak`) while generating, and the
    generated token ids; rank 0's sampler is restored afterwards."""
    from runner.parallel.memory import SamplerPeak

    peaks, tokens = {}, {}
    for name, engine in engines.items():
        rank0 = engine.runner
        plain = rank0.sampler
        rank0.sampler = SamplerPeak(plain, rank0.device)
        try:
            tokens[name] = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]
        finally:
            peaks[name], rank0.sampler = rank0.sampler.peak_bytes, plain
    return peaks, tokens


def perturbed_checkpoint(src: Path, dst: Path, seed: int) -> Path:
    """A copy of the checkpoint directory `src` at `dst` with every tensor moved by 0.05 * N(0, 1)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}, dst / "model.safetensors")
    return dst


def replace_sampled_tokens(engine, token_of) -> None:
    """Make `engine` report `token_of(req_id)` as each sample's next token: the model runs as usual and the
    tokens its runner reports are replaced (sync steps reach `collect` through `runner.execute`, async ones
    directly), so a random model "writes" a chosen completion."""
    real = engine.runner.collect

    def collect(handle):
        out = real(handle)
        out.sampled_token_ids = [[token_of(rid)] for rid in out.req_ids]
        return out

    engine.runner.collect = collect


def perturb_lora(model, seed: int, fraction: float) -> None:
    """Move a random `fraction` of every lora_A / lora_B entry of the peft `model` by 0.3 * N(0, 1), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                keep = torch.rand(p.shape, generator=g) >= fraction
                p.add_(torch.where(keep, 0.0, 0.3 * torch.randn(p.shape, generator=g)))


def rank_local_expert_patch(engine, one, model) -> None:
    """Adopt `engine`'s weights into the trainer `model` (a TrainingModel of a two-rank MoE), move entries of two
    experts (rank 1's columns of layer 1 expert 4's down_proj, rank 0's row of layer 0 expert 1's up_proj) and push
    them through `TrainerBridge(engine, rank_local=True)`: a patch (no dense record, under 4 KiB) after which the
    engine's weights equal the model's; the engine's expert weights then go to the single-process engine `one`."""
    from trainer_bridge import TrainerBridge

    bridge = TrainerBridge(engine, rank_local=True)
    assert bridge.adopt_engine_weights(model) == len(model.checkpoint_state())
    with torch.no_grad():
        model.checkpoint_state()["model.layers.1.mlp.experts.4.down_proj.weight"][:4, 20:] += 0.5  # rank 1's columns
        model.checkpoint_state()["model.layers.0.mlp.experts.1.up_proj.weight"][3] -= 0.5  # rank 0's row
    result = bridge.push_weights(model)
    assert result.num_dense == 0 and result.nbytes < 4096
    exported = {r.name: r.tensor for r in engine.export_weights()}
    for name, t in model.checkpoint_state().items():
        assert torch.equal(exported[name], t), name
    one.apply_weight_update(1, [r for r in engine.export_weights() if ".experts." in r.name])


def run_ranks(target, tmp_path: Path, size: int = 2, timeout_s: float = 120) -> list:
    """Run target(rank, store, out) in `size` spawned processes sharing a file store under tmp_path; each rank
    writes a JSON result to `out`. Asserts every rank exited 0; returns the results in rank order."""
    import json

    import torch.multiprocessing as mp

    store = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, store, str(tmp_path / f"rank{r}.json"))) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    assert [p.exitcode for p in procs] == [0] * size
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
