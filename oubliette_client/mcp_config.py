"""Per-session MCP config files: the shape Claude Code's `--mcp-config` reads.

The guest runtime writes one for each session, so an agent command given
`{mcp_config}` starts `oubliette-client` bound to that session. The file name
must be distinct for distinct sessions (two sessions sharing a file would bind
both agents to whichever wrote last), so it ends in a hash of the whole key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .settings import RelaySettings

SERVER_NAME = "oubliette"


def client_command() -> list[str]:
    """How to start `oubliette-client` with the Python that runs this one."""
    return [sys.executable, "-m", "oubliette_client"]


def otel_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The guest runtime's `OTEL_*` variables: an MCP client such as the SDK's starts its server
    with only a few safe variables and the config's `env`, so this is how the agent's
    `oubliette-client` exports its spans where the runtime does (docs/OBSERVABILITY.md)."""
    return {name: value for name, value in environ.items() if name.startswith("OTEL_")}


def mcp_config(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """The `--mcp-config` document that starts this `oubliette-client` bound to `session`; it holds the token."""
    command = client_command()
    return {
        "mcpServers": {
            SERVER_NAME: {
                "type": "stdio",
                "command": command[0],
                "args": command[1:],
                "env": {**settings.environment(session), **otel_environment()},
            }
        }
    }


def config_file_name(session: str | None) -> str:
    """`mcp-<readable part>-<hash>.json`: the hash of the exact key makes the name injective.

    The readable part only helps people; it maps other characters to `_` and is cut short,
    so it may repeat across sessions (`a@b`, `a_b`), but the SHA-256 of the key does not.
    """
    key = "default" if session is None else session
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"mcp-{readable}-{digest}.json"


def write_mcp_config(directory: Path, settings: RelaySettings, session: str | None) -> Path:
    """Write the config (mode 0600: it holds the token) and return its path."""
    path = directory / config_file_name(session)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(mcp_config(settings, session), handle, indent=2)
    return path
