"""Error codes and the one exception type that crosses the relay socket.

Every failure that a peer must hear about is a :class:`RelayError`: it carries a JSON-RPC
error code, so the same object can be raised locally and sent as an ``error`` member.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "PARSE_ERROR",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "INVALID_PARAMS",
    "INTERNAL_ERROR",
    "TIMEOUT",
    "PEER_DISCONNECTED",
    "CANCELLED",
    "TOOL_ERROR",
    "NOT_FOUND",
    "UNAUTHORIZED",
    "DENIED",
    "ERROR_NAMES",
    "CATEGORIES",
    "CATEGORY_BY_CODE",
    "error_category",
    "RelayError",
]

# JSON-RPC 2.0 standard codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

# Oubliette codes (JSON-RPC "server error" range).
TIMEOUT = -32001
PEER_DISCONNECTED = -32002
CANCELLED = -32003
TOOL_ERROR = -32004
NOT_FOUND = -32005
UNAUTHORIZED = -32006
DENIED = -32007

#: Short stable names, for logs and for the ``error`` field of events shown to callers.
ERROR_NAMES: dict[int, str] = {
    PARSE_ERROR: "parse_error",
    INVALID_REQUEST: "invalid_request",
    METHOD_NOT_FOUND: "method_not_found",
    INVALID_PARAMS: "invalid_params",
    INTERNAL_ERROR: "internal_error",
    TIMEOUT: "timeout",
    PEER_DISCONNECTED: "peer_disconnected",
    CANCELLED: "cancelled",
    TOOL_ERROR: "tool_error",
    NOT_FOUND: "not_found",
    UNAUTHORIZED: "unauthorized",
    DENIED: "denied",
}


#: The error categories of the action contract's error envelope that Oubliette emits (endpoints may use
#: others; they are passed through). ``pipeline`` is a malformed answer from an endpoint.
CATEGORIES: tuple[str, ...] = (
    "usage", "not_found", "tool", "timeout", "cancelled", "unavailable", "pipeline", "fatal",
)

#: The one table from a relay error code to the category an agent sees in an error envelope
#: (what ``oubliette-client endpoint`` emits). Codes not listed are ``tool``.
CATEGORY_BY_CODE: dict[int, str] = {
    INVALID_PARAMS: "usage",
    TIMEOUT: "timeout",
    PEER_DISCONNECTED: "unavailable",
    CANCELLED: "cancelled",
    TOOL_ERROR: "tool",
    NOT_FOUND: "not_found",
    UNAUTHORIZED: "unavailable",
    DENIED: "tool",
}


def error_category(code: int) -> str:
    """The envelope category of a relay error code (:data:`CATEGORY_BY_CODE`, else ``tool``)."""
    return CATEGORY_BY_CODE.get(code, "tool")


class RelayError(Exception):
    """An error with a JSON-RPC code, raisable locally and sendable as a response ``error``."""

    code: int
    message: str
    data: Any

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        # Passing all three to Exception keeps pickling and copying working.
        super().__init__(code, message, data)
        self.code = code
        self.message = message
        self.data = data

    @property
    def name(self) -> str:
        """The short name of the code (``"timeout"``), or ``"error"`` for an unknown code."""
        return ERROR_NAMES.get(self.code, "error")

    @property
    def category(self) -> str:
        """The error-envelope category of the code (see :func:`error_category`)."""
        return error_category(self.code)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-RPC ``error`` member; ``data`` only when there is some."""
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            out["data"] = self.data
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RelayError:
        """Rebuild an error received from a peer (always a plain :class:`RelayError`).

        Raises ``ValueError`` when ``d`` is not a valid error object; :func:`parse_message`
        checks the shape before it calls this.
        """
        code = d.get("code") if isinstance(d, Mapping) else None
        message = d.get("message") if isinstance(d, Mapping) else None
        if not isinstance(code, int) or isinstance(code, bool) or not isinstance(message, str):
            raise ValueError("an error object needs an integer 'code' and a string 'message'")
        return RelayError(code, message, d.get("data"))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        extra = f", data={self.data!r}" if self.data is not None else ""
        return f"{type(self).__name__}({self.code}, {self.message!r}{extra})"
