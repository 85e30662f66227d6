"""A client whose token the relay refuses fails its MCP start with the reason, in both eras.

A refused token is permanent, so `oubliette-client` (the stdio MCP server an agent's host spawns)
must not look healthy: the agent's first request (`initialize`, or a 2026-07-28 agent's first
request) gets a JSON-RPC error saying why, and the program exits 1 with the same line on stderr.
An unreachable relay at the start (no socket at the path, nothing listening) fails the start the
same way (PEER_DISCONNECTED, -32002); a relay lost after the start may come back: calls say why they fail.
All with the real programs: oubliette-server as the caller's stdio server (it binds the relay),
oubliette-client spawned by the MCP SDK's client or driven line by line.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio
from mcp import Client, MCPError
from mcp.client.stdio import StdioServerParameters

from harness import PYTHON, Deployment, HandMcp, text_of

BOUND = 20.0
REFUSAL = "refused instance 'box1': wrong token for instance 'box1'"


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def initialize(request_id: int = 0) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "agent", "version": "1"}}}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_the_sdk_client_of_a_refused_token_fails_to_start_with_the_reason(
    deployment: Deployment, tmp_path: Path, mode: str,
) -> None:
    log = tmp_path / "client.log"
    async with deployment.caller():
        with log.open("w") as errlog, trio.fail_after(BOUND):
            with pytest.raises(Exception) as caught:
                async with deployment.agent("box1", "mcp:s1", mode=mode, token="wrong", errlog=errlog) as agent:
                    await agent.list_tools()
    [error] = leaves(caught.value)
    assert isinstance(error, MCPError) and error.code == -32006 and REFUSAL in str(error), repr(caught.value)
    assert f"oubliette-client: error: the relay at {deployment.relay} {REFUSAL}" in log.read_text()


@pytest.mark.parametrize("early", ["1", "0"])
async def test_initialize_of_a_refused_token_is_an_error_and_the_client_exits_1(deployment: Deployment, early: str) -> None:
    async with deployment.caller():
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **deployment.client_env("box1", "mcp:s1", token="wrong"), "OUBLIETTE_FAST_PATH": early},
        )
        agent = HandMcp(process)
        with trio.fail_after(BOUND):
            await agent.send(initialize())
            answer = await agent.response(0)
            code = await process.wait()
            assert process.stderr is not None
            stderr = (await process.stderr.receive_some(65536)).decode()
    assert answer["error"]["code"] == -32006, answer
    assert REFUSAL in answer["error"]["message"] and "oubliette-server token box1" in answer["error"]["message"]
    assert code == 1
    assert REFUSAL in stderr, stderr


@pytest.mark.parametrize("broken", ["wrong token", "no relay socket"])
async def test_claude_code_lists_a_broken_client_as_failed(deployment: Deployment, tmp_path: Path, broken: str) -> None:
    """`claude mcp list` (the real Claude Code) says "Failed to connect", not "Connected", for a
    refused token and for a relay socket path where nothing listens."""
    from claude_code import claude_binary, claude_env

    home = tmp_path / "home"
    home.mkdir()
    env = claude_env("http://127.0.0.1:9", home, {})  # `mcp list` asks no model
    settings = deployment.client_env("box1", token="wrong")
    if broken == "no relay socket":
        settings = {**deployment.client_env("box1"), "OUBLIETTE_RELAY": f"unix:{tmp_path / 'nothing-here.sock'}"}
    client_env = [word for key, value in settings.items() for word in ("-e", f"{key}={value}")]
    async with deployment.caller():
        with trio.fail_after(120):
            await trio.run_process(
                [claude_binary(), "mcp", "add", "-s", "user", "oubliette", *client_env, "--", PYTHON, "-m", "oubliette_client"],
                env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True,
            )
            listed = await trio.run_process(
                [claude_binary(), "mcp", "list"], env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True, check=False,
            )
    line = next(line for line in listed.stdout.decode().splitlines() if line.startswith("oubliette:"))
    assert "Failed to connect" in line and "Connected" not in line.replace("Failed to connect", ""), line


@pytest.mark.parametrize("early", ["1", "0"])
async def test_initialize_with_an_unreachable_relay_is_an_error_and_the_client_exits_1(deployment: Deployment, early: str) -> None:
    """No server: nothing listens on the relay socket (a missing mount, a wrong path). The start
    fails with the reason, so `claude mcp list` cannot show it as connected."""
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **deployment.client_env("box1", "mcp:s1", token="any"), "OUBLIETTE_FAST_PATH": early},
    )
    agent = HandMcp(process)
    with trio.fail_after(BOUND):
        await agent.send(initialize())
        answer = await agent.response(0)
        code = await process.wait()
        assert process.stderr is not None
        stderr = (await process.stderr.receive_some(65536)).decode()
    unreachable = f"cannot connect to {deployment.relay}: No such file or directory (is oubliette-server running"
    assert answer["error"]["code"] == -32002 and unreachable in answer["error"]["message"], answer
    assert code == 1
    assert f"oubliette-client: error: {unreachable}" in stderr, stderr


async def test_a_relay_lost_after_the_start_is_said_in_each_call(deployment: Deployment) -> None:
    """Started with its relay, the client serves on when the relay goes (it may come back)."""
    params = StdioServerParameters(command=PYTHON, args=["-m", "oubliette_client"], env=deployment.client_env("box1", "mcp:s1"))
    async with deployment.http_server() as server:
        with trio.fail_after(BOUND):
            async with Client(params, mode="legacy") as agent:
                await agent.list_tools()
                server.process.kill()
                await server.process.wait()
                result = await agent.call_tool("ext.anything", {})
    assert result.is_error and "is unavailable (" in text_of(result), text_of(result)
