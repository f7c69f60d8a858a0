"""Everything that holds device tensors: models, checkpoint loading, KV cache tensors, the sampler and the
per-step model runner. The scheduler in `rollout/` talks to it only through `ModelRunner.execute`.
"""
