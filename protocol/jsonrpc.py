"""The JSON-RPC 2.0 envelope: classify and check incoming objects, build outgoing ones.

Checking the envelope once, here, means handlers only ever see well-formed requests,
responses and notifications, and a peer that sends garbage gets an error naming exactly
what was wrong.
"""

from __future__ import annotations

from typing import Any

import attrs

from .convert import unstructure
from .errors import INVALID_REQUEST, RelayError

__all__ = [
    "JSONRPC_VERSION",
    "Request",
    "Response",
    "Notification",
    "Message",
    "parse_message",
    "request",
    "notification",
    "result_response",
    "error_response",
]

JSONRPC_VERSION = "2.0"


@attrs.define(frozen=True)
class Request:
    """A call that expects exactly one response with the same ``id``."""

    id: int | str
    method: str
    params: dict[str, Any] = attrs.field(factory=dict)


@attrs.define(frozen=True)
class Response:
    """The answer to a request: ``error`` set means it failed, otherwise ``result`` holds."""

    id: int | str | None
    result: Any = None
    error: RelayError | None = None

    @property
    def is_error(self) -> bool:
        """Whether the request failed."""
        return self.error is not None


@attrs.define(frozen=True)
class Notification:
    """A one-way message; nobody answers it."""

    method: str
    params: dict[str, Any] = attrs.field(factory=dict)


Message = Request | Response | Notification


def _invalid(message: str) -> RelayError:
    return RelayError(INVALID_REQUEST, message)


def _is_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def parse_message(obj: dict[str, Any]) -> Message:
    """Classify a decoded frame, or raise ``RelayError(INVALID_REQUEST)`` saying what is wrong.

    Only object ``params`` are accepted (every method here takes named params); a missing
    ``params`` is ``{}``. Unknown extra keys are ignored.
    """
    if not isinstance(obj, dict):
        raise _invalid("message is not a JSON object")
    if "jsonrpc" not in obj:
        raise _invalid("message has no 'jsonrpc' member (must be \"2.0\")")
    if obj["jsonrpc"] != JSONRPC_VERSION:
        raise _invalid(f"'jsonrpc' must be \"2.0\", got {obj['jsonrpc']!r}")

    if "method" in obj:
        method = obj["method"]
        if not isinstance(method, str) or not method:
            raise _invalid("'method' must be a non-empty string")
        if "result" in obj or "error" in obj:
            raise _invalid("a request or notification must not carry 'result' or 'error'")
        params = obj.get("params", {})
        if not isinstance(params, dict):
            raise _invalid(f"'params' of {method!r} must be an object")
        if "id" not in obj:
            return Notification(method, params)
        msg_id = obj["id"]
        if not _is_id(msg_id):
            raise _invalid(f"'id' of {method!r} must be an integer or a string")
        return Request(msg_id, method, params)

    has_result = "result" in obj
    has_error = "error" in obj
    if not has_result and not has_error:
        raise _invalid("message has neither 'method' nor 'result'/'error'")
    if has_result and has_error:
        raise _invalid("a response must not carry both 'result' and 'error'")
    if "id" not in obj:
        raise _invalid("a response must carry 'id'")
    msg_id = obj["id"]
    if has_result:
        if not _is_id(msg_id):
            raise _invalid("the 'id' of a result response must be an integer or a string")
        return Response(msg_id, result=obj["result"])
    if msg_id is not None and not _is_id(msg_id):
        raise _invalid("the 'id' of an error response must be an integer, a string or null")
    err = obj["error"]
    if not isinstance(err, dict):
        raise _invalid("'error' must be an object")
    code = err.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        raise _invalid("'error.code' must be an integer")
    if not isinstance(err.get("message"), str):
        raise _invalid("'error.message' must be a string")
    return Response(msg_id, error=RelayError.from_dict(err))


def _params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    data = unstructure(params) if attrs.has(type(params)) else params
    if not isinstance(data, dict):
        raise TypeError(f"params must be an object, not {type(data).__name__}")
    return data


def request(id: int | str, method: str, params: Any = None) -> dict[str, Any]:
    """A request dict; ``params`` may be a dict or a protocol attrs instance."""
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "method": method, "params": _params(params)}


def notification(method: str, params: Any = None) -> dict[str, Any]:
    """A notification dict; ``params`` may be a dict or a protocol attrs instance."""
    return {"jsonrpc": JSONRPC_VERSION, "method": method, "params": _params(params)}


def result_response(id: int | str, result: Any) -> dict[str, Any]:
    """A success response; an attrs ``result`` is unstructured."""
    value = unstructure(result) if attrs.has(type(result)) else result
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "result": value}


def error_response(id: int | str | None, err: RelayError) -> dict[str, Any]:
    """An error response; ``id`` is ``None`` when the request's id could not be read."""
    return {"jsonrpc": JSONRPC_VERSION, "id": id, "error": err.to_dict()}
