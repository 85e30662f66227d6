"""Helpers of tests/e2e/test_cluster_approvals.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
from typing import Any

from loop_caller import INSTANCE

from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore


def steps(*calls: dict[str, Any]) -> str:
    """The loop agent's message: one call per step, in turn."""
    return json.dumps({"steps": [[c] for c in calls]})


async def session_frames(pg_url: str, session_id: str, prefix: str) -> list[Any]:
    """The test's own view of the log: the session's frames whose type starts with `prefix`."""
    store = PostgresFrameStore(pg_url)
    async with store.running():
        return [f for f in await store.query(INSTANCE, FrameQuery(session_id=session_id, limit=200))
                if f.type.startswith(prefix)]


def one_decision_each(found: list[Any]) -> list[Any]:
    """Every `approval_request` has exactly one `approval_resolved`; those, in request order."""
    requests = [f.payload["request_id"] for f in found if f.type == "approval_request"]
    resolved: dict[str, list[Any]] = {}
    for f in found:
        if f.type == "approval_resolved":
            resolved.setdefault(f.payload["request_id"], []).append(f)
    assert sorted(resolved) == sorted(requests), (requests, resolved)
    assert all(len(r) == 1 for r in resolved.values()), resolved
    return [resolved[rid][0] for rid in requests]
