"""A real, throwaway PostgreSQL server for the tests (no mocks of the database).

One server per pytest process: under pytest-xdist each worker starts its own (about one
second), so workers never share a server and need no lock between them. Each test that
asks for a database gets a fresh one (`CREATE DATABASE`), so tests never see each other's
rows. The server:

- lives in a directory under /tmp, not under pytest's `tmp_path` (its parents are mode
  0700, which the `nobody` user cannot traverse), owned by `nobody`;
- is initialised and run as `nobody` through `setpriv` when the tests run as root (initdb
  refuses root), else as the current user;
- listens on a Unix socket only (`-k SOCKDIR -c listen_addresses=`), with `fsync=off`
  (a test database need not survive a power loss);
- is ready when its log says "ready to accept connections" (read from its stderr by a
  thread that keeps draining it), confirmed by `pg_isready`;
- is stopped (fast shutdown) and its directory removed when the session ends.

The binaries are taken from `$OUBLIETTE_PG_BIN`, else `/usr/lib/postgresql/15/bin` (Debian's
`postgresql-15` package, which .ci/run installs where it is missing).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

PG_BIN = Path(os.environ.get("OUBLIETTE_PG_BIN", "/usr/lib/postgresql/15/bin"))
READY_LINE = b"ready to accept connections"
START_TIMEOUT = 60.0


class PostgresServer:
    """One running PostgreSQL; `url(db)` is a libpq URI for database `db` over its socket."""

    def __init__(self, *, fsync: bool = False, settings: dict[str, str] | None = None) -> None:
        self.fsync = fsync
        """Whether the server fsyncs (off for tests; on for the benchmark's honest commits)."""
        self.settings = settings or {}
        """More server settings (`-c name=value`), e.g. a benchmark's `pg_stat_statements`."""
        if not (PG_BIN / "postgres").exists():
            raise RuntimeError(
                f"PostgreSQL binaries are missing from {PG_BIN}: apt-get install -y postgresql-15 "
                "(.ci/run does), or set OUBLIETTE_PG_BIN"
            )
        self.root = Path(tempfile.mkdtemp(prefix="oubliette-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.socket_dir.mkdir()
        self.log: list[bytes] = []
        self._ready = threading.Event()
        self._names = itertools.count(1)
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            self._prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
            os.chmod(self.root, 0o755)
            for path in (self.root, self.socket_dir):
                os.chown(path, 65534, 65534)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """initdb (the first time), start the server, wait until it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            [*self._prefix, str(PG_BIN / "postgres"), "-D", str(self.data), "-k", str(self.socket_dir),
             "-c", "listen_addresses=", "-c", f"fsync={'on' if self.fsync else 'off'}", "-c", "max_connections=200",
             *[arg for name, value in self.settings.items() for arg in ("-c", f"{name}={value}")]],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self._drainer = threading.Thread(target=self._drain, args=(self.process,), daemon=True)
        self._drainer.start()
        if not self._ready.wait(START_TIMEOUT):
            self.stop()
            raise RuntimeError("PostgreSQL did not start:\n" + b"".join(self.log).decode(errors="replace"))
        subprocess.run(
            [str(PG_BIN / "pg_isready"), "-h", str(self.socket_dir), "-U", "postgres", "-t", "10"],
            check=True, stdout=subprocess.DEVNULL,
        )

    def _initdb(self) -> None:
        subprocess.run(
            [*self._prefix, str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--no-sync", "--locale=C", "-E", "UTF8"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def _drain(self, process: subprocess.Popen[bytes]) -> None:
        """Keep reading the server's stderr (a full pipe would stall it); note the ready line."""
        assert process.stderr is not None
        for line in process.stderr:
            self.log.append(line)
            if READY_LINE in line:
                self._ready.set()
        self._ready.set()  # exited: let start() see it and fail

    def url(self, database: str = "postgres") -> str:
        """The libpq URI of `database` on this server (Unix socket, user postgres)."""
        return f"postgresql://postgres@/{database}?host={self.socket_dir}"

    def new_database(self) -> str:
        """Create an empty database and return its URI."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def halt(self) -> None:
        """Stop the server (fast shutdown, SIGINT) and keep its data: `start()` brings it back,
        as a database outage and its end look to the programs using it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr is not None:
            self._drainer.join(10)  # it ends at EOF, now that the server is gone
            self.process.stderr.close()
        self.process = None

    def stop(self) -> None:
        """`halt`, then remove the directory."""
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)
