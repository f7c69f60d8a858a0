"""JSON messages over a ``multiprocessing.connection.Connection`` with timeouts.

Only UTF-8 JSON bytes cross (``send_bytes``/``recv_bytes``), never pickles. A peer that stays silent
past the timeout, or closes the connection, becomes a WeightUpdateError that says which.
"""

import json
from multiprocessing.connection import Connection

from weight_updates.errors import WeightUpdateError


def send_json(conn: Connection, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection, *, timeout_s: float | None, waiting_for: str) -> dict:
    """The next message (``timeout_s=None`` waits forever); WeightUpdateError on timeout, a closed
    peer or malformed JSON."""
    try:
        if not conn.poll(timeout_s):
            raise WeightUpdateError(f"timed out after {timeout_s:g} s waiting for {waiting_for}")
        data = conn.recv_bytes()
    except (EOFError, OSError) as e:
        raise WeightUpdateError(f"peer closed the channel while waiting for {waiting_for} ({type(e).__name__})") from None
    try:
        message = json.loads(data)
    except json.JSONDecodeError as e:
        raise WeightUpdateError(f"malformed message while waiting for {waiting_for}: {e}") from None
    if not isinstance(message, dict) or "op" not in message:
        raise WeightUpdateError(f"message without 'op' while waiting for {waiting_for}")
    return message
