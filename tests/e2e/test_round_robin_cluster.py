"""Three servers on one PostgreSQL behind a plain round-robin TCP proxy: no stickiness at all.

The proxy (bench/round_robin_proxy.py) sends each new TCP connection to the next server, and the
caller opens a new connection for every request (its HTTP client keeps no connection alive), so
consecutive requests of one conversation land on different servers; the proxy's own record of
where each connection went is what the tests assert that on. The caller is the MCP SDK's
`Client` over Streamable HTTP in the 2026-07-28 revision (no MCP session: its `owner_key` names
it on every server); it acts on tool results only. The guest runtime (`oubliette-client run`,
given every server's relay address) runs tests/support/loop_agent.py on one of the servers.
Everything is a real program and a real PostgreSQL (tests/support/postgres.py); docs/SCALING.md,
"No stickiness: a round-robin balancer in front".
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import attrs
import trio

from harness import Deployment, HttpServer
from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore
from round_robin_proxy import RoundRobinProxy
from approval_flows import DELETE, GATED
from loop_caller import INSTANCE, LOOP_AGENT, TURN_TIMEOUT, LoopCaller, ends_with, script, tool
from tether_http import POLL, STREAM, TETHER, SseEvents

TOOL = "myapp_send_notification"
SERVERS = 3
LEASE_TTL = 1.5
"""The servers' `[store] lease_ttl` (default 10 s): short, so a killed server's lease ends soon."""
LOOP = script([(TOOL, {"n": 1})], [(GATED, {"path": "/tmp/a"})], [(TOOL, {"n": 2})])
"""One turn of the whole loop: a caller tool call, a gated one (approval, then the call), another call."""
TOOLS = [tool("send_notification"), DELETE]


@attrs.define
class Cluster:
    """One test's world: three servers (in rotation order), the proxy in front, the guest's server."""

    servers: list[HttpServer]
    proxy: RoundRobinProxy
    url: str
    token: str
    guest_on: int
    pg_url: str
    guest: trio.Process

    def backend(self, connection: int) -> int:
        """The server (index) the proxy sent connection number `connection` to."""
        return self.proxy.order[connection]

    async def kill(self, server: int) -> None:
        """kill -9 of `server`, and wait until it is gone (until then its listening socket still
        accepts connections into its backlog, so the proxy would not skip it yet)."""
        process = self.servers[server].process
        process.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            await process.wait()

    def agent_pids(self) -> list[int]:
        """The running loop agent's processes: the guest runtime's descendants running tests/support/loop_agent.py."""
        pending, found = [self.guest.pid], []
        while pending:
            pid = pending.pop()
            for task in Path(f"/proc/{pid}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
            if b"loop_agent.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        assert found, "no loop agent runs"
        return found


def config(deployment: Deployment) -> str:
    """A config file declaring `box1`, with this test's lease TTL."""
    path = deployment.config_file(INSTANCE)
    path.write_text(path.read_text() + f"[store]\nlease_ttl = {LEASE_TTL}\n")
    return str(path)


@asynccontextmanager
async def cluster(pg_url: str, guest_on: int = 0) -> AsyncIterator[Cluster]:
    """Three servers on `pg_url`, the round-robin proxy in front of their HTTP listeners, and the
    guest of `box1` given every server's relay address, `guest_on`'s first (so it is there)."""
    deployments = [Deployment(store=pg_url) for _ in range(SERVERS)]
    try:
        async with AsyncExitStack() as stack:
            servers = [await stack.enter_async_context(d.http_server("--config", config(d))) for d in deployments]
            relays = [deployments[guest_on].relay] + [d.relay for i, d in enumerate(deployments) if i != guest_on]
            guest = await stack.enter_async_context(
                deployments[0].guest(INSTANCE, LOOP_AGENT, relay=",".join(relays), token=deployments[0].token(INSTANCE)))
            await servers[guest_on].wait_connected(INSTANCE)
            backends = []
            for server in servers:
                host, _, port = server.url.removeprefix("http://").rpartition(":")
                backends.append((host, int(port)))
            proxy = RoundRobinProxy(backends)
            async with trio.open_nursery() as nursery:
                port = await nursery.start(proxy.serve)
                yield Cluster(servers, proxy, f"http://127.0.0.1:{port}", servers[0].token, guest_on, pg_url, guest)
                nursery.cancel_scope.cancel()
    finally:
        for d in deployments:
            d.cleanup()


