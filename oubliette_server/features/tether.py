"""The tether (docs/TETHER.md): send into a session, read its frames, wait for new ones, stream them.

The caller's MCP tools (`tether_send`, `tether_read`, `session_events`) and the
HTTP routes (`/v1/instances/{id}/tether[/poll|/stream]`) are thin adapters over
`Tether`; validation lives here, once.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, AsyncIterator

from protocol import FRAME_TYPES, INGRESS_SCHEMA, Frame, RelayError, errors
from protocol.frames import FrameType, frame_type_problem
from protocol.limits import Limits
from protocol.schema_check import first_problem
from protocol.session_keys import channel_problem, check_session, session_id_problem

from ..core.frame_log import FrameLog
from ..core.ids import strict_validator
from ..core.instances import InstanceDirectory
from ..store.api import CursorPruned, FrameQuery, FrameStoreAPI

TETHER_CHANNEL = "host"
"""The channel of sessions opened with `tether_send` (`mcp` is session_message's)."""
DEFAULT_TETHER_SESSION = "default"
EGRESS_TYPES = tuple(t for t in FRAME_TYPES if t != FrameType.USER_MESSAGE)
"""What tether_read returns by default: the agent's side of the conversation, not the host's own messages."""
MAX_WAIT_MS = 30_000
STREAM_BATCH = 200

_ingress_validator = strict_validator(INGRESS_SCHEMA)  # `$` anchors as in ECMA-262: no trailing newline


def host_msg_id() -> str:
    """`host-{timestamp}` (docs/TETHER.md), with a random suffix so two sends in one millisecond differ."""
    return f"host-{int(time.time() * 1000)}-{secrets.token_hex(3)}"


class Tether:
    """The frame log as the tether's duplex channel (docs/TETHER.md).

    Needs: the frame store (reads, long-poll waits), the frame log (appends that reach
    followers and wake the instance), the instance directory (unknown instances are refused)
    and the limits (checked before anything is stored).
    Raises: `RelayError` (INVALID_PARAMS, NOT_FOUND; `LimitExceeded`) with the message a caller
    or HTTP client gets.
    """

    def __init__(
        self, store: FrameStoreAPI, frame_log: FrameLog, instances: InstanceDirectory, limits: Limits | None = None,
    ) -> None:
        self.store = store
        self.frame_log = frame_log
        self.instances = instances
        self.limits = limits or Limits()

    async def send(self, instance: str, text: str, session_id: str | None = None) -> dict[str, Any]:
        """`tether_send`: a `user.message` on the `host` channel; `{msg_id, session_id, ingress_seq}`."""
        self.limits.check_value(text, "text")
        session_id = DEFAULT_TETHER_SESSION if session_id is None else session_id
        check_session(TETHER_CHANNEL, session_id)
        instance = await self.instances.require_known(instance)
        frame = await self.frame_log.ingress(
            instance, TETHER_CHANNEL, session_id, FrameType.USER_MESSAGE, {"text": text}, msg_id=host_msg_id(),
        )
        return {"msg_id": frame.msg_id, "session_id": session_id, "ingress_seq": frame.seq}

    async def ingest(self, instance: str, body: Any) -> Frame:
        """HTTP ingress: validate a frame a program outside the sandbox posts, and append it (`FrameLog.ingress`
        refuses the types and payload keys only the server writes: server_owned.py)."""
        if isinstance(body, dict) and "payload" in body:
            self.limits.check_value(body["payload"], "payload")
        problem = (isinstance(body, dict) and "type" in body and frame_type_problem(body["type"])) or first_problem(
            _ingress_validator, body, "invalid frame")
        if problem is not None:
            raise RelayError(errors.INVALID_PARAMS, problem)
        instance = await self.instances.require_known(instance)  # a lookup: after the checks that need none
        return await self.frame_log.ingress(
            instance, body["session"]["channel"], body["session"]["id"], body["type"],
            body.get("payload", {}), msg_id=body.get("msg_id"), reply_to=body.get("reply_to"),
        )

    async def read(
        self,
        instance: str,
        *,
        channel: str | None,
        session_id: str | None,
        after_seq: int = 0,
        limit: int = 50,
        wait_ms: int = 0,
        types: list[str] | tuple[str, ...] | None = None,
        reply_to: str | None = None,
    ) -> dict[str, Any]:
        """`{frames, next_seq, timed_out}`: session_events, tether_read and the poll endpoint.

        Waits up to `wait_ms` for a first matching frame (woken by the append, no polling).
        """
        if not isinstance(wait_ms, int) or not 0 <= wait_ms <= MAX_WAIT_MS:
            raise RelayError(errors.INVALID_PARAMS, f"wait_ms must be between 0 and {MAX_WAIT_MS}, got {wait_ms}")
        # A filter is a session key too: held to the same rule (protocol/session_keys.py).
        problem = (channel is not None and channel_problem(channel)) or (
            session_id is not None and session_id_problem(session_id)) or next(
            filter(None, map(frame_type_problem, types or ())), None)  # a type filter too
        if problem:
            raise RelayError(errors.INVALID_PARAMS, problem)
        query = self._query(channel, session_id, after_seq, limit, types, reply_to)
        try:
            frames, timed_out = await self.store.wait_for_frames(instance, query, timeout=wait_ms / 1000)
        except CursorPruned as exc:
            raise RelayError(errors.NOT_FOUND, str(exc)) from None
        return {
            "frames": [f.to_wire() for f in frames],
            "next_seq": frames[-1].seq if frames else after_seq,
            "timed_out": timed_out,
        }

    async def stream(
        self,
        instance: str,
        *,
        after_seq: int,
        keepalive_seconds: float,
        channel: str | None = None,
        session_id: str | None = None,
        types: list[str] | None = None,
        reply_to: str | None = None,
    ) -> AsyncIterator[dict[str, Any] | None]:
        """Every matching frame after `after_seq`, then new ones as they come; None when idle.

        The first batch is read (and its errors raised) before the iterator is returned, so an
        HTTP adapter can answer a bad request with an error status instead of a broken stream.
        """
        first = await self.read(
            instance, channel=channel, session_id=session_id, after_seq=after_seq, limit=STREAM_BATCH,
            types=types, reply_to=reply_to,
        )
        wait_ms = int(keepalive_seconds * 1000)

        async def frames() -> AsyncIterator[dict[str, Any] | None]:
            batch = first
            while True:
                for frame in batch["frames"]:
                    yield frame
                if not batch["frames"]:
                    yield None
                batch = await self.read(
                    instance, channel=channel, session_id=session_id, after_seq=batch["next_seq"],
                    limit=STREAM_BATCH, wait_ms=wait_ms, types=types, reply_to=reply_to,
                )

        return frames()

    @staticmethod
    def _query(
        channel: str | None, session_id: str | None, after_seq: int, limit: int,
        types: list[str] | tuple[str, ...] | None, reply_to: str | None,
    ) -> FrameQuery:
        try:
            return FrameQuery(
                channel=channel, session_id=session_id, after_seq=after_seq,
                types=tuple(types) if types else None, reply_to=reply_to, limit=limit,
            )
        except ValueError as exc:
            raise RelayError(errors.INVALID_PARAMS, str(exc)) from None
