"""Ctrl-C in a program of Oubliette: exit status 130 and no traceback, whenever it comes.

Each program spends up to a second importing (Trio, the MCP SDK) before its event loop runs;
Python's default SIGINT handler would raise `KeyboardInterrupt` in the middle of an import and
print its traceback. `exit_on_interrupt` is installed first thing, before those imports: a
Ctrl-C then ends the process at once with the shell's status for SIGINT, since nothing has
been started that needs stopping. A program with something to stop (a server's listeners and
store, a demo's children) calls `raise_on_interrupt` before `trio.run`, so Trio turns SIGINT
into a cancellation, and maps what comes out with `is_interrupt`. Signal receivers
(`trio.open_signal_receiver`) take SIGINT over while they are open, whichever is installed.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Callable

__all__ = [
    "INTERRUPTED", "exit_on_interrupt", "exception_leaves", "exit_status", "failure_line", "is_interrupt",
    "raise_on_interrupt", "run_program",
]

#: The exit status of a program ended by SIGINT, as shells report it (128 + 2).
INTERRUPTED = 128 + signal.SIGINT


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    os._exit(INTERRUPTED)


def exit_on_interrupt() -> None:
    """From now on SIGINT ends the process with status 130, silently (main thread only)."""
    signal.signal(signal.SIGINT, _exit_interrupted)


def run_program(cli_module: str) -> int:
    """A program's entry point: SIGINT quiet first, then import `cli_module` (the slow part) and
    return its `main()`, the exit status. `cli_module` installs nothing when imported, so it stays
    usable as a library; only the program installs the handler."""
    exit_on_interrupt()
    # `__import__`, the import statement's own path (which `-X importtime` reports), not importlib's
    status: int = __import__(cli_module, fromlist=["main"]).main()
    return status


def raise_on_interrupt() -> None:
    """From now on SIGINT raises `KeyboardInterrupt` (Python's default), which `trio.run` turns into
    a cancellation of everything it runs; main thread only."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a Ctrl-C: a `KeyboardInterrupt`, possibly inside exception groups beside the
    cancellations it caused, and nothing else."""
    import trio  # loaded by now (the exception came out of `trio.run`); not at import, see above

    leaves = exception_leaves(exc)
    interrupts = [leaf for leaf in leaves if isinstance(leaf, KeyboardInterrupt)]
    others = [leaf for leaf in leaves if not isinstance(leaf, (KeyboardInterrupt, trio.Cancelled))]
    return bool(interrupts) and not others


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside `exc`'s (nested) exception groups, in order; `[exc]` for a plain one."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in exception_leaves(inner)]
    return [exc]


def failure_line(
    exc: BaseException, *, own_line: tuple[type[BaseException], ...] = (), also: tuple[type[BaseException], ...] = (),
) -> str | None:
    """One line for a failure an operator can fix, else None (a bug: keep its traceback).

    Such a failure is, possibly inside Trio's exception groups beside cancellations, one of
    `own_line` (its message is the line), or only `OSError`s and `also` (the first one's line).
    """
    import trio  # loaded by now (the exception came out of `trio.run`); not at import

    leaves = [leaf for leaf in exception_leaves(exc) if not isinstance(leaf, (trio.Cancelled, KeyboardInterrupt))]
    for leaf in leaves:
        if isinstance(leaf, own_line):
            return str(leaf)
    if not leaves or not all(isinstance(leaf, (OSError, *also)) for leaf in leaves):
        return None
    first = leaves[0]
    if isinstance(first, OSError) and first.strerror:
        return f"{first.strerror}: {first.filename}" if first.filename else first.strerror
    return str(first) or type(first).__name__


def exit_status(prog: str, run: Callable[[], int], describe: Callable[[BaseException], str | None]) -> int:
    """`run()`'s exit status; a failure `describe` names is one line on stderr and status 1 (with
    its traceback too at DEBUG), any other is raised. The one place a failure becomes a status."""
    try:
        return run()
    except Exception as exc:
        line = describe(exc)
        if line is None:
            raise
        import logging
        import sys
        import traceback

        if logging.getLogger().isEnabledFor(logging.DEBUG):
            traceback.print_exception(exc)
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
