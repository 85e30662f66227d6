"""Limits on what crosses a boundary: encoded size and nesting depth, checked before anything is stored.

A value that the server accepts must always reach whoever reads it next: the guest
(one relay line, at most :data:`DEFAULT_MAX_FRAME_BYTES`), the agent's client (the
``caller_tool`` response, also one relay line) and the caller (an MCP message that
its SDK parses). So every ingress checks a caller's or a sandbox's value against
:class:`Limits` first, and refuses what is over with a :class:`LimitExceeded` that
names the limit and its setting; nothing is stored.

Sizes are measured exactly as :func:`protocol.framing.encode` writes a line
(``json.dumps`` compact, ``ensure_ascii=False``): non-ASCII text counts its UTF-8
bytes, and a control character counts the 6 bytes of its ``\\u0001`` escape (JSON
escapes those under either ``ensure_ascii`` setting, and pydantic, which the MCP SDK
uses, writes the same bytes). So 200,000 x U+0001 is 1.2 MB here, not 200 kB.

Depth is counted in containers: ``0`` is 0 deep, ``[0]`` 1, ``{"a": [0]}`` 2. The
walk is iterative and bounded by the size limit, so a 100,000-deep (or cyclic) value
costs no stack and little time.

This module uses no Trio; it imports only the error type, the frame types' rule and the session
keys' length limits.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from .errors import INVALID_PARAMS, RelayError
from .frames import MAX_FRAME_TYPE_CHARS, frame_type_problem
from .framing import compact_json
from .session_keys import MAX_CHANNEL_CHARS, MAX_SESSION_ID_CHARS, shown

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_DEPTH",
    "MAX_DEPTH_CEILING",
    "ENVELOPE_OVERHEAD_BYTES",
    "WRAPPER_OVERHEAD_BYTES",
    "MAX_PAYLOAD_BYTES_CEILING",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "LimitExceeded",
    "Limits",
    "encoded_size",
    "nesting_depth",
]

#: One relay line (``protocol.framing.MAX_FRAME_BYTES``; a test keeps the two equal).
DEFAULT_MAX_FRAME_BYTES = 1024 * 1024

#: Default nesting limit of a payload. Why 64: the callers' MCP SDK (pydantic-core's
#: JSON parser, jiter) refuses a message nested 200 levels deep and its serializer stops
#: at 255 ("Maximum serialization depth exceeded"); the envelopes around a payload (JSON-RPC
#: message, params, event or frame, the result wrapper, MCP content) add at most 8 levels.
#: 64 leaves a threefold margin under what breaks and is far deeper than tool arguments
#: or results that people write (rarely over 10).
DEFAULT_MAX_DEPTH = 64
#: The highest depth a setting may ask for: 128 + envelopes stays well under the parsers' 200.
MAX_DEPTH_CEILING = 128

# The longest identifiers an envelope carries, as the server's checks bound them.
_MAX_INSTANCE = 64  # auth.check_instance_id
_MAX_MSG_ID = 128  # tether ingress msg_id / reply_to
_MAX_TOOL_NAME = 128  # caller tool names
_MAX_CALLER_ID = 32  # context.caller_id
_MAX_RPC_ID = 64  # a relay request id (oubliette-client sends small integers)
_MAX_SEQ = 2**63 - 1  # seq is a SQLite integer
_TS = "2026-11-22T10:00:00.123Z"  # store.format_ts: fixed width
_GENERATED_MSG_ID = "m-" + "0" * 32  # store: "m-" + 32 random hex digits
_REQUEST_ID = "ctr-" + "0" * 16  # caller_tool_relay.pending


def _bytes(value: Any) -> int:
    """The bytes `value` takes on the wire (``protocol.framing.encode``'s text)."""
    return len(compact_json(value).encode("utf-8"))


def _frame_wire(
    instance: str, channel: str, session_id: str, type: str, msg_id: str, reply_to: str | None, payload: Any
) -> dict[str, Any]:
    """A frame as ``Frame.to_wire`` writes it, with the largest seq."""
    wire: dict[str, Any] = {
        "v": 1, "seq": _MAX_SEQ, "ts": _TS, "instance": instance,
        "session": {"channel": channel, "id": session_id}, "type": type, "msg_id": msg_id,
    }
    if reply_to is not None:
        wire["reply_to"] = reply_to
    wire["payload"] = payload
    return wire


def _guest_delivery(frame: dict[str, Any]) -> dict[str, Any]:
    """The ``user_message`` notification that carries a frame to the guest."""
    return {"jsonrpc": "2.0", "method": "user_message", "params": {"frame": frame}}


@functools.lru_cache(maxsize=4096)
def _frame_overhead(
    instance: str, channel: str, session_id: str, type: str, msg_id: str | None, reply_to: str | None
) -> int:
    """Bytes of a delivered frame's line besides its payload's own encoding (no newline).

    Cached: every frame of a session has the same envelope but for its ids, and `FrameLog.append`
    asks for each frame it stores (it need not encode the envelope again each time)."""
    frame = _frame_wire(instance, channel, session_id, type, msg_id or _GENERATED_MSG_ID, reply_to, {})
    return _bytes(_guest_delivery(frame)) - len("{}")


def _compute_envelope_overhead() -> int:
    """The largest envelope a payload travels in, on one relay line.

    Two envelopes reach a sandbox: a frame delivered to the guest (``user_message``) and
    the response to the client's ``caller_tool`` request (``{"result": value}``).
    """
    delivered = _frame_overhead(
        "i" * _MAX_INSTANCE, "c" * MAX_CHANNEL_CHARS, "s" * MAX_SESSION_ID_CHARS, "t" * MAX_FRAME_TYPE_CHARS,
        "m" * _MAX_MSG_ID, "r" * _MAX_MSG_ID,
    )
    response = _bytes({"jsonrpc": "2.0", "id": "x" * _MAX_RPC_ID, "result": {"result": 0}}) - 1
    return max(delivered, response)


def _compute_wrapper_overhead() -> int:
    """The largest payload the server builds around one value from a caller or a sandbox."""
    tool, caller_id = "t" * _MAX_TOOL_NAME, "c" * _MAX_CALLER_ID
    wrappers = [
        {"text": 0},  # user.message
        {"request_id": _REQUEST_ID, "tool": tool, "arguments": 0, "caller_id": caller_id,
         "expires_at": "2026-11-22T10:00:00.000Z"},  # caller_tool_request
        {"request_id": _REQUEST_ID, "tool": tool, "result": 0},  # caller_tool_result
        {"request_id": _REQUEST_ID, "tool": tool, "error": 0},
    ]
    return max(_bytes(w) for w in wrappers) - 1


#: Bytes of the largest envelope around a frame payload on a relay line (no newline).
ENVELOPE_OVERHEAD_BYTES = _compute_envelope_overhead()
#: Bytes of the largest payload the server wraps around one value.
WRAPPER_OVERHEAD_BYTES = _compute_wrapper_overhead()
#: The largest value that still fits one relay line in any envelope: no setting may exceed it.
MAX_PAYLOAD_BYTES_CEILING = DEFAULT_MAX_FRAME_BYTES - ENVELOPE_OVERHEAD_BYTES - WRAPPER_OVERHEAD_BYTES
#: Default size limit of one value (a message text, tool arguments, a result, a frame payload).
DEFAULT_MAX_PAYLOAD_BYTES = MAX_PAYLOAD_BYTES_CEILING


class LimitExceeded(RelayError):
    """A value over a limit; ``limit`` is the setting's name, ``data`` says the numbers.

    The code is ``INVALID_PARAMS``: the request is well-formed JSON-RPC, its params are not
    acceptable. HTTP adapters answer 413 for a size limit and 400 for depth.
    """

    limit: str

    def __init__(self, limit: str, message: str, maximum: int, actual: int | None = None) -> None:
        data: dict[str, Any] = {"limit": limit, "max": maximum}
        if actual is not None:
            data["actual"] = actual
        super().__init__(INVALID_PARAMS, message, data)
        self.limit = limit

    @property
    def is_size(self) -> bool:
        """A size limit (as opposed to depth)."""
        return self.limit != "max_payload_depth"


def nesting_depth(value: Any, stop_above: int, max_nodes: int) -> tuple[int, int]:
    """``(depth, nodes)`` of a JSON-like value, without recursion.

    Stops as soon as the depth exceeds ``stop_above`` or more than ``max_nodes``
    containers and items have been seen (a value that large cannot fit anyway), so the
    cost is bounded whatever the value is (100,000 deep, shared, or cyclic).
    """
    if not isinstance(value, (dict, list, tuple)):
        return 0, 1
    deepest = 0
    nodes = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > stop_above:
                break
        children = node.values() if isinstance(node, dict) else node
        nodes += len(children)
        if nodes > max_nodes:
            break
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest, nodes


def _check_frame_id(name: str, value: str, type: str) -> None:
    """Refuse a frame's ``msg_id`` or ``reply_to`` that no envelope bound allows for: longer than
    128 characters, or with a lone surrogate (no UTF-8 encoding: it would end as an internal error)."""
    try:
        value.encode("utf-8")
        encodable = True
    except UnicodeEncodeError:
        encodable = False
    if not encodable or len(value) > _MAX_MSG_ID:
        raise RelayError(
            INVALID_PARAMS,
            f"{name} {shown(value)} of a {type!r} frame: use at most {_MAX_MSG_ID} characters of text "
            "(the msg_id of the frame it answers)",
        )


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` encoded as on a relay line; ``LimitExceeded``-free, raises for non-JSON."""
    return _bytes(value)


@attrs.frozen
class Limits:
    """The limits of one server; :meth:`check_value` at every ingress, :meth:`check_frame` when storing.

    ``max_payload_bytes``: the largest value (a message text, tool arguments, a result or
    error, a frame payload, a caller tools declaration), encoded; at most
    :data:`MAX_PAYLOAD_BYTES_CEILING`, the default. ``max_depth``: the deepest nesting,
    1 to :data:`MAX_DEPTH_CEILING`, default :data:`DEFAULT_MAX_DEPTH`. ``max_frame_bytes``
    is the relay line limit, not a setting.
    """

    max_payload_bytes: int = attrs.field(default=DEFAULT_MAX_PAYLOAD_BYTES)
    max_depth: int = attrs.field(default=DEFAULT_MAX_DEPTH)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    @max_payload_bytes.validator
    def _check_bytes(self, attribute: Any, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 1024 <= value <= MAX_PAYLOAD_BYTES_CEILING:
            raise ValueError(
                f"max_payload_bytes must be between 1024 and {MAX_PAYLOAD_BYTES_CEILING} "
                f"(what still fits one relay line), got {value!r}"
            )

    @max_depth.validator
    def _validate_max_depth(self, attribute: Any, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DEPTH_CEILING:
            raise ValueError(f"max_payload_depth must be between 1 and {MAX_DEPTH_CEILING}, got {value!r}")

    def check_value(self, value: Any, what: str) -> None:
        """Refuse ``value`` (described as ``what`` in the message) if it is too deep, too large or not JSON.

        Raises :class:`LimitExceeded` naming ``max_payload_depth`` or ``max_payload_bytes``,
        or ``RelayError(INVALID_PARAMS)`` for a value that is not JSON (NaN, a set).
        """
        self._check_depth(value, what)
        size = self._size(value, what)
        if size > self.max_payload_bytes:
            raise LimitExceeded(
                "max_payload_bytes",
                f"{what} is {size} bytes once encoded; the limit (max_payload_bytes) is {self.max_payload_bytes} bytes",
                self.max_payload_bytes, size,
            )

    def check_frame(
        self,
        payload: Any,
        *,
        instance: str,
        channel: str,
        session_id: str,
        type: str,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> None:
        """The last line before storing: a stored frame is always deliverable.

        Refuses a ``type`` outside its rule (``protocol.frames.frame_type_problem``: at most 64
        characters), a ``msg_id`` or ``reply_to`` over 128 characters or not text (a lone surrogate:
        it could not be encoded, and a peer chooses it), a payload nested deeper than
        ``max_depth``, or a frame whose delivery line
        (the guest's ``user_message`` notification, the largest envelope a frame travels
        in, with the largest seq) would exceed ``max_frame_bytes``.
        """
        problem = frame_type_problem(type)
        if problem is not None:
            raise RelayError(INVALID_PARAMS, problem)
        what = f"the payload of a {type!r} frame"
        for name, value in (("msg_id", msg_id), ("reply_to", reply_to)):
            if value is not None:
                _check_frame_id(name, value, type)
        self._check_depth(payload, what)
        line = _frame_overhead(instance, channel, session_id, type, msg_id, reply_to) + self._size(payload, what)
        if line > self.max_frame_bytes:
            raise LimitExceeded(
                "max_frame_bytes",
                f"a {type!r} frame would be {line} bytes on the wire; a relay line holds at most "
                f"{self.max_frame_bytes} bytes (max_frame_bytes), so it could never be delivered",
                self.max_frame_bytes, line,
            )

    def _check_depth(self, value: Any, what: str) -> None:
        depth, nodes = nesting_depth(value, self.max_depth, self.max_frame_bytes)
        if depth > self.max_depth:
            raise LimitExceeded(
                "max_payload_depth",
                f"{what} is nested more than {self.max_depth} levels deep; "
                f"the limit (max_payload_depth) is {self.max_depth}",
                self.max_depth,
            )
        if nodes > self.max_frame_bytes:  # every item costs at least one byte: it cannot fit
            raise LimitExceeded(
                "max_payload_bytes",
                f"{what} has more than {self.max_frame_bytes} items; "
                f"the limit (max_payload_bytes) is {self.max_payload_bytes} bytes",
                self.max_payload_bytes,
            )

    @staticmethod
    def _size(value: Any, what: str) -> int:
        try:
            return _bytes(value)
        except (TypeError, ValueError) as exc:
            raise RelayError(INVALID_PARAMS, f"{what} is not JSON: {exc}") from None
