"""Model definitions and the registry that picks one from config.json's `architectures`.

    interface.py  CausalLM: the methods a model class offers the runner, loader and trainer
    layout.py     CheckpointSlot and the layers' checkpoint-layout declarations, composed per module
    registry.py   ModelRegistry: architecture name -> model class
    llama.py      DecoderForCausalLM: the Llama, Mistral, Qwen2 and Qwen3 dense decoders
    qwen_moe.py   Qwen3MoeForCausalLM, Qwen2MoeForCausalLM: the decoder with sparse Mixture-of-Experts blocks

A new model is a module here plus one `ModelRegistry.register_model` line below (or a call from outside the
package); docs/ARCHITECTURE.md ("How to add a model") says what it must offer.
"""

from runner.models.interface import CausalLM
from runner.models.layout import CheckpointSlot
from runner.models.registry import ModelRegistry

for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    ModelRegistry.register_model(_arch, "runner.models.llama:DecoderForCausalLM")
for _arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
    ModelRegistry.register_model(_arch, f"runner.models.qwen_moe:{_arch}")

__all__ = ["CausalLM", "CheckpointSlot", "ModelRegistry"]
