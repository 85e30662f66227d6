"""Health that tells the truth: `/livez`, `/readyz` and `/v1/health`, and long polls that fail fast
when the store is down (docs/CONFIG.md, "Health endpoints").

Two ways to take the store away:

- SQLite with a fault injected (`FaultyStore`: a real SQLite store whose reads raise
  `StoreUnavailable` while `down`, waking the waits parked on it, as a lost database does),
  the server embedded in the test's Trio loop;
- a real PostgreSQL (tests/support/postgres.py) stopped under the real `oubliette-server` program.

What must hold in both: `/livez` stays 200 without a token; `/readyz` (no token) and `/v1/health`
(token) say 503 with the reason; a long poll (HTTP poll, MCP `session_events` / `session_message`
waits) answers 503 / a tool error saying the store is unavailable and to retry, at once rather
than after its 20 s; and all of it is 200 again once the store is back.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx2
import trio

from harness import Deployment, EmbeddedHttpServer, text_of
from tether_http import sse
from oubliette_server.doors.health import Readiness
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import FrameQuery, StoreUnavailable
from oubliette_server.store.postgres import safe_url

FAIL_FAST = 5.0
"""How soon a long poll asked to wait 20 s must hear that the store is down."""
LONG = 20_000
"""The long polls' `wait_ms`: what they would block for without the fail-fast rule."""


class FaultyStore(FrameStore):
    """The SQLite store with a fault switch: while `down`, every read and the readiness probe raise
    `StoreUnavailable` (appends still work, so a message can be sent before its wait fails)."""

    down = False

    def fail(self) -> None:
        """The database goes away: reads fail, and the waits parked on the log wake to find it so."""
        self.down = True
        self._wake_all()

    def _query(self, instance: str, q: FrameQuery) -> Any:
        if self.down:
            raise StoreUnavailable(f"the SQLite store {self.describe()} is unavailable: injected fault")
        return super()._query(instance, q)

    async def check_available(self, timeout: float) -> None:
        if self.down:
            raise StoreUnavailable(f"the SQLite store {self.describe()} is unavailable: injected fault")
        await super().check_available(timeout)


@asynccontextmanager
async def faulty_server(deployment: Deployment) -> AsyncIterator[tuple[EmbeddedHttpServer, FaultyStore]]:
    """The server embedded here on a `FaultyStore`, `box1` configured, a TCP HTTP listener."""
    store = FaultyStore(deployment.data_dir / "frames.sqlite3")
    async with deployment.embedded(store=store, http=["127.0.0.1:0"], instances={"box1": {}}) as embedded:
        yield embedded.http_server(deployment), store


