"""Model definitions and the registry that picks one from config.json's `architectures`.

    interface.py  CausalLM: the methods a model class offers the runner, loader and trainer
    layout.py     CheckpointSlot and the layers' checkpoint-layout declarations, composed per module
    registry.py   ModelRegistry: architecture name -> model class
    llama.py      DecoderForCausalLM: the Llama, Mistral, Qwen2 and Qwen3 dense decoders

A new model is a module here plus one `ModelRegistry.register_model` line below (or a call from outside the
package); docs/ARCHITECTURE.md ("How to add a model") says what it must offer.
"""

from runner.models.interface import CausalLM
from runner.models.layout import CheckpointSlot
from runner.models.registry import ModelRegistry

for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    ModelRegistry.register_model(_arch, "runner.models.llama:DecoderForCausalLM")

__all__ = ["CausalLM", "CheckpointSlot", "ModelRegistry"]
