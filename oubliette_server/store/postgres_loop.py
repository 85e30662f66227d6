"""One PostgreSQL statement run on the Trio loop itself, through libpq's non-blocking calls.

Why: psycopg's async API needs asyncio, so the PostgreSQL store runs its work in worker threads
(`trio.to_thread`), and on a small machine the hop to a thread and back cost about as much as
the statement: a durable single append took ~0.8 ms against ~0.3 ms for the same statement run
directly. The store's hottest call, appending one frame, is one statement in autocommit mode;
this module sends it with `PGconn.send_query_params` and waits for the socket with
`trio.lowlevel.wait_readable`, as the store's LISTEN connection already does.

Owns: up to `size` autocommit connections, made on first use (in a worker thread: connecting
blocks) and replaced when broken. Needs: a libpq URI.
Raises: `StoreUnavailable` when the database cannot be reached or a statement's fate is
unknown; `psycopg.DatabaseError` (the class of its SQLSTATE) for a statement the database refused
(nothing was stored).
Cancellation: a statement once sent is waited for under a shield (bounded by `timeout`): it may
commit, so the caller learns its outcome; cancellation is delivered at the next checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

import psycopg
import trio
from psycopg import pq

from .api import StoreUnavailable

__all__ = ["LoopStatements"]

_ADMIN_SHUTDOWN = "57P01"  # the backend was told to end (pg_terminate_backend, a restart)


class _Refused(Exception):
    """The database answered the statement with an error: it did not commit."""

    def __init__(self, sqlstate: str | None, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message


class LoopStatements:
    """Runs single statements on autocommit connections driven by the Trio loop (module docstring)."""

    def __init__(self, url: str, size: int, timeout: float, describe: str) -> None:
        self.url = url
        self.timeout = timeout
        self.describe = describe
        self._slots = trio.Semaphore(size)
        self._idle: list[psycopg.Connection] = []

    async def rows(
        self, sql: bytes, params: Sequence[bytes | None], *, read_only: bool = False, timeout: float | None = None,
    ) -> list[list[bytes | None]]:
        """The rows of one statement (text values), committed when this returns.

        A statement the database refused because its connection was being closed (a restart,
        `pg_terminate_backend`) did not commit, so it is sent once more on a new connection.
        `read_only`: a statement that changes nothing, whose fate need not be known, is sent on an
        idle connection without checking it first (one round trip less), and sent once more, on a
        checked connection, if that connection turns out to be gone. `timeout`: how long to wait
        for the answer (default the store's `connect_timeout`), so a long poll hears of an outage soon.
        """
        # A free slot is taken without a schedule point (the statement's own socket waits are
        # this call's schedule points): ~10 µs of a ~0.5 ms append.
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            if read_only and self._idle:
                try:
                    return await self._on_a_connection(sql, params, check=False, timeout=timeout)
                except (StoreUnavailable, _Refused):
                    # The idle connection was gone, and the others likely too (a restart, cut
                    # connections): drop them all, and send it on a new one.
                    self.close()
            return await self._rows(sql, params, timeout)
        finally:
            self._slots.release()

    async def _rows(self, sql: bytes, params: Sequence[bytes | None], timeout: float | None) -> list[list[bytes | None]]:
        """`rows` with a slot held: the statement, sent once more after a 57P01 refusal."""
        for attempt in (1, 2):
            try:
                return await self._on_a_connection(sql, params, timeout=timeout)
            except _Refused as refused:
                if refused.sqlstate == _ADMIN_SHUTDOWN and attempt == 1:
                    continue
                if refused.sqlstate is None or refused.sqlstate.startswith(("08", "57P")):
                    # libpq's own report of a lost connection, or the server going away
                    raise StoreUnavailable(f"the PostgreSQL store {self.describe} is unavailable: {refused.message}") from None
                raise _refusal(refused) from None
        raise AssertionError("unreachable")

    async def _on_a_connection(
        self, sql: bytes, params: Sequence[bytes | None], *, check: bool = True, timeout: float | None = None,
    ) -> list[list[bytes | None]]:
        conn = self._idle.pop() if self._idle else None
        healthy = False
        limit = self.timeout if timeout is None else timeout
        try:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(limit) as waited:
                    if conn is not None and check and not await _alive(conn.pgconn):
                        conn.close()
                        conn = None
                    if conn is None:
                        conn = await trio.to_thread.run_sync(self._connect)
                    rows = await _execute(conn.pgconn, sql, params)
                if waited.cancelled_caught:
                    raise StoreUnavailable(
                        f"the PostgreSQL store {self.describe} did not answer within {limit:g} s")
            healthy = True
            return rows
        except _Refused:
            healthy = conn is not None and _usable(conn.pgconn)
            raise
        except (psycopg.OperationalError, OSError) as exc:
            raise StoreUnavailable(
                f"the PostgreSQL store {self.describe} is unavailable: {str(exc).strip().splitlines()[0]}") from exc
        finally:
            if conn is not None:
                if healthy:
                    self._idle.append(conn)
                else:
                    conn.close()

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=max(1, math.ceil(self.timeout)))
        conn.pgconn.nonblocking = 1
        return conn

    def close(self) -> None:
        """Close the idle connections (those in use are closed as their statements end)."""
        while self._idle:
            self._idle.pop().close()


def _refusal(refused: _Refused) -> psycopg.Error:
    """The database's refusal as psycopg's error class of its SQLSTATE (`psycopg.errors.UniqueViolation`
    for a unique index: the store tells which), a plain `psycopg.DatabaseError` for an unknown one."""
    try:
        kind = psycopg.errors.lookup(refused.sqlstate) if refused.sqlstate else psycopg.DatabaseError
    except KeyError:
        kind = psycopg.DatabaseError
    return kind(refused.message)


def _usable(pg: pq.abc.PGconn) -> bool:
    """Whether a connection may be kept after a refused statement: open, reads what the server
    sent meanwhile (no round trip), and not inside a transaction."""
    if pg.status != pq.ConnStatus.OK:
        return False
    try:
        pg.consume_input()
    except psycopg.OperationalError:
        return False
    return pg.status == pq.ConnStatus.OK and pg.transaction_status == pq.TransactionStatus.IDLE


async def _alive(pg: pq.abc.PGconn) -> bool:
    """Whether an idle connection still answers (an empty query: one round trip on the loop).

    Why before every statement: a connection the database dropped (a restart,
    `pg_terminate_backend`) may look open until it is used, and a statement sent on it has an
    unknown fate; this makes it fail here, where nothing was sent, as the pool's check does for
    the worker threads' connections."""
    if not _usable(pg):
        return False
    try:
        pg.send_query(b"")
        while pg.flush():
            await trio.lowlevel.wait_writable(pg.socket)
        answered = False
        while True:
            pg.consume_input()
            if pg.is_busy():
                await trio.lowlevel.wait_readable(pg.socket)
                continue
            result = pg.get_result()
            if result is None:
                return answered and pg.status == pq.ConnStatus.OK
            answered = answered or result.status == pq.ExecStatus.EMPTY_QUERY
    except psycopg.OperationalError:
        return False


async def _execute(pg: pq.abc.PGconn, sql: bytes, params: Sequence[bytes | None]) -> list[list[bytes | None]]:
    """Send one statement and read its results.

    What committed is decided by what came back: the statement's rows, then no error, then the
    connection idle again (its `ReadyForQuery`: with the extended protocol the implicit
    transaction commits at `Sync`, after the rows) means committed; an error result means not
    committed (`_Refused`); anything else — the connection lost after the rows, or before any
    answer — is unknown (`psycopg.OperationalError`, reported as the store being unavailable).
    """
    waited = False
    try:
        pg.send_query_params(sql, params)
        while pg.flush():
            await trio.lowlevel.wait_writable(pg.socket)
            waited = True
        outcome = _Outcome()
        while True:
            try:
                pg.consume_input()
            except psycopg.OperationalError:
                outcome.take_buffered(pg)  # the results that came before the connection ended
                outcome.raise_lost(pg)
            if pg.is_busy():
                await trio.lowlevel.wait_readable(pg.socket)
                waited = True
                continue
            result = pg.get_result()
            if result is None:
                if outcome.refused is not None:
                    if outcome.answered:  # an error after the rows: at the commit, so unknown
                        outcome.raise_lost(pg)
                    raise outcome.refused
                if pg.status == pq.ConnStatus.OK and outcome.answered:
                    return outcome.rows
                outcome.raise_lost(pg)
            outcome.take(result)
    finally:
        if not waited:
            # The answer was there before the first read (this process was descheduled after
            # the send, as on a loaded machine): a Trio function still schedules once.
            await trio.lowlevel.checkpoint()  # (its callers shield it: the outcome is never lost to a cancel)


class _Outcome:
    """The results of one statement as they arrive."""

    def __init__(self) -> None:
        self.rows: list[list[bytes | None]] = []
        self.answered = False
        self.refused: _Refused | None = None

    def take(self, result: pq.abc.PGresult) -> None:
        if result.status == pq.ExecStatus.TUPLES_OK:
            self.answered = True
            self.rows.extend([result.get_value(r, c) for c in range(result.nfields)] for r in range(result.ntuples))
        elif result.status == pq.ExecStatus.FATAL_ERROR:
            state = result.error_field(pq.DiagnosticField.SQLSTATE)
            message = (result.error_message or b"").decode("utf-8", "replace").strip()
            self.refused = _Refused(state.decode() if state else None, message.splitlines()[0] if message else "error")

    def take_buffered(self, pg: pq.abc.PGconn) -> None:
        while True:
            try:
                result = pg.get_result()
            except psycopg.OperationalError:
                return
            if result is None:
                return
            self.take(result)

    def raise_lost(self, pg: pq.abc.PGconn) -> NoReturn:
        """The connection ended: refused if the server said so before any rows, else unknown."""
        if self.refused is not None and not self.answered and self.refused.sqlstate is not None:
            raise self.refused
        detail = (pg.error_message or b"").decode("utf-8", "replace").strip()
        raise psycopg.OperationalError(detail.splitlines()[0] if detail else "the connection ended before the statement's outcome")
