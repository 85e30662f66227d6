"""The tether frame: the one model of a record of the tether log, its JSON Schemas and its views.

Every message and event of a session is a :class:`Frame` (docs/TETHER.md, "Frames"). The server's
store returns frames; everything that shows a frame to someone produces it from this model:

- :meth:`Frame.to_wire` is the frame as JSON: tether responses (``tether_read``,
  ``session_events``, poll), SSE events and guest delivery (``user_message``);
- :meth:`Frame.to_event` is the flattened event pushed to a caller
  (README.md, "Caller tools").

:data:`FRAME_SCHEMA` states the wire shape, derived from :class:`Frame` (its fields and their
bounds); :data:`INGRESS_SCHEMA`, what a producer outside the server may send (HTTP ingress), is
derived from it.
"""

from __future__ import annotations

import copy
import re
from datetime import datetime, timezone
from typing import Any, ClassVar

import attrs

from .convert import unstructure
from .schema_parts import NON_EMPTY, SEQ, TIMESTAMP, bounded, obj, schema_of
from .session_keys import DEFAULT_CHANNEL, SESSION_CHANNEL_SCHEMA, SESSION_ID_SCHEMA, shown
from .timestamps import utc_timestamp

__all__ = [
    "DEFAULT_CHANNEL",
    "FRAME_VERSION",
    "FRAME_TYPES",
    "FRAME_TYPE_RULE",
    "FRAME_TYPE_SCHEMA",
    "MAX_FRAME_TYPE_CHARS",
    "frame_type_problem",
    "FrameType",
    "TURN_END_TYPES",
    "SESSION_CHANNEL_SCHEMA",
    "SESSION_ID_SCHEMA",
    "SESSION_REF_SCHEMA",
    "FRAME_SCHEMA",
    "INGRESS_FIELDS",
    "INGRESS_SCHEMA",
    "SessionRef",
    "Frame",
    "utc_timestamp",
]

#: Current value of ``Frame.v``.
FRAME_VERSION = 1



class FrameType:
    """The conversation's frame types, one name each (the relay's methods are protocol/messages.py's)."""

    USER_MESSAGE = "user.message"
    ASSISTANT_DELTA = "assistant.delta"
    ASSISTANT_DONE = "assistant.done"
    STATUS_PRESENCE = "status.presence"
    SESSION_ERROR = "session.error"


#: The frames that end a turn (answer its `user.message` through `reply_to`).
TURN_END_TYPES: tuple[str, ...] = (FrameType.ASSISTANT_DONE, FrameType.SESSION_ERROR)

#: The frame types docs/TETHER.md names; other producers may add more.
FRAME_TYPES: tuple[str, ...] = (
    FrameType.USER_MESSAGE,
    FrameType.ASSISTANT_DELTA,
    FrameType.ASSISTANT_DONE,
    FrameType.STATUS_PRESENCE,
    "caller_tool_request",
    "caller_tool_result",
    "caller_tool_cancelled",
    "approval_request",
    "approval_resolved",
    FrameType.SESSION_ERROR,
)

#: A frame type's rule, at every door that names one (HTTP ingress, a guest's `append_frame`, the
#: read filters; `Limits.check_frame` before every append): lower-case dotted names, at most 64
#: characters — three times the longest the server writes, and a bound on what a type costs
#: every envelope, log line and terminal it reaches (a 5,000-character type was stored and
#: printed whole by `oubliette-server tail`).
FRAME_TYPE_RULE = r"[a-z][a-z0-9_]*(\.[a-z0-9_]+)*"
MAX_FRAME_TYPE_CHARS = 64
FRAME_TYPE_SCHEMA: dict[str, Any] = {
    "type": "string", "pattern": f"^{FRAME_TYPE_RULE}$", "maxLength": MAX_FRAME_TYPE_CHARS,
}
_FRAME_TYPE_RE = re.compile(FRAME_TYPE_RULE)


def frame_type_problem(value: object) -> str | None:
    """Why `value` is not a frame type (`FRAME_TYPE_RULE`, at most `MAX_FRAME_TYPE_CHARS`), or None."""
    if isinstance(value, str) and len(value) <= MAX_FRAME_TYPE_CHARS and _FRAME_TYPE_RE.fullmatch(value):
        return None
    return (f"invalid frame type {shown(value)}: use at most {MAX_FRAME_TYPE_CHARS} characters of "
            "a-z 0-9 _ in dot-separated parts, starting with a letter (e.g. user.message)")


