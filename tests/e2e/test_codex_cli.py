"""The real Codex CLI as the agent in the sandbox, with its model replaced by a script.

Codex 0.171.0 (installed into .codex-cli/ by tests/tools/install-codex-cli.sh, which README
command 2 and .ci/run call) runs offline against `FakeCodexAPI`, a scripted stand-in of the
Responses API on 127.0.0.1 (tests/support/fake_codex.py), with its own HOME. The guest runtime runs
docs/AGENTS.md's Codex line per message (`{codex_home}` is the runtime's per-session
`CODEX_HOME` holding its `config.toml`), with the stand-in as the model provider (`-c`
overrides); the test's SDK caller answers the relayed caller tool call. Everything else is
real: `oubliette-server`, the guest runtime, `oubliette-client` and Codex's MCP client. A
missing CLI fails these tests: it is part of the test setup.
"""

from __future__ import annotations

import json
import tomllib
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from fake_codex import FakeCodexAPI, deferred_namespaces, function_call, function_outputs, text
import agent_clis
from agent_clis import FAILED, GAVE_UP, assert_the_suite_command_installs, clean_env, error_turn, installed_cli, toolset_turn
from harness import Deployment
from oubliette_client.mcp_config import CODEX, mcp_config, write_mcp_config
from oubliette_client.settings import RelaySettings
from claude_code import INSTANCE, notify_turn, scratch

ROOT = Path(__file__).resolve().parents[2]
CODEX_CLI = ROOT / ".codex-cli" / "codex"
INSTALL = "tests/tools/install-codex-cli.sh"


def codex_binary() -> str:
    """The installed CLI's path."""
    return installed_cli(CODEX_CLI, INSTALL)


def documented_agent_command() -> list[str]:
    """docs/AGENTS.md's guest runtime line for Codex: the agent command after `--`."""
    return agent_clis.documented_agent_command(agent_clis.ROOT / "docs" / "AGENTS.md", "codex", codex_binary())


def with_provider(command: list[str], fake_url: str) -> list[str]:
    """`command` with the stand-in as Codex's model provider (`-c` overrides before the prompt)."""
    provider = f'model_providers.fake={{name="fake",base_url="{fake_url}/v1",env_key="OPENAI_API_KEY",wire_api="responses"}}'
    return [*command[:-1], "-c", 'model_provider="fake"', "-c", provider, command[-1]]


def shown_json(output: dict[str, Any]) -> Any:
    """The JSON a function_call_output shows the model after Codex's `Wall time` header."""
    return json.loads(output["output"].split("Output:\n", 1)[-1])


@asynccontextmanager
async def codex_agent(deployment: Deployment, script: list[Any]) -> AsyncIterator[FakeCodexAPI]:
    """The scripted model, and the guest runtime for INSTANCE running the doc's Codex line in
    an empty working directory, until the block ends."""
    command = documented_agent_command()
    assert any("{codex_home}" in word for word in command), command
    fake = FakeCodexAPI(script)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        env = clean_env(scratch(deployment, "home"), OPENAI_API_KEY="stand-in")
        async with deployment.guest(INSTANCE, with_provider(command, fake.url), env=env, cwd=scratch(deployment, "work")):
            yield fake
        nursery.cancel_scope.cancel()
    if fake.errors:
        raise fake.errors[0]


async def test_codex_as_the_agent_calls_a_caller_tool(deployment: Deployment) -> None:
    """Codex in the sandbox is offered the session's tools through oubliette-client (the
    `mcp__oubliette` namespace) and calls the caller's tool; the caller answers from the
    `requires_action` stop; the model is shown the answer as the function_call_output, and its
    closing text is the turn's end (`assistant.done`)."""
    session = "codex-agent"
    script = [[function_call("mcp__oubliette", "myapp_send_notification", {"message": "build is green"})],
              [text("Told the host: build is green.")]]
    async with codex_agent(deployment, script) as fake, deployment.caller(events=False) as (caller, _events):
        end = await notify_turn(caller, session)
    assert end["stop_reason"] == "end_turn", end
    assert end["text"].strip() == "Told the host: build is green."
    first = fake.main_requests[0]
    assert "mcp__oubliette" in deferred_namespaces(first), deferred_namespaces(first)
    assert "Tell the host the build is green." in json.dumps(first["input"])  # stdin, with `-`
    [answered] = function_outputs(fake.main_requests[-1])
    assert answered["call_id"] == "call_1", answered
    assert shown_json(answered) == {"status": "sent", "id": 7}, answered


