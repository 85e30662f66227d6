"""Per-session agent config files: each agent's shape of "start this `oubliette-client`".

The guest runtime writes one for each session and placeholder in the agent command, so an
agent given `{mcp_config}` (Claude Code's `--mcp-config`), `{gemini_home}` (a Gemini CLI
home holding `.gemini/settings.json`), `{opencode_config}` (OpenCode's `OPENCODE_CONFIG`) or
`{codex_home}` (a Codex home holding `config.toml`) starts `oubliette-client` bound to that session. The file name must be
distinct for distinct sessions (two sessions sharing a file would bind both agents to
whichever wrote last), so it ends in a hash of the whole key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import attrs
import tomli_w

from .permission_prompt import APPROVAL_WAIT
from .settings import RelaySettings

SERVER_NAME = "oubliette"
#: The server's default caller timeout (seconds): how long a caller tool call may wait.
CALLER_WAIT = 60.0
#: An agent's limit on one MCP call (ms): it must outlast the longest wait behind the call, a
#: gated caller tool's approval and then its answer (docs/AGENTS.md, "Timeouts").
AGENT_TOOL_TIMEOUT_MS = int((APPROVAL_WAIT + CALLER_WAIT) * 1000)
#: The auth method of a generated Gemini CLI home: an API key, from `GEMINI_API_KEY`.
GEMINI_AUTH = "gemini-api-key"
#: How long Codex waits for `oubliette-client` to start and list its tools (seconds).
CODEX_STARTUP_TIMEOUT_SEC = 30


def client_command() -> list[str]:
    """How to start `oubliette-client` with the Python that runs this one."""
    return [sys.executable, "-m", "oubliette_client"]


def otel_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The guest runtime's `OTEL_*` variables: an MCP client such as the SDK's starts its server
    with only a few safe variables and the config's `env`, so this is how the agent's
    `oubliette-client` exports its spans where the runtime does (docs/OBSERVABILITY.md)."""
    return {name: value for name, value in environ.items() if name.startswith("OTEL_")}


def client_entry(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """The session's `oubliette-client` as every agent's stdio server entry names it (`command`,
    `args`, `env`); it holds the token. Each agent's shape adds its own keys."""
    command = client_command()
    return {"command": command[0], "args": command[1:], "env": {**settings.environment(session), **otel_environment()}}


def mcp_config(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """The `--mcp-config` document that starts this `oubliette-client` bound to `session`."""
    return {"mcpServers": {SERVER_NAME: {"type": "stdio", **client_entry(settings, session)}}}


def gemini_settings(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """A Gemini CLI `settings.json` that starts this `oubliette-client` bound to `session`.

    `timeout`: Gemini's limit on one call must outlast approvals and caller answers. `trust`:
    `gemini -p` cannot ask a person to confirm a tool call; the gate is the server's approvals.
    The auth method: this home replaces the user's, and Gemini will not start without one.
    """
    entry = {**client_entry(settings, session), "timeout": AGENT_TOOL_TIMEOUT_MS, "trust": True}
    return {"security": {"auth": {"selectedType": GEMINI_AUTH}}, "mcpServers": {SERVER_NAME: entry}}


def opencode_config(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """An OpenCode config (`OPENCODE_CONFIG`, merged over the user's and the project's) whose
    `mcp` key starts this `oubliette-client` bound to `session`.

    OpenCode's local server takes its command as one list and its variables as `environment`;
    `timeout` is its limit on each MCP request, a tool call included, so it must outlast
    approvals and caller answers.
    """
    entry = client_entry(settings, session)
    local = {"type": "local", "command": [entry["command"], *entry["args"]], "environment": entry["env"],
             "enabled": True, "timeout": AGENT_TOOL_TIMEOUT_MS}
    return {"mcp": {SERVER_NAME: local}}


def codex_config(settings: RelaySettings, session: str | None) -> dict[str, Any]:
    """A Codex `config.toml` that starts this `oubliette-client` bound to `session`.

    `tool_timeout_sec`: Codex's limit on one call must outlast approvals and caller answers
    (its default is 60 s). `startup_timeout_sec`: the client's start and tool listing.
    `default_tools_approval_mode`: `codex exec` refuses a tool call that would need a person's
    approval; the gate is the server's approvals. `required`: Codex waits for the client before
    the first model request (else, on a slow start, the turn runs without the relay's tools).
    """
    entry = {**client_entry(settings, session), "startup_timeout_sec": CODEX_STARTUP_TIMEOUT_SEC,
             "tool_timeout_sec": AGENT_TOOL_TIMEOUT_MS / 1000, "default_tools_approval_mode": "approve",
             "required": True}
    return {"mcp_servers": {SERVER_NAME: entry}}


def json_text(document: dict[str, Any]) -> str:
    """A JSON config file's text."""
    return json.dumps(document, indent=2)


@attrs.frozen
class ConfigShape:
    """One agent's config: the placeholder the agent command names it by, its file name's start,
    its document, and `home`: where the file goes in a per-session directory that the placeholder
    names instead (Gemini CLI takes a home, `GEMINI_CLI_HOME`: it ignores a system settings file
    that root does not own; Codex one, `CODEX_HOME`), `text`: the file's format, and
    `tool_separator`: the separator its `oubliette-client` shows in toolset tool names instead of
    the server's (`OUBLIETTE_TOOL_SEPARATOR`), for an agent that would rewrite the server's `.`
    itself (docs/AGENTS.md, "Toolset tool names")."""

    placeholder: str
    prefix: str
    document: Callable[[RelaySettings, str | None], dict[str, Any]]
    home: str | None = None
    text: Callable[[dict[str, Any]], str] = json_text
    tool_separator: str | None = None

    def settings(self, settings: RelaySettings) -> RelaySettings:
        """The relay settings this agent's `oubliette-client` gets: `settings`, with its separator."""
        return settings if self.tool_separator is None else attrs.evolve(settings, tool_separator=self.tool_separator)


CLAUDE_CODE = ConfigShape("{mcp_config}", "mcp", mcp_config)
GEMINI_CLI = ConfigShape("{gemini_home}", "gemini", gemini_settings, home=".gemini/settings.json")
OPENCODE = ConfigShape("{opencode_config}", "opencode", opencode_config, tool_separator="_")
CODEX = ConfigShape("{codex_home}", "codex", codex_config, home="config.toml", text=tomli_w.dumps, tool_separator="_")
SHAPES = (CLAUDE_CODE, GEMINI_CLI, OPENCODE, CODEX)


def config_file_name(session: str | None, prefix: str = CLAUDE_CODE.prefix) -> str:
    """`<prefix>-<readable part>-<hash>.json`: the hash of the exact key makes the name injective.

    The readable part only helps people; it maps other characters to `_` and is cut short,
    so it may repeat across sessions (`a@b`, `a_b`), but the SHA-256 of the key does not.
    """
    key = "default" if session is None else session
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:64]
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}-{readable}-{digest}.json"


def write_mcp_config(directory: Path, settings: RelaySettings, session: str | None,
                     shape: ConfigShape = CLAUDE_CODE) -> Path:
    """Write the session's config in `shape` (mode 0600: it holds the token) and return its path
    (the session's home directory for a shape with a `home`)."""
    name = config_file_name(session, shape.prefix)
    if shape.home is None:
        home, path = None, directory / name
    else:
        home = directory / name.removesuffix(".json")
        path = home / shape.home
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(shape.text(shape.document(shape.settings(settings), session)))
    return path if home is None else home
