"""Model definitions. One decoder covers the Llama, Qwen2 and Qwen3 dense families."""

from runner.models.llama import DecoderForCausalLM

__all__ = ["DecoderForCausalLM"]
