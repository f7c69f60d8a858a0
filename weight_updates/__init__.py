"""Versioned weight updates from a trainer to the rollout engine.

Records (``Dense``, ``Patch``) in checkpoint names and flat coordinates; a sender-side
``WeightDiffer`` that chooses them; a rollout-side ``WeightReceiver`` whose sessions validate, apply
in place through a ``WeightTarget`` and verify checksums (a ``StagingReceiver`` where the weights are out
of reach, as on a tensor-parallel engine's ranks); and transports in ``weight_updates.transports``
(in-process, shared memory / CUDA IPC, torch.distributed, NIXL), which all return a ``SendResult`` and
write into an ``UpdateSink``. Importing this package imports only torch: transports load their backends
(torch.distributed, NIXL) when used.
"""

from weight_updates.checksum import checksum, checksum_tensor, patch_checksum_delta
from weight_updates.differ import DiffConfig, ParamStats, PendingPush, PushStats, WeightDiffer
from weight_updates.encoding import Dense, PackedIndices, Patch, Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import RemoteSessions, StagingReceiver, UpdateResult, UpdateSession, WeightReceiver, apply_update
from weight_updates.target import ParamSpec, TensorDictTarget, WeightTarget
from weight_updates.transports.protocol import SendResult, UpdateSink

__all__ = [
    "Dense",
    "DiffConfig",
    "PackedIndices",
    "ParamSpec",
    "ParamStats",
    "Patch",
    "PendingPush",
    "PushStats",
    "SendResult",
    "RemoteSessions",
    "StagingReceiver",
    "TensorDictTarget",
    "Update",
    "UpdateResult",
    "UpdateSession",
    "UpdateSink",
    "WeightDiffer",
    "WeightReceiver",
    "WeightTarget",
    "WeightUpdateError",
    "apply_update",
    "checksum",
    "checksum_tensor",
    "patch_checksum_delta",
]
