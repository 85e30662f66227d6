"""Relay settings of the sandbox side, from flags or `OUBLIETTE_*` environment variables."""

from __future__ import annotations

import argparse
import os
from typing import Any
from collections.abc import Mapping

from pathlib import Path

import attrs

from protocol import parse_relay_address

#: Where a sandbox finds the relay: the server's socket bind-mounted at this path.
SANDBOX_RELAY = "unix:/oubliette/relay.sock"
DEFAULT_RELAY = SANDBOX_RELAY
#: Seconds a relay request waits by default (`OUBLIETTE_REQUEST_TIMEOUT`): the server's
#: default caller timeout (60 s) plus a wide margin; raise it with the server's.
DEFAULT_REQUEST_TIMEOUT = 120.0


def server_default_relay(env: Mapping[str, str] = os.environ) -> str:
    """The relay a same-host `oubliette-server` listens on by default: `<data dir>/relay.sock`.

    The data directory follows the server's rule (`oubliette_server.program.config.default_data_dir`):
    `$OUBLIETTE_DATA_DIR`, else `$XDG_DATA_HOME/oubliette`, else `~/.local/share/oubliette`.
    """
    data_dir = env.get("OUBLIETTE_DATA_DIR")
    if not data_dir:
        data_dir = str(Path(env.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "oubliette")
    return f"unix:{Path(data_dir) / 'relay.sock'}"


def default_relay(env: Mapping[str, str] = os.environ) -> str:
    """The relay address when neither `--relay` nor `OUBLIETTE_RELAY` is given.

    Why two places: inside a sandbox the server's socket is mounted at `/oubliette/relay.sock`;
    on the server's own host nothing is mounted, so the client finds the server's default socket.
    """
    if os.path.exists(SANDBOX_RELAY[len("unix:"):]):
        return SANDBOX_RELAY
    return server_default_relay(env)


@attrs.define(frozen=True)
class RelaySettings:
    """Where and as whom the sandbox side connects: relay address, instance, token, session, request deadline.

    Immutable; `environment()` passes the same settings to a child process.
    """

    relay: str
    instance: str
    token: str
    session: str | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    """Default deadline of one relay request (seconds)."""
    tool_separator: str | None = None
    """The separator the agent sees in toolset tool names instead of the server's
    (`OUBLIETTE_TOOL_SEPARATOR`): for an agent that would rewrite the server's (docs/AGENTS.md)."""

    def environment(self, session: str | None = None) -> dict[str, str]:
        """The `OUBLIETTE_*` variables that reproduce these settings in a child process."""
        env = {"OUBLIETTE_RELAY": self.relay, "OUBLIETTE_INSTANCE": self.instance, "OUBLIETTE_TOKEN": self.token}
        chosen = session if session is not None else self.session
        if chosen:
            env["OUBLIETTE_SESSION"] = chosen
        if self.request_timeout != DEFAULT_REQUEST_TIMEOUT:
            env["OUBLIETTE_REQUEST_TIMEOUT"] = f"{self.request_timeout:g}"
        if self.tool_separator is not None:
            env["OUBLIETTE_TOOL_SEPARATOR"] = self.tool_separator
        return env


def relay_addresses(relay: str) -> list[str]:
    """The addresses of a relay setting: one, or several separated by commas (several servers of
    one deployment, docs/SCALING.md), tried in turn. Raises `ValueError` for a malformed one."""
    addresses = [part.strip() for part in relay.split(",") if part.strip()]
    if not addresses:
        raise ValueError(f"no relay address in {relay!r}")
    for address in addresses:
        parse_relay_address(address)
    return addresses


def add_relay_arguments(parser: argparse.ArgumentParser, *, session: bool = True) -> None:
    """Add `--relay`, `--instance`, `--token` (and `--session` unless `session=False`) to `parser`."""
    parser.add_argument(
        "--relay",
        help="relay address unix:PATH or tcp:HOST:PORT, or several separated by commas, tried in turn "
        "(env OUBLIETTE_RELAY; default /oubliette/relay.sock if it exists, else the server's default <data dir>/relay.sock)",
    )
    parser.add_argument("--instance", help="instance id (env OUBLIETTE_INSTANCE)")
    parser.add_argument("--token", help="instance token (env OUBLIETTE_TOKEN)")
    if session:
        parser.add_argument("--session", help="session key channel:id (env OUBLIETTE_SESSION)")


def settings_from_environment(
    env: Mapping[str, str] = os.environ, *,
    relay: str | None = None, instance: str | None = None, token: str | None = None, session: str | None = None,
) -> RelaySettings:
    """The settings `oubliette-client` would use: each given value, else its `OUBLIETTE_*` variable
    (`OUBLIETTE_RELAY`, `OUBLIETTE_INSTANCE`, `OUBLIETTE_TOKEN`, `OUBLIETTE_SESSION`,
    `OUBLIETTE_REQUEST_TIMEOUT`, `OUBLIETTE_TOOL_SEPARATOR`), else the default relay. The one
    rule of the command line and of an agent that embeds the client (docs/EMBEDDING.md, "The
    sandbox side").

    Raises: `ValueError` when the instance or token is missing, the relay address is malformed,
    `OUBLIETTE_REQUEST_TIMEOUT` is not a positive number, or `OUBLIETTE_TOOL_SEPARATOR` is not
    one of `TOOL_SEPARATORS`.
    """
    instance = instance or env.get("OUBLIETTE_INSTANCE")
    token = token or env.get("OUBLIETTE_TOKEN")
    missing = [name for name, value in (("--instance/OUBLIETTE_INSTANCE", instance), ("--token/OUBLIETTE_TOKEN", token)) if not value]
    if missing:
        raise ValueError("missing " + " and ".join(missing))
    relay = relay or env.get("OUBLIETTE_RELAY") or default_relay(env)
    relay_addresses(relay)
    separator = env.get("OUBLIETTE_TOOL_SEPARATOR") or None
    if separator is not None:
        from protocol.messages import TOOL_SEPARATORS  # only when set: the wire's messages load later (cold start)

        if separator not in TOOL_SEPARATORS:
            raise ValueError(f"OUBLIETTE_TOOL_SEPARATOR must be one of {', '.join(map(repr, TOOL_SEPARATORS))}; got {separator!r}")
    return RelaySettings(
        relay=relay,
        instance=instance or "",
        token=token or "",
        session=session or env.get("OUBLIETTE_SESSION") or None,
        request_timeout=seconds_setting(env.get("OUBLIETTE_REQUEST_TIMEOUT"), DEFAULT_REQUEST_TIMEOUT, "OUBLIETTE_REQUEST_TIMEOUT"),
        tool_separator=separator,
    )


def settings_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RelaySettings:
    """Settings from the parsed flags, falling back to the `OUBLIETTE_*` environment (`settings_from_environment`).

    Raises: `SystemExit` through `parser.error` for what `settings_from_environment` refuses.
    """
    try:
        return settings_from_environment(
            os.environ, relay=args.relay, instance=args.instance, token=args.token, session=getattr(args, "session", None),
        )
    except ValueError as exc:
        parser.error(str(exc))


def seconds_setting(value: Any, default: float, name: str) -> float:
    """`value` (a flag's or an environment variable's), else `default`, as positive seconds.
    One rule for every duration the client reads. Raises: `ValueError` naming `name`."""
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return seconds


def positive_seconds(parser: argparse.ArgumentParser, value: Any, default: float, name: str) -> float:
    """`seconds_setting`, a usage error through `parser.error` when it refuses."""
    try:
        return seconds_setting(value, default, name)
    except ValueError as exc:
        parser.error(str(exc))
