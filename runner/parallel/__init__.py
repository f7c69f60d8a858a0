"""Tensor parallelism: process groups, sharded layers and layouts, batch-sharded sampling, TP workers.

    group.py     TPGroup: the rank's place in the group, tensor collectives (gloo on CPU, NCCL on CUDA)
                 and a gloo control channel for plain-data messages
    layers.py    head / row / vocab partitions, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead
    sampling.py  TensorParallelSampler: vocab-sharded logits in, tokens in batch order out
    weights.py   ShardedCheckpointWeights: the rank's WeightTarget in full checkpoint coordinates
    worker.py    TensorParallelExecutor (rank 0, behind the engine; collective_rpc) and the worker ranks' loop
    rpc.py       plain-data encoding of collective-RPC arguments and results; one error per failed call
    memory.py    peak CPU/CUDA allocation of a code region, for the logits-memory measurements

Column-parallel projections that fuse checkpoint tensors (qkv, gate_up) are plain `Linear`s over the rank's
rows; which rows is declared by the layer that owns them (its `checkpoint_layout`, runner/models/layout.py).
Not here: scheduling (rollout/), pipeline or expert parallelism.
"""
