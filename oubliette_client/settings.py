"""Relay settings of the sandbox side, from flags or `OUBLIETTE_*` environment variables."""

from __future__ import annotations

import argparse
import os

import attrs

DEFAULT_RELAY = "unix:/oubliette/relay.sock"


@attrs.define(frozen=True)
class RelaySettings:
    relay: str
    instance: str
    token: str
    session: str | None = None

    def environment(self, session: str | None = None) -> dict[str, str]:
        """The `OUBLIETTE_*` variables that reproduce these settings in a child process."""
        env = {"OUBLIETTE_RELAY": self.relay, "OUBLIETTE_INSTANCE": self.instance, "OUBLIETTE_TOKEN": self.token}
        chosen = session if session is not None else self.session
        if chosen:
            env["OUBLIETTE_SESSION"] = chosen
        return env


def add_relay_arguments(parser: argparse.ArgumentParser, *, session: bool = True) -> None:
    parser.add_argument("--relay", help=f"relay address (env OUBLIETTE_RELAY; default {DEFAULT_RELAY})")
    parser.add_argument("--instance", help="instance id (env OUBLIETTE_INSTANCE)")
    parser.add_argument("--token", help="instance token (env OUBLIETTE_TOKEN)")
    if session:
        parser.add_argument("--session", help="session key channel:id (env OUBLIETTE_SESSION)")


def settings_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RelaySettings:
    env = os.environ
    instance = args.instance or env.get("OUBLIETTE_INSTANCE")
    token = args.token or env.get("OUBLIETTE_TOKEN")
    missing = [name for name, value in (("--instance/OUBLIETTE_INSTANCE", instance), ("--token/OUBLIETTE_TOKEN", token)) if not value]
    if missing:
        parser.error("missing " + " and ".join(missing))
    return RelaySettings(
        relay=args.relay or env.get("OUBLIETTE_RELAY") or DEFAULT_RELAY,
        instance=instance or "",
        token=token or "",
        session=getattr(args, "session", None) or env.get("OUBLIETTE_SESSION") or None,
    )
