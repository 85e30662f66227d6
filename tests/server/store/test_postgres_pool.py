"""The PostgreSQL store alone: the connection pool's own warnings during an outage stay one line each
and at most one per `POOL_LOG_INTERVAL` (20 two-line warnings per server per 9 s were seen)."""

from __future__ import annotations

import logging

import pytest

from oubliette_server.store.postgres import PoolLogThrottle, throttle_pool_log

#: psycopg_pool's warning of a failed connection attempt, as it logs it (libpq's hint on a line of its own).
FAILED = ("error connecting in %r: %s", "oubliette-store",
          'connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused\n'
          "\tIs the server running on that host and accepting TCP/IP connections?")


def test_pool_warnings_are_one_line_and_one_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    pool_log = logging.getLogger("psycopg.pool")
    installed = list(pool_log.filters)  # a store opened earlier in this process installed its own
    pool_log.filters[:] = [PoolLogThrottle(interval=30.0, clock=lambda: now[0])]
    try:
        with caplog.at_level(logging.WARNING, logger="psycopg.pool"):
            for _ in range(20):  # one outage's attempts within the interval
                pool_log.warning(*FAILED)
                now[0] += 0.45
            now[0] = 130.5
            pool_log.warning(*FAILED)
    finally:
        pool_log.filters[:] = installed
    lines = [record.getMessage() for record in caplog.records if record.name == "psycopg.pool"]
    assert len(lines) == 2, lines
    assert all("\n" not in line for line in lines), lines
    assert lines[0].endswith("Is the server running on that host and accepting TCP/IP connections?")
    assert lines[1].endswith("(19 more pool warning(s) in the last 30 s not logged)"), lines[1]


def test_the_store_installs_the_throttle_once() -> None:
    pool_log = logging.getLogger("psycopg.pool")
    before = list(pool_log.filters)
    try:
        throttle_pool_log()
        throttle_pool_log()
        assert sum(isinstance(f, PoolLogThrottle) for f in pool_log.filters) == 1
    finally:
        pool_log.filters[:] = before
