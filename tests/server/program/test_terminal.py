"""`oubliette-server` typed in a terminal: one line says stdio is for programs, and it serves as with `--no-stdio`.

A real pseudo-terminal (pty.openpty) is the server's stdin, stdout and stderr, as in a shell.
In the foreground the server would otherwise wait silently for JSON-RPC on the keyboard; as a
background job (`oubliette-server &`: its own process group, not the terminal's foreground
one) reading the terminal would stop it with SIGTTIN. Either way it must serve the relay: a
`tools list` through it answers.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import trio

from harness import PYTHON, env_without_oubliette
from program_runs import RUN_BOUND, run

NOTICE = (
    "oubliette-server: stdin is a terminal, so no caller is served on stdio (that is for programs that spawn "
    "oubliette-server, such as an MCP client); serving the relay and HTTP as with --no-stdio"
)

#: Makes the pty the controlling terminal of a new session, then runs the server in a process
#: group of its own, which is therefore a background job of that terminal (as `cmd &` in a shell).
#: Prints the server's pid, and how it ended: "exit N", or "stopped SIG" if the terminal stopped it.
BACKGROUND = """
import fcntl, os, signal, sys, termios
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.execv(sys.argv[1], sys.argv[1:])
print(f"pid {pid}", flush=True)
_, status = os.waitpid(pid, os.WUNTRACED)
if os.WIFSTOPPED(status):
    print(f"stopped {signal.Signals(os.WSTOPSIG(status)).name}", flush=True)
    os.kill(pid, signal.SIGKILL)
else:
    print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class Terminal:
    """The master side of a pty: what the programs on it wrote, awaitable by text."""

    def __init__(self, master: int) -> None:
        self.stream = trio.lowlevel.FdStream(master)
        self.text = ""
        self._changed = trio.Event()

    async def drain(self) -> None:
        while True:
            try:
                chunk = await self.stream.receive_some(65536)
            except (OSError, trio.BrokenResourceError):  # EIO: every slave side is closed
                chunk = b""
            self.text += chunk.decode(errors="replace").replace("\r\n", "\n")
            self._changed.set()
            self._changed = trio.Event()
            if not chunk:
                return

    async def wait_for(self, needle: str) -> None:
        with trio.fail_after(RUN_BOUND):
            while needle not in self.text:
                await self._changed.wait()


@asynccontextmanager
async def on_a_terminal(argv: list[str], env: dict[str, str]) -> AsyncIterator[tuple[trio.Process, Terminal]]:
    master, slave = pty.openpty()
    process = await trio.lowlevel.open_process(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    terminal = Terminal(master)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(terminal.drain)
            yield process, terminal
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        await terminal.stream.aclose()


async def _tools_list_answers(data_dir: Path) -> None:
    from oubliette_server.core.auth import TokenAuthority

    env = {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(data_dir), "OUBLIETTE_INSTANCE": "box1",
           "OUBLIETTE_TOKEN": TokenAuthority.for_data_dir(data_dir).token_for("box1")}
    status, out, err = await run(["oubliette_client", "tools", "list"], env)
    assert status == 0 and json.loads(out)["type"] == "result", (out, err)


async def test_typed_in_a_terminal_it_says_so_and_serves_the_relay(tmp_path: Path) -> None:
    env = {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(tmp_path / "data")}
    server = str(Path(sys.executable).with_name("oubliette-server"))
    async with on_a_terminal([server], env) as (process, terminal):
        await terminal.wait_for("oubliette-server ready ")
        assert terminal.text.splitlines()[0] == NOTICE, terminal.text
        await _tools_list_answers(tmp_path / "data")
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(RUN_BOUND):
            assert await process.wait() == 0
    assert "Traceback" not in terminal.text


async def test_as_a_background_job_it_is_not_stopped_by_the_terminal(tmp_path: Path) -> None:
    env = {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(tmp_path / "data")}
    server = str(Path(sys.executable).with_name("oubliette-server"))
    async with on_a_terminal([PYTHON, "-c", BACKGROUND, server], env) as (process, terminal):
        await terminal.wait_for("oubliette-server ready ")
        await _tools_list_answers(tmp_path / "data")
        assert "stopped" not in terminal.text, terminal.text
        pid = int(terminal.text.split("pid ", 1)[1].split()[0])
        os.kill(pid, signal.SIGTERM)
        await terminal.wait_for("exit ")
        with trio.fail_after(RUN_BOUND):
            await process.wait()
    assert "exit 0" in terminal.text and NOTICE in terminal.text, terminal.text


async def test_a_program_on_pipes_is_still_served_on_stdio(tmp_path: Path) -> None:
    """The check is for terminals only: a spawning program's pipes get the MCP server as before."""
    env = {**env_without_oubliette(), "OUBLIETTE_DATA_DIR": str(tmp_path / "data")}
    request = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_server", "--log-level", "warning"], env=env,
            stdin=json.dumps(request).encode() + b"\n", capture_stdout=True, capture_stderr=True, check=False,
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["result"]["serverInfo"]["name"] == "oubliette-server"
    assert b"stdin is a terminal" not in done.stderr
