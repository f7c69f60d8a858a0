"""Public API of the rollout engine.

    from rollout import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model="path/to/hf_dir", device="cpu", dtype="float32"))
    outs = engine.generate(["1+1="], SamplingParams(n=4, max_tokens=16, seed=7))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs

Importing this package loads no CUDA, Ray or NIXL code; the engine's device code lives in `runner/`.
"""

from rollout.config import EngineConfig, SpeculativeConfig
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    if name == "Engine":
        from rollout.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from rollout.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = ["Engine", "AsyncEngine", "EngineConfig", "SamplingParams", "SpeculativeConfig", "RequestOutput",
           "CompletionOutput", "RequestOutputKind"]