async def test_codex_gets_a_caller_error_as_a_tool_error(deployment: Deployment) -> None:
    """A caller's `error` answer reaches Codex as a failed MCP call (`isError`, with
    oubliette-client's text naming the tool); Codex shows the model that text as the
    function_call_output's content after its `Wall time` header, and the turn ends with the
    model's text."""
    session = "codex-error"
    script = [[function_call("mcp__oubliette", "myapp_send_notification", {"message": "build is green"})],
              [text(GAVE_UP)]]
    fake = await error_turn(codex_agent, deployment, session, script)
    [answered] = function_outputs(fake.main_requests[-1])
    # The Responses API has no error flag for a function_call_output, and Codex 0.171.0 shows a
    # failed call as it shows a text-only result (checked): the text is what says it failed.
    assert [item["text"] for item in answered["output"]][1:] == [FAILED], answered


async def test_codex_calls_a_host_toolset_tool_by_its_underscored_name(deployment: Deployment) -> None:
    """On a server with the default `.` separator, Codex offers toolset tool `ext.echo_external`
    as `ext_echo_external` in the `mcp__oubliette` namespace (its client shows that name, from the
    generated config's separator; Codex would rewrite a `.` to the same) and the dotted name is
    refused; the call reaches the toolset: the model is shown its answer; the caller's tool works
    beside it."""
    session = "codex-toolset"
    script = [[function_call("mcp__oubliette", "ext.echo_external", {"message": "dotted"}, "call_1")],
              [function_call("mcp__oubliette", "ext_echo_external", {"message": "hello from the sandbox"}, "call_2")],
              [function_call("mcp__oubliette", "myapp_send_notification", {"message": "build is green"}, "call_3")],
              [text("Told the host: build is green.")]]
    fake = await toolset_turn(codex_agent, deployment, session, script)
    dotted, echoed, answered = function_outputs(fake.main_requests[-1])
    assert dotted["output"] == "unsupported call: mcp__oublietteext.echo_external", dotted
    assert shown_json(echoed) == {"echo": "hello from the sandbox"}, echoed
    assert shown_json(answered) == {"status": "sent", "id": 7}, answered


def test_the_suite_command_installs_the_codex_cli_these_tests_run() -> None:
    """README command 2 (.ci/run's command) runs the install script, and the installed CLI is
    the version that script pins."""
    assert_the_suite_command_installs(INSTALL, codex_binary(), "codex-cli {}")


def test_the_generated_codex_home_holds_the_session_entry(tmp_path: Path) -> None:
    """`{codex_home}` is a directory with `config.toml` (0600: the token): the same
    `oubliette-client` entry as Claude Code's config, with `_` as the separator of toolset tool
    names (Codex would rewrite `.` itself), Codex's timeouts and its tools approved (the server's
    approvals gate them)."""
    settings = RelaySettings(relay="unix:/oubliette/relay.sock", instance="box1", token="t0k")
    home = write_mcp_config(tmp_path, settings, "mcp:s-4f2a", CODEX)
    path = home / "config.toml"
    assert home.is_dir() and path.stat().st_mode & 0o777 == 0o600
    document = tomllib.loads(path.read_text())
    claude = mcp_config(settings, "mcp:s-4f2a")["mcpServers"]["oubliette"]
    assert document == {"mcp_servers": {"oubliette": {
        **{k: v for k, v in claude.items() if k != "type"}, "env": {**claude["env"], "OUBLIETTE_TOOL_SEPARATOR": "_"},
        "startup_timeout_sec": 30, "tool_timeout_sec": 660.0,
        "default_tools_approval_mode": "approve", "required": True}}}
    assert document["mcp_servers"]["oubliette"]["env"]["OUBLIETTE_SESSION"] == "mcp:s-4f2a"
    assert write_mcp_config(tmp_path, settings, "mcp:s-4f2b", CODEX) != home
