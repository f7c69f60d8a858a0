"""Model ids resolve through huggingface_hub's local cache (offline included); local paths stay as they are; a
model found nowhere names the directory tried and the cache looked in.

No hub is reachable from the tests, so the cache is written by hand in huggingface_hub's layout
(models--ORG--NAME/{refs/main, blobs/, snapshots/<commit>/ -> ../../blobs/...}) under a temporary directory,
which huggingface_hub is pointed at (its `constants`, or HF_HOME in a subprocess); a "reachable" hub is a
closed port on 127.0.0.1, so a download fails at once without leaving the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.model_files import looks_like_repo_id, resolve_model

huggingface_hub = pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, repo_id: str, src: Path, files: list[str] | None = None) -> Path:
    """Put the files of directory `src` into `cache` as huggingface_hub stores a downloaded snapshot; returns
    the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(src.iterdir()) if files is None else [src / name for name in files]:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at an empty cache under tmp_path, its hub a closed local port."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    return cache


def test_local_paths_are_returned_as_given(ckpt_factory, tmp_path, monkeypatch):
    src = ckpt_factory("llama")
    assert resolve_model(str(src)) == src
    monkeypatch.chdir(src.parent)
    assert resolve_model(src.name) == Path(src.name)  # a relative directory wins over a hub id of that name
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    assert resolve_model(str(tok), needs=None) == tok


def test_a_cached_model_id_resolves_offline_to_its_snapshot(ckpt_factory, hub, monkeypatch):
    snapshot = write_hub_cache(hub, "tiny-org/tiny-llama", ckpt_factory("llama"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    assert (snapshot / "config.json").is_symlink()


def test_engine_config_with_a_model_id_generates_what_the_directory_does(ckpt_factory, hub, monkeypatch):
    src = ckpt_factory("llama")
    write_hub_cache(hub, "tiny-org/tiny-llama", src)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    params = SamplingParams(n=2, max_tokens=6, seed=3, ignore_eos=True)
    outs = []
    for model in ("tiny-org/tiny-llama", str(src)):
        with Engine(EngineConfig(model=model, dtype="float32", num_kv_blocks=64, max_model_len=64)) as engine:
            assert engine.config.model == model  # kept as given (the server's default model name)
            assert engine.model_dir == engine.tokenizer_dir == str(resolve_model(model))
            outs.append([c.token_ids for c in engine.generate([[3, 4, 5, 6]], params)[0].outputs])
    assert outs[0] == outs[1] and len(outs[0][0]) == 6


def test_a_missing_model_names_the_directory_and_the_cache(hub, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_model("tiny-org/absent")
    message = str(e.value)
    assert str(tmp_path / "tiny-org" / "absent") in message and str(hub) in message
    assert "download failed" in message and "Connection refused" in message
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as e:
        resolve_model("tiny-org/absent")
    assert str(hub) in str(e.value)


def test_a_path_that_cannot_be_an_id_is_a_missing_directory(hub, tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # relative names resolve inside tmp_path, where none of them exists
    for name in (str(tmp_path / "nowhere"), "./nowhere", "a/b/c", "../x"):
        with pytest.raises(ValueError, match="no such directory") as e:
            resolve_model(name)
        assert "cache" not in str(e.value)  # nothing was looked up
    assert [looks_like_repo_id(n) for n in ("Qwen/Qwen3-8B", "gpt2", "org/x.y-z_1", "/abs", "a/b/c", "x/..", "t.json")] \
        == [True, True, True, False, False, False, False]


def test_a_snapshot_without_config_json_is_refused(ckpt_factory, hub, monkeypatch):
    src = ckpt_factory("llama")
    write_hub_cache(hub, "tiny-org/weights-only", src, files=["model.safetensors"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model("tiny-org/weights-only")
    assert resolve_model("tiny-org/weights-only", needs=None).is_dir()


def test_the_command_line_finds_a_model_id_in_hf_home(ckpt_factory, tmp_path):
    """HF_HOME (read by huggingface_hub at import, as in a user's shell) and HF_HUB_OFFLINE=1: `generate --model
    ID` runs from the cache and samples what the directory's engine samples."""
    src = ckpt_factory("llama")
    write_hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-llama", src)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    args = ["--prompt-ids", "3,4,5,6", "--n", "2", "--max-tokens", "5", "--seed", "1", "--ignore-eos",
            "--dtype", "float32", "--max-model-len", "64"]
    proc = subprocess.run([sys.executable, "-m", "rollout", "generate", "--model", "tiny-org/tiny-llama", *args],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    got = [r["token_ids"] for r in rows if "token_ids" in r]
    with Engine(EngineConfig(model=str(src), dtype="float32", max_model_len=64)) as engine:
        want = [c.token_ids for c in engine.generate([[3, 4, 5, 6]], SamplingParams(
            n=2, max_tokens=5, seed=1, ignore_eos=True))[0].outputs]
    assert got == want