def assert_unavailable(response: Any) -> str:
    """A 503 JSON error that says the store is unavailable and to retry, with `Retry-After`."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["retry-after"] == "2", response.headers
    message = response.json()["error"]["message"]
    assert "is unavailable" in message and "retry in a few seconds" in message, message
    return message


async def timed(work: Any) -> tuple[Any, float]:
    """`await work()` and how long it took."""
    start = time.monotonic()
    result = await work()
    return result, time.monotonic() - start


async def test_probes_without_a_token_and_the_detailed_view_with_one(deployment: Deployment) -> None:
    async with faulty_server(deployment) as (server, _), server.rest(token=None) as anonymous, server.rest() as admin:
        live = await anonymous.get("/livez")
        assert (live.status_code, live.json()) == (200, {"ok": True})
        ready = await anonymous.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ok": True, "checks": {"store": {"ok": True}, "relay": {"ok": True}}})
        assert (await anonymous.get("/v1/health")).status_code == 401, "the detailed view needs the token"
        health = await admin.get("/v1/health")
        assert health.status_code == 200 and health.json()["ok"] is True, health.text
        assert health.json()["checks"] == {"store": {"ok": True}, "relay": {"ok": True}}


async def test_a_store_fault_is_told_truthfully_and_long_polls_fail_fast(deployment: Deployment) -> None:
    async with faulty_server(deployment) as (server, store), server.rest(token=None) as anonymous, \
            server.rest() as admin, server.caller(events=False) as (caller, _):
        sent = await caller.call_tool("session_message", {"instance": "box1", "session_id": "s1", "message": "hi"})
        assert not sent.is_error, text_of(sent)
        results: dict[str, Any] = {}

        async def parked_poll() -> None:
            results["poll"] = await timed(lambda: admin.get(
                "/v1/instances/box1/tether/poll", params={"wait_ms": LONG, "after_seq": 99}))

        async def parked_stream() -> None:
            async with sse(admin, "box1", {"after_seq": 99}) as events:
                results["stream"] = await events.next(timeout=30)

        async def parked_turn_wait() -> None:
            results["turn"] = await timed(lambda: caller.call_tool("session_message", {
                "instance": "box1", "session_id": "s2", "message": "hello", "wait": 60,
            }))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(parked_poll)
            nursery.start_soon(parked_turn_wait)
            nursery.start_soon(parked_stream)
            await server.wait_waiters("box1", 3)  # all parked on the log, waiting for frames
            failed_at = time.monotonic()
            store.fail()  # the database goes away under them
        assert time.monotonic() - failed_at < FAIL_FAST, "all answered soon after the fault, not after their wait"
        assert results["stream"]["event"] == "error", results["stream"]  # the SSE stream ends saying why
        assert "retry in a few seconds" in results["stream"]["data"]["error"]["message"]
        response, _ = results["poll"]
        assert_unavailable(response)
        turn, _ = results["turn"]
        assert turn.is_error and "is unavailable" in text_of(turn) and "retry" in text_of(turn), text_of(turn)
        assert "do not send it again" in text_of(turn), "the message was stored before the wait failed"

        # New long polls while it is down: answered at once, not after wait_ms.
        response, took = await timed(lambda: admin.get(
            "/v1/instances/box1/tether/poll", params={"wait_ms": LONG, "after_seq": 99}))
        assert_unavailable(response)
        assert took < FAIL_FAST, took
        events, took = await timed(lambda: caller.call_tool("session_events", {
            "instance": "box1", "session_id": "s1", "wait_ms": LONG, "after_seq": 99,
        }))
        assert events.is_error and "retry in a few seconds" in text_of(events), text_of(events)
        assert took < FAIL_FAST, took

        # The probes tell the truth; the public one names no file or URL.
        assert (await anonymous.get("/livez")).status_code == 200
        ready = await anonymous.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json() == {
            "ok": False, "checks": {"store": {"ok": False, "reason": "the frame store is unavailable"}, "relay": {"ok": True}},
            "reasons": ["store: the frame store is unavailable"],
        }
        assert str(deployment.data_dir) not in ready.text
        health = await admin.get("/v1/health")
        assert health.status_code == 503 and health.json()["ok"] is False, health.text
        assert "injected fault" in health.json()["checks"]["store"]["detail"]

        store.down = False  # the database is back
        assert (await anonymous.get("/readyz")).status_code == 200
        assert (await admin.get("/v1/health")).json()["ok"] is True
        assert (await admin.get("/v1/instances/box1/tether/poll")).status_code == 200


async def test_readiness_says_when_the_relay_listener_is_not_up() -> None:
    """The service alone: a relay listener that is not bound fails readiness with its own reason."""
    async def store_ok(timeout: float) -> None:
        await trio.lowlevel.checkpoint()

    relay = [False]
    readiness = Readiness(store_ok, lambda: relay[0])
    report = await readiness.check()
    assert not report.ok and report.reasons() == ["relay: the relay listener is not up"]
    relay[0] = True
    assert (await readiness.check()).ok


async def test_readiness_bounds_a_store_that_does_not_answer() -> None:
    """A store probe that hangs is cut at the readiness timeout by the store (PostgreSQL's probe
    is abandoned past its deadline); here a probe that says so is reported as unavailable."""
    async def slow(timeout: float) -> None:
        with trio.move_on_after(timeout):
            await trio.sleep_forever()
        raise StoreUnavailable(f"the store did not answer within {timeout:g} s")

    with trio.fail_after(5):
        report = await Readiness(slow, lambda: True, timeout=0.2).check()
    assert report.checks["store"].detail == "the store did not answer within 0.2 s"


async def test_a_postgres_outage_fails_readiness_and_long_polls_fast(pg_url: str, postgres_server: Any) -> None:
    """The real server on a real PostgreSQL that stops: `/readyz` 503 and a 20 s long poll
    (HTTP, and MCP `session_events`) answered 503 / a tool error within seconds, where it
    blocked for the pool's timeout twice (20 s) before; all 200 again once it is back."""
    d = Deployment(store=pg_url)
    try:
        config = d.config_file("box1")
        async with d.http_server("--config", str(config)) as server, server.rest(token=None) as anonymous, \
                server.rest() as admin, server.caller(events=False) as (caller, _):
            assert (await anonymous.get("/readyz")).status_code == 200
            health = (await admin.get("/v1/health")).json()
            assert health["ok"] is True and health["store"] == safe_url(pg_url), health
            await trio.to_thread.run_sync(postgres_server.halt)
            try:
                # The store's LISTEN connection is down (in the step that logs so): not ready from then on.
                await server.wait_stderr("lost the LISTEN connection", timeout=30)
                ready = await anonymous.get("/readyz")
                assert ready.status_code == 503, ready.text
                assert ready.json()["reasons"] == ["store: the frame store is unavailable"], ready.text
                assert "postgresql" not in ready.text
                assert (await anonymous.get("/livez")).status_code == 200
                health = await admin.get("/v1/health")
                assert health.status_code == 503 and "is unavailable" in health.json()["checks"]["store"]["detail"]

                response, took = await timed(lambda: admin.get(
                    "/v1/instances/box1/tether/poll", params={"wait_ms": LONG}))
                assert_unavailable(response)
                assert took < FAIL_FAST, took
                events, took = await timed(lambda: caller.call_tool("tether_read", {
                    "instance": "box1", "wait_ms": LONG,
                }))
                assert events.is_error and "retry in a few seconds" in text_of(events), text_of(events)
                assert took < FAIL_FAST, took
            finally:
                await trio.to_thread.run_sync(postgres_server.start)
            with trio.fail_after(30):
                while (await anonymous.get("/readyz")).status_code != 200:
                    # The pool and the listener reconnect with backoff; at WARNING neither logs its return.
                    await trio.sleep(0.1)
            polled = await admin.get("/v1/instances/box1/tether/poll", params={"wait_ms": 0})
            assert polled.status_code == 200, polled.text
            assert server.process.returncode is None
    finally:
        d.cleanup()


async def test_probes_need_no_token_over_tcp_only_for_themselves(deployment: Deployment) -> None:
    """`/livez` and `/readyz` are the only paths without a token: a look-alike path is refused."""
    async with faulty_server(deployment) as (server, _):
        async with httpx2.AsyncClient(base_url=server.url, timeout=30) as anonymous:
            for path in ("/livez/", "/readyz/x", "/v1/livez", "/v1/instances/box1/tether/poll"):
                assert (await anonymous.get(path)).status_code == 401, path
