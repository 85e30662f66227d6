"""What the real-CLI tests of agents in the sandbox share (tests/e2e/test_gemini_cli.py,
tests/e2e/test_opencode.py, tests/e2e/test_codex_cli.py): the installed CLI, docs/AGENTS.md's runtime
line for it, the check that README command 2 installs the version they run, and the turn whose
caller answers with an error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, AsyncContextManager, Callable, TypeVar

import pytest

from harness import PYTHON, Deployment
from claude_code import documented_lines, notify_turn, toolset_config

ROOT = Path(__file__).resolve().parents[2]
GAVE_UP = "The host could not be told."
"""The scripted model's closing text once it is shown the caller's error."""
FAILED = "myapp_send_notification failed: notification quota exceeded"
"""oubliette-client's text of the caller's error answer in `error_turn`, as the agent gets it."""
Fake = TypeVar("Fake")


def installed_cli(path: Path, install: str) -> str:
    """The installed CLI's path; the test fails (never skips) when it is not there."""
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path.name} is not installed at {path}: run {install} (README command 2 and .ci/run do)")
    return str(path)


def documented_agent_command(doc: Path, program: str, binary: str) -> list[str]:
    """`doc`'s guest runtime line for `program`: the agent command after `--`, with `program`
    as the installed `binary`."""
    for _env, words in documented_lines(doc):
        if words[:2] == ["oubliette-client", "run"] and program in words:
            command = words[words.index("--") + 1:]
            return [binary if word == program else word for word in command]
    pytest.fail(f"{doc.name} shows no guest runtime line for {program}")


def clean_env(home: Path, **settings: str) -> dict[str, str]:
    """A clean environment for an agent CLI: its own HOME, `settings`, none of the host's agent
    or Oubliette settings."""
    env = {key: os.environ[key] for key in ("LANG", "LC_ALL", "TMPDIR") if key in os.environ}
    env.update({"PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", os.defpath)]),
                "HOME": str(home), **settings})
    return env


def assert_the_suite_command_installs(install: str, binary: str, version_output: str = "{}") -> None:
    """README command 2 (.ci/run's command, the same line) runs `install`, and `binary --version`
    reports the version that script pins (as `version_output` formats it)."""
    ci_line = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if "pytest" in line and not line.startswith("#"))
    assert ci_line in (ROOT / "README.md").read_text().splitlines()
    assert f"(bash {install})" in ci_line
    pinned = (ROOT / install).read_text().split("\nVERSION=", 1)[1].split("\n", 1)[0]
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == version_output.format(pinned), done


async def error_turn(agent: Callable[[Deployment, list[Any]], AsyncContextManager[Fake]], deployment: Deployment,
                     session: str, script: list[Any]) -> Fake:
    """`notify_turn` with `agent` running `script` and the caller's `error` answer: the turn still
    ends (`end_turn`), with the scripted model's closing text; returns the model stand-in."""
    async with agent(deployment, script) as fake, deployment.caller(events=False) as (caller, _events):
        end = await notify_turn(caller, session, {"error": "notification quota exceeded"})
    assert end["stop_reason"] == "end_turn", end
    assert end["text"].strip() == GAVE_UP
    return fake


async def toolset_turn(agent: Callable[[Deployment, list[Any]], AsyncContextManager[Fake]], deployment: Deployment,
                       session: str, script: list[Any]) -> Fake:
    """`notify_turn` with `agent` running `script`, on a server whose toolset `ext` (the reference
    command endpoint) keeps the default `.` separator; returns the model stand-in."""
    async with agent(deployment, script) as fake, \
            deployment.caller("--config", str(toolset_config(deployment, ".")), events=False) as (caller, _events):
        end = await notify_turn(caller, session)
    assert end["stop_reason"] == "end_turn", end
    return fake
