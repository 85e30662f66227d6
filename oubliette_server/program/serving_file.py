"""`serving.json`: the running server's addresses in its data directory, for `status` and `tail`.

Why: a listener given as `--http 127.0.0.1:0` has its port only once bound, and the operator's
commands see neither the server's command line nor its config; they see its data directory.
`run_server` writes this file once every listener is bound (before the ready line) and removes
it when it stops cleanly; it is written whole (a temporary file renamed over it), mode 0600.
A killed server leaves it behind, so a reader trusts it only while its `pid` is a live process
(`read_serving`), and `status` also checks that the address answers with the file's server id.
An embedded server (the library's `serve`) writes none: its data directory and its lifetime
are its embedder's, as is the lock the command line holds on it (data_dir_lock.py).
With PostgreSQL each server has its own data directory, so each its own file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import attrs
import trio

from protocol.convert import structure, unstructure
from protocol.errors import RelayError

SERVING_FILE = "serving.json"


@attrs.frozen
class ServingRecord:
    """What `serving.json` holds: who serves this data directory and where it listens."""

    pid: int
    server: str
    """The server's id, as `/v1/health` and the leases name it."""
    relay: str
    http: list[str]
    """Each HTTP listener's URL (`http://127.0.0.1:PORT`, `http://unix:PATH`), as the ready line prints it."""
    metrics: list[str]
    instances: list[str]
    """The configured instances (`[instances.NAME]`)."""

    def http_bind(self) -> str | None:
        """The first HTTP listener as `--http` takes it (`HOST:PORT`, `unix:PATH`), or None."""
        return self.http[0].removeprefix("http://") if self.http else None


def write_serving(data_dir: Path, record: ServingRecord) -> None:
    """Replace `data_dir`'s `serving.json` with `record` at once: a reader sees the old file or the new one."""
    fd, temporary = tempfile.mkstemp(dir=data_dir, prefix=".serving-", suffix=".json")  # mode 0600
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(unstructure(record), file)
        os.replace(temporary, data_dir / SERVING_FILE)
    except BaseException:
        os.unlink(temporary)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of another user
    return True


def read_serving(data_dir: Path) -> ServingRecord | None:
    """The record of the server running on `data_dir`, or None: no file, an unreadable one, or one
    a server that is gone left (its pid is no live process)."""
    try:
        record = structure(json.loads((data_dir / SERVING_FILE).read_text()), ServingRecord)
    except (OSError, ValueError, RelayError):  # absent, or not whole JSON of this shape
        return None
    return record if _alive(record.pid) else None


async def keep_serving_file(data_dir: Path, record: ServingRecord, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Hold `serving.json` for as long as this task runs (start it with `nursery.start` in the
    server's nursery): written before started, removed when cancelled."""
    write_serving(data_dir, record)
    try:
        task_status.started()
        await trio.sleep_forever()
    finally:
        (data_dir / SERVING_FILE).unlink(missing_ok=True)
