"""A handshake-era (2025-11-25) Streamable HTTP caller is bound to one server by its `Mcp-Session-Id`
(docs/SCALING.md, "What needs stickiness"): the MCP SDK keeps that session in the memory of the
server that issued it. Any other server — another one on the same PostgreSQL, or the same data
dir after a restart — answers a request with that id promptly with 404 and a JSON-RPC error (the
MCP spec's signal to start a new session with a new `initialize`), and a new session there works.
Everything is a real program and a real PostgreSQL (tests/support/postgres.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx2
import pytest
import trio
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from harness import Deployment, HttpServer
from loop_caller import INSTANCE, LoopCaller, ends_with, script
from cluster_servers import two_servers

PROMPT = 10
"""Seconds: far more than a 404 takes; a request that hangs fails the test instead."""
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2025-11-25"}
TOOLS_LIST = {"jsonrpc": "2.0", "id": 7, "method": "tools/list"}


class Balancer(httpx2.AsyncBaseTransport):
    """A client-side stand-in for a load balancer: sends every request to `target`'s host and port."""

    def __init__(self, target: HttpServer) -> None:
        self.target = target
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = httpx2.URL(self.target.url)
        request.url = request.url.copy_with(host=url.host, port=url.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def legacy_caller(balancer: Balancer) -> AsyncIterator[Client]:
    """A 2025-11-25 caller (initialize handshake) whose requests go wherever `balancer` points."""
    http = httpx2.AsyncClient(transport=balancer, timeout=60,
                              headers={"Authorization": f"Bearer {balancer.target.token}"})
    async with http, Client(streamable_http_client(balancer.target.mcp_url, http_client=http), mode="legacy") as client:
        yield client


async def mcp_session_id(server: HttpServer) -> str:
    """Open a 2025-11-25 session on `server` by a raw `initialize`; its `Mcp-Session-Id`."""
    async with server.rest() as rest:
        response = await rest.post("/mcp", headers=MCP_HEADERS, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"}}})
    assert response.status_code == 200, response.text
    return response.headers["mcp-session-id"]


async def assert_unknown_everywhere(server: HttpServer, session_id: str) -> None:
    """POST, GET and DELETE with `session_id` on `server`: each a prompt 404 with a JSON-RPC error body."""
    headers = {**MCP_HEADERS, "Mcp-Session-Id": session_id}
    async with server.rest() as rest:
        for method, body in (("POST", TOOLS_LIST), ("GET", None), ("DELETE", None)):
            with trio.fail_after(PROMPT):
                response = await rest.request(method, "/mcp", headers=headers, json=body)
            assert response.status_code == 404, (method, response.status_code, response.text)
            assert response.headers["content-type"].startswith("application/json"), method
            answer = response.json()
            assert answer["jsonrpc"] == "2.0" and answer["id"] is None and answer["error"]["code"] == -32600, answer
            message = answer["error"]["message"]
            # The SDK's words first (what clients may match), then why and what to do.
            assert message.startswith("Session not found: this server does not know MCP session"), message
            assert "another server" in message and "start a new session with initialize" in message, message


async def test_a_made_up_session_id_is_a_prompt_404(deployment: Deployment) -> None:
    """Beside a live session, an id this server never issued is 404 for POST, GET and DELETE;
    the live session still answers."""
    async with deployment.http_server() as server:
        live = await mcp_session_id(server)
        await assert_unknown_everywhere(server, "0123456789abcdef0123456789abcdef")
        async with server.rest() as rest:
            with trio.fail_after(PROMPT):
                response = await rest.post("/mcp", headers={**MCP_HEADERS, "Mcp-Session-Id": live}, json=TOOLS_LIST)
        assert response.status_code == 200, response.text


async def test_a_session_id_from_before_a_restart_is_a_prompt_404(deployment: Deployment) -> None:
    """The same data dir, a new process: the sessions of the old one are gone (they were in its memory)."""
    async with deployment.http_server() as server:
        old = await mcp_session_id(server)
    async with deployment.http_server() as server:
        await assert_unknown_everywhere(server, old)


async def test_a_session_opened_on_a_is_a_prompt_404_on_b_and_a_new_one_on_b_works(pg_url: str) -> None:
    """Two servers on one PostgreSQL, the guest on B. A 2025-11-25 caller (the MCP SDK's client)
    runs a turn on A; its requests then land on B (a balancer without affinity): B answers its
    `Mcp-Session-Id` 404 at once, which the SDK client reports as the error "Session not found"
    (it does not re-initialize by itself). A new session on B (a fresh `initialize`) sends the
    instance's next message there and the turn runs."""
    async with two_servers(pg_url) as (server_a, server_b):
        balancer = Balancer(server_a)
        async with legacy_caller(balancer) as client:
            caller = LoopCaller(client)
            ends_with(await caller.message("on-a", script(), wait=60), "end_turn")
            balancer.target = server_b
            with trio.fail_after(PROMPT), pytest.raises(MCPError, match="Session not found: .*another server"):
                await client.call_tool("session_message", {
                    "instance": INSTANCE, "session_id": "on-a", "message": script(), "wait": 30})
        await assert_unknown_everywhere(server_b, await mcp_session_id(server_a))
        async with legacy_caller(balancer) as client:
            caller = LoopCaller(client)
            ends_with(await caller.message("on-b", script(), wait=60), "end_turn")
            # The new MCP session is a new caller: the conversation opened by the old one stays its.
            refused = await caller.message("on-a", script(), wait=5)
            assert refused == {"error": "session_message: session 'on-a' belongs to another caller"}, refused

