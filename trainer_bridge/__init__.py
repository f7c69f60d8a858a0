"""What a training script imports to drive the rollout engine.

    from trainer_bridge import TrainerBridge, TrainingModel
    bridge = TrainerBridge(engine_or_pool)
    batch = bridge.rollout(prompts, SamplingParams(n=8, max_tokens=16, seed=0))   # TokenSamples
    stats = bridge.push_weights(model)                                              # PushResult

Importing this package loads neither Ray, wandb nor matplotlib.
"""

from trainer_bridge.bridge import PaddedBatch, PushResult, RolloutBatch, TokenSample, TrainerBridge, logprob_mismatch
from trainer_bridge.training_model import TrainingModel

__all__ = [
    "PaddedBatch",
    "PushResult",
    "RolloutBatch",
    "TokenSample",
    "TrainerBridge",
    "TrainingModel",
    "logprob_mismatch",
]
