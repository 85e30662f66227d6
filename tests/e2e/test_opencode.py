"""The real OpenCode CLI as the agent in the sandbox, with its model replaced by a script.

OpenCode 1.18.33 (installed into .opencode-cli/ by tests/tools/install-opencode-cli.sh, which
README command 2 and .ci/run call) runs offline against `FakeOpenAI`, a scripted stand-in of the
Chat Completions API on 127.0.0.1 (tests/support/fake_openai.py), named as a custom provider in the
working folder's `opencode.json`, with its own HOME. The guest runtime runs docs/AGENTS.md's
OpenCode line per message (`{opencode_config}` is the runtime's per-session `OPENCODE_CONFIG`);
the test's SDK caller answers the relayed caller tool call. Everything else is real:
`oubliette-server`, the guest runtime, `oubliette-client` and OpenCode's MCP client. A missing
CLI fails these tests: it is part of the test setup.
"""

from __future__ import annotations

import json
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from agent_clis import FAILED, GAVE_UP, assert_the_suite_command_installs, documented_agent_command, error_turn, installed_cli, toolset_turn
from fake_openai import FakeOpenAI, offered_tools, text, tool_call, tool_results
from harness import PYTHON, Deployment
from oubliette_client.mcp_config import OPENCODE, mcp_config, write_mcp_config
from oubliette_client.settings import RelaySettings
from claude_code import INSTANCE, notify_turn, scratch

ROOT = Path(__file__).resolve().parents[2]
OPENCODE_CLI = ROOT / ".opencode-cli" / "opencode"
INSTALL = "tests/tools/install-opencode-cli.sh"
DOC = ROOT / "docs" / "AGENTS.md"


def opencode_binary() -> str:
    """The installed CLI's path; the test fails (never skips) when it is not there."""
    return installed_cli(OPENCODE_CLI, INSTALL)


def provider_config(fake_url: str) -> dict[str, Any]:
    """The working folder's `opencode.json`: the stand-in as OpenCode's model (the session's
    `OPENCODE_CONFIG` is merged over it)."""
    return {"provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "fake",
                                  "options": {"baseURL": f"{fake_url}/v1", "apiKey": "stand-in"},
                                  "models": {"m1": {"name": "m1"}}}},
            "model": "fake/m1"}


def opencode_env(home: Path) -> dict[str, str]:
    """A clean environment for OpenCode: its own HOME, none of the host's OpenCode or Oubliette
    settings."""
    env = {key: os.environ[key] for key in ("LANG", "LC_ALL", "TMPDIR") if key in os.environ}
    env.update({"PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", os.defpath)]),
                "HOME": str(home)})
    return env


@asynccontextmanager
async def opencode_agent(deployment: Deployment, script: list[Any]) -> AsyncIterator[FakeOpenAI]:
    """The scripted model, and the guest runtime for INSTANCE running the doc's OpenCode line in
    a working directory holding only the provider's `opencode.json`, until the block ends."""
    command = documented_agent_command(DOC, "opencode", opencode_binary())
    assert any("{opencode_config}" in word for word in command), command
    fake = FakeOpenAI(script)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        work = scratch(deployment, "work")
        (work / "opencode.json").write_text(json.dumps(provider_config(fake.url)))
        async with deployment.guest(INSTANCE, command, env=opencode_env(scratch(deployment, "home")), cwd=work):
            yield fake
        nursery.cancel_scope.cancel()
    if fake.errors:
        raise fake.errors[0]


