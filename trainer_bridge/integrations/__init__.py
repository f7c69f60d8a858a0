"""Adapters that plug the rollout engine into RL training frameworks (one module per framework)."""
