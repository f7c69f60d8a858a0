"""`ServerConfig`: what the HTTP server (rollout/server.py) listens on, who may call it, and the bounds it puts on
every request so that no request can stall the others. The engine's own settings are `EngineConfig`'s.

Not here: parsing flags (rollout/cli.py), the request schema (rollout/protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ServerConfig:
    """How `rollout.server.serve` / `build_app` serve one `AsyncEngine`."""

    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 30000
    """TCP port to listen on."""
    served_model_name: str | None = None
    """The model id `/v1/models` lists and responses carry; a request naming another model gets a 404.
    None: the model path as given to the engine."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every endpoint but `/health` answers 401 unless the request carries
    `Authorization: Bearer <api_key>` (as OpenAI clients send it). Never logged, never echoed in errors."""
    enable_admin: bool = True
    """Serve the control endpoints (`/update_weights_from_disk`, `/release_memory_occupation`,
    `/resume_memory_occupation`, `/flush_cache`, `/abort_request`); False: they answer 404."""
    max_n: int = 1024
    """Most samples per prompt (`n`); a request asking for more is refused with a 400 before it reaches the
    engine."""
    max_prompt_tokens: int | None = None
    """Most tokens in one prompt (after tokenization or chat-template rendering). None: the engine's
    max_model_len - 1."""
    max_tokens: int | None = None
    """Largest `max_tokens` / `max_new_tokens` / `max_completion_tokens` a request may ask for. None: the
    engine's max_model_len."""
    max_body_bytes: int = 32 << 20
    """Largest request body in bytes; a larger one gets a 413 before it is parsed."""
    max_pending_requests: int = 4096
    """Most prompts (engine requests; a request with n samples counts once) in flight at once, over all
    endpoints; past it new requests get a 429 with `Retry-After`."""
    max_cache_salt_chars: int = 256
    """Longest `cache_salt` accepted."""
    tool_parser: str = "hermes"
    """Which `rollout.tool_parsers.ToolParsers` entry turns a chat completion into `tool_calls`."""
    chat_template: str | None = None
    """Path of a Jinja chat template that overrides the model directory's (tokenizer_config.json's
    `chat_template` or chat_template.jinja)."""
    retry_after_s: int = 1
    """The `Retry-After` seconds a 429 (too many pending requests) or 503 (no free KV blocks to score a
    prompt) suggests."""
    weight_group_timeout_s: int = 60
    """Seconds a weight-update process group (/init_weights_update_group) waits for its peers to join, and
    each broadcast of a push for its sender: past it the push is refused and the old weights stay."""

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(f"ServerConfig.port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("max_n", "max_body_bytes", "max_pending_requests", "max_cache_salt_chars", "retry_after_s",
                     "weight_group_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ServerConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ServerConfig.{name} must be an integer >= 1 or None, got {value!r}")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("ServerConfig.api_key must be a non-empty string or None")
