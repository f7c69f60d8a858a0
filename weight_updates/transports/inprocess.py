"""Same-process transport: hand records straight to a ``WeightReceiver``. No copies, no threads."""

from collections.abc import Sequence

from weight_updates.encoding import Update
from weight_updates.session import UpdateResult, WeightReceiver


class InProcessSender:
    """Sends each push as one session on ``receiver``; raises WeightUpdateError if it is rejected."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver

    def send(self, version: int, updates: Sequence[Update]) -> UpdateResult:
        return self.receiver.apply(version, updates, expected_names=[u.name for u in updates])
