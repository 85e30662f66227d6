"""A clean end: both stdio programs read and write stdin/stdout on Trio streams
(oubliette_runtime/stdio_streams.py); EOF on stdin and a reader that went away (broken pipe)
must still end them, as they ended with the SDK's threaded transport.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from harness import fresh_dir

PYTHON = sys.executable
EXIT_TIMEOUT = 20.0

INITIALIZE = json.dumps({
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}).encode() + b"\n"


def _programs(tmp: Path) -> dict[str, list[str]]:
    return {
        "client": [PYTHON, "-m", "oubliette_client", "--relay", f"unix:{tmp / 'none.sock'}",
                   "--instance", "box1", "--token", "t", "--connect-wait", "0"],  # no relay: serve at once
        "server": [PYTHON, "-m", "oubliette_server", "--relay", f"unix:{tmp / 'relay.sock'}",
                   "--data-dir", str(tmp / "data")],
    }


async def _initialized(argv: list[str]) -> trio.Process:
    """`argv` started on pipes, after it answered `initialize`."""
    proc = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdin.send_all(INITIALIZE)
    buffer = b""
    with trio.fail_after(EXIT_TIMEOUT):
        while b"\n" not in buffer:
            chunk = await proc.stdout.receive_some(65536)
            assert chunk, "closed stdout before answering initialize"
            buffer += chunk
    assert json.loads(buffer.split(b"\n", 1)[0])["id"] == 1
    return proc


@pytest.mark.parametrize("program", ["client", "server"])
async def test_eof_on_stdin_ends_the_program(program: str) -> None:
    tmp = fresh_dir()
    proc = await _initialized(_programs(tmp)[program])
    try:
        assert proc.stdin is not None
        await proc.stdin.aclose()
        with trio.fail_after(EXIT_TIMEOUT):
            code = await proc.wait()
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("program", ["client", "server"])
async def test_broken_stdout_ends_the_program(program: str) -> None:
    """The reader of stdout goes away; the next answer meets a broken pipe and the program ends
    (it must not hang nor spin); stdin still open, so EOF is not what ends it."""
    tmp = fresh_dir()
    proc = await _initialized(_programs(tmp)[program])
    try:
        assert proc.stdin is not None and proc.stdout is not None
        await proc.stdout.aclose()
        ping = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "ping"}).encode() + b"\n"
        with trio.fail_after(EXIT_TIMEOUT):
            try:
                await proc.stdin.send_all(ping)
            except trio.BrokenResourceError:
                pass  # it is already gone
            code = await proc.wait()
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
