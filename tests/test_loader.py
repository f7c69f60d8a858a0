"""The checkpoint readers: the chunked reader (runner/safetensors_io.py, forced on the CPU with plain host buffers
and chunks far smaller than a tensor, so that tensors straddle chunk boundaries and elements straddle reads)
fills the same parameters bitwise as the tensor-wise reader, and both hold the checkpoint's values: fused and
stacked slots, tied embeddings, tensor-parallel shards (rows and columns, every rank's layout built without
processes), multi-shard checkpoints with an index, bf16 and fp32 files into bf16 and fp32 models. Corrupt
and truncated files are refused naming the file. The streamed random-checkpoint writer writes what
`random_state_dict` draws, in files the safetensors package reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_checkpoint
from runner.loader import CheckpointWeights, load_model, safetensors_files
from runner.model_config import ModelConfig
from runner.safetensors_io import ChunkStager, DirectTarget, StagedTarget
from runner.testing import random_state_dict, write_random_checkpoint

CPU = torch.device("cpu")


def _load(path: Path, dtype: torch.dtype, reader: str, tp=None, **kw):
    cfg = ModelConfig.from_dir(path)
    return load_model(path, cfg, dtype, CPU, None, 64, tp=tp, reader=reader, **kw)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory, read with the safetensors package."""
    return {k: v for f in safetensors_files(path) for k, v in load_file(f).items()}


def _assert_bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, x in pa.items():
        y = pb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.detach().reshape(-1).view(torch.uint8), y.detach().reshape(-1).view(torch.uint8)), name


def _assert_holds_checkpoint(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Each checkpoint name's live view is its tensor (the rank's part), cast to the model's dtype."""
    weights = CheckpointWeights(model)
    assert set(weights.layout) <= set(full)
    for name, slot in weights.layout.items():
        view = weights.view(name)
        expected = slot.own_part(full[name]).to(view.device, view.dtype)
        assert torch.equal(view, expected), name


CASES = [  # (family, checkpoint dtype, model dtype, HF save_pretrained max_shard_size or None, overrides)
    ("llama", torch.float32, torch.float32, None, {}),
    ("llama", torch.bfloat16, torch.bfloat16, "60KB", {}),  # several shards + index, no conversion: direct copies
    ("qwen2", torch.bfloat16, torch.float32, None, {"tie_word_embeddings": True}),  # tied, bf16 -> fp32 staged
    ("qwen3", torch.float32, torch.bfloat16, "100KB", {}),  # fp32 -> bf16 rounding, q/k norms
    ("qwen3_moe", torch.float32, torch.float32, None, {}),  # experts stacked [E, 2I, H] / [E, H, I]
    ("qwen3_moe", torch.bfloat16, torch.bfloat16, "80KB", {}),
]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """HF-written checkpoints of CASES (one per case index), sharded where the case says."""
    from conftest import load_hf

    dirs = {}
    for i, (family, ckpt_dtype, _, shard, kw) in enumerate(CASES):
        path = make_checkpoint(tmp_path_factory.mktemp(f"{family}{i}"), family, seed=i, dtype=ckpt_dtype, **kw)
        if shard is not None:
            sharded = tmp_path_factory.mktemp(f"{family}{i}_sharded")
            load_hf(path, ckpt_dtype).save_pretrained(sharded, max_shard_size=shard)
            assert (sharded / "model.safetensors.index.json").is_file()
            assert len(safetensors_files(sharded)) > 1
            path = sharded
        dirs[i] = path
    return dirs


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
@pytest.mark.parametrize("chunk_bytes", [777, 4096, 1 << 30])
def test_chunked_reader_matches_tensorwise(hf_checkpoints, case, chunk_bytes):
    _, _, dtype, _, _ = CASES[case]
    path = hf_checkpoints[case]
    reference = _load(path, dtype, "tensorwise")
    chunked = _load(path, dtype, "chunked", chunk_bytes=chunk_bytes)
    _assert_bitwise_equal(reference, chunked)
    _assert_holds_checkpoint(chunked, _checkpoint(path))


