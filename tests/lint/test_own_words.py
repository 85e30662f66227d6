"""The project speaks in its own terms: no `--help`, doc, comment or config names something a user
cannot open (another tracker's "issue 14", a design brief's "seed 001", a DESIGN.md that is not
in the repository). Checked in every tracked source and doc file, and in every `--help`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"seed 00\d|issue \d|DESIGN\.md", re.I)
HELP = [
    ["oubliette-server"], ["oubliette-server", "token"], ["oubliette-server", "http-token"], ["oubliette-server", "backup"],
    ["oubliette-client"], ["oubliette-client", "run"], ["oubliette-client", "endpoint"],
    ["oubliette-client", "tools"], ["oubliette-client", "demo-agent"],
]


def test_no_tracked_file_names_what_a_user_cannot_open() -> None:
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "*.py", "*.md", "*.toml", "*.sh"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    found = [
        f"{name}:{number}: {line.strip()}"
        for name in files if (ROOT / name).exists()
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if OUTSIDE.search(line) and name != "tests/lint/test_own_words.py"
    ]
    assert found == []


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_speaks_in_the_projects_terms(argv: list[str]) -> None:
    program = Path(sys.executable).with_name(argv[0])
    done = subprocess.run([str(program), *argv[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not OUTSIDE.search(done.stdout), done.stdout
