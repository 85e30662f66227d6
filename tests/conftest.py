from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from harness import Deployment, InProcessDeployment, fresh_dir

if TYPE_CHECKING:
    from postgres import PostgresServer


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker more than the machine has cores. The end-to-end
    tests spend part of their time waiting (on a subprocess starting, a deadline passing), so as
    many workers as cores leave a core idle about a fifth of the time; on 2 cores the whole suite
    took 5 min 53 s with 2 workers and 5 min 9 s with 3 (docs/ARCHITECTURE.md, "Testing the rooms")."""
    return (os.cpu_count() or 1) + 1


@pytest.fixture
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """The real programs as subprocesses; in a module marked `in_process`, the same programs
    in the test's Trio loop (`InProcessDeployment`), except for tests marked `real_programs`."""
    in_process = request.node.get_closest_marker("in_process") is not None
    real = request.node.get_closest_marker("real_programs") is not None
    d = InProcessDeployment() if in_process and not real else Deployment()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (`/tmp/oub-…`), removed afterwards: a `HOME` or data
    directory under it leaves room for Unix socket paths (~107 bytes), which pytest's own
    `tmp_path` (`/tmp/pytest-of-root/pytest-NNN/test_…0/`) can use up by itself."""
    root = fresh_dir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator["PostgresServer"]:
    """A real PostgreSQL for this pytest process (one per xdist worker; tests/support/postgres.py)."""
    from postgres import PostgresServer

    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(postgres_server: "PostgresServer") -> str:
    """A fresh, empty database on the test PostgreSQL: its libpq URI."""
    return postgres_server.new_database()


@pytest.fixture
def pg_deployment(pg_url: str) -> Iterator[Deployment]:
    """A server whose log is in a fresh database of the test PostgreSQL (`--store`)."""
    d = Deployment(store=pg_url)
    try:
        yield d
    finally:
        d.cleanup()
