"""Ways to carry update records from a trainer rank to a rollout rank.

- ``inprocess``: the receiver lives in the trainer's process; records are handed over as they are.
- ``ipc``: same host; buckets in POSIX shared memory (CPU) or CUDA IPC allocations (GPU), described
  by JSON messages on a ``multiprocessing.connection.Connection``. Trainer rank r talks to rollout
  rank r only.
- ``rank_local``: under tensor parallelism, trainer rank r stages rank r's part (in the rank's own
  coordinates) in shared memory or a CUDA IPC allocation, the engine passes each rollout rank its JSON
  handle, and the ranks vote so that all of them apply the update or none does.
- ``dist``: ``torch.distributed`` broadcast of flat buckets (gloo on CPU, NCCL on GPU), JSON
  metadata as length-prefixed uint8 tensors.
- ``nixl``: each rollout rank READs its own slice of the trainer's registered memory.

Every transport speaks one protocol (``protocol``): each sender's ``send`` returns a ``SendResult``, and
each receiver is a message source (start, chunks, reply) of the one session loop ``serve_session``, into
any ``UpdateSink`` (a ``WeightReceiver``, or an engine's ``weight_sink()``). ``protocol.commit_on_all`` is the
two-phase push of a coordinator over several engines (``rollout.pool``).

Every transport moves safetensors-described flat buffers (``weight_updates.wire``) and JSON; tensor
data is never pickled. Backends are imported inside the modules that need them; this package
imports none of them.
"""
