"""The runner's configuration: what a `ModelRunner` (one per rank) needs to know of the engine's settings.

`RunnerConfig` holds the device-side fields of `rollout.config.EngineConfig` under the same names and with
the same meanings (documented there, where users set them); `EngineConfig.runner_config()` builds it. It
is plain data, so it crosses to the worker ranks of a tensor-parallel engine as it is. `SpeculativeConfig`
lives here because the runner's drafters read it; `rollout.config` re-exports it. Nothing here imports
torch or the rest of the project.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding settings (a drafter proposes tokens, the target verifies them)."""

    method: str = "eagle"
    """"eagle" (a decoder layer over token embedding + target hidden state) or "mtp"."""
    num_speculative_tokens: int = 4
    """Draft tokens proposed per step (k)."""
    drafter: str | None = None
    """Path of a saved drafter directory; None starts from a freshly initialised drafter."""
    auto_off: bool = True
    """Stop speculating at batch sizes where measured throughput is higher without it (re-checked now and
    then); the engine's `spec_decode_stats` say per batch size which mode won."""

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "mtp"):
            raise ValueError(f"SpeculativeConfig.method must be 'eagle' or 'mtp', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class RunnerConfig:
    """The runner's part of EngineConfig; every field means what the EngineConfig field of its name means, except
    `max_loras`, which is 0 in LoRA's merged mode (`EngineConfig.lora_merged`: no slots, the adapter is folded
    into the weights, rollout/loras.py)."""

    model: str  # checkpoint directory
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "safetensors"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    fused_gemv_rows: int = 1
    seed: int = 0
    tensor_parallel_size: int = 1
    tp_sampling: str = "sharded"
    expert_parallel: bool = False
    deterministic: bool = False
    speculative: SpeculativeConfig | None = None
    enable_return_routed_experts: bool = True
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] | None = None
    lora_overlap: bool = False
    lora_deferred: bool = False
    lora_fused_linear: bool = False
