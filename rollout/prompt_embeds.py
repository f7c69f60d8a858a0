"""Prompt embeddings: a prompt given as rows of the model's input embeddings instead of token ids (vLLM's
`EmbedsPrompt`, `{"prompt_embeds": tensor}`), checked once when a request is added, and its HTTP form.

    check_prompt_embeds(value, hidden_size=H, dtype=model dtype) -> PromptEmbeds    (a ValueError otherwise)
    encode_prompt_embeds(tensor) -> str      base64 of a safetensors blob holding the one tensor (a client's side)
    decode_prompt_embeds(text, field) -> torch.Tensor   the server's side of it

The rules (each refusal is a ValueError naming the field and the rule): a dense torch.Tensor, 2-D
[T, hidden_size] with T >= 1 and the model's hidden size, of a floating-point dtype, which is cast to the
model's dtype (a float32 tensor for a bfloat16 model is rounded as the checkpoint's embedding table was), and
finite after that cast. Length bounds (T < max_model_len, the KV blocks a request needs) are the engine's, as
for token prompts (rollout/engine.py).

A `PromptEmbeds` keeps its own contiguous host copy (the caller may reuse its tensor) and the sha256 of its
dtype, shape and bytes (`digest`), which is the request's prefix-cache extra key (`Request.cache_keys`): two
prompts with byte-identical embeddings share KV blocks (so do the n samples of one), different ones share
none, and an embedding prompt never shares with a token prompt, even one whose embedding rows it repeats.
The request's token ids at the T prompt positions are `PLACEHOLDER_TOKEN_ID`s, which the runner never embeds
(runner/input_batch.py takes the rows instead); its outputs have `prompt=None` and `prompt_token_ids=None`
(vLLM's), and only generated tokens are detokenized and matched against stop strings.

The HTTP form is safetensors, never a pickle (vLLM's server takes `torch.save` output; this one does not
unpickle anything a client sends): `safetensors.torch.save({"prompt_embeds": t})`, base64-encoded (standard
alphabet, padded). Its size is bounded by the server's body limit (`ServerConfig.max_body_bytes`).

Not here: how the runner feeds the rows (runner/input_batch.py, runner/model_runner.py), what refuses them
(speculative decoding and tensor parallelism: rollout/engine.py), the endpoints (rollout/server.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = 0
"""The token id an embedding prompt's positions hold in `Request.token_ids` (their count is the prompt's length;
the runner replaces their embeddings by the prompt's rows, so the value never reaches the model)."""


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """A checked embedding prompt (made by `check_prompt_embeds`)."""

    tensor: torch.Tensor
    """[T, hidden_size] on the host, contiguous, in the model's dtype; owned (a copy of what the caller gave)."""
    digest: str
    """sha256 (hex) of the dtype, the shape and the bytes: the prompt's prefix-cache extra key."""

    @property
    def num_tokens(self) -> int:
        return self.tensor.shape[0]


def check_prompt_embeds(value, *, hidden_size: int, dtype: torch.dtype, field: str = "prompt_embeds") -> PromptEmbeds:
    """`value` as a `PromptEmbeds` of a model with `hidden_size` and `dtype`, or a ValueError naming `field` and the
    rule it breaks (see the module docstring). A `PromptEmbeds` already checked for this hidden size and dtype is
    returned as it is."""
    if isinstance(value, PromptEmbeds) and value.tensor.dtype == dtype and value.tensor.shape[1] == hidden_size:
        return value
    want = f"[T, hidden_size={hidden_size}]"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field} must be a torch.Tensor of shape {want}, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise ValueError(f"{field} must be a dense (strided) tensor, got layout {value.layout}")
    if value.device.type == "meta":
        raise ValueError(f"{field} must hold data (a CPU or CUDA tensor), got a meta tensor")
    if value.dim() != 2:
        raise ValueError(f"{field} must be 2-D {want}, got shape {tuple(value.shape)}")
    if value.shape[0] < 1:
        raise ValueError(f"{field} must have at least 1 row (one per prompt position), got shape {tuple(value.shape)}")
    if value.shape[1] != hidden_size:
        raise ValueError(f"{field} rows must have the model's hidden_size={hidden_size}, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{field} must have a floating-point dtype (it is cast to the model's {dtype}), got {value.dtype}")
    tensor = value.detach().to(device="cpu", dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        row, col = (~finite).nonzero()[0].tolist()
        raise ValueError(f"{field} must hold finite values (after the cast to the model's {dtype}); "
                         f"[{row}, {col}] is {tensor[row, col].item()}")
    digest = hashlib.sha256(f"{dtype}:{tuple(tensor.shape)}:".encode())
    digest.update(tensor.view(torch.uint8).numpy())
    return PromptEmbeds(tensor=tensor, digest=digest.hexdigest())


def encode_prompt_embeds(tensor: torch.Tensor) -> str:
    """The HTTP form of an embedding prompt: base64 of a safetensors blob holding `tensor` [T, hidden_size] (on the
    host, contiguous) under the name "prompt_embeds"."""
    from safetensors.torch import save

    return base64.b64encode(save({"prompt_embeds": tensor.detach().cpu().contiguous()})).decode("ascii")


def decode_prompt_embeds(text: str, field: str = "prompt_embeds") -> torch.Tensor:
    """The one tensor of the base64 safetensors blob `text` (any name), not yet checked against a model; a
    ValueError naming `field` when it is not base64, not a safetensors blob, or holds no tensor or several."""
    try:
        blob = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} must be base64 (standard alphabet, padded) of a safetensors blob") from None
    from safetensors.torch import load

    try:
        tensors = load(blob)
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error type for every malformed blob)
        raise ValueError(f"{field} is not a safetensors blob: {e}") from None
    if len(tensors) != 1:
        raise ValueError(f"{field} must hold exactly one tensor, got {len(tensors)}")
    return next(iter(tensors.values()))
