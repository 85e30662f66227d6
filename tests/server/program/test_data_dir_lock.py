"""One server per data directory: the lock, and the stdio server Claude Code spawns next to the README's daemon.

Two servers on one SQLite data directory would both write its frame log and both close the
requests "a previous run" left; the second one now gets one line naming the first one's pid,
and exits 1. docs/CLAUDE_CODE.md's `claude mcp add` line gives the stdio server a data directory
of its own, so it runs beside the daemon: checked here with the real programs, the line taken
from the doc and expanded by bash as a user's shell would.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import trio

from harness import Deployment, env_without_oubliette, fresh_shell
from oubliette_server.program.data_dir_lock import LOCK_FILE, DataDirInUse, hold_data_dir
from program_runs import READY, RUN_BOUND, assert_one_line, program

DOC = Path(__file__).resolve().parents[3] / "docs" / "CLAUDE_CODE.md"


def test_a_second_holder_is_told_the_first_ones_pid(tmp_path: Path) -> None:
    with hold_data_dir(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(DataDirInUse) as refused:
            with hold_data_dir(tmp_path):
                pass  # pragma: no cover
        assert refused.value.holder == str(os.getpid())
        assert f"in use by another oubliette-server (pid {os.getpid()})" in str(refused.value)
    with hold_data_dir(tmp_path):  # released: the next server takes it
        pass
    assert (tmp_path / LOCK_FILE).read_text() == ""


def _documented_block() -> str:
    """docs/CLAUDE_CODE.md's first shell block with `claude mcp add oubliette -- …`, as a user pastes it."""
    for block in re.findall(r"^```sh\n(.*?)^```$", DOC.read_text(), re.S | re.M):
        if re.search(r"^claude mcp add oubliette -- ", block, re.M):
            return block
    raise AssertionError("docs/CLAUDE_CODE.md has no `claude mcp add oubliette -- …` block")


async def _bash(script: str, cwd: Path, env: dict[str, str]) -> tuple[int, str, list[str]]:
    with trio.fail_after(RUN_BOUND * 2):
        done = await trio.run_process(
            ["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            capture_stdout=True, capture_stderr=True, check=False,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode().splitlines()


async def test_the_documented_claude_mcp_add_works_next_to_the_readme_daemon(short_tmp: Path) -> None:
    """The README's daemon runs; the doc's block, pasted into a new shell, adds the stdio server to
    the real Claude Code, whose health check (`claude mcp list`) starts it and connects."""
    checkout, env = fresh_shell(short_tmp)
    daemon_dir = Path(env["HOME"]) / ".local" / "share" / "oubliette"
    async with program(["oubliette_server", "--no-stdio"], env) as (daemon, daemon_err):
        await daemon_err.wait_for(READY)
        assert (daemon_dir / LOCK_FILE).read_text() == f"{daemon.pid}\n"

        block = _documented_block()
        status, out, err = await _bash(block + "\nclaude mcp list\n", checkout, env)
        assert status == 0, (out, err)
        assert re.search(r"^oubliette: .*oubliette-claude.* Connected$", out, re.M), (out, err)

        # The same line on the daemon's data directory: refused, naming the daemon.
        line = re.search(r"^claude mcp add oubliette -- (.+)$", block, re.M).group(1)  # type: ignore[union-attr]
        status, _, err = await _bash(f"exec {line.replace('oubliette-claude', 'oubliette')}", checkout, env)
        assert status == 1
        assert_one_line(
            err, f"the data directory {daemon_dir} is in use by another "
            f"oubliette-server (pid {daemon.pid}); stop it, or pass another --data-dir",
        )
        assert daemon.returncode is None, "the daemon keeps running"


async def test_servers_on_one_postgresql_store_each_lock_their_own_data_dir(pg_url: str) -> None:
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    env = env_without_oubliette()

    def serve(deployment: Deployment, data_dir: Path) -> list[str]:
        return ["oubliette_server", "--no-stdio", "--store", pg_url, "--data-dir", str(data_dir),
                "--relay", f"unix:{deployment.root / 'own.sock'}"]

    async with program(serve(a, a.data_dir), env) as (first, first_err):
        await first_err.wait_for(READY)
        async with program(serve(b, b.data_dir), env) as (_, second_err):
            await second_err.wait_for(READY)  # several servers on one store: allowed
        async with program(serve(b, a.data_dir), env) as (third, third_err):
            with trio.fail_after(RUN_BOUND):
                assert await third.wait() == 1
            await third_err.wait_for(f"in use by another oubliette-server (pid {first.pid})".encode())
