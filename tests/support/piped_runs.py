"""Helpers of tests/runtime/test_interrupts.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import subprocess
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
import trio.testing
from program_runs import Stderr


@asynccontextmanager
async def piped(argv: list[str], **options: Any) -> AsyncIterator[tuple[trio.Process, Stderr, Stderr]]:
    """`argv` running with its stdout and stderr read in the background; killed at the end if still running."""
    process = await trio.lowlevel.open_process(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **options,
    )
    out, err = Stderr(), Stderr()
    try:
        async with trio.open_nursery() as nursery:
            assert process.stdout is not None and process.stderr is not None
            nursery.start_soon(out.drain, process.stdout)
            nursery.start_soon(err.drain, process.stderr)
            yield process, out, err
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
