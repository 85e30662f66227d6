"""Helpers of tests/e2e/test_claude_code.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import trio

from harness import PYTHON, Deployment, structured, text_of

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = ROOT / ".claude-code" / "claude"
INSTALL = "tests/tools/install-claude-code.sh"
DOC = ROOT / "docs" / "CLAUDE_CODE.md"
INSTANCE = "box1"


RUN_TIMEOUT = 90.0


WAIT = 60


NOTIFY_TOOL = {
    "name": "send_notification", "description": "Tell the person at the host",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
    "timeout_ms": 60000,
}
CONTEXT = {"caller_id": "myapp", "caller_tools": [NOTIFY_TOOL]}


def claude_binary() -> str:
    """The installed CLI's path; the test fails (never skips) when it is not there."""
    if not os.access(CLAUDE, os.X_OK):
        pytest.fail(f"Claude Code is not installed at {CLAUDE}: run {INSTALL} (README command 2 and .ci/run do)")
    return str(CLAUDE)


def claude_env(fake_url: str, home: Path, documented: dict[str, str]) -> dict[str, str]:
    """A clean environment for Claude Code: the stand-in model, a temporary HOME, no traffic
    elsewhere, none of the host's Claude or Oubliette settings, the venv's programs first on
    PATH (the doc's configs name `oubliette-server` and `oubliette-client`), and the variables
    the doc's command line sets."""
    env = {key: os.environ[key] for key in ("LANG", "LC_ALL", "TMPDIR") if key in os.environ}
    env.update({
        "PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", os.defpath)]),
        "HOME": str(home), "ANTHROPIC_BASE_URL": fake_url, "ANTHROPIC_API_KEY": "sk-ant-test-stand-in",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
    })
    env.update(documented)
    return env


# -- what docs/CLAUDE_CODE.md shows ---------------------------------------------------------------


def doc_blocks(language: str, doc: Path = DOC) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", doc.read_text(), re.S | re.M)


def documented_lines(doc: Path = DOC) -> list[tuple[dict[str, str], list[str]]]:
    """Each shell line of `doc` (continuations joined): its leading `NAME=value`s, and its words."""
    lines = []
    for block in doc_blocks("sh", doc):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            env: dict[str, str] = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words:
                lines.append((env, words))
    return lines


def scratch(deployment: Deployment, name: str) -> Path:
    """An empty directory under the test's root (removed with it): a HOME or a working directory."""
    path = deployment.root / name
    path.mkdir()
    return path


async def call(caller: Any, name: str, **arguments: Any) -> dict[str, Any]:
    """One caller tool call, acting on its result only (as a model would)."""
    with trio.fail_after(RUN_TIMEOUT):
        result = await caller.call_tool(name, arguments)
    assert not result.is_error, text_of(result)
    return structured(result)


SENT = {"result": {"status": "sent", "id": 7}}
"""The caller's answer in `notify_turn` unless a test gives another (`{"error": "…"}`)."""


async def notify_turn(caller: Any, session: str, answer: dict[str, Any] = SENT) -> dict[str, Any]:
    """The caller's side of a turn whose agent calls `send_notification` once: `session_message`
    with `wait` stops at `requires_action` for that call, the caller answers it (`answer`: its
    `result` or `error`), and the turn's end is returned."""
    stop = await call(caller, "session_message", instance=INSTANCE, session_id=session,
                      message="Tell the host the build is green.", context=CONTEXT, wait=WAIT)
    assert stop["stop_reason"] == "requires_action", stop
    [pending] = stop["pending"]
    assert (pending["tool"], pending["arguments"]) == ("send_notification", {"message": "build is green"})
    return await call(caller, "caller_tool_response", session_id=session, request_id=pending["request_id"],
                      wait=WAIT, **answer)


ECHO_ENDPOINT = str(ROOT / "examples" / "mcp_echo.py")


def toolset_config(deployment: Deployment, separator: str = "_") -> Path:
    """A server config: the reference command endpoint as toolset `ext` for INSTANCE, with
    `separator` (`_` by default, as Claude Code needs: docs/CLAUDE_CODE.md, "Tool names")."""
    path = deployment.root / "oubliette.toml"
    path.write_text(
        f'[server]\ntool_separator = "{separator}"\n\n'
        f'[toolsets.ext]\nkind = "command"\nprefix = "ext"\ncommand = {json.dumps([PYTHON, ECHO_ENDPOINT])}\n\n'
        f'[allowlists]\n{INSTANCE} = ["ext"]\n'
    )
    return path
