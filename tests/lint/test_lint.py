"""The four packages type-check (mypy) and lint clean (ruff), with the settings of pyproject.toml.

Run here so that CI, which runs the README's test command, fails on a type error or an unused
name as it fails on a broken test (the import contracts are checked the same way, in
tests/lint/test_architecture.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "oubliette_runtime", "oubliette_server", "oubliette_client")


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name(tool)), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )


def test_mypy_finds_no_type_error() -> None:
    # The packages come from [tool.mypy]; its cache (.mypy_cache, gitignored) makes a rerun quick.
    run = _run("mypy")
    assert run.returncode == 0, run.stdout + run.stderr


def test_ruff_finds_nothing() -> None:
    run = _run("ruff", "check", "--no-cache", *PACKAGES, "bench")
    assert run.returncode == 0, run.stdout + run.stderr
