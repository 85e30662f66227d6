"""The real Gemini CLI as the agent in the sandbox, with its model replaced by a script.

Gemini CLI 0.61.0 (installed into .gemini-cli/ by tests/tools/install-gemini-cli.sh, which
README command 2 and .ci/run call) runs offline against `FakeGemini`, a scripted stand-in of
the Gemini API on 127.0.0.1 (tests/support/fake_gemini.py), with its own HOME. The guest runtime runs
docs/AGENTS.md's Gemini line per message (`{gemini_home}` is the runtime's per-session
home holding its `settings.json`); the test's SDK caller answers the relayed caller tool call. Everything else is
real: `oubliette-server`, the guest runtime, `oubliette-client` and Gemini CLI's MCP client. A
missing CLI fails these tests: it is part of the test setup.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, AsyncIterator
from contextlib import asynccontextmanager

import trio

from agent_clis import FAILED, GAVE_UP, assert_the_suite_command_installs, documented_agent_command, error_turn, installed_cli, toolset_turn
from fake_gemini import FakeGemini, function_call, function_responses, offered_tools, text
from harness import PYTHON, Deployment
from oubliette_client.mcp_config import GEMINI_CLI, mcp_config, write_mcp_config
from oubliette_client.settings import RelaySettings
from claude_code import INSTANCE, notify_turn, scratch

ROOT = Path(__file__).resolve().parents[2]
GEMINI = ROOT / ".gemini-cli" / "gemini"
INSTALL = "tests/tools/install-gemini-cli.sh"
DOC = ROOT / "docs" / "AGENTS.md"


def gemini_binary() -> str:
    """The installed CLI's path; the test fails (never skips) when it is not there."""
    return installed_cli(GEMINI, INSTALL)


def gemini_env(fake_url: str, home: Path) -> dict[str, str]:
    """A clean environment for Gemini CLI: the stand-in model, its own HOME, none of the host's
    Gemini or Oubliette settings."""
    env = {key: os.environ[key] for key in ("LANG", "LC_ALL", "TMPDIR") if key in os.environ}
    env.update({"PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", os.defpath)]),
                "HOME": str(home), "GOOGLE_GEMINI_BASE_URL": fake_url, "GEMINI_API_KEY": "stand-in"})
    return env


@asynccontextmanager
async def gemini_agent(deployment: Deployment, script: list[Any]) -> AsyncIterator[FakeGemini]:
    """The scripted model, and the guest runtime for INSTANCE running the doc's Gemini line in
    an empty working directory, until the block ends."""
    command = documented_agent_command(DOC, "gemini", gemini_binary())
    assert any("{gemini_home}" in word for word in command), command
    fake = FakeGemini(script)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        env = gemini_env(fake.url, scratch(deployment, "home"))
        async with deployment.guest(INSTANCE, command, env=env, cwd=scratch(deployment, "work")):
            yield fake
        nursery.cancel_scope.cancel()
    if fake.errors:
        raise fake.errors[0]


async def test_gemini_cli_as_the_agent_calls_a_caller_tool(deployment: Deployment) -> None:
    """Gemini CLI in the sandbox is offered the session's caller tool through oubliette-client
    and calls it; the caller answers from the `requires_action` stop; the model is shown the
    answer as the functionResponse, and its closing text is the turn's end (`assistant.done`)."""
    session = "gemini-agent"
    tool = "mcp_oubliette_myapp_send_notification"
    script = [[function_call(tool, {"message": "build is green"})], [text("Told the host: build is green.")]]
    async with gemini_agent(deployment, script) as fake, deployment.caller(events=False) as (caller, _events):
        end = await notify_turn(caller, session)
    assert end["stop_reason"] == "end_turn", end
    assert end["text"].strip() == "Told the host: build is green."
    first = fake.main_requests[0]
    assert tool in offered_tools(first), sorted(offered_tools(first))
    assert "Tell the host the build is green." in json.dumps(first["contents"])  # stdin, with `-p ""`
    [answered] = function_responses(fake.main_requests[-1])
    assert answered["name"] == tool, answered
    # Gemini CLI shows the model an MCP tool's text inside <untrusted_context> tags.
    wrapped = re.fullmatch(r"<untrusted_context>\n(.*)\n</untrusted_context>", answered["response"]["output"], re.S)
    assert wrapped is not None and json.loads(wrapped.group(1)) == {"status": "sent", "id": 7}, answered


