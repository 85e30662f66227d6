"""docs/CLAUDE_CODE.md is what Claude Code reads: its MCP configs have Claude Code's shape and its commands start.

Claude Code itself is not run here; these checks catch the documentation and the generated
`{mcp_config}` drifting from the shape Claude Code's `--mcp-config` / `.mcp.json` accepts, and
documented commands that no longer start.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness import fresh_shell
from oubliette_client.mcp_config import mcp_config, write_mcp_config
from oubliette_client.settings import RelaySettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "CLAUDE_CODE.md"
PROGRAMS = {"oubliette-server", "oubliette-client"}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def _is_str_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def shape_problem(document: Any) -> str | None:
    """Why `document` is not an MCP config as Claude Code reads it, or None.

    A stdio server is `{"command", "args", "env"}` (plus the optional `"type": "stdio"`); an HTTP
    one `{"type": "http", "url", "headers"}`; either may carry Claude Code's per-server
    `"timeout"` in milliseconds. Nothing else.
    """
    if not isinstance(document, dict) or set(document) != {"mcpServers"}:
        return f"the top level must be exactly {{'mcpServers'}}, not {document!r}"
    servers = document["mcpServers"]
    if not isinstance(servers, dict) or not servers:
        return "mcpServers must be a non-empty object"
    for name, server in servers.items():
        if not isinstance(server, dict):
            return f"server {name!r} is not an object"
        if "timeout" in server and not (isinstance(server["timeout"], int) and server["timeout"] > 0):
            return f"server {name!r}: timeout must be a positive integer (milliseconds)"
        keys = set(server) - {"timeout"}
        if server.get("type") == "http":
            if keys != {"type", "url", "headers"}:
                return f"http server {name!r} has keys {sorted(keys)}"
            if not isinstance(server["url"], str) or not _is_str_map(server["headers"]):
                return f"http server {name!r}: url must be a string and headers a string map"
            continue
        if keys - {"type"} != {"command", "args", "env"} or server.get("type", "stdio") != "stdio":
            return f"stdio server {name!r} has keys {sorted(keys)}"
        args = server["args"]
        if not isinstance(server["command"], str) or not server["command"]:
            return f"stdio server {name!r}: command must be a non-empty string"
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)) or not _is_str_map(server["env"]):
            return f"stdio server {name!r}: args must be a list of strings and env a string map"
    return None


@pytest.mark.parametrize(
    "document",
    [
        {"mcpServers": {"x": {"command": "a", "args": ["b"], "env": {"K": "V"}, "cwd": "/"}}},
        {"mcpServers": {"x": {"command": "a", "args": "b", "env": {}}}},
        {"mcpServers": {"x": {"command": "a", "args": [], "env": {"K": 1}}}},
        {"mcpServers": {"x": {"type": "sse", "command": "a", "args": [], "env": {}}}},
        {"mcpServers": {"x": {"type": "http", "url": "http://h/mcp", "headers": {}, "oauth": {}}}},
        {"mcpServers": {"x": {"type": "http", "url": "http://h/mcp", "headers": {}, "timeout": "1"}}},
        {"mcpServers": {}},
        {"servers": {}},
    ],
)
def test_the_shape_check_refuses_what_claude_code_would_not_read(document: Any) -> None:
    assert shape_problem(document) is not None


def test_every_json_block_of_the_doc_is_an_mcp_config_claude_code_reads() -> None:
    blocks = _blocks("json")
    kinds = set()
    for text in blocks:
        document = json.loads(text)
        assert shape_problem(document) is None, (shape_problem(document), text)
        kinds.update(server.get("type", "stdio") for server in document["mcpServers"].values())
    assert kinds == {"stdio", "http"} and len(blocks) >= 3


def test_the_generated_mcp_config_has_that_shape(tmp_path: Path) -> None:
    settings = RelaySettings(relay="unix:/oubliette/relay.sock", instance="box1", token="t0k", request_timeout=300)
    path = write_mcp_config(tmp_path, settings, "host:default")
    document = json.loads(path.read_text())
    assert shape_problem(document) is None, shape_problem(document)
    assert document == mcp_config(settings, "host:default")
    env = document["mcpServers"]["oubliette"]["env"]
    assert env == {
        "OUBLIETTE_RELAY": "unix:/oubliette/relay.sock", "OUBLIETTE_INSTANCE": "box1",
        "OUBLIETTE_TOKEN": "t0k", "OUBLIETTE_SESSION": "host:default", "OUBLIETTE_REQUEST_TIMEOUT": "300",
    }


#: What makes the programs findable where the doc sets nothing: a config file's `"command"` is
#: looked up on the PATH Claude Code was started with (the doc says: from a shell with the venv
#: active), and in a sandbox the image has them installed.
ACTIVATE = ". .venv/bin/activate"


def _documented_commands() -> list[tuple[str, str]]:
    """Each oubliette program line the doc shows, as shell text with what runs before it in a
    new shell: `(preamble, command)`, from the stdio configs and what follows `--` in
    `claude mcp add` (with the block's own first line as the preamble when it sets PATH)."""
    commands: list[tuple[str, str]] = []
    for text in _blocks("json"):
        for server in json.loads(text)["mcpServers"].values():
            if "command" in server:
                commands.append((ACTIVATE, shlex.join([server["command"], *server["args"]])))
    for text in _blocks("sh"):
        lines = text.replace("\\\n", " ").splitlines()
        first = re.sub(r"\s+#.*$", "", lines[0])
        preamble = first if first.startswith(ACTIVATE) else ACTIVATE
        for line in lines:
            words = shlex.split(line, comments=True)
            if words[:3] == ["claude", "mcp", "add"] and "--" in words:
                commands.append((preamble, re.sub(r"\s+#.*$", "", line.split(" -- ", 1)[1]).strip()))
    return commands


def _help(preamble: str, command: str, shell: tuple[Path, dict[str, str]]) -> subprocess.CompletedProcess[str]:
    """`command --help` pasted into a new shell in the checkout after `preamble` (the venv not active before)."""
    assert shlex.split(command)[0].rsplit("/", 1)[-1] in PROGRAMS, command
    checkout, env = shell
    return subprocess.run(
        ["bash", "-c", f"{preamble} && {command} --help"], cwd=checkout, env=env,
        capture_output=True, text=True, timeout=60,
    )


def test_the_documented_commands_start_the_programs(short_tmp: Path) -> None:
    shell = fresh_shell(short_tmp)
    commands = _documented_commands()
    assert (f'{ACTIVATE} && export PATH="$PWD/.claude-code:$PATH"',
            '"$PWD/.venv/bin/oubliette-server" --data-dir ~/.local/share/oubliette-claude') in commands
    assert (ACTIVATE, "oubliette-client") in commands
    extra = [(ACTIVATE, "oubliette-server"), (ACTIVATE, "oubliette-client"), (ACTIVATE, "oubliette-client run")]
    for preamble, command in commands + extra:
        done = _help(preamble, command, shell)
        assert done.returncode == 0 and done.stdout.startswith("usage: "), (preamble, command, done.stderr)
    assert "run -- CMD" in _help(ACTIVATE, "oubliette-client", shell).stdout
    assert "{mcp_config}" in _help(ACTIVATE, "oubliette-client run", shell).stdout
    assert "http-token" in _help(ACTIVATE, "oubliette-server", shell).stdout
    # the blocks' first line finds the checkout's Claude Code (README command 2) too
    checkout, env = shell
    for preamble in {p for p, _ in commands if ".claude-code" in p}:
        found = subprocess.run(["bash", "-c", f"{preamble} && command -v claude"], cwd=checkout, env=env,
                               capture_output=True, text=True, timeout=60)
        assert found.returncode == 0 and found.stdout.strip().endswith("/.claude-code/claude"), found


def test_the_guest_runtime_lines_are_the_documented_ones() -> None:
    text = DOC.read_text()
    for needed in (
        "claude -p --mcp-config {mcp_config} --strict-mcp-config --allowedTools 'mcp__oubliette__*'",
        "--permission-mode default --permission-prompt-tool mcp__oubliette__permission_prompt",
        "OUBLIETTE_MSG_ID", 'tool_separator = "_"', "MCP_TOOL_TIMEOUT",
        "## Claude Code on the host drives a sandboxed agent",
    ):
        assert needed in text, needed
