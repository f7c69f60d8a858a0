"""LoRA adapters: PEFT adapter directories read and validated (`adapters`), the preallocated device slots
the LoRA kernels read (`slots`), and the runner's use of them (`runtime`: the hooks on the model's linears, each
forward's per-token slots, a slot's weight-update target); `merged`: one adapter folded into the base weights
instead (`EngineConfig.lora_merged`). The names of loaded adapters are the engine's (rollout/loras.py)."""

from runner.lora.adapters import (LORA_MODULES, LoraAdapter, adapter_from_peft, lora_module_shapes, lora_scaling,
                                  peft_tensor_name, read_adapter)
from runner.lora.slots import FUSED_MODULES, LoraSlots, LoraStack

__all__ = ["FUSED_MODULES", "LORA_MODULES", "LoraAdapter", "LoraSlots", "LoraStack", "adapter_from_peft",
           "lora_module_shapes", "lora_scaling", "peft_tensor_name", "read_adapter"]
