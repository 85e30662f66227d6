"""What only the server states in the frame log, and the one rule every door applies to it.

The servers read some frames back from the log and act on them as facts: who owns a session and
which caller tools it declared (with a shared store, a server that holds no caller for the
session reads them, docs/SCALING.md), and the relayed calls and approvals with their outcomes.
A peer that could store such a frame could make those facts up: a sandbox re-declaring its
caller's gated tools as ungated, or naming a session's owner.

Decision (docs/SECURITY.md, "Server-owned frames and payload keys"):

- such facts are frames of a **type only the server appends** (`SERVER_OWNED_TYPES`); a session's
  owner and its declaration are a `session_record` frame (`{owner, caller_tools?}`), never keys
  of a `user.message`;
- the log's readers trust only those types (`cluster/log_bus.py` reads `session_record`
  and nothing else for ownership and declarations);
- every door that stores a frame a peer shaped — `FrameLog.ingress` (the HTTP tether POST,
  `tether_send`, `session_message`'s message) and a guest's `append_frame`
  (`guests/guest_frames.py`) — calls `refuse_server_owned` before anything is stored (the MCP
  `tether_send` also on its arguments, which the original tether schema does not close). It refuses
  those types, and the server's record keys (`SERVER_OWNED_KEYS`) at the top of any payload:
  the reader no longer looks at them elsewhere, but a producer learns at once that they are not
  its to write, and a server of an older release sharing the database (which took them from any
  `user.message`) is not fooled by a frame a newer one stored.

The server's own appends (`FrameLog.append`, `append_outcome`, `record`) do not pass through
this check: only a door does.
"""

from __future__ import annotations

from typing import Any

from protocol import RelayError, errors

# The server's record of a session (`{owner, caller_tools?}`) and its keys are named in the store's
# layer, which finds a session's records by an index on that type (`FrameStoreAPI.session_records`).
from ..store.api import DECLARATION_KEY, OWNER_KEY, SESSION_RECORD

__all__ = [
    "DECLARATION_KEY", "OWNER_KEY", "POLICY_DECISION", "POLICY_KEY", "PUSHED_TO_NOBODY", "SERVER_OWNED_KEYS", "SERVER_OWNED_TYPES", "SESSION_RECORD", "refuse_server_owned",
]

POLICY_DECISION = "policy_decision"
"""The deployment's policies' decision on an agent's tool call (features/policy/gate.py)."""
POLICY_KEY = "policy"
"""The key of a request frame (`caller_tool_request`, `approval_request`) that carries the policies'
decision on its call instead of a `policy_decision` frame (docs/POLICY.md)."""

SERVER_OWNED_TYPES = frozenset({
    SESSION_RECORD,
    "caller_tool_request", "caller_tool_result", "caller_tool_cancelled", "caller_tool_progress",
    "approval_request", "approval_resolved", POLICY_DECISION,
})
"""Frame types only the server appends; every door refuses them."""

PUSHED_TO_NOBODY = frozenset({SESSION_RECORD, POLICY_DECISION})
"""The server's own records (`FrameLog.record`): no event of the conversation, pushed to no
follower by the server that stores one, nor by another server's log tail."""

SERVER_OWNED_KEYS = frozenset({DECLARATION_KEY, OWNER_KEY})
"""Payload keys of the server's own records; every door refuses them at the top of a payload."""


def refuse_server_owned(type: Any, payload: Any, where: str = "payload") -> None:
    """Raise `RelayError(INVALID_PARAMS)`, naming the type or key, for a frame a peer may not store.

    Every door calls this before anything is stored (see the module's docstring); the server's
    own appends never do. `where` names what `payload` is to the peer (`tether_send` checks its
    arguments: the original tether schema lets unknown ones through).
    """
    if isinstance(type, str) and type in SERVER_OWNED_TYPES:
        raise RelayError(
            errors.INVALID_PARAMS, f"frames of type {type!r} are made by the server only; nothing was stored",
        )
    owned = sorted(SERVER_OWNED_KEYS.intersection(payload)) if isinstance(payload, dict) else []
    if owned:
        raise RelayError(
            errors.INVALID_PARAMS,
            f"{where} key {owned[0]!r} is written by the server only (a session's owner and caller tools are "
            "recorded by the server from its caller's session_message); nothing was stored",
        )
