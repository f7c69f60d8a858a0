"""JSON messages over a ``multiprocessing.connection.Connection`` with timeouts, and the result message
that ends a session.

Only UTF-8 JSON bytes cross (``send_bytes``/``recv_bytes``), never pickles. A peer that stays silent
past the timeout, or closes the connection, becomes a WeightUpdateError that says which.
"""

import json
from multiprocessing.connection import Connection

from weight_updates.errors import WeightUpdateError
from weight_updates.session import UpdateResult


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


def send_result(conn: Connection, result: UpdateResult | None, error: str | None) -> None:
    """The receiver's answer: ``{"op": "result", "ok": true, "result": ...}`` or ``{"op": "result", "ok": false,
    "error": ...}``. A sender that is gone is not an error here (the receiver's caller gets the session's)."""
    if error is not None:
        message = {"op": "result", "ok": False, "error": error}
    else:
        message = {"op": "result", "ok": True, "result": result.to_json()}
    try:
        send_json(conn, message)
    except OSError:
        pass


def recv_result(conn: Connection, *, timeout_s: float | None, waiting_for: str) -> tuple[UpdateResult | None, str | None]:
    """(the receiver's result, None) or (None, its error's text); WeightUpdateError when no well-formed answer
    came."""
    reply = recv_json(conn, timeout_s=timeout_s, waiting_for=waiting_for)
    if reply["op"] != "result":
        raise WeightUpdateError(f"expected a result message, got {reply['op']!r}")
    if not reply.get("ok"):
        return None, str(reply.get("error"))
    return UpdateResult.from_json(reply.get("result")), None