@pytest.mark.parametrize("chunk_bytes,read_threads,part", [(1000, 1, 1 << 20), (1000, 3, 64), (1 << 20, 4, 100)])
def test_stager_reads_ranges_across_chunks_and_threads(tmp_path, chunk_bytes, read_threads, part):
    """Ranges (gaps between them, one empty) read through the stager land byte for byte, whatever the chunking
    and however the reads are split over threads."""
    file = tmp_path / "blob"
    data = torch.randint(0, 256, (50_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    file.write_bytes(data.numpy().tobytes())
    ranges = [(0, 1), (1, 2999), (2999, 2999), (5000, 17_003), (17_003, 50_000)]
    dests = [torch.zeros(end - begin, dtype=torch.uint8) for begin, end in ranges]
    with ChunkStager(CPU, chunk_bytes=chunk_bytes, read_threads=read_threads, read_part_bytes=part) as stager:
        targets = [DirectTarget(b, e, d) if e > b else StagedTarget(b, e, CPU, lambda raw: None)
                   for (b, e), d in zip(ranges, dests)]
        assert stager.read_file(file, targets[::-1]) == sum(e - b for b, e in ranges)
    for (begin, end), dest in zip(ranges, dests):
        assert torch.equal(dest, data[begin:end])


@pytest.mark.parametrize("family,kw", [
    ("qwen2", {"tie_word_embeddings": True}),  # vocab-parallel tied embedding, column-sharded o_proj / down_proj
    ("llama", {"num_key_value_heads": 4}),  # kv heads split, untied LM head sharded by rows
    ("qwen3_moe", {}),  # experts: w13 rows and w2 columns of each expert
])
@pytest.mark.parametrize("ckpt_dtype", [torch.float32, torch.bfloat16])
def test_chunked_reader_tensor_parallel_shards(tmp_path, family, kw, ckpt_dtype):
    path = make_checkpoint(tmp_path, family, seed=5, dtype=ckpt_dtype, **kw)
    full = _checkpoint(path)
    for rank in range(2):
        tp = SimpleNamespace(rank=rank, size=2, device=CPU)
        reference = _load(path, ckpt_dtype, "tensorwise", tp=tp)
        chunked = _load(path, ckpt_dtype, "chunked", tp=tp, chunk_bytes=1000)
        _assert_bitwise_equal(reference, chunked)
        _assert_holds_checkpoint(chunked, full)
        weights = CheckpointWeights(chunked)
        assert any(not slot.is_whole for slot in weights.layout.values()), "the layout shards nothing"


def test_rank_reads_only_its_rows(tmp_path, monkeypatch):
    """Under TP the chunked reader reads a rank's part alone where it is contiguous in the file (a range of rows),
    and the whole tensor otherwise (a range of columns), nothing else."""
    import math

    import runner.safetensors_io as sio

    path = make_checkpoint(tmp_path, "llama", seed=2, num_key_value_heads=4)
    read = []
    real = sio.ChunkStager.read_file
    monkeypatch.setattr(sio.ChunkStager, "read_file", lambda self, f, t: read.append(real(self, f, t)) or read[-1])
    model = _load(path, torch.float32, "chunked", tp=SimpleNamespace(rank=1, size=2, device=CPU))
    layout = CheckpointWeights(model).layout
    rows = sum(math.prod(s.shard_shape) for s in layout.values() if s.dim == 0 and not s.is_whole)
    columns = sum(math.prod(s.shape) for s in layout.values() if s.dim > 0 and not s.is_whole)
    whole = sum(math.prod(s.shape) for s in layout.values() if s.is_whole)
    assert rows and columns and whole
    assert sum(read) == 4 * (rows + columns + whole)


def test_streamed_writer_draws_random_state_dict_in_shards(tmp_path):
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    one = write_random_checkpoint(tmp_path / "one", family="qwen3", seed=3, **shape)
    two = write_random_checkpoint(tmp_path / "two", family="qwen3", seed=3, shards=2, dtype="bfloat16", **shape)
    index = json.loads((two / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sizes = [(two / f).stat().st_size for f in files]
    assert max(sizes) < 0.8 * sum(sizes), sizes  # about equal halves
    a, b = _checkpoint(one), _checkpoint(two)  # the safetensors package reads the streamed files
    config = json.loads((two / "config.json").read_text())
    assert a.keys() == b.keys() == random_state_dict(config, torch.bfloat16, 3, 0.1).keys()
    for name in a:
        assert b[name].dtype == torch.bfloat16 and torch.equal(a[name].to(torch.bfloat16), b[name]), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in b.values())


def _corrupt(tmp_path: Path, src: Path, name: str, mutate) -> Path:
    import shutil

    dst = tmp_path / name
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    file.write_bytes(mutate(file.read_bytes()))
    return dst


@pytest.mark.parametrize("mutation,message", [
    (lambda b: b[: len(b) - 100], "truncated: tensor"),
    (lambda b: b[:5], "5 bytes, shorter than the 8-byte header length"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length 1000000000 exceeds the file"),
    (lambda b: b[:8] + b"[" + b[9:], "header is not JSON"),
    (lambda b: b.replace(b'"F32"', b'"F99"', 1), "tensor 'lm_head.weight' has unknown dtype 'F99'"),
    (lambda b: b.replace(b'"data_offsets":[0,', b'"data_offsets":[4,', 1), "do not hold"),
])
def test_corrupt_files_are_refused_naming_the_file(tmp_path, mutation, message):
    src = write_random_checkpoint(tmp_path / "src", device="cpu", shards=1)
    raw = (src / "model.safetensors").read_bytes()
    assert b'"data_offsets":[0,' in raw and b'"F32"' in raw  # the mutations find what they change
    bad = _corrupt(tmp_path, src, "bad", mutation)
    prefix = re.escape(f"cannot read safetensors file {bad / 'model.safetensors'}: ")
    with pytest.raises(ValueError, match=prefix + ".*" + re.escape(message)):
        _load(bad, torch.float32, "chunked")


def test_read_past_the_end_is_a_truncation_error(tmp_path):
    path = write_random_checkpoint(tmp_path, device="cpu", shards=1)
    file = path / "model.safetensors"
    dest = torch.empty(64, dtype=torch.uint8)
    size = file.stat().st_size
    with ChunkStager(CPU, chunk_bytes=16) as stager, \
            pytest.raises(ValueError, match=re.escape(f"{file}: truncated at byte {size}")):
        stager.read_file(file, [DirectTarget(size - 32, size + 32, dest)])


def test_checkpoint_errors_are_the_same_for_both_readers(tmp_path):
    path = make_checkpoint(tmp_path / "ok", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    for reader in ("tensorwise", "chunked"):
        with pytest.raises(ValueError, match="shape mismatch for model.layers.0.mlp"):
            _load(path, torch.float32, reader)
    with pytest.raises(ValueError, match="reader must be one of"):
        _load(path, torch.float32, "mmap")


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    path = write_random_checkpoint(tmp_path, device="cpu")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.norm.weight'\]"):
        _load(path, torch.float32, "chunked")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp_rank", [None, 1])
def test_chunked_reader_on_cuda_matches_tensorwise(tmp_path, tp_rank):
    """Pinned buffers, side-stream copies and device staging: the same parameters as the tensor-wise reader."""
    path = make_checkpoint(tmp_path, "qwen3_moe", seed=4, dtype=torch.bfloat16)
    cfg = ModelConfig.from_dir(path)
    dev = torch.device("cuda")
    tp = None if tp_rank is None else SimpleNamespace(rank=tp_rank, size=2, device=dev)
    models = [load_model(path, cfg, dtype, dev, None, 64, tp=tp, reader=reader, chunk_bytes=3001)
              for reader in ("tensorwise", "chunked") for dtype in (torch.bfloat16, torch.float32)]
    _assert_bitwise_equal(models[0], models[2])
    _assert_bitwise_equal(models[1], models[3])
    _assert_holds_checkpoint(models[2], _checkpoint(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoint_drawn_on_cuda_loads_the_same_with_both_readers(tmp_path):
    path = write_random_checkpoint(tmp_path, family="qwen3", dtype="bfloat16", device="cuda", shards=2, seed=1,
                                   vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    assert len(safetensors_files(path)) == 2
    cfg = ModelConfig.from_dir(path)
    dev = torch.device("cuda")
    tensorwise, chunked = (load_model(path, cfg, torch.bfloat16, dev, None, 64, reader=r, chunk_bytes=1 << 18)
                           for r in ("tensorwise", "chunked"))
    _assert_bitwise_equal(tensorwise, chunked)
    _assert_holds_checkpoint(chunked, _checkpoint(path))


def test_load_reports_its_parts(hf_checkpoints):
    """`load_model(stats=...)` fills the load's parts: allocation and fill for both readers, and for the chunked
    one its file reads and its waits (no device copies to wait for on the CPU: zero), each within the fill."""
    for reader in ("tensorwise", "chunked"):
        stats: dict[str, float] = {}
        _load(hf_checkpoints[0], torch.float32, reader, stats=stats)
        assert stats["allocate"] > 0 and stats["fill"] > 0
        if reader == "chunked":
            assert 0 < stats["fill_read"] <= stats["fill"] and stats["fill_wait"] == 0.0
        else:
            assert "fill_read" not in stats
