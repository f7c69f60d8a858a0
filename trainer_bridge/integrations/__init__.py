"""Adapters that plug the rollout engine into RL training frameworks (one module per framework).

`trainer_bridge.integrations.trl`: TRL's GRPOTrainer (`rollout_func` + a `TrainerCallback`);
`trainer_bridge.integrations.verl`: a verl rollout plugin (`rollout.name=rollout_engine`). slime needs no
module: it drives the server's SGLang endpoints (rollout/server.py). Each module
imports its framework lazily, so importing this package needs none of them. See docs/INTEGRATIONS.md.
"""