async def test_gemini_cli_gets_a_caller_error_as_a_tool_error(deployment: Deployment) -> None:
    """A caller's `error` answer reaches Gemini CLI as a failed MCP call (`isError`, with
    oubliette-client's text naming the tool), which it shows the model as the functionResponse's
    `error` (its own sentence around the MCP result), not its `output`; the turn ends with the
    model's text."""
    session = "gemini-error"
    tool = "mcp_oubliette_myapp_send_notification"
    script = [[function_call(tool, {"message": "build is green"})], [text(GAVE_UP)]]
    fake = await error_turn(gemini_agent, deployment, session, script)
    [answered] = function_responses(fake.main_requests[-1])
    assert answered["name"] == tool and list(answered["response"]) == ["error"], answered
    error = answered["response"]["error"]
    assert error.startswith("MCP tool 'myapp_send_notification' reported tool error for function call: "), error
    said = json.loads(error.split(" with response: ", 1)[1])[0]["functionResponse"]["response"]
    assert said == {"content": [{"type": "text", "text": FAILED}], "isError": True}, error


async def test_gemini_cli_calls_a_host_toolset_tool_by_its_dotted_name(deployment: Deployment) -> None:
    """With the default `.` separator, Gemini CLI offers toolset tool `ext.echo_external` as
    `mcp_oubliette_ext.echo_external`, keeping the `.`, and the model is shown the toolset's
    answer; the caller's tool works beside it."""
    session = "gemini-toolset"
    toolset_tool, tool = "mcp_oubliette_ext.echo_external", "mcp_oubliette_myapp_send_notification"
    script = [[function_call(toolset_tool, {"message": "hello from the sandbox"})],
              [function_call(tool, {"message": "build is green"})], [text("Told the host: build is green.")]]
    fake = await toolset_turn(gemini_agent, deployment, session, script)
    assert {toolset_tool, tool} <= offered_tools(fake.main_requests[0]), sorted(offered_tools(fake.main_requests[0]))
    echoed, answered = function_responses(fake.main_requests[-1])
    assert echoed["name"] == toolset_tool and answered["name"] == tool, (echoed, answered)
    assert echoed["response"]["output"] == '<untrusted_context>\n{"echo": "hello from the sandbox"}\n</untrusted_context>', echoed


def test_the_suite_command_installs_the_gemini_cli_these_tests_run() -> None:
    """README command 2 installs the pinned Gemini CLI these tests run."""
    assert_the_suite_command_installs(INSTALL, gemini_binary())


def test_the_generated_gemini_home_holds_the_session_entry(tmp_path: Path) -> None:
    """`{gemini_home}` is a directory with `.gemini/settings.json` (0600: the token): the same
    `oubliette-client` entry as Claude Code's config, with Gemini's timeout, trust and auth."""
    settings = RelaySettings(relay="unix:/oubliette/relay.sock", instance="box1", token="t0k")
    home = write_mcp_config(tmp_path, settings, "mcp:s-4f2a", GEMINI_CLI)
    path = home / ".gemini" / "settings.json"
    assert home.is_dir() and path.stat().st_mode & 0o777 == 0o600
    document = json.loads(path.read_text())
    claude = mcp_config(settings, "mcp:s-4f2a")["mcpServers"]["oubliette"]
    assert document == {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "mcpServers": {"oubliette": {**{k: v for k, v in claude.items() if k != "type"}, "timeout": 660000, "trust": True}},
    }
    assert document["mcpServers"]["oubliette"]["env"]["OUBLIETTE_SESSION"] == "mcp:s-4f2a"
    assert write_mcp_config(tmp_path, settings, "mcp:s-4f2b", GEMINI_CLI) != home
