"""One server per data directory: the lock, and the stdio server Claude Code spawns next to the README's daemon.

Two servers on one SQLite data directory would both write its frame log and both close the
requests "a previous run" left; the second one now gets one line naming the first one's pid,
and exits 1. docs/CLAUDE_CODE.md's `claude mcp add` line gives the stdio server a data directory
of its own, so it runs beside the daemon: checked here with the real programs, the line taken
from the doc and expanded by bash as a user's shell would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from harness import Deployment, env_without_oubliette
from oubliette_server.data_dir_lock import LOCK_FILE, DataDirInUse, hold_data_dir
from test_first_hour import READY, RUN_BOUND, assert_one_line, program

VENV = Path(sys.executable).parent.parent
DOC = Path(__file__).resolve().parent.parent / "docs" / "CLAUDE_CODE.md"


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


def _user_env(home: Path) -> dict[str, str]:
    """A user's shell: HOME of its own, no OUBLIETTE_* and no XDG data home (the default data dir applies)."""
    env = {k: v for k, v in env_without_oubliette().items() if k not in {"XDG_DATA_HOME", "VIRTUAL_ENV"}}
    return {**env, "HOME": str(home)}


def _documented_stdio_line() -> str:
    """The program part (after `--`) of docs/CLAUDE_CODE.md's first `claude mcp add` line, unexpanded."""
    match = re.search(r"^claude mcp add oubliette -- (.+)$", DOC.read_text(), re.M)
    assert match, "docs/CLAUDE_CODE.md has no `claude mcp add oubliette -- …` line"
    return match.group(1)


async def _initialize(process: trio.Process) -> dict:
    """Send MCP `initialize` on the server's stdin; its answer from stdout."""
    assert process.stdin is not None and process.stdout is not None
    request = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}}
    await process.stdin.send_all(json.dumps(request).encode() + b"\n")
    buffer = b""
    with trio.fail_after(RUN_BOUND):
        while b"\n" not in buffer:
            chunk = await process.stdout.receive_some(65536)
            assert chunk, "the stdio server closed stdout before answering"
            buffer += chunk
    return json.loads(buffer.split(b"\n", 1)[0])


async def test_the_documented_stdio_server_runs_next_to_the_readme_daemon(tmp_path: Path) -> None:
    home, checkout = tmp_path / "home", tmp_path / "checkout"
    home.mkdir()
    checkout.mkdir()
    (checkout / ".venv").symlink_to(VENV)  # the checkout after the README's command 1
    env = _user_env(home)
    daemon_dir = home / ".local" / "share" / "oubliette"
    async with program(["oubliette_server", "--no-stdio"], env) as (daemon, daemon_err):
        await daemon_err.wait_for(READY)
        assert (daemon_dir / LOCK_FILE).read_text() == f"{daemon.pid}\n"

        # The doc's line, as bash expands it in the checkout ($PWD, ~): it serves a caller.
        line = _documented_stdio_line()
        stdio = await trio.lowlevel.open_process(
            ["bash", "-c", f"exec {line} --log-level warning"], cwd=checkout, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            answer = await _initialize(stdio)
            assert answer["result"]["serverInfo"]["name"] == "oubliette-server", answer
            assert (home / ".local" / "share" / "oubliette-claude" / LOCK_FILE).read_text() == f"{stdio.pid}\n"
            assert stdio.stdin is not None
            await stdio.stdin.aclose()  # the caller leaves: the stdio server ends
            with trio.fail_after(RUN_BOUND):
                assert await stdio.wait() == 0
        finally:
            if stdio.returncode is None:
                stdio.kill()
                with trio.CancelScope(shield=True):
                    await stdio.wait()

        # The same line on the daemon's data directory: refused, naming the daemon.
        with trio.fail_after(RUN_BOUND):
            refused = await trio.run_process(
                ["bash", "-c", f"exec {line.replace('oubliette-claude', 'oubliette')}"], cwd=checkout, env=env,
                stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False,
            )
        assert refused.returncode == 1
        assert_one_line(
            refused.stderr.decode().splitlines(), f"the data directory {daemon_dir} is in use by another "
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
