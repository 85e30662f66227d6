"""Per-session MCP config files: the shape Claude Code's `--mcp-config` reads.

The guest runtime writes one for each session, so an agent command given
`{mcp_config}` starts `oubliette-client` bound to that session.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .settings import RelaySettings

SERVER_NAME = "oubliette"


def client_command() -> list[str]:
    """How to start `oubliette-client` with the Python that runs this one."""
    return [sys.executable, "-m", "oubliette_client"]


def mcp_config(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    command = client_command()
    return {
        "mcpServers": {
            SERVER_NAME: {
                "type": "stdio",
                "command": command[0],
                "args": command[1:],
                "env": settings.environment(session),
            }
        }
    }


def write_mcp_config(directory: Path, settings: RelaySettings, session: str | None) -> Path:
    """Write the config (mode 0600: it holds the token) and return its path."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", session or "default")
    path = directory / f"mcp-{safe}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(mcp_config(settings, session), handle, indent=2)
    return path
