"""LoRA adapters: PEFT adapter directories read and validated (`adapters`), and the preallocated device slots
the LoRA kernels read (`slots`). Nothing here is wired into the engine or the models."""

from runner.lora.adapters import (LORA_MODULES, LoraAdapter, adapter_from_peft, lora_module_shapes, lora_scaling,
                                  peft_tensor_name, read_adapter)
from runner.lora.slots import FUSED_MODULES, LoraSlots, LoraStack

__all__ = ["FUSED_MODULES", "LORA_MODULES", "LoraAdapter", "LoraSlots", "LoraStack", "adapter_from_peft",
           "lora_module_shapes", "lora_scaling", "peft_tensor_name", "read_adapter"]
