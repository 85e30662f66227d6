"""Session keys: the one grammar and length limit of a session's channel and id, at every door.

A session is named by a channel and an id (``channel:id``, :class:`protocol.frames.SessionRef`).
Whoever names one from outside — a guest's ``append_frame``, a client's ``hello``, an HTTP
tether request, a caller's MCP tool — is held to the rules here, before anything is looked up
or stored (docs/SECURITY.md, "Session keys at every door"):

- channel: 1-:data:`MAX_CHANNEL_CHARS` of ``A-Z a-z 0-9 _ . -``;
- id: 1-:data:`MAX_SESSION_ID_CHARS` of ``A-Z a-z 0-9 _ . : @ -``.

So a key is short ASCII without whitespace, control characters or surrogates: it costs the
server a bounded amount of memory, encodes the same everywhere (UTF-8, SQL, JSON, a log line)
and names exactly what it shows. Every check is a full match (``re.fullmatch``): Python's
``$`` would also match before a final newline. The JSON Schema forms
(:data:`SESSION_CHANNEL_SCHEMA`, :data:`SESSION_ID_SCHEMA`) state the same rule for peers and
docs; their ``^…$`` means what it does in ECMA-262 (the server validates them that way).

A refusal names the rule and shows at most a short prefix of the value (a 1 MB key is not
echoed back). This module imports only the error type.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import INVALID_PARAMS, RelayError

__all__ = [
    "DEFAULT_CHANNEL",
    "MAX_CHANNEL_CHARS",
    "MAX_SESSION_ID_CHARS",
    "CHANNEL_RULE",
    "SESSION_ID_RULE",
    "SESSION_CHANNEL_SCHEMA",
    "SESSION_ID_SCHEMA",
    "channel_problem",
    "session_id_problem",
    "session_problem",
    "session_key_problem",
    "check_session",
    "check_session_key",
    "shown",
]

#: Channel of a session key written without one (``"s-1"`` means ``"mcp:s-1"``).
DEFAULT_CHANNEL = "mcp"
#: The longest channel name.
MAX_CHANNEL_CHARS = 64
#: The longest session id (within its channel).
MAX_SESSION_ID_CHARS = 128

#: A channel, as a regular expression to match in full.
CHANNEL_RULE = rf"[A-Za-z0-9_.-]{{1,{MAX_CHANNEL_CHARS}}}"
#: A session id, as a regular expression to match in full.
SESSION_ID_RULE = rf"[A-Za-z0-9_.:@-]{{1,{MAX_SESSION_ID_CHARS}}}"

_CHANNEL_RE = re.compile(CHANNEL_RULE)
_SESSION_ID_RE = re.compile(SESSION_ID_RULE)

#: A session channel, as a JSON Schema (``^…$`` anchored as in ECMA-262).
SESSION_CHANNEL_SCHEMA: dict[str, Any] = {"type": "string", "pattern": f"^{CHANNEL_RULE}$"}
#: A session id, as a JSON Schema (``^…$`` anchored as in ECMA-262).
SESSION_ID_SCHEMA: dict[str, Any] = {"type": "string", "pattern": f"^{SESSION_ID_RULE}$"}

_SHOWN_CHARS = 40


def shown(value: object) -> str:
    """`value` for an error message: its repr, cut to a short prefix with its length when long."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return f"{value[:_SHOWN_CHARS]!r}… ({len(value)} characters)"
    return repr(value)


def channel_problem(value: object) -> str | None:
    """Why `value` is not a valid channel, or None."""
    if isinstance(value, str) and _CHANNEL_RE.fullmatch(value):
        return None
    return f"invalid channel {shown(value)}: use 1-{MAX_CHANNEL_CHARS} of A-Z a-z 0-9 _ . -"


def session_id_problem(value: object) -> str | None:
    """Why `value` is not a valid session id, or None."""
    if isinstance(value, str) and _SESSION_ID_RE.fullmatch(value):
        return None
    return f"invalid session_id {shown(value)}: use 1-{MAX_SESSION_ID_CHARS} of A-Z a-z 0-9 _ . : @ -"


def session_problem(channel: object, session_id: object) -> str | None:
    """Why `channel` and `session_id` do not name a valid session, or None."""
    return channel_problem(channel) or session_id_problem(session_id)


def session_key_problem(key: object) -> str | None:
    """Why `key` is not a valid session key (`channel:id`, or a bare id in channel `mcp`), or None."""
    if not isinstance(key, str):
        return f"invalid session {shown(key)}: want 'channel:id'"
    channel, sep, sid = key.partition(":")
    if not sep:
        channel, sid = DEFAULT_CHANNEL, key
    problem = session_problem(channel, sid)
    return f"invalid session {shown(key)}: {problem}" if problem else None


def check_session(channel: object, session_id: object) -> None:
    """Raise ``RelayError(INVALID_PARAMS)`` unless `channel` and `session_id` name a valid session."""
    problem = session_problem(channel, session_id)
    if problem:
        raise RelayError(INVALID_PARAMS, problem)


def check_session_key(key: object) -> None:
    """Raise ``RelayError(INVALID_PARAMS)`` unless `key` is a valid ``channel:id`` session key."""
    problem = session_key_problem(key)
    if problem:
        raise RelayError(INVALID_PARAMS, problem)
