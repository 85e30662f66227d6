"""JSON Schemas (draft 2020-12) of every method's params and result, collected by name, and the
one check of a relay message.

Each schema is derived from its attrs class (:func:`protocol.schema_parts.schema_of`: field types,
required fields, the bounds a field declares), so a shape is written once, in
:mod:`protocol.messages`, :mod:`protocol.frames` or :mod:`protocol.descriptors`. The schemas are
the language-neutral statement of the wire shapes, for peers written in other languages, docs and
tests; the action contract's request and response (:mod:`protocol.descriptors`) are the only ones
written by hand, being unions with no class. :func:`parse_params` checks untrusted params against
the schema once and builds the class from them without checking again.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .convert import build_valid
from .descriptors import ACTION_REQUEST_SCHEMA, ACTION_RESPONSE_SCHEMA, ToolDescriptor
from .errors import METHOD_NOT_FOUND, RelayError
from .frames import Frame, SessionRef
from .messages import (
    METHODS,
    PARAMS_TYPES,
    RESULT_TYPES,
    CallerToolSpec,
    ToolsetToolSpec,
    UnavailableToolset,
)
from .schema_check import protocol_validator, require_valid
from .schema_parts import SCHEMA_DIALECT, document, schema_of

__all__ = [
    "SCHEMA_DIALECT",
    "SCHEMAS",
    "CALLER_TOOL_SPEC_SCHEMA",
    "validate_params",
    "validator_for",
    "parse_params",
]

#: The JSON Schema of a :class:`protocol.messages.CallerToolSpec`, also what a caller
#: declares in ``session_message`` (the server's caller-facing schema is this one).
CALLER_TOOL_SPEC_SCHEMA: dict[str, Any] = schema_of(CallerToolSpec)

# The shapes with a schema of their own besides the methods' params and results.
_SHAPES: dict[str, type[Any]] = {
    "frame": Frame,
    "session_ref": SessionRef,
    "caller_tool_spec": CallerToolSpec,
    "toolset_tool_spec": ToolsetToolSpec,
    "unavailable_toolset": UnavailableToolset,
    "tool_descriptor": ToolDescriptor,
}


def _document(cls: type[Any]) -> dict[str, Any]:
    return document(cls.wire_label, schema_of(cls))


#: Schema name -> JSON Schema. Method names hold that method's params, ``<method>_result`` its
#: result; ``frame``, ``session_ref``, ``caller_tool_spec``, ``toolset_tool_spec``,
#: ``unavailable_toolset`` the other relay shapes; ``tool_descriptor``, ``action_request`` and
#: ``action_response`` the action contract (:mod:`protocol.descriptors`).
SCHEMAS: dict[str, dict[str, Any]] = {
    **{method: _document(cls) for method, cls in PARAMS_TYPES.items()},
    **{f"{method}_result": _document(cls) for method, cls in RESULT_TYPES.items()},
    **{name: _document(cls) for name, cls in _SHAPES.items()},
    "action_request": document("action request", ACTION_REQUEST_SCHEMA),
    "action_response": document("action response", ACTION_RESPONSE_SCHEMA),
}


@lru_cache(maxsize=None)
def validator_for(name: str) -> Any:
    """The compiled (cached) validator of a schema in :data:`SCHEMAS`; ``KeyError`` if unknown."""
    return protocol_validator(SCHEMAS[name])


def validate_params(method: str, params: dict[str, Any]) -> None:
    """Check ``params`` against the schema named ``method``.

    Raises ``RelayError(INVALID_PARAMS)`` naming the JSON path and the problem, or
    ``RelayError(METHOD_NOT_FOUND)`` for a name without a schema.
    """
    try:
        validator = validator_for(method)
    except KeyError:
        raise RelayError(METHOD_NOT_FOUND, f"unknown method {method!r}") from None
    label = f"{method} params" if method in METHODS else method.replace("_", " ")
    require_valid(validator, params, label)


def parse_params(method: str, params: dict[str, Any], cls: type[Any] | None = None) -> Any:
    """Check ``params`` against the method's schema, then build its params class (or ``cls``).

    The one check of an incoming request or notification: the schema is derived from the class,
    so what it accepts the class holds, and the build checks nothing again. Raises
    ``RelayError`` (``METHOD_NOT_FOUND`` or ``INVALID_PARAMS``).
    """
    cls = cls or PARAMS_TYPES.get(method)
    if cls is None:
        raise RelayError(METHOD_NOT_FOUND, f"unknown method {method!r}")
    validate_params(method, params)
    return build_valid(params, cls)
