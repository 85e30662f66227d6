"""Docs that run: every ```sh block of README.md and docs/*.md is executed here, or says why not;
so is every ```python block of docs/EMBEDDING.md (each a whole program).

A block preceded by `<!-- run by tests/lint/test_docs_run.py[, output contains: TEXT] -->` is run
with bash, as pasted into a new shell in the checkout after the README's command 1: the
directory holds `.venv` but nothing has activated it (`harness.fresh_shell`: the venv is not
on `PATH`), with a data directory, `HOME` and `PORT` of its own; it must exit 0, stop what it
started, print no traceback, and print TEXT. A block preceded by
`<!-- not run here: REASON -->` is not run. Any other ```sh block fails the test, so a new shell
session in the docs is either checked or visibly excused. A marked ```python block is run the same
way by the venv's Python (`.venv/bin/python block.py`), and must also stop what it started.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import attrs
import pytest

from harness import fresh_shell

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = re.compile(r"<!-- run by tests/lint/test_docs_run\.py(?:, output contains: (?P<expect>.+?))? -->")
NOT_RUN = re.compile(r"<!-- not run here: \S.*? -->")
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```$", re.S | re.M)
#: The docs whose Python blocks are programs, every one of them run.
PROGRAMS = {"docs/EMBEDDING.md"}
#: Seconds one block may take: servers start in about a second, a demo turn in a few.
BLOCK_TIMEOUT = 120


@attrs.frozen
class ShellBlock:
    """One ```sh (or ```python) block: where it is, its text, the marker line just before it ('' if
    none) and its language."""

    where: str
    text: str
    marker: str
    language: str = "sh"


def shell_blocks() -> list[ShellBlock]:
    blocks = []
    for path in DOCS:
        source = path.read_text()
        for match in BLOCK.finditer(source):
            before = source[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            line = source.count("\n", 0, match.start()) + 1
            blocks.append(ShellBlock(f"{path.relative_to(ROOT)}:{line}", match.group(2), before, match.group(1)))
    return blocks


BLOCKS = shell_blocks()
RUNNABLE = [b for b in BLOCKS if RUN.fullmatch(b.marker) and (b.language == "sh" or b.where.split(":")[0] in PROGRAMS)]


def test_every_shell_block_is_run_or_says_why_not() -> None:
    unmarked = [b.where for b in BLOCKS if b.language == "sh" and not (RUN.fullmatch(b.marker) or NOT_RUN.fullmatch(b.marker))]
    assert not unmarked, f"```sh blocks with neither a run marker nor '<!-- not run here: why -->': {unmarked}"
    where = {b.where.split(":")[0] for b in RUNNABLE}
    assert {"README.md", "docs/TETHER.md"} <= where


def test_every_python_block_of_the_embedding_doc_is_run() -> None:
    programs = [b for b in BLOCKS if b.language == "python" and b.where.split(":")[0] in PROGRAMS]
    assert programs, "docs/EMBEDDING.md has no Python block"
    unmarked = [b.where for b in programs if not RUN.fullmatch(b.marker)]
    assert not unmarked, f"Python blocks of {sorted(PROGRAMS)} without a run marker: {unmarked}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_the_block_runs_as_written(block: ShellBlock, short_tmp: Path) -> None:
    expect = RUN.fullmatch(block.marker).group("expect")  # type: ignore[union-attr]
    work, env = fresh_shell(short_tmp)
    env.update(OUBLIETTE_DATA_DIR=str(short_tmp / "data"), PORT=str(_free_port()))
    if block.language == "python":
        script = short_tmp / "block.py"
        script.write_text(block.text)
        command = [str(work / ".venv" / "bin" / "python"), str(script)]
    else:
        script = short_tmp / "block.sh"
        # `wait`: the block's own `kill` must stop what it started in the background.
        script.write_text(block.text + "\nwait\n")
        command = ["bash", str(script)]
    # Output goes to files, not pipes: a background process the block failed to stop would
    # otherwise hold the pipe open; the process group is ended below whatever happened.
    with open(short_tmp / "out", "w") as out, open(short_tmp / "err", "w") as err:
        process = subprocess.Popen(
            command, cwd=work, env=env, stdout=out, stderr=err, start_new_session=True,
        )
        leftovers = True
        try:
            code = process.wait(timeout=BLOCK_TIMEOUT)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                leftovers = False
            process.wait()
    stdout, stderr = (short_tmp / "out").read_text(), (short_tmp / "err").read_text()
    report = f"{block.where}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert code == 0, report
    assert not leftovers, f"the block left processes running\n{report}"
    assert "Traceback" not in stdout + stderr, report
    if expect:
        assert expect in stdout, report
