"""One server per data directory: an advisory lock held for the server's life.

Two servers on one data directory would both write its SQLite frame log, both clean up the
requests "a previous run" left open, and race for its relay socket. `hold_data_dir` takes an
exclusive `flock` on `<data dir>/server.lock` and writes the holder's pid into it, so a second
server fails at once with one line naming that pid. The kernel drops the lock when the holder
exits, however it exits (a killed server leaves no stale lock); the file itself stays, since
removing it would let two servers lock two different files of the same name. With a shared
PostgreSQL store several servers run, each with its own data directory (docs/SCALING.md).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_FILE = "server.lock"


class DataDirInUse(Exception):
    """Another live server holds the data directory's lock; the message names it and what to do."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        who = f"pid {holder}" if holder.isdigit() else "a server that is just starting"
        super().__init__(
            f"the data directory {data_dir} is in use by another oubliette-server ({who}); "
            "stop it, or pass another --data-dir"
        )
        self.holder = holder


@contextmanager
def hold_data_dir(data_dir: Path) -> Iterator[None]:
    """Hold `data_dir`'s lock until the block ends (or the process does).

    Raises: `DataDirInUse` when another process holds it; `OSError` when the lock file cannot
    be opened (the directory is checked for writability before this).
    The descriptor is close-on-exec, so guests the server starts never inherit the lock.
    """
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirInUse(data_dir, os.pread(fd, 32, 0).decode(errors="replace").strip()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # still locked: the next holder finds no stale pid
    finally:
        os.close(fd)
