"""The Oubliette relay wire protocol, shared by oubliette-server and oubliette-client.

Newline-delimited JSON-RPC 2.0 over a Unix or TCP socket (see ``docs/PROTOCOL.md``).
This package is the single definition of the wire: framing, envelope, typed messages,
JSON Schemas and error codes, the tether frame (``protocol.frames``), the sans-IO connection
(``protocol.core``) and the one Trio peer over it (``protocol.peer``), plus the tool
descriptors and action contract of docs/TOOLSETS.md (``protocol.descriptors``). It imports nothing from either
program, and its modules form layers (each imports only those below it), listed once, as the
``protocol-layers`` contract of ``pyproject.toml`` (``[tool.importlinter]``). It is also the
home of both programs' ``VERSION`` and of ``lazy_exports``, the loader every package uses.

Every public name is importable from the package (``from protocol import RelayPeer``), but a
module is imported only when one of its names is first asked for (PEP 562): a program loads
only the layers it uses, which keeps ``oubliette-client``'s cold start (spawn → ``initialize``
answered) under the SDK's own. ``_EXPORTS`` lists each module's ``__all__``;
tests/protocol/test_protocol.py checks that it matches.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .addresses import *  # noqa: F403
    from .convert import *  # noqa: F403
    from .core import *  # noqa: F403
    from .descriptors import *  # noqa: F403
    from .errors import *  # noqa: F403
    from .frames import *  # noqa: F403
    from .framing import *  # noqa: F403
    from .jsonrpc import *  # noqa: F403
    from .messages import *  # noqa: F403
    from .peer import *  # noqa: F403
    from .schemas import *  # noqa: F403

VERSION = "0.1.0"
"""Both programs' version (`--version`, the relay's `hello` answer, the MCP `serverInfo`)."""


def lazy_exports(
    package: str, module_of: Mapping[str, str], names: Iterable[str], namespace: dict[str, Any],
    *, submodules: Collection[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's PEP 562 `__getattr__` and `__dir__`: a public name imports its module (`module_of`,
    relative to `package`) when first asked for, and is kept in `namespace` after; a name in
    `submodules` is that submodule. Every package of both programs loads its modules this way, so
    a cold start imports only what it uses.
    """

    def __getattr__(name: str) -> Any:
        """A public name (or a submodule), importing its module on first use."""
        module = module_of.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif name in submodules:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        """The package's names, the lazy ones included."""
        return sorted({*namespace, *names, *submodules})

    return __getattr__, __dir__


#: Each module's public names (its ``__all__``), in the order ``__all__`` lists them.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "addresses": (
        'RelayAddress', 'connect_relay', 'parse_relay_address',
    ),
    "errors": (
        'PARSE_ERROR', 'INVALID_REQUEST', 'METHOD_NOT_FOUND', 'INVALID_PARAMS', 'INTERNAL_ERROR',
        'TIMEOUT', 'PEER_DISCONNECTED', 'CANCELLED', 'TOOL_ERROR', 'NOT_FOUND', 'UNAUTHORIZED',
        'DENIED', 'ERROR_NAMES', 'CATEGORIES', 'CATEGORY_BY_CODE', 'error_category', 'RelayError',
    ),
    "framing": (
        'MAX_FRAME_BYTES', 'RECEIVE_CHUNK_BYTES', 'encode', 'decode', 'FrameTooLarge', 'LineBuffer',
        'END_OF_STREAM', 'read_lines',
    ),
    "jsonrpc": (
        'JSONRPC_VERSION', 'Request', 'Response', 'Notification', 'Message', 'parse_message', 'request',
        'notification', 'result_response', 'error_response',
    ),
    "frames": (
        'DEFAULT_CHANNEL', 'FRAME_VERSION', 'FRAME_TYPES', 'FRAME_TYPE_RULE', 'FRAME_TYPE_SCHEMA', 'MAX_FRAME_TYPE_CHARS',
        'frame_type_problem', 'FrameType', 'TURN_END_TYPES', 'SESSION_CHANNEL_SCHEMA',
        'SESSION_ID_SCHEMA', 'SESSION_REF_SCHEMA', 'FRAME_SCHEMA', 'INGRESS_FIELDS', 'INGRESS_SCHEMA',
        'SessionRef', 'Frame', 'utc_timestamp',
    ),
    "messages": (
        'PROTOCOL_VERSION', 'APPEND_ID_FEATURE', 'APPEND_ID_RULE', 'server_features', 'is_append_id',
        'CALLER_ID_SCHEMA', 'HELLO',
        'CALLER_TOOLS_CONFIG', 'CALLER_TOOL', 'CANCEL', 'USER_MESSAGE',
        'ACK', 'APPEND_FRAME', 'TOOLSETS_CONFIG', 'TOOLSET_CALL', 'TOOL_SEPARATORS', 'APPROVAL', 'PROGRESS', 'METHODS',
        'ROLE_CLIENT', 'ROLE_GUEST', 'ROLES', 'Hello', 'HelloResult', 'CallerToolSpec',
        'CallerToolsConfig', 'CallerToolCall', 'CallerToolResult', 'Cancel', 'ToolsetToolSpec', 'UnavailableToolset',
        'ToolsetsConfig', 'ToolsetCall', 'ToolsetCallResult', 'AgentApproval', 'AgentApprovalResult',
        'Progress', 'UserMessageDelivery', 'Ack', 'AppendFrame', 'AppendFrameResult', 'PARAMS_TYPES',
        'RESULT_TYPES',
    ),
    "descriptors": (
        'DESCRIPTOR_META_KEY', 'ACTIONS', 'LIST_TOOLS', 'DESCRIBE_TOOL', 'CALL_TOOL', 'ORIGINS',
        'TOOL_DESCRIPTOR_SCHEMA', 'ACTION_REQUEST_SCHEMA', 'ACTION_RESPONSE_SCHEMA', 'ToolDescriptor',
        'build_descriptor', 'ActionError', 'ActionRequest', 'parse_action_request', 'parse_action_line',
        'list_tools_response', 'describe_tool_response', 'call_tool_response', 'parse_action_response',
        'parse_action_response_line',
    ),
    "convert": (
        'converter', 'make_converter', 'structure', 'build_valid', 'unstructure', 'wire_label', 'StrictTypeError',
        'json_type_name',
    ),
    "schemas": (
        'SCHEMA_DIALECT', 'SCHEMAS', 'CALLER_TOOL_SPEC_SCHEMA', 'validate_params',
        'validator_for', 'parse_params',
    ),
    "core": (
        'ROLE_SERVER', 'PEER_ROLES', 'MethodRule', 'METHOD_RULES', 'senders_of', 'ProtocolError',
        'LocalProtocolError', 'RemoteProtocolError', 'RelayEvent', 'RequestReceived',
        'NotificationReceived', 'ResponseReceived', 'RequestRejected', 'NotificationRejected',
        'ConnectionClosed', 'NEED_DATA', 'EncodedNotification', 'encode_notification', 'RelayCore',
    ),
    "peer": (
        'DEFAULT_WRITE_TIMEOUT', 'DEFAULT_QUEUE_FRAMES', 'DEFAULT_MAX_REQUESTS_IN_FLIGHT', 'HELLO_TIMEOUT',
        'PeerLimits', 'HandlerEntry', 'RelayPeer',
    ),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


__getattr__, __dir__ = lazy_exports(__name__, {name: f".{module}" for name, module in _MODULE_OF.items()}, __all__, globals(), submodules=_EXPORTS)
