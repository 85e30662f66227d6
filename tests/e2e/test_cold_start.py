"""Cold start: what each command loads before it can answer.

Importing the MCP SDK takes about a second per process; `--help` of both programs (and
`oubliette-server token`) must not pay for it, and the stdio MCP server the agent spawns must
not load the guest runtime. Checked in a fresh interpreter: `python -X importtime` lists every
module a run imported, on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import fresh_dir

PYTHON = sys.executable
SDK = ("mcp", "mcp_types")


def imported(args: list[str], env: dict[str, str] | None = None, stdin: int | None = subprocess.DEVNULL) -> set[str]:
    """The modules `python -X importtime ARGS` imported (it must exit 0)."""
    run = subprocess.run(
        [PYTHON, "-X", "importtime", *args], capture_output=True, text=True, timeout=120, stdin=stdin,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return {
        line.rsplit("|", 1)[1].strip()
        for line in run.stderr.splitlines() if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize(("program", "cli"), [
    ("oubliette_client", "oubliette_client.cli"), ("oubliette_server", "oubliette_server.program.cli"),
])
def test_help_does_not_import_the_sdk(program: str, cli: str) -> None:
    modules = imported(["-m", program, "--help"])
    assert cli in modules, "the check saw the program's own imports"
    assert not {m for m in modules if m.split(".")[0] in SDK}, "--help imported the MCP SDK"


def test_server_token_does_not_import_the_sdk() -> None:
    modules = imported(["-m", "oubliette_server", "token", "box1", "--data-dir", str(fresh_dir() / "data")])
    assert not {m for m in modules if m.split(".")[0] in SDK}


def test_the_stdio_server_does_not_load_the_guest_runtime() -> None:
    """`oubliette-client` (stdio MCP server) runs until stdin closes, without the guest runtime's modules."""
    tmp = fresh_dir()
    modules = imported(
        ["-m", "oubliette_client", "--connect-wait", "0.1"],
        env={"OUBLIETTE_RELAY": f"unix:{tmp / 'none.sock'}", "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": "t"},
    )
    assert "oubliette_client.stdio_server" in modules, "the check saw the stdio server start"
    assert not {"oubliette_client.guest", "oubliette_client.mcp_config", "oubliette_client.demo_agent"} & modules


def test_the_stdio_server_with_the_relay_down_loads_no_validator_and_no_peer() -> None:
    """Cold start: what `initialize` does not need is not imported before it. With the
    relay down, `oubliette-client` never checks a schema (jsonschema loads on the first check),
    never builds a relay peer nor a message (protocol.peer, core and messages load on the first
    connection) and never converts one (protocol.convert and cattrs load on first use)."""
    tmp = fresh_dir()
    modules = imported(
        ["-m", "oubliette_client", "--connect-wait", "0.1"],
        env={"OUBLIETTE_RELAY": f"unix:{tmp / 'none.sock'}", "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": "t"},
    )
    assert "oubliette_client.stdio_server" in modules, "the check saw the stdio server start"
    assert not {m for m in modules if m.split(".")[0] in ("jsonschema", "referencing", "cattrs")}
    assert not {"protocol.peer", "protocol.core", "protocol.schemas", "protocol.messages", "protocol.convert"} & modules


def test_client_help_loads_no_protocol_model() -> None:
    """`oubliette-client --help` parses flags only: no message models, no validator."""
    modules = imported(["-m", "oubliette_client", "--help"])
    assert "oubliette_client.cli" in modules
    assert not {"protocol.messages", "protocol.peer", "jsonschema"} & modules