async def test_opencode_as_the_agent_calls_a_caller_tool(deployment: Deployment) -> None:
    """OpenCode in the sandbox is offered the session's caller tool through oubliette-client and
    calls it; the caller answers from the `requires_action` stop; the model is shown the answer
    as the tool message, and its closing text is the turn's end (`assistant.done`)."""
    session = "opencode-agent"
    tool = "oubliette_myapp_send_notification"
    script = [[tool_call(tool, {"message": "build is green"})], [text("Told the host: build is green.")]]
    async with opencode_agent(deployment, script) as fake, deployment.caller(events=False) as (caller, _events):
        end = await notify_turn(caller, session)
    assert end["stop_reason"] == "end_turn", end
    assert end["text"].strip() == "Told the host: build is green."
    first = fake.main_requests[0]
    assert tool in offered_tools(first), sorted(offered_tools(first))
    assert "Tell the host the build is green." in json.dumps(first["messages"])  # the message, from stdin
    [answered] = tool_results(fake.main_requests[-1])
    assert answered["tool_call_id"] == "call_0", answered
    assert json.loads(answered["content"]) == {"status": "sent", "id": 7}, answered


async def test_opencode_gets_a_caller_error_as_a_tool_error(deployment: Deployment) -> None:
    """A caller's `error` answer reaches OpenCode as a failed MCP call (`isError`, with
    oubliette-client's text naming the tool), which OpenCode shows the model as the tool
    message's text (Chat Completions has no error flag); the turn ends with the model's text."""
    session = "opencode-error"
    tool = "oubliette_myapp_send_notification"
    script = [[tool_call(tool, {"message": "build is green"})], [text(GAVE_UP)]]
    fake = await error_turn(opencode_agent, deployment, session, script)
    [answered] = tool_results(fake.main_requests[-1])
    assert answered["content"] == FAILED, answered


async def test_opencode_calls_a_host_toolset_tool_by_its_underscored_name(deployment: Deployment) -> None:
    """On a server with the default `.` separator, OpenCode offers toolset tool
    `ext.echo_external` as `oubliette_ext_echo_external` (its client shows `ext_echo_external`,
    from the generated config's separator; OpenCode would rewrite a `.` to the same) and the call
    reaches the toolset: the model is shown its answer; the caller's tool works beside it."""
    session = "opencode-toolset"
    toolset_tool, tool = "oubliette_ext_echo_external", "oubliette_myapp_send_notification"
    script = [[tool_call(toolset_tool, {"message": "hello from the sandbox"})],
              [tool_call(tool, {"message": "build is green"})], [text("Told the host: build is green.")]]
    fake = await toolset_turn(opencode_agent, deployment, session, script)
    offered = offered_tools(fake.main_requests[0])
    assert {toolset_tool, tool} <= offered and not any("." in name for name in offered), sorted(offered)
    echoed, answered = tool_results(fake.main_requests[-1])
    assert json.loads(echoed["content"]) == {"echo": "hello from the sandbox"}, echoed
    assert json.loads(answered["content"]) == {"status": "sent", "id": 7}, answered


def test_the_suite_command_installs_the_opencode_these_tests_run() -> None:
    """README command 2 installs the pinned OpenCode these tests run."""
    assert_the_suite_command_installs(INSTALL, opencode_binary())


def test_the_generated_opencode_config_holds_the_session_entry(tmp_path: Path) -> None:
    """`{opencode_config}` is a file (0600: the token) whose `mcp` key holds the same
    `oubliette-client` as Claude Code's config, in OpenCode's local shape with its timeout, and
    `_` as the separator of toolset tool names (OpenCode would rewrite `.` itself)."""
    settings = RelaySettings(relay="unix:/oubliette/relay.sock", instance="box1", token="t0k")
    path = write_mcp_config(tmp_path, settings, "mcp:s-4f2a", OPENCODE)
    assert path.is_file() and path.stat().st_mode & 0o777 == 0o600
    claude = mcp_config(settings, "mcp:s-4f2a")["mcpServers"]["oubliette"]
    assert json.loads(path.read_text()) == {"mcp": {"oubliette": {
        "type": "local", "command": [claude["command"], *claude["args"]],
        "environment": {**claude["env"], "OUBLIETTE_TOOL_SEPARATOR": "_"}, "enabled": True, "timeout": 660000}}}
    assert claude["env"]["OUBLIETTE_SESSION"] == "mcp:s-4f2a"
    assert write_mcp_config(tmp_path, settings, "mcp:s-4f2b", OPENCODE) != path