class BalancedCaller(LoopCaller):
    """A 2026-07-28 caller whose every request is a new TCP connection through the proxy.

    As `LoopCaller` (its `owner_key` passed on every call), and `connections` lists the
    proxy's connection number of each call. Its MCP client runs in a task of its own: when a
    server is killed under a call, the SDK's transport fails the whole client (the call raises
    `MCPError`, "Connection closed"), and `broken` records the transport's error; `open` again
    gives the same caller (same token, same `owner_key`) a new client, as an application does."""

    def __init__(self, world: Cluster, nursery: trio.Nursery) -> None:
        super().__init__(None)
        self.world = world
        self.connections: list[int] = []
        self.executed: dict[str, int] = {}
        """Each caller tool request the caller ran (answered), by request id: how many times."""
        self.broken: list[BaseException] = []
        self.http_requests = 0
        """Every HTTP request its clients sent (the SDK's own, such as a `tools/list`, too)."""
        self._nursery = nursery
        self._scope: trio.CancelScope | None = None

    async def open(self) -> None:
        """A new HTTP client (no keep-alive) and MCP client through the proxy (the old one closed)."""
        if self._scope is not None:
            self._scope.cancel()
        self.client = await self._nursery.start(self._run_client)

    async def _run_client(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        with trio.CancelScope() as self._scope:
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {self.world.token}"}, timeout=TURN_TIMEOUT,
                                      limits=httpx2.Limits(max_keepalive_connections=0),
                                      event_hooks={"request": [self._sending]})
            try:
                async with http, Client(streamable_http_client(self.world.url + "/mcp", http_client=http),
                                        mode="auto") as client:
                    assert client.protocol_version == "2026-07-28"
                    task_status.started(client)
                    await trio.sleep_forever()
            except* Exception as error:  # the transport died with its connection: noted, the test decides
                self.broken.append(error)  # (a Cancelled beside it, from `open`, ends in this task's scope)

    async def _sending(self, request: Any) -> None:
        self.http_requests += 1

    async def call(self, name: str, **arguments: Any) -> dict[str, Any]:
        """`LoopCaller.call`, noting which proxy connection it is."""
        self.connections.append(len(self.world.proxy.order))
        return await super().call(name, **arguments)

    async def run_tool(self, session_id: str, pending: dict[str, Any], *, resend: bool = False) -> dict[str, Any]:
        """Run the requested caller tool (count it) and answer with its result, with `wait`;
        `resend`: send the answer of a run already made again (a retry, not a second run)."""
        rid = pending["request_id"]
        if not resend:
            self.executed[rid] = self.executed.get(rid, 0) + 1
        return await self.call("caller_tool_response", session_id=session_id, request_id=rid,
                               result={"ran": pending["tool"], **pending["arguments"]}, wait=60)

    async def approve(self, session_id: str, request: dict[str, Any]) -> dict[str, Any]:
        return await self.call("approval_response", session_id=session_id, request_id=request["request_id"],
                               approve=True, wait=60)


@asynccontextmanager
async def balanced_caller(world: Cluster) -> AsyncIterator[BalancedCaller]:
    async with trio.open_nursery() as nursery:
        caller = BalancedCaller(world, nursery)
        await caller.open()
        yield caller
        nursery.cancel_scope.cancel()


def on_different_servers(world: Cluster, connections: list[int]) -> list[int]:
    """The servers `connections` went to; each differs from the one before, and all three served."""
    servers = [world.backend(c) for c in connections]
    assert all(a != b for a, b in zip(servers, servers[1:])), servers
    return servers


async def log_of(pg_url: str, session_id: str | None = None) -> list[Any]:
    """The test's own view of the log (never the caller's): the instance's frames, or a session's."""
    store = PostgresFrameStore(pg_url, pool_size=1)
    frames: list[Any] = []
    async with store.running():
        while True:
            page = await store.query(INSTANCE, FrameQuery(session_id=session_id, after_seq=frames[-1].seq if frames else 0,
                                                          limit=200))
            frames += page
            if len(page) < 200:
                return frames


def nothing_twice(frames: list[Any], executed: dict[str, int]) -> None:
    """Every caller tool request has one outcome and every approval one decision in the log, the
    caller ran each request once, and each message reached the agent once (one `thinking`, one turn end)."""
    requests = [f.payload["request_id"] for f in frames if f.type == "caller_tool_request"]
    outcomes = [f.payload["request_id"] for f in frames if f.type in ("caller_tool_result", "caller_tool_cancelled")]
    assert sorted(outcomes) == sorted(requests) and len(set(requests)) == len(requests), (requests, outcomes)
    approvals = [f.payload["request_id"] for f in frames if f.type == "approval_request"]
    decisions = [f.payload["request_id"] for f in frames if f.type == "approval_resolved"]
    assert sorted(decisions) == sorted(approvals), (approvals, decisions)
    assert sorted(executed) == sorted(requests) and set(executed.values()) == {1}, (executed, requests)
    for message in (f for f in frames if f.type == "user.message"):
        replies = [f for f in frames if f.reply_to == message.msg_id]
        assert len([f for f in replies if f.type == "status.presence" and f.payload.get("state") == "thinking"]) == 1
        assert len([f for f in replies if f.type in ("assistant.done", "session.error")]) == 1


