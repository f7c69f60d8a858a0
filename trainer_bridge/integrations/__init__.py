"""Adapters that plug the rollout engine into RL training frameworks (one module per framework).

`trainer_bridge.integrations.trl`: TRL's GRPOTrainer (`rollout_func` + a `TrainerCallback`). Each module
imports its framework lazily, so importing this package needs none of them. See docs/INTEGRATIONS.md.
"""
