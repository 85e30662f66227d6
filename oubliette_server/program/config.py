"""Server settings, with the defaults a user gets when passing no flags."""

from __future__ import annotations

import grp
import os
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from protocol.limits import DEFAULT_MAX_DEPTH, DEFAULT_MAX_PAYLOAD_BYTES, Limits
from protocol.messages import TOOL_SEPARATORS

from ..core.client_connections import DEFAULT_MAX_CLIENT_CONNECTIONS
from ..core.sessions import DEFAULT_MAX_SESSIONS
from ..core.toml_types import wrong_type
from ..doors.connection_limits import (
    DEFAULT_HTTP_BODY_TIMEOUT,
    DEFAULT_HTTP_KEEP_ALIVE_MAX_REQUESTS,
    DEFAULT_HTTP_KEEP_ALIVE_TIMEOUT,
    DEFAULT_RELAY_HELLO_TIMEOUT,
    HttpLimits,
    RelayLimits,
)
from ..features.approvals import DEFAULT_APPROVAL_TIMEOUT, DELIVERIES
from ..store.api import DEFAULT_CHECKPOINT_EVERY, check_checkpoint_every

MAX_SESSIONS_CEILING = 1_000_000

DEFAULT_CALLER_TIMEOUT = 60.0
DEFAULT_SESSION_WAIT = 600.0
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_RELAY_WRITE_TIMEOUT = 10.0
DEFAULT_STORE_POOL_SIZE = 4
DEFAULT_STORE_CONNECT_TIMEOUT = 10.0
DEFAULT_STORE_LEASE_TTL = 10.0
STORE_URL_SCHEMES = ("postgresql://", "postgres://")


def relay_group_id(group: str | int) -> int:
    """A group's id from its name or number (a number need not name a group in /etc/group: a
    container's `--group-add` takes numbers). Raises `ValueError` for an unknown name."""
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"relay_group: no group named {group!r} on this host") from None