async def drive_loop(caller: BalancedCaller, session_id: str) -> dict[str, Any]:
    """`session_message` with caller tools → `requires_action` → `caller_tool_response` →
    `requires_approval` → `approval_response` → `requires_action` → … → `end_turn`."""
    stop = ends_with(await caller.message(session_id, LOOP, TOOLS, wait=60), "requires_action")
    [first] = stop["pending"]
    assert (first["tool"], first["arguments"]) == ("send_notification", {"n": 1}), first
    return await finish_loop(caller, ends_with(await caller.run_tool(session_id, first), "requires_approval"), session_id)


def loop_text_ok(end: dict[str, Any]) -> None:
    lines = [line for line in end["text"].splitlines() if line.startswith("myapp_")]
    assert lines == [
        f'{TOOL} -> {{"ran": "send_notification", "n": 1}}',
        f'{GATED} -> {{"ran": "delete_file", "path": "/tmp/a"}}',
        f'{TOOL} -> {{"ran": "send_notification", "n": 2}}',
    ], end["text"]


async def test_the_whole_loop_through_a_round_robin_proxy(pg_url: str) -> None:
    """Every request of the loop lands on a different server than the one before (the proxy's
    record), all three serve it, and the turn ends with each call run once."""
    async with cluster(pg_url) as world, balanced_caller(world) as caller:
        end = await drive_loop(caller, "s1")
        # The next turn of the same conversation, sent wherever the rotation is now.
        again = ends_with(await caller.message("s1", script([(TOOL, {"n": 3})]), wait=60), "requires_action")
        [third] = again["pending"]
        ends_with(await caller.run_tool("s1", third), "end_turn")
        # Every HTTP request of the caller (its 7 calls and the SDK's own) was a connection of its own.
        assert len(world.proxy.order) == caller.http_requests >= 7, (world.proxy.order, caller.http_requests)
        served = on_different_servers(world, list(range(len(world.proxy.order))))
    loop_text_ok(end)
    assert sorted({world.backend(c) for c in caller.connections}) == list(range(SERVERS)), served
    assert caller.broken == []
    nothing_twice(await log_of(pg_url, "s1"), caller.executed)


async def test_the_tether_through_a_round_robin_proxy(pg_url: str) -> None:
    """`POST …/tether`, the long poll and SSE with `Last-Event-ID` resume, each request a new
    connection to the next server: messages sent through one server are run by the guest on
    another, read back through a third; an SSE stream resumed on another server goes on after
    the last event it had, nothing repeated, nothing skipped."""
    import httpx2

    session = {"channel": "host", "id": "t1"}
    async with cluster(pg_url) as world, httpx2.AsyncClient(
        base_url=world.url, headers={"Authorization": f"Bearer {world.token}"}, timeout=TURN_TIMEOUT,
        limits=httpx2.Limits(max_keepalive_connections=0),
    ) as rest:
        first = len(world.proxy.order)
        sent = []
        for n in range(3):
            response = await rest.post(TETHER.format(INSTANCE), json={"type": "user.message", "session": session,
                                                                        "payload": {"text": json.dumps({"steps": [], "n": n})}})
            assert response.status_code == 201, response.text
            sent.append(response.json()["frame"])
        # The long poll: each turn's end, read through the next server in the rotation.
        ends: list[dict[str, Any]] = []
        after = sent[-1]["seq"] - 3
        with trio.fail_after(TURN_TIMEOUT):
            while len(ends) < 3:
                response = await rest.get(POLL.format(INSTANCE), params={
                    "channel": "host", "session_id": "t1", "types": "assistant.done", "after_seq": after, "wait_ms": 25_000})
                assert response.status_code == 200, response.text
                page = response.json()
                ends += page["frames"]
                after = page["next_seq"]
        assert sorted(e["reply_to"] for e in ends) == sorted(s["msg_id"] for s in sent)
        # SSE: read a few events on one server, resume with Last-Event-ID on the next.
        every = [f.seq for f in await log_of(pg_url, "t1")]
        seen: list[int] = []
        last_id = None
        while len(seen) < len(every):
            headers = {"Last-Event-ID": last_id} if last_id else {}
            async with rest.stream("GET", STREAM.format(INSTANCE), params={"channel": "host", "session_id": "t1"},
                                   headers=headers) as response:
                assert response.status_code == 200, response.text
                events = SseEvents(response)
                for _ in range(min(2, len(every) - len(seen))):
                    event = await events.next()
                    seen.append(int(event["id"]))
                    last_id = event["id"]
        served = on_different_servers(world, list(range(first, len(world.proxy.order))))
    assert seen == every, (seen, every)
    assert sorted(set(served)) == list(range(SERVERS)), served


