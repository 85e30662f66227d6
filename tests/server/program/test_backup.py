"""Backing up a running server's SQLite data directory, and restoring it (docs/DEPLOY.md, "Backup").

`oubliette-server backup DEST` runs beside a server that is storing frames; DEST, used as a new
data directory, starts a server whose log holds exactly the frames acknowledged up to one
moment (a contiguous prefix, each as stored, none half-written) and whose tokens are the old
ones. A copy with `cp` of a live store would miss the commits still in its `-wal` file.
"""

from __future__ import annotations

import sqlite3
import subprocess
from contextlib import closing
from typing import Any

import trio

from harness import PYTHON, Deployment, fresh_dir
from tether_http import POLL, frame_body, post

#: Frames stored before the first backup starts, so it has something to copy.
BEFORE_BACKUP = 20


async def read_log(rest: Any, instance: str) -> list[dict[str, Any]]:
    """Every frame of `instance`, page by page."""
    frames: list[dict[str, Any]] = []
    while True:
        response = await rest.get(POLL.format(instance), params={"after_seq": len(frames) and frames[-1]["seq"], "limit": 200})
        assert response.status_code == 200, response.text
        page = response.json()["frames"]
        if not page:
            return frames
        frames.extend(page)


async def test_a_backup_taken_under_traffic_restores_a_consistent_log_and_the_same_tokens(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    restored = Deployment(fresh_dir())
    acknowledged: list[dict[str, Any]] = []
    warmed_up = trio.Event()
    try:
        async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:

            async def traffic() -> None:
                while True:
                    stored = await post(rest, "box1", frame_body("host", f"s{len(acknowledged) % 3}", text=f"frame {len(acknowledged)}"))
                    acknowledged.append(stored["frame"])
                    if len(acknowledged) == BEFORE_BACKUP:
                        warmed_up.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(traffic)
                await warmed_up.wait()
                floor = len(acknowledged)
                done = await trio.run_process(
                    [PYTHON, "-m", "oubliette_server", "backup", str(restored.data_dir), "--data-dir", str(deployment.data_dir)],
                    capture_stdout=True, capture_stderr=True, check=False,
                )
                nursery.cancel_scope.cancel()
            assert done.returncode == 0, done.stderr.decode()
            assert f"into {restored.data_dir}: frames.sqlite3, secret" in done.stdout.decode()
            assert len(acknowledged) > floor, "the server stored no frame while the backup ran"

        with closing(sqlite3.connect(restored.data_dir / "frames.sqlite3")) as copy:
            assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert restored.http_token() == deployment.http_token()
        assert restored.token("box1") == deployment.token("box1")
        async with restored.http_server("--config", str(config)) as again, again.rest() as rest:
            frames = await read_log(rest, "box1")
        assert len(frames) >= floor, (len(frames), floor)
        assert frames == acknowledged[: len(frames)], "the restored log is not a prefix of what was stored"
    finally:
        restored.cleanup()


def test_backup_refuses_a_destination_in_use_and_a_data_dir_without_a_store(deployment: Deployment) -> None:
    deployment.data_dir.mkdir(parents=True)
    (deployment.root / "full").mkdir()
    (deployment.root / "full" / "frames.sqlite3").write_text("")

    def backup(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "oubliette_server", "backup", *args], capture_output=True, text=True, timeout=60)

    empty = backup(str(deployment.root / "copy"), "--data-dir", str(deployment.data_dir))
    assert (empty.returncode, empty.stderr.strip()) == (
        1, f"oubliette-server: error: there is no frame store at {deployment.data_dir}/frames.sqlite3 "
        "(is --data-dir the server's?)",
    )
    assert not (deployment.root / "copy").exists()
    (deployment.data_dir / "frames.sqlite3").write_text("")
    full = backup(str(deployment.root / "full"), "--data-dir", str(deployment.data_dir))
    assert (full.returncode, full.stderr.strip()) == (
        1, f"oubliette-server: error: {deployment.root}/full exists and is not an empty directory; back up into a new one",
    )
    shared = backup(str(deployment.root / "copy"), "--store", "postgresql://oubliette@db/oubliette")
    assert shared.returncode == 2 and "back it up with pg_dump" in shared.stderr, shared.stderr
