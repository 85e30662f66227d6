"""What the real-CLI tests of agents in the sandbox share (tests/e2e/test_gemini_cli.py,
tests/e2e/test_opencode.py): the installed CLI, docs/AGENTS.md's runtime line for it, and the
check that README command 2 installs the version they run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness import PYTHON
from claude_code import documented_lines

ROOT = Path(__file__).resolve().parents[2]


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
