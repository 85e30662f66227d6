"""`oubliette-server backup DEST`: a consistent copy of a running server's SQLite data directory.

The copy is itself a data directory: the frame log as of one commit (`FrameStore.backup_to`)
and the secret, so every token (the sandboxes' and the HTTP one) is the same after a restore.
Nothing else of a data directory is state: the lock and the sockets belong to a running server.
A PostgreSQL store is backed up with PostgreSQL's own tools (docs/DEPLOY.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.auth import SECRET_FILE_NAME
from ..store.sqlite import FrameStore
from .config import ServerConfig


class BackupError(OSError):
    """The backup cannot be made; the message says why, in one line."""


def backup_data_dir(config: ServerConfig, dest: Path) -> list[Path]:
    """Write the frame log and the secret of `config`'s data directory into `dest`, a new or empty
    directory (created 0700); returns the files written.

    Why the server's own command: a copy of the log without the secret restores a server whose
    tokens all changed, and the copy must be read inside one SQLite transaction, which `cp` is not.
    It takes no lock and writes nothing in the data directory, so it runs beside the server.
    """
    source = Path(config.frame_store_path)
    if not source.is_file():
        raise BackupError(f"there is no frame store at {source} (is --data-dir the server's?)")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BackupError(f"{dest} exists and is not an empty directory; back up into a new one")
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = [Path(ServerConfig(data_dir=dest).frame_store_path)]
    store = FrameStore.reader(source)
    try:
        store.backup_to(written[0])
    finally:
        store.close()
    secret = config.data_dir / SECRET_FILE_NAME
    if secret.is_file():
        written.append(dest / SECRET_FILE_NAME)
        fd = os.open(written[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secret.read_bytes())
    return written
