"""The real oubliette-server on the PostgreSQL store (`--store postgresql://…`), end to end.

The database is the real throwaway PostgreSQL of tests/support/postgres.py (a fresh database per test).
The caller, the server, the guest runtime and the agent (tests/support/loop_agent.py) are the real
programs as subprocesses, as in tests/e2e/test_caller_loop.py's stdio case.
"""

from __future__ import annotations

import subprocess
from typing import Any

import trio

from harness import PYTHON, Deployment, env_without_oubliette
from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore, safe_url
from tether_http import frame_body, poll, post
from loop_caller import INSTANCE, LOOP_AGENT, LoopCaller, one_answered_call, script


async def test_a_relayed_call_with_the_log_in_postgres(pg_deployment: Deployment, pg_url: str) -> None:
    """requires_action with the arguments, the answer, end_turn with the result; every frame is
    in PostgreSQL, and a second server run on the same database goes on with the same seq."""
    async with pg_deployment.guest(INSTANCE, LOOP_AGENT), pg_deployment.caller(events=False) as (client, _):
        end = await one_answered_call(LoopCaller(client))
    assert 'myapp_send_notification -> {"status": "sent"}' in end["text"]

    store = PostgresFrameStore(pg_url)
    async with store.running():
        frames = await store.query(INSTANCE, FrameQuery(session_id="s7", limit=200))
        types = [f.type for f in frames]
        assert types[:2] == ["session_record", "user.message"]  # the server's record of owner and tools, then the message
        assert {"caller_tool_request", "caller_tool_result", "assistant.done"} <= set(types)
        assert [f.seq for f in frames] == sorted(f.seq for f in frames)
        last = await store.last_seq(INSTANCE)

    # A second run of the server on the same database: the log and its seq go on.
    async with pg_deployment.caller(events=False) as (client, _):
        sent = await client.call_tool("session_message", {"message": script(), "instance": INSTANCE, "session_id": "s8"})
        assert not sent.is_error, sent
        assert sent.structured_content["ingress_seq"] == last + 2  # the new session's session_record is last + 1


async def test_an_unreachable_database_is_one_line_and_status_1(pg_deployment: Deployment) -> None:
    nowhere = pg_deployment.root / "no-postgres-here"
    with trio.fail_after(60):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_server", "--data-dir", str(pg_deployment.data_dir), "--relay", pg_deployment.relay,
             "--no-stdio", "--store", f"postgresql://postgres@/db?host={nowhere}&connect_timeout=1",
             "--config", str(write_config(pg_deployment, "connect_timeout = 1"))],
            stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False, env=env_without_oubliette(),
        )
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1, lines
    assert len(lines) == 1 and lines[0].startswith(
        "oubliette-server: error: cannot reach the PostgreSQL store postgresql://postgres@"
    ), lines


def write_config(deployment: Deployment, *store_lines: str) -> str:
    deployment.root.mkdir(parents=True, exist_ok=True)
    path = deployment.root / "store.toml"
    path.write_text("[store]\n" + "\n".join(store_lines) + "\n")
    return str(path)


