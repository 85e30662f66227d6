"""The PostgreSQL store's statements on the Trio loop (store/postgres_loop.py), alone with a fake
connection: what a real server cannot be made to do on demand."""

from __future__ import annotations

from typing import Any, cast

import trio.testing
from psycopg import pq

from oubliette_server.store.postgres_loop import _execute


class _Row:
    """One result of one row, one field."""

    status = pq.ExecStatus.TUPLES_OK
    nfields = 1
    ntuples = 1

    def get_value(self, row: int, column: int) -> bytes:
        return b"7"


class _AnsweredAlready:
    """A connection whose whole answer is in before the first read: no socket wait at all, as
    when the process is descheduled right after sending (a loaded machine)."""

    socket = -1
    status = pq.ConnStatus.OK

    def __init__(self) -> None:
        self.results: list[Any] = [_Row(), None]

    def send_query_params(self, sql: bytes, params: Any) -> None:
        pass

    def flush(self) -> int:
        return 0

    def consume_input(self) -> None:
        pass

    def is_busy(self) -> bool:
        return False

    def get_result(self) -> Any:
        return self.results.pop(0)


async def test_a_statement_answered_before_its_first_read_still_schedules_once() -> None:
    with trio.testing.assert_checkpoints():
        rows = await _execute(cast(Any, _AnsweredAlready()), b"SELECT 7", [])
    assert rows == [[b"7"]]
