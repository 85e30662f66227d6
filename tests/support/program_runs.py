"""Helpers of tests/e2e/test_first_hour.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import subprocess
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from harness import PYTHON, env_without_oubliette

#: Bound on one short run of a program (start, fail or answer, exit) on a slow, shared machine.
RUN_BOUND = 60.0
READY = b"oubliette-server ready "


async def run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    """Run `python -m ARGS…` to its end: exit status, stdout, stderr lines."""
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-m", *args], stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True,
            env=env if env is not None else env_without_oubliette(), check=False,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode().splitlines()


def assert_one_line(err: list[str], *needles: str) -> None:
    assert len(err) == 1, "\n".join(err)
    assert "Traceback" not in err[0] and "error:" in err[0], err[0]
    for needle in needles:
        assert needle in err[0], (needle, err[0])


class Stderr:
    """A running program's stderr, read in the background; wait for a line containing some text."""

    def __init__(self) -> None:
        self.text = b""
        self._changed = trio.Event()

    async def drain(self, stream: trio.abc.ReceiveStream) -> None:
        while chunk := await stream.receive_some(65536):
            self.text += chunk
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def wait_for(self, needle: bytes, timeout: float = RUN_BOUND) -> None:
        with trio.fail_after(timeout):
            while needle not in self.text:
                await self._changed.wait()


@asynccontextmanager
async def program(args: list[str], env: dict[str, str]) -> AsyncIterator[tuple[trio.Process, Stderr]]:
    """`python -m ARGS…` running, its stderr collected; terminated at the end if still running."""
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )
    stderr = Stderr()
    try:
        async with trio.open_nursery() as nursery:
            assert process.stderr is not None
            nursery.start_soon(stderr.drain, process.stderr)
            yield process, stderr
            if process.returncode is None:
                process.terminate()
            with trio.fail_after(RUN_BOUND):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