async def test_two_servers_on_one_database_share_tokens_log_and_wake_ups(pg_url: str) -> None:
    """Two servers, two data directories, one database: `token`/`http-token --store` print what
    both accept; /v1/health tells them apart; a frame posted to A wakes a long poll on B."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        config_a, config_b = a.config_file("box1"), b.config_file("box1")
        async with a.http_server("--config", str(config_a)) as server_a, \
                b.http_server("--config", str(config_b)) as server_b:
            assert server_a.token == server_b.token, "one bearer token for the deployment"
            assert a.token("box1") == b.token("box1")
            async with server_a.rest() as rest_a, server_b.rest(token=server_a.token) as rest_b:
                health = [(await rest.get("/v1/health")).json() for rest in (rest_a, rest_b)]
                assert [h["store"] for h in health] == [safe_url(pg_url)] * 2
                assert health[0]["server"]["id"] != health[1]["server"]["id"]

                got: dict[str, Any] = {}

                async def long_poll_on_b() -> None:
                    got.update(await poll(rest_b, "box1", {"wait_ms": 20_000, "channel": "host"}))

                with trio.fail_after(20):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(long_poll_on_b)
                        # Whether B's poll is parked yet or not, it must return A's frame and only it
                        # (the wake across two store objects itself: tests/server/store/test_conformance.py).
                        posted = await post(rest_a, "box1", frame_body("host", "s1", text="from A"))
                assert got["frames"] == [posted["frame"]] and not got["timed_out"]
    finally:
        a.cleanup()
        b.cleanup()


async def test_a_database_outage_is_a_clear_error_and_the_server_recovers(
    pg_deployment: Deployment, postgres_server: Any,
) -> None:
    """The database stops under a running server: a caller gets HTTP 503 naming the store, not
    a traceback; the server stays up, and once the database is back the same request works."""
    config = pg_deployment.root / "outage.toml"
    pg_deployment.root.mkdir(parents=True, exist_ok=True)
    config.write_text('[store]\nconnect_timeout = 2\n[instances.box1]\n')
    async with pg_deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        await post(rest, "box1", frame_body("host", "s1", text="before"))
        await trio.to_thread.run_sync(postgres_server.halt)
        try:
            with trio.fail_after(30):
                response = await rest.post("/v1/instances/box1/tether", json=frame_body("host", "s1", text="during"))
            assert response.status_code == 503, response.text
            message = response.json()["error"]["message"]
            assert message.startswith(f"the PostgreSQL store {safe_url(pg_deployment.store or '')} is unavailable"), message
        finally:
            await trio.to_thread.run_sync(postgres_server.start)
        with trio.fail_after(30):
            while True:  # the pool reconnects in the background: the first calls may still fail
                response = await rest.post("/v1/instances/box1/tether", json=frame_body("host", "s1", text="after"))
                if response.status_code != 503:
                    break
                await trio.sleep(0.2)  # the pool's return writes no line at WARNING nor any notice
        assert response.status_code == 201, response.text
        assert response.json()["frame"]["seq"] == 2, "nothing was stored during the outage; seq goes on"
        assert server.process.returncode is None


async def test_a_guest_stays_through_an_outage_and_gets_the_next_message(
    pg_deployment: Deployment, postgres_server: Any,
) -> None:
    """The database stops while a guest waits for messages: the server keeps the guest (its
    delivery retries), and the first message after the database is back gets its turn."""
    config = pg_deployment.root / "outage.toml"
    pg_deployment.root.mkdir(parents=True, exist_ok=True)
    config.write_text('[store]\nconnect_timeout = 2\n[instances.box1]\n')
    async with pg_deployment.http_server("--config", str(config)) as server, server.rest() as rest, \
            pg_deployment.guest("box1", LOOP_AGENT):
        await server.wait_connected("box1")
        await trio.to_thread.run_sync(postgres_server.halt)
        try:
            # The delivery loop is woken by the lost LISTEN connection and finds the store down.
            await server.wait_stderr("guest of box1", "retrying delivery", timeout=30)
        finally:
            await trio.to_thread.run_sync(postgres_server.start)
        with trio.fail_after(30):
            while True:  # the pool reconnects in the background: the first calls may still fail
                response = await rest.post("/v1/instances/box1/tether", json={
                    "type": "user.message", "session": {"channel": "host", "id": "after"}, "payload": {"text": script()},
                })
                if response.status_code != 503:
                    break
                await trio.sleep(0.2)  # the pool's return writes no line at WARNING nor any notice
        assert response.status_code == 201, response.text
        msg_id = response.json()["msg_id"]
        with trio.fail_after(60):
            done = await poll(rest, "box1", {
                "channel": "host", "session_id": "after", "types": "assistant.done",
                "reply_to_msg_id": msg_id, "wait_ms": 30_000,
            })
        assert [f["type"] for f in done["frames"]] == ["assistant.done"], done
        assert "box1" in (await rest.get("/v1/health")).json()["connected_instances"]
