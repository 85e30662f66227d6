"""Pick the frame store a server runs on: SQLite in the data directory, or PostgreSQL.

The choice is the config's `store_url` (`--store`, or the config file's `[store] url`): none
means the embedded SQLite file, a `postgresql://` libpq URI the shared PostgreSQL store.
The PostgreSQL driver is an optional extra, imported only when it is asked for, so the
embedded default installs and imports nothing more.
"""

from __future__ import annotations

from collections.abc import Callable

from .api import DEFAULT_CHECKPOINT_EVERY, FrameStoreAPI
from .sqlite import FrameStore

#: What to install, said in the one line the server prints. The distribution is `oubliette-relay`
#: (`oubliette` on PyPI is an unrelated project); from a checkout, the editable install.
MISSING_EXTRA = (
    "the PostgreSQL store needs the optional extra postgres (psycopg and psycopg_pool): "
    "pip install -e '.[postgres]' in the Oubliette checkout "
    "(once published: pip install 'oubliette-relay[postgres]')"
)


def store_url_problem(url: str) -> str | None:
    """Why `url` is not a PostgreSQL store URI libpq can read, or None.

    Checked before serving, so a typo (`postgresql://[::1`, `?x`, an unknown query parameter)
    is a usage error in one line, not the driver's traceback. Without the driver installed it
    says nothing: `open_store` then names the missing extra.
    """
    try:
        from psycopg import ProgrammingError, conninfo
    except ImportError:
        return None
    try:
        conninfo.conninfo_to_dict(url)
    except ProgrammingError as exc:
        return "the store URL is not a libpq URI: " + " ".join(str(exc).split("\n")).strip()
    return None


class StoreConfigError(ValueError):
    """The configured store cannot be used (its driver is not installed); the message says what to do."""


def open_store(
    url: str | None,
    sqlite_path: str,
    *,
    retention_frames: int | None,
    retention_seconds: float | None,
    pool_size: int,
    connect_timeout: float,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    sign: Callable[[bytes], bytes] | None = None,
) -> FrameStoreAPI:
    """The store `url` names (None: SQLite at `sqlite_path`); PostgreSQL connects in `running()`.

    Raises: `StoreConfigError` when the PostgreSQL extra is missing; SQLite's own errors
    (`sqlite3.Error`, `OSError`) for an unusable file.
    """
    if url is None:
        return FrameStore(
            sqlite_path, retention_frames=retention_frames, retention_seconds=retention_seconds,
            checkpoint_every=checkpoint_every, sign=sign,
        )
    try:
        from .postgres import PostgresFrameStore
    except ImportError:
        raise StoreConfigError(MISSING_EXTRA) from None
    return PostgresFrameStore(
        url, retention_frames=retention_frames, retention_seconds=retention_seconds,
        pool_size=pool_size, connect_timeout=connect_timeout, checkpoint_every=checkpoint_every, sign=sign,
    )


def open_reader(url: str | None, sqlite_path: str, *, connect_timeout: float = 10.0) -> FrameStoreAPI:
    """The store `url` names, opened to be read beside its running server(s) by another process
    (`oubliette-server status`, `tail`): SQLite read-only (`FrameStore.reader`: no lock, no
    writes), PostgreSQL as one more client with retention off (it prunes nothing).

    Raises: `StoreConfigError` when the PostgreSQL extra is missing; `OSError` when there is no
    SQLite file at `sqlite_path` or it cannot be opened.
    """
    if url is None:
        return FrameStore.reader(sqlite_path)
    try:
        from .postgres import PostgresFrameStore
    except ImportError:
        raise StoreConfigError(MISSING_EXTRA) from None
    return PostgresFrameStore(
        url, retention_frames=None, retention_seconds=None, pool_size=2, connect_timeout=connect_timeout,
    )
