"""Versioned weight updates from a trainer to the rollout engine.

Records (``Dense``, ``Patch``) in checkpoint names and flat coordinates; a sender-side
``WeightDiffer`` that chooses them; a rollout-side ``WeightReceiver`` whose sessions validate, apply
in place through a ``WeightTarget`` and verify checksums; and transports in ``weight_updates.transports``
(in-process, shared memory / CUDA IPC, torch.distributed, NIXL). Importing this package imports only
torch: transports load their backends (torch.distributed, NIXL) when used.
"""

from weight_updates.checksum import checksum, checksum_tensor, patch_checksum_delta
from weight_updates.differ import DiffConfig, ParamStats, PendingPush, PushStats, WeightDiffer
from weight_updates.encoding import Dense, PackedIndices, Patch, Update
from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult, UpdateSession, WeightReceiver, apply_update
from weight_updates.target import ParamSpec, TensorDictTarget, WeightTarget

__all__ = [
    "Dense",
    "DiffConfig",
    "PackedIndices",
    "ParamSpec",
    "ParamStats",
    "Patch",
    "PendingPush",
    "PushStats",
    "TensorDictTarget",
    "Update",
    "UpdateResult",
    "UpdateSession",
    "WeightDiffer",
    "WeightReceiver",
    "WeightTarget",
    "WeightUpdateError",
    "apply_update",
    "checksum",
    "checksum_tensor",
    "patch_checksum_delta",
]
