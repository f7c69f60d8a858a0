"""What a training script imports to drive the rollout engine."""

from trainer_bridge.training_model import TrainingModel

__all__ = ["TrainingModel"]
