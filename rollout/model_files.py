"""Where a model's files are: a local directory as given, or a Hugging Face hub model id resolved through
`huggingface_hub`.

    resolve_model("path/to/hf_dir")   -> that directory (or a tokenizer.json file), unchanged
    resolve_model("Qwen/Qwen3-8B")    -> the snapshot directory in the local Hugging Face cache

An id is looked up in the local cache first (`snapshot_download(local_files_only=True)`), so a model
downloaded once works offline (HF_HUB_OFFLINE=1 included); otherwise it is downloaded into the cache when a
hub is reachable (only the files the engine reads: *.json, *.safetensors, chat templates, tokenizer files).
The cache is huggingface_hub's (`HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache/huggingface/hub). A model
that is neither a directory nor found in the cache nor downloadable is a ValueError naming the directory it
tried and the cache it looked in. Not here: reading the files (runner/model_config.py, rollout/tokenizer.py).
"""

from __future__ import annotations

import re
from pathlib import Path

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
"""The files of a hub repository a download fetches (configs, weights, tokenizer files, chat templates); not
*.bin / *.pt / *.onnx / *.gguf copies of the weights."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` can be a hub model id ("org/name" or "name"): not an absolute or ./-relative path, at most
    one "/", hub characters only, no ".." and not ending in ".json"."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".json", "."))


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads and writes (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def resolve_model(name_or_path: str | Path, *, revision: str | None = None, needs: str | None = "config.json") -> Path:
    """The local path of a model: `name_or_path` itself when it exists (a directory, or a tokenizer.json file),
    else the cached (or, with a reachable hub, freshly downloaded) snapshot of the hub model id it names, which
    must hold the file `needs` (None: anything). Raises ValueError naming the directory tried and the cache
    looked in."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if not looks_like_repo_id(name):
        raise ValueError(f"model {name!r}: no such directory ({path.absolute()}); a model directory holds "
                         "config.json and *.safetensors, or give a Hugging Face model id such as 'Qwen/Qwen3-8B'")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import LocalEntryNotFoundError
    except ImportError:
        raise ValueError(f"model {name!r}: no such directory ({path.absolute()}), and huggingface_hub, which "
                         "resolves hub model ids, is not installed (pip install huggingface_hub)") from None
    cache = hub_cache_dir()
    try:  # the local cache first: works offline
        snapshot = snapshot_download(name, revision=revision, cache_dir=str(cache), local_files_only=True,
                                     allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        snapshot = None
    except Exception as e:  # an incomplete snapshot, a malformed id, ...: say what the hub library said
        raise ValueError(f"model {name!r}: no such directory ({path.absolute()}), and the Hugging Face cache "
                         f"({cache}) cannot serve it: {_one_line(e)}") from None
    if snapshot is None:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"model {name!r}: no such directory ({path.absolute()}), and not in the Hugging Face "
                             f"cache ({cache}); HF_HUB_OFFLINE is set, so it was not downloaded")
        try:
            snapshot = snapshot_download(name, revision=revision, cache_dir=str(cache), allow_patterns=ALLOW_PATTERNS)
        except Exception as e:  # no hub reachable, no such repository, a gated one, ...
            raise ValueError(f"model {name!r}: no such directory ({path.absolute()}), not in the Hugging Face cache "
                             f"({cache}), and the download failed: {_one_line(e)}") from None
    snapshot = Path(snapshot)
    if needs is not None and not (snapshot / needs).is_file():
        raise ValueError(f"model {name!r}: its snapshot in the Hugging Face cache ({snapshot}) has no {needs}")
    return snapshot


def _one_line(e: Exception) -> str:
    """The error in one line; a lookup that failed because of a network error says that error."""
    cause = e.__cause__ if e.__cause__ is not None else e
    text = f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    return text if len(text) <= 300 else text[:297] + "..."