def default_data_dir() -> Path:
    """`$OUBLIETTE_DATA_DIR`, else the XDG data home's `oubliette` folder."""
    env = os.environ.get("OUBLIETTE_DATA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "oubliette"


def _toolset_entries(value: Any) -> list[Any]:
    """`ServerConfig.toolsets` as entries: `ToolsetEntry` values as given; a `[toolsets]`-shaped
    mapping (id → table), or tables with their `id`, checked as the config file's are."""
    if not isinstance(value, Mapping) and not any(isinstance(item, Mapping) for item in value):
        return list(value)
    from ..features.toolsets.from_config import parse_toolsets

    if isinstance(value, Mapping):
        return parse_toolsets(dict(value), "ServerConfig.toolsets")
    return [
        parse_toolsets({item["id"]: {k: v for k, v in item.items() if k != "id"}}, "ServerConfig.toolsets")[0]
        if isinstance(item, Mapping) else item
        for item in value
    ]


def _allowlists(value: Any) -> dict[str, list[str]]:
    """`ServerConfig.allowlists`, checked as the config file's `[allowlists]` is."""
    if not value:
        return {}
    from ..features.toolsets.from_config import parse_allowlists

    return parse_allowlists(value, "ServerConfig.allowlists")


@attrs.define
class ServerConfig:
    """Everything `OublietteServer` needs; the CLI builds one from flags."""

    data_dir: Path = attrs.field(factory=default_data_dir, converter=Path)
    relay: str | None = None
    """`unix:PATH` or `tcp:HOST:PORT`; None means `unix:<data_dir>/relay.sock`."""
    relay_group: str | int | None = attrs.field(default=None)
    """A group (name or number) whose members may connect to the Unix relay socket: the socket is
    then mode 0660 with that group instead of 0600, for sandboxes whose agent runs as another uid
    (docs/SECURITY.md, "The relay socket"). None: the server's user alone."""

    @relay_group.validator
    def _check_relay_group(self, attribute: Any, value: str | int | None) -> None:
        if value is None:
            return
        if not self.relay_address.startswith("unix:"):
            raise ValueError("relay_group applies to a Unix relay socket, not to a tcp: relay address")
        relay_group_id(value)

    @property
    def relay_gid(self) -> int | None:
        """The numeric group of `relay_group` (None when it is not set)."""
        return None if self.relay_group is None else relay_group_id(self.relay_group)

    caller_timeout: float = DEFAULT_CALLER_TIMEOUT
    """Seconds a relayed caller tool call waits for the caller (per tool: `timeout_ms`)."""
    approval_timeout: float = DEFAULT_APPROVAL_TIMEOUT
    """Seconds a gated call waits for its approval before it is denied (per tool: `approval_timeout_ms`)."""
    approval_delivery: str = attrs.field(default="auto")
    """How approvals reach a caller: `elicitation` (a form for the person at the caller's MCP client while
    a `wait` call is in flight), `tool` (the `requires_approval` stop and `approval_response`), or `auto`
    (elicitation where the caller's client offers it, else tool)."""

    @approval_delivery.validator
    def _check_delivery(self, attribute: Any, value: str) -> None:
        if value not in DELIVERIES:
            raise ValueError(f"approval_delivery must be one of {', '.join(DELIVERIES)}; got {value!r}")

    store_path: str | None = None
    """SQLite file of the frame log; None means `<data_dir>/frames.sqlite3`."""
    store_url: str | None = attrs.field(default=None)
    """The frame store: None (SQLite at `store_path`) or a libpq URI `postgresql://…` (docs/SCALING.md)."""

    @store_url.validator
    def _check_store_url(self, attribute: Any, value: str | None) -> None:
        if value is not None and not value.startswith(STORE_URL_SCHEMES):
            raise ValueError(f"store url must start with postgresql:// or postgres:// (a libpq URI); got {value!r}")

    store_pool_size: int = attrs.field(default=DEFAULT_STORE_POOL_SIZE)
    """PostgreSQL store: connections in the pool (and worker threads that use them)."""
    store_connect_timeout: float = DEFAULT_STORE_CONNECT_TIMEOUT
    """PostgreSQL store: seconds to wait for a connection (at start, and from the pool per call)."""

    store_lease_ttl: float = attrs.field(default=DEFAULT_STORE_LEASE_TTL)
    """PostgreSQL store: seconds a server's leases (its own and its instances') last unless it renews
    them (every third of it); the requests a dead server waited on are closed within about twice
    this (docs/SCALING.md, "Instance leases")."""

    @store_pool_size.validator
    def _check_pool(self, attribute: Any, value: int) -> None:
        if not 1 <= value <= 100:
            raise ValueError(f"store pool_size must be between 1 and 100; got {value!r}")

    @store_lease_ttl.validator
    def _check_lease_ttl(self, attribute: Any, value: float) -> None:
        if not 0.3 <= value <= 3600:
            raise ValueError(f"store lease_ttl must be between 0.3 and 3600 seconds; got {value!r}")
    retention_frames: int | None = 100_000
    """Frames kept per instance (the oldest are pruned); None keeps all."""
    retention_seconds: float | None = None
    """Also prune frames older than this (checked on appends and at start); None: no age limit."""
    audit_key: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    """The Ed25519 private key (PEM) that signs the frame log's checkpoints (docs/AUDIT.md); None: unsigned."""
    checkpoint_every: int | None = attrs.field(default=DEFAULT_CHECKPOINT_EVERY)
    """Frames of an instance between two checkpoints of its hash chain (besides those retention makes); None: none."""

    @checkpoint_every.validator
    def _check_checkpoint_every(self, attribute: Any, value: int | None) -> None:
        check_checkpoint_every(value)
    session_wait_limit: float = DEFAULT_SESSION_WAIT
    start_timeout: float = DEFAULT_START_TIMEOUT
    """Seconds a start command (wake on message) has to connect its guest before it is stopped."""
    relay_write_timeout: float = DEFAULT_RELAY_WRITE_TIMEOUT
    """Seconds one frame to a sandbox may take to be written; a sandbox that does not read is disconnected."""
    max_client_connections: int = attrs.field(default=DEFAULT_MAX_CLIENT_CONNECTIONS)
    """Client-role relay connections one instance may have on this server; the next one's hello is refused."""

    @max_client_connections.validator
    def _check_max_client_connections(self, attribute: Any, value: int) -> None:
        if not 1 <= value <= 10_000:
            raise ValueError(f"max_client_connections must be between 1 and 10000; got {value!r}")
    http: list[str] = attrs.field(factory=list)
    """HTTP listeners: `HOST:PORT` (bearer tokens) and/or `unix:PATH` (mode 0600, no token)."""
    metrics: list[str] = attrs.field(factory=list)
    """Listeners of `GET /metrics` alone, without a token (`HOST:PORT` or `unix:PATH`), for scrapers
    that cannot hold the HTTP token; the `http` listeners serve it too, behind the token."""
    allowed_hosts: list[str] = attrs.field(factory=list)
    """Extra Host header values accepted on /mcp besides loopback ones (e.g. `oubliette.internal:*`)."""
    http_max_connections: int | None = attrs.field(default=None)
    """HTTP connections open at once over all listeners; one more is answered 503. None: HTTP's
    share of the descriptor limit (`RLIMIT_NOFILE`): 1024 gives 384."""
    http_body_timeout: float = attrs.field(default=DEFAULT_HTTP_BODY_TIMEOUT)
    """Seconds a request's whole body has to arrive in; a slower one is cut off with 408."""
    http_keep_alive_timeout: float = attrs.field(default=DEFAULT_HTTP_KEEP_ALIVE_TIMEOUT)
    """Seconds an idle HTTP connection is kept for its next request (and a new one has to send its headers)."""
    http_keep_alive_max_requests: int = attrs.field(default=DEFAULT_HTTP_KEEP_ALIVE_MAX_REQUESTS)
    """Requests one HTTP connection may make before the server closes it."""
    relay_max_connections: int | None = attrs.field(default=None)
    """Relay connections open at once; at the cap the oldest ones without a valid hello are evicted for
    a new one. None: the relay's share of the descriptor limit (`RLIMIT_NOFILE`): 1024 gives 384."""
    relay_hello_timeout: float = attrs.field(default=DEFAULT_RELAY_HELLO_TIMEOUT)
    """Seconds a new relay connection has to send its whole hello; then it is closed."""

    @http_max_connections.validator
    @http_keep_alive_max_requests.validator
    @relay_max_connections.validator
    def _check_door_counts(self, attribute: Any, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"{attribute.name} must be at least 1; got {value!r}")

    @http_body_timeout.validator
    @http_keep_alive_timeout.validator
    @relay_hello_timeout.validator
    def _check_door_seconds(self, attribute: Any, value: float) -> None:
        if not value > 0:
            raise ValueError(f"{attribute.name} must be a positive number of seconds; got {value!r}")

    @property
    def http_limits(self) -> HttpLimits:
        """What HTTP clients may hold of the server (docs/SECURITY.md, "Slow HTTP clients")."""
        return HttpLimits(
            max_connections=self.http_max_connections, body_timeout=self.http_body_timeout,
            keep_alive_timeout=self.http_keep_alive_timeout, keep_alive_max_requests=self.http_keep_alive_max_requests,
        )

    @property
    def relay_limits(self) -> RelayLimits:
        """What sandbox connections may hold of the server (docs/SECURITY.md, "Relay connections that never say hello")."""
        return RelayLimits(max_connections=self.relay_max_connections, hello_timeout=self.relay_hello_timeout)

    policy_files: list[Path] = attrs.field(factory=list, converter=lambda paths: [Path(p) for p in paths])
    """Cedar policy files deciding every agent's tool call, read as one set (docs/POLICY.md);
    empty: the default policy (every call runs, gated as its tool asks). Read again on SIGHUP and
    when one changes; an invalid set keeps the previous one."""
    policy_observe_only: bool = False
    """Log and store what the policies would forbid, and let the call run as its tool asks."""
    http_principals: list[str] = attrs.field(factory=list)
    """Named HTTP principals whose bearer token is derived from the deployment's secret
    (`oubliette-server http-token --principal NAME`); the policies say what each may do
    (docs/POLICY.md, "HTTP principals")."""
    http_principal_token_files: dict[str, Path] = attrs.field(
        factory=dict, converter=lambda files: {name: Path(path) for name, path in files.items()})
    """Named HTTP principals given their bearer token in a file (name -> path, the token on its
    first line), read when the server starts."""

    tool_separator: str = attrs.field(default=".")
    """Between a toolset's prefix and its tools' names: "." (the default) or "_" for hosts that reject dots."""

    @tool_separator.validator
    def _check_separator(self, attribute: Any, value: str) -> None:
        if value not in TOOL_SEPARATORS:
            raise ValueError(f"tool_separator must be one of {', '.join(map(repr, TOOL_SEPARATORS))}; got {value!r}")

    max_payload_bytes: int = attrs.field(default=DEFAULT_MAX_PAYLOAD_BYTES)
    """Largest value a caller or sandbox may send (message text, tool arguments, result, frame payload),
    encoded as on the relay; at most what still fits one relay line (the default). See docs/SECURITY.md."""
    max_payload_depth: int = attrs.field(default=DEFAULT_MAX_DEPTH)
    """Deepest nesting of such a value (1-128; default 64: the callers' SDK cannot parse 200)."""
    max_sessions: int = attrs.field(default=DEFAULT_MAX_SESSIONS)
    """Sessions of one instance held in memory besides those in use; the least recently used idle
    ones are forgotten (their frames stay in the log). See docs/SECURITY.md, "Session keys at every door"."""

    @max_sessions.validator
    def _check_max_sessions(self, attribute: Any, value: int) -> None:
        if not 1 <= value <= MAX_SESSIONS_CEILING:
            raise ValueError(f"max_sessions must be between 1 and {MAX_SESSIONS_CEILING}; got {value!r}")

    @max_payload_bytes.validator
    @max_payload_depth.validator
    def _check_limits(self, attribute: Any, value: int) -> None:
        Limits(**{"max_payload_bytes" if attribute.name == "max_payload_bytes" else "max_depth": value})

    @property
    def limits(self) -> Limits:
        """The limits every ingress checks (protocol/limits.py)."""
        return Limits(max_payload_bytes=self.max_payload_bytes, max_depth=self.max_payload_depth)

    toolsets: list[Any] = attrs.field(factory=list, converter=_toolset_entries)
    """Toolsets registered when `serve` starts (`toolsets.from_config.ToolsetEntry`); a mapping of
    toolset id to its `[toolsets.ID]` table, as in the config file, is checked and converted."""
    allowlists: dict[str, list[str]] = attrs.field(factory=dict, converter=_allowlists)
    """Instance id → the toolset ids its agents see, set when `serve` starts."""
    instances: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Per-instance settings from the config file, e.g. `{"box1": {"start": ["docker", "start", "box1"]}}`."""

    def start_command(self, instance: str) -> list[str] | None:
        """The instance's configured start command as argv (a string is split like a shell), or None."""
        start = self.instances.get(instance, {}).get("start")
        if not start:
            return None
        return shlex.split(start) if isinstance(start, str) else [str(part) for part in start]

    @property
    def relay_address(self) -> str:
        """The relay address: `relay`, or the Unix socket `relay.sock` in the data directory."""
        return self.relay or f"unix:{self.data_dir / 'relay.sock'}"

    @property
    def frame_store_path(self) -> str:
        """The SQLite file of the frame log: `store_path`, or `frames.sqlite3` in the data directory."""
        return self.store_path or str(self.data_dir / "frames.sqlite3")


SERVER_KEYS = {
    "relay": str, "relay_group": (str, int), "data_dir": str, "caller_timeout": (int, float), "approval_timeout": (int, float), "approval_delivery": str, "store_path": str,
    "retention_frames": int, "retention_seconds": (int, float), "session_wait_limit": (int, float), "http": list, "metrics": list, "allowed_hosts": list,
    "tool_separator": str, "start_timeout": (int, float), "relay_write_timeout": (int, float),
    "max_client_connections": int, "relay_max_connections": int, "relay_hello_timeout": (int, float),
    "max_payload_bytes": int, "max_payload_depth": int, "max_sessions": int,
    "http_max_connections": int, "http_body_timeout": (int, float), "http_keep_alive_timeout": (int, float),
    "http_keep_alive_max_requests": int, "audit_key": str, "checkpoint_every": int,
    "policy_files": list, "policy_observe_only": bool, "http_principals": list, "http_principal_token_files": dict,
}


STORE_KEYS = {"url": str, "pool_size": int, "connect_timeout": (int, float), "lease_ttl": (int, float)}


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into `ServerConfig` keyword arguments, with clear errors."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(document) - {"server", "store", "instances", "toolsets", "allowlists"}
    if unknown:
        raise ValueError(f"config file {path}: unknown section(s) {', '.join(sorted(unknown))}")
    settings: dict[str, Any] = {}
    for key, value in _checked_section(document, "server", SERVER_KEYS, path):
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise ValueError(f"config file {path}: [server] {key} must be a list of strings")
        settings[key] = value
    if "policy_files" in settings:  # relative to the config file, as an operator reads it
        settings["policy_files"] = [path.parent / file for file in settings["policy_files"]]
    if "http_principal_token_files" in settings:  # a table of name = "path", relative to the config file too
        files = settings["http_principal_token_files"]
        if not all(isinstance(file, str) for file in files.values()):
            raise ValueError(f"config file {path}: [server] http_principal_token_files maps names to file paths (strings)")
        settings["http_principal_token_files"] = {name: path.parent / file for name, file in files.items()}
    for key, value in _checked_section(document, "store", STORE_KEYS, path):
        settings[f"store_{key}"] = value
    instances = document.get("instances", {})
    for name, table in instances.items():
        if not isinstance(table, dict):
            raise ValueError(f"config file {path}: [instances.{name}] must be a table")
        unknown_keys = set(table) - {"start"}
        if unknown_keys:
            raise ValueError(
                f"config file {path}: unknown [instances.{name}] key(s) {', '.join(repr(k) for k in sorted(unknown_keys))}"
            )
        start = table.get("start")
        if start is not None and not (isinstance(start, str) or (isinstance(start, list) and start)):
            raise ValueError(f"config file {path}: [instances.{name}] start must be a string or a list")
    settings["instances"] = instances
    from ..features.toolsets.from_config import parse_allowlists, parse_toolsets

    settings["toolsets"] = parse_toolsets(document.get("toolsets", {}), f"config file {path}")
    settings["allowlists"] = parse_allowlists(document.get("allowlists", {}), f"config file {path}")
    return settings


def _checked_section(document: dict[str, Any], section: str, keys: dict[str, Any], path: Path) -> list[tuple[str, Any]]:
    """The `(key, value)` pairs of one flat section, each key known and its value of its type."""
    pairs = []
    for key, value in document.get(section, {}).items():
        expected = keys.get(key)
        if expected is None:
            raise ValueError(f"config file {path}: unknown [{section}] key {key!r}")
        problem = wrong_type(f"[{section}] {key}", value, expected)
        if problem:
            raise ValueError(f"config file {path}: {problem}")
        pairs.append((key, value))
    return pairs