# --- models ----------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class SessionRef:
    """A session, named by channel and id; keyed ``channel:id`` in maps and logs."""

    wire_label: ClassVar[str] = "session"

    channel: str = bounded(NON_EMPTY)
    id: str = bounded(NON_EMPTY)

    @property
    def key(self) -> str:
        """The ``channel:id`` key."""
        return f"{self.channel}:{self.id}"

    @classmethod
    def parse_key(cls, key: str) -> SessionRef:
        """Split ``channel:id`` on its first colon; a key without one is in channel ``mcp``."""
        channel, sep, sid = key.partition(":")
        if not sep:
            channel, sid = DEFAULT_CHANNEL, key
        if not channel or not sid:
            raise ValueError(f"invalid session key {key!r}: want 'channel:id'")
        return cls(channel=channel, id=sid)

    def __str__(self) -> str:
        return self.key


@attrs.define(frozen=True, kw_only=True)
class Frame:
    """One record of the tether log; ``seq`` is per instance and strictly increasing."""

    wire_label: ClassVar[str] = "frame"

    v: int = bounded({"minimum": 1})
    seq: int = bounded(SEQ)
    ts: str = bounded(TIMESTAMP)
    instance: str = bounded(NON_EMPTY)
    session: SessionRef
    type: str = bounded(NON_EMPTY)
    msg_id: str = bounded(NON_EMPTY)
    reply_to: str | None = None
    payload: dict[str, Any] = attrs.field(factory=dict)

    @property
    def channel(self) -> str:
        """The channel of the frame's session."""
        return self.session.channel

    @property
    def session_id(self) -> str:
        """The id of the frame's session (within its channel)."""
        return self.session.id

    def to_wire(self) -> dict[str, Any]:
        """The frame as JSON (:data:`FRAME_SCHEMA`); ``reply_to`` is left out when None."""
        return unstructure(self)

    def to_event(self) -> dict[str, Any]:
        """The flattened event a caller receives: the payload's members, then
        ``type, seq, ts, instance, channel, session_id, msg_id`` and ``reply_to`` (when set),
        which win over payload members of the same name."""
        event: dict[str, Any] = dict(self.payload)
        event.update(
            type=self.type, seq=self.seq, ts=self.ts, instance=self.instance,
            channel=self.session.channel, session_id=self.session.id, msg_id=self.msg_id,
        )
        if self.reply_to is not None:
            event["reply_to"] = self.reply_to
        return event


# --- schemas ---------------------------------------------------------------------------

#: The JSON Schema of a :class:`SessionRef` (derived from the class).
SESSION_REF_SCHEMA: dict[str, Any] = schema_of(SessionRef)

#: The JSON Schema of a :class:`Frame` on the wire (derived from the class).
FRAME_SCHEMA: dict[str, Any] = schema_of(Frame)

#: The members of a frame a producer outside the server may set; the server assigns
#: ``seq``, ``ts`` and ``instance`` (and ``msg_id`` when it is absent).
INGRESS_FIELDS: tuple[str, ...] = ("v", "type", "session", "payload", "msg_id", "reply_to")

# How ingress narrows each of those frame members (merged over the frame's own schema).
_INGRESS_NARROWING: dict[str, dict[str, Any]] = {
    "v": {"const": FRAME_VERSION},
    "type": FRAME_TYPE_SCHEMA,
    "session": {
        "properties": {
            "channel": SESSION_CHANNEL_SCHEMA,
            "id": SESSION_ID_SCHEMA,
        },
    },
    "msg_id": {"maxLength": 128},
    "reply_to": {"type": "string", "minLength": 1, "maxLength": 128},
}


def _ingress_schema() -> dict[str, Any]:
    properties = {}
    for name in INGRESS_FIELDS:
        member = copy.deepcopy(FRAME_SCHEMA["properties"][name])
        member.update(_INGRESS_NARROWING.get(name, {}))
        properties[name] = member
    return obj(["type", "session"], properties)


#: The JSON Schema of a frame sent by a producer outside the server (HTTP ingress): the
#: members of :data:`INGRESS_FIELDS` of :data:`FRAME_SCHEMA`, narrowed (names by pattern,
#: ids at most 128 characters, ``v`` the current version); ``type`` and ``session`` required.
INGRESS_SCHEMA: dict[str, Any] = _ingress_schema()


def is_past(timestamp: str, now: datetime | None = None) -> bool:
    """Whether a UTC timestamp as :func:`utc_timestamp` writes it (a request's ``expires_at``)
    is before ``now``; False for one that cannot be read (no deadline is known)."""
    try:
        moment = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return False
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment < (now or datetime.now(timezone.utc))