async def test_the_callers_server_killed_mid_loop(pg_url: str) -> None:
    """kill -9 of the server the caller's `caller_tool_response` (with `wait`) went to, once that
    answer is in the log and the request waits for the turn's next stop (the test holds the
    agent still with SIGSTOP meanwhile, so the stop cannot come first): the caller's connection
    breaks; it sends the same answer again (a new client: the same token and `owner_key`), the
    next server takes it as already resolved and waits from there, and the loop goes on through
    the two servers left. Every call is run once, every message once."""
    store = PostgresFrameStore(pg_url, pool_size=1)
    async with store.running(), cluster(pg_url, guest_on=2) as world, balanced_caller(world) as caller:
        stop = ends_with(await caller.message("s1", LOOP, TOOLS, wait=60), "requires_action")
        [first] = stop["pending"]
        agent = world.agent_pids()
        for pid in agent:
            os.kill(pid, signal.SIGSTOP)
        outcome: dict[str, Any] = {}

        async def answer() -> None:
            try:
                outcome["stop"] = await caller.run_tool("s1", first)
            except Exception as error:  # noqa: BLE001 - the connection broke under the call: the point
                outcome["error"] = error

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer)
                await stored(store, "s1", "caller_tool_result", 1)
                victim = world.backend(caller.connections[-1])
                assert victim != world.guest_on, "this test kills a server the guest is not on"
                killed_at = len(world.proxy.order)
                await world.kill(victim)
        finally:
            for pid in agent:
                os.kill(pid, signal.SIGCONT)
        assert "error" in outcome, f"the killed server answered: {outcome}"
        await caller.open()
        again = await caller.run_tool("s1", first, resend=True)
        assert again.get("resolved") is False and "already resolved" in again.get("not_pending", ""), again
        end = await finish_loop(caller, ends_with(again, "requires_approval"))
        after_kill = on_different_servers(world, list(range(killed_at, len(world.proxy.order))))
        assert victim not in after_kill and world.proxy.refused[victim] >= 1, (after_kill, world.proxy.refused)
        assert len(caller.broken) == 1, caller.broken  # the client the kill broke, and only that one
    loop_text_ok(end)
    nothing_twice(await log_of(pg_url, "s1"), caller.executed)


async def test_the_guests_server_killed_between_turns(pg_url: str) -> None:
    """kill -9 of the server the guest is on, after a turn ended: the guest reconnects to another
    server, and the caller's next message, sent wherever the rotation (without the dead server)
    puts it, runs the whole loop again there. Every call is run once, every message once."""
    async with cluster(pg_url, guest_on=1) as world, balanced_caller(world) as caller:
        loop_text_ok(await drive_loop(caller, "s1"))
        killed_at = len(world.proxy.order)
        await world.kill(world.guest_on)
        end = await drive_loop(caller, "s1")
        after_kill = on_different_servers(world, list(range(killed_at, len(world.proxy.order))))
        assert world.guest_on not in after_kill and world.proxy.refused[world.guest_on] >= 1, after_kill
        assert caller.broken == []
    loop_text_ok(end)
    nothing_twice(await log_of(pg_url, "s1"), caller.executed)


async def finish_loop(caller: BalancedCaller, stop: dict[str, Any], session_id: str = "s1") -> dict[str, Any]:
    """`drive_loop` from its `requires_approval` stop on."""
    [asked] = stop["approval_requests"]
    assert (asked["tool_name"], asked["arguments"]) == (GATED, {"path": "/tmp/a"}), asked
    stop = ends_with(await caller.approve(session_id, asked), "requires_action")
    [gated] = stop["pending"]
    assert (gated["tool"], gated["arguments"]) == ("delete_file", {"path": "/tmp/a"}), gated
    stop = ends_with(await caller.run_tool(session_id, gated), "requires_action")
    [last] = stop["pending"]
    assert last["arguments"] == {"n": 2}, last
    return ends_with(await caller.run_tool(session_id, last), "end_turn")


async def stored(store: PostgresFrameStore, session_id: str, type_: str, count: int) -> list[Any]:
    """The test's own view (a store of its own, opened beforehand): wait until `count` frames of
    `type_` of the session are in the log."""
    found: list[Any] = []
    with trio.fail_after(TURN_TIMEOUT):
        while len(found) < count:
            frames, _ = await store.wait_for_frames(INSTANCE, FrameQuery(
                session_id=session_id, types=(type_,), after_seq=found[-1].seq if found else 0), timeout=TURN_TIMEOUT)
            found += frames
    return found
