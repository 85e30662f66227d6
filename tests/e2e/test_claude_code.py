"""The real Claude Code CLI as the MCP host, on both sides, with its model replaced by a script.

Claude Code 2.1.197 (installed into .claude-code/ by tests/tools/install-claude-code.sh, which
README command 2 and .ci/run call) runs offline against `FakeAnthropic`, a scripted stand-in of
the Messages API on 127.0.0.1 (tests/support/fake_anthropic.py). Each test scripts the "model"'s
replies (tool_use blocks, then text) and asserts on what the stand-in was sent: the
`tool_result` blocks are exactly what a real model would have read. Everything else is real:
`oubliette-server`, the guest runtime, `oubliette-client`, and Claude Code's own MCP client,
permission checks and Bash tool.

- On the host, Claude Code is the *caller*: it spawns `oubliette-server` over stdio (or reaches
  a daemon over Streamable HTTP) and drives an agent (the scripted demo agent under the guest
  runtime) with the caller's loop (docs/CLAUDE_CODE.md): `session_message` with `wait` → `requires_action` →
  `caller_tool_response` with `wait` → `end_turn`; gated tools through `requires_approval` and
  `approval_response` (and what `-p` does with an approval form instead).
- In the sandbox, Claude Code is the *agent*: the guest runtime runs `claude -p --mcp-config
  {mcp_config}` per message, and the test's SDK caller answers its relayed caller tool calls,
  and its permission prompts (`--permission-prompt-tool mcp__oubliette__permission_prompt`).

Each Claude Code run gets a temporary HOME and working directory (no CLAUDE.md, no .mcp.json)
and `--strict-mcp-config`. The Claude Code command lines, their environment and the host's MCP
config are read from docs/CLAUDE_CODE.md, so the doc shows what runs here. A missing CLI fails
these tests: it is part of the test setup.
"""

from __future__ import annotations

import json
import re
import subprocess
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio

from fake_anthropic import FakeAnthropic, last_result_json, result_text, text, tool_results, tool_use
from harness import DEMO_AGENT, PYTHON, Deployment
from claude_code import (
    toolset_config,
    CONTEXT,
    DOC,
    INSTALL,
    INSTANCE,
    NOTIFY_TOOL,
    ROOT,
    RUN_TIMEOUT,
    WAIT,
    call,
    claude_binary,
    claude_env,
    doc_blocks,
    documented_lines,
    notify_turn,
    scratch,
)

"""One whole Claude Code run (it starts in about 1 s; each MCP server in 1-2 s more)."""
"""The `wait` (seconds) every caller call passes: longer than any step takes here."""


# -- what docs/CLAUDE_CODE.md shows ---------------------------------------------------------------


def waits_for_mcp(env: dict[str, str]) -> dict[str, str]:
    """`env`, checked to make `claude -p` wait for its MCP servers before the first request (it
    waits at most MCP_CONNECT_TIMEOUT_MS, 5 s by default: too short on a busy machine)."""
    assert env.get("MCP_CONNECTION_NONBLOCKING") == "false", env
    assert int(env.get("MCP_CONNECT_TIMEOUT_MS", "0")) >= 30000, env
    return env


def documented_host_run() -> tuple[dict[str, str], list[str]]:
    """The doc's `claude -p` line on the host (Claude Code spawning oubliette-server): env, argv."""
    for env, words in documented_lines():
        if words[:2] == ["claude", "-p"]:
            return waits_for_mcp(env), [claude_binary(), *words[1:]]
    pytest.fail(f"{DOC.name} shows no `claude -p` line for the host")


def documented_host_config(data_dir: Path, *, for_print_mode: bool = True) -> dict[str, Any]:
    """The doc's stdio MCP config for oubliette-server, with this test's data directory: the one
    for `claude -p` (approvals as tool results, `--approval-delivery tool`) or the plain one."""
    for block in doc_blocks("json"):
        config = json.loads(block)
        server = config["mcpServers"].get("oubliette", {})
        if server.get("command") == "oubliette-server" and ("--approval-delivery" in server["args"]) == for_print_mode:
            server["env"]["OUBLIETTE_DATA_DIR"] = str(data_dir)
            return config
    pytest.fail(f"{DOC.name} shows no stdio MCP config that starts oubliette-server (for -p: {for_print_mode})")


def documented_agent_command(*, permission_prompt: bool) -> tuple[dict[str, str], list[str]]:
    """The doc's agent command after `oubliette-client run --` (with or without the permission
    prompt flags), and the non-OUBLIETTE variables the line sets."""
    for env, words in documented_lines():
        if words[:2] == ["oubliette-client", "run"] and "--" in words:
            command = words[words.index("--") + 1:]
            if ("--permission-prompt-tool" in command) == permission_prompt and command[:2] == ["claude", "-p"]:
                return (waits_for_mcp({k: v for k, v in env.items() if not k.startswith("OUBLIETTE_")}),
                        [claude_binary(), *command[1:]])
    pytest.fail(f"{DOC.name} shows no guest runtime line (permission prompt: {permission_prompt})")


@asynccontextmanager
async def stand_in(replies: list[Any]) -> AsyncIterator[FakeAnthropic]:
    """The scripted model, serving until the block ends."""
    fake = FakeAnthropic(replies)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        yield fake
        nursery.cancel_scope.cancel()
    if fake.errors:
        raise fake.errors[0]


def results_seen(fake: FakeAnthropic) -> list[dict[str, Any]]:
    """The tool_result blocks of the last request the model got: every result of the run, in order."""
    return tool_results(fake.main_requests[-1])


# -- the host: Claude Code as the caller ----------------------------------------------------------


def documented_http_config(url: str) -> dict[str, Any]:
    """The doc's Streamable HTTP MCP config, pointed at this test's server (`url`, no path)."""
    for block in doc_blocks("json"):
        config = json.loads(block)
        server = config["mcpServers"].get("oubliette", {})
        if server.get("type") == "http":
            assert server["headers"] == {"Authorization": "Bearer ${OUBLIETTE_HTTP_TOKEN}"}, server
            server["url"] = re.sub(r"^http://[^/]+", url, server["url"])
            return config
    pytest.fail(f"{DOC.name} shows no HTTP MCP config")


async def claude_on_the_host(
    deployment: Deployment, script: list[Any], *, config: str = "print",
) -> tuple[subprocess.CompletedProcess[bytes], FakeAnthropic]:
    """One documented `claude -p` run on the host with a guest running the demo agent; the
    finished run and the stand-in. `config`: the doc's stdio config for `-p` ("print", Claude
    Code spawns oubliette-server), its plain stdio config ("interactive"), or its HTTP config
    ("http", a running server daemon and its token in `OUBLIETTE_HTTP_TOKEN`)."""
    documented_env, argv = documented_host_run()
    home, work = scratch(deployment, "home"), scratch(deployment, "work")
    config_file = work / argv[argv.index("--mcp-config") + 1]
    async with AsyncExitStack() as stack:
        if config == "http":
            server = await stack.enter_async_context(deployment.http_server())
            config_file.write_text(json.dumps(documented_http_config(server.url)))
            documented_env = {**documented_env, "OUBLIETTE_HTTP_TOKEN": server.token}
        else:
            stdio = documented_host_config(deployment.data_dir, for_print_mode=config == "print")
            config_file.write_text(json.dumps(stdio))
            # The documented config sets only the data directory: the relay is its default socket there.
            deployment.socket = deployment.data_dir / "relay.sock"
            deployment.relay = f"unix:{deployment.socket}"
        fake = await stack.enter_async_context(stand_in(script))
        await stack.enter_async_context(deployment.guest(INSTANCE, DEMO_AGENT))
        with trio.fail_after(RUN_TIMEOUT):
            run = await trio.run_process(
                argv, stdin=b"Notify me through the sandboxed agent.", env=claude_env(fake.url, home, documented_env),
                cwd=work, capture_stdout=True, capture_stderr=True, check=False)
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    return run, fake


@pytest.mark.parametrize("config", ["print", "http"])
async def test_claude_code_on_the_host_drives_the_loop(deployment: Deployment, config: str) -> None:
    """The basic loop with the real CLI as the caller (spawning the server over stdio, or
    over Streamable HTTP with the bearer header): its model sees `requires_action` with the
    request's arguments in a tool result, answers with `caller_tool_response` and `wait`, and
    sees `end_turn` with the caller tool's result in the agent's text."""
    session = "cc-host"
    message = 'Please call myapp_send_notification {"message": "tests pass"}'

    def answer(request: dict[str, Any]) -> list[dict[str, Any]]:
        stop = last_result_json(request)
        assert stop.get("stop_reason") == "requires_action", stop
        pending = stop["pending"][0]
        owner = {"owner_key": stop["owner_key"]} if stop.get("owner_key") else {}
        return [tool_use("mcp__oubliette__caller_tool_response", {
            "session_id": session, "request_id": pending["request_id"],
            "result": {"status": "sent", "to": "the person"}, "wait": WAIT, **owner})]

    script = [
        [text("Handing it to the sandbox."), tool_use("mcp__oubliette__session_message", {
            "instance": INSTANCE, "session_id": session, "message": message, "context": CONTEXT, "wait": WAIT})],
        answer,
        [text("The agent notified the person.")],
    ]
    run, fake = await claude_on_the_host(deployment, script, config=config)
    assert run.stdout.decode().strip().endswith("The agent notified the person.")

    first = fake.main_requests[0]
    offered = {tool["name"] for tool in first["tools"]}
    assert {"mcp__oubliette__session_message", "mcp__oubliette__caller_tool_response",
            "mcp__oubliette__approval_response"} <= offered

    assert len(fake.main_requests) == 3, [len(tool_results(r)) for r in fake.main_requests]
    stopped, ended = results_seen(fake)
    assert not stopped.get("is_error") and not ended.get("is_error"), (stopped, ended)
    stop = json.loads(result_text(stopped))
    assert stop["stop_reason"] == "requires_action" and stop["session_id"] == session, stop
    [pending] = stop["pending"]
    assert pending["kind"] == "caller_tool" and pending["tool"] == "send_notification", pending
    assert pending["arguments"] == {"message": "tests pass"} and pending["expires_at"], pending

    end = json.loads(result_text(ended))
    assert end["stop_reason"] == "end_turn" and end["resolved"] is True and end["pending"] == [], end
    assert 'myapp_send_notification returned {"status": "sent", "to": "the person"}' in end["text"], end["text"]


GATED_CONTEXT = {"caller_id": "myapp", "caller_tools": [dict(NOTIFY_TOOL, requires_approval=True)]}


async def test_claude_code_on_the_host_approves_a_gated_tool_as_the_model(deployment: Deployment) -> None:
    """With the documented `-p` config (`--approval-delivery tool`) a gated caller tool stops the
    turn with `requires_approval`; the model approves with `approval_response` and `wait`, gets
    `requires_action`, answers, and gets `end_turn`."""
    session = "cc-gated"
    message = 'Please call myapp_send_notification {"message": "deploy?"}'

    def approve(request: dict[str, Any]) -> list[dict[str, Any]]:
        stop = last_result_json(request)
        assert stop.get("stop_reason") == "requires_approval", stop
        [pending] = stop["pending"]
        assert (pending["kind"], pending["tool"], pending["origin"]) == ("approval", "myapp_send_notification", "caller"), pending
        assert pending["arguments"] == {"message": "deploy?"}, pending
        return [tool_use("mcp__oubliette__approval_response", {
            "session_id": session, "request_id": pending["request_id"], "approve": True, "wait": WAIT})]

    def answer(request: dict[str, Any]) -> list[dict[str, Any]]:
        stop = last_result_json(request)
        assert stop.get("stop_reason") == "requires_action", stop
        [pending] = stop["pending"]
        return [tool_use("mcp__oubliette__caller_tool_response", {
            "session_id": session, "request_id": pending["request_id"], "result": {"status": "sent"}, "wait": WAIT})]

    script = [
        [tool_use("mcp__oubliette__session_message", {
            "instance": INSTANCE, "session_id": session, "message": message, "context": GATED_CONTEXT, "wait": WAIT})],
        approve, answer, [text("Approved and sent.")],
    ]
    run, fake = await claude_on_the_host(deployment, script)
    assert run.stdout.decode().strip() == "Approved and sent."
    end = json.loads(result_text(results_seen(fake)[-1]))
    assert end["stop_reason"] == "end_turn", end
    assert 'myapp_send_notification returned {"status": "sent"}' in end["text"], end["text"]


async def test_claude_code_p_turns_down_approval_forms(deployment: Deployment) -> None:
    """Why the `-p` config sets `--approval-delivery tool`: with the default (`auto`) the server
    puts the approval to Claude Code's person as an elicitation form, `-p` has nobody to show it
    to, and the gated tool is denied at once; the model only sees the agent's failure."""
    message = 'Please call myapp_send_notification {"message": "deploy?"}'
    script = [
        [tool_use("mcp__oubliette__session_message", {
            "instance": INSTANCE, "session_id": "cc-form", "message": message, "context": GATED_CONTEXT, "wait": WAIT})],
        [text("It was declined.")],
    ]
    run, fake = await claude_on_the_host(deployment, script, config="interactive")
    [seen] = results_seen(fake)
    end = json.loads(result_text(seen))
    assert end["stop_reason"] == "end_turn" and end["pending"] == [], end
    assert "'myapp_send_notification' was denied: declined by the user" in end["text"], end["text"]


# -- the sandbox: Claude Code as the agent --------------------------------------------------------


@asynccontextmanager
async def claude_agent(deployment: Deployment, fake: FakeAnthropic, *, permission_prompt: bool = False) -> AsyncIterator[Path]:
    """The guest runtime for INSTANCE running the doc's Claude Code line per message (with or
    without the permission prompt; `{mcp_config}` is the runtime's per-session config); yields
    the agent's working directory."""
    documented_env, command = documented_agent_command(permission_prompt=permission_prompt)
    assert "{mcp_config}" in command and "--strict-mcp-config" in command, command
    work = scratch(deployment, "work")
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_client", "run", "--relay", deployment.relay, "--instance", INSTANCE,
         "--token", deployment.token(INSTANCE), "--log-level", "WARNING", "--", *command],
        env=claude_env(fake.url, scratch(deployment, "home"), documented_env), cwd=work, stdin=subprocess.DEVNULL,
    )
    try:
        yield work
    finally:
        process.terminate()
        with trio.CancelScope(shield=True):
            await process.wait()


async def test_claude_code_as_the_agent_calls_a_host_toolset_and_a_caller_tool(deployment: Deployment) -> None:
    """Claude Code in the sandbox calls a host toolset tool and then the session's caller tool
    through oubliette-client; the caller answers the latter from the `requires_action` stop, and
    the model sees both results."""
    session = "cc-agent"
    script = [
        [tool_use("mcp__oubliette__ext_echo_external", {"message": "hello from the sandbox"})],
        [tool_use("mcp__oubliette__myapp_send_notification", {"message": "build is green"})],
        [text("Told the host: build is green.")],
    ]
    async with stand_in(script) as fake, claude_agent(deployment, fake), \
            deployment.caller("--config", str(toolset_config(deployment)), events=False) as (caller, _events):
        end = await notify_turn(caller, session)
    assert end["stop_reason"] == "end_turn", end
    assert end["text"].strip() == "Told the host: build is green."

    offered = {tool["name"] for tool in fake.main_requests[0]["tools"]}
    assert {"mcp__oubliette__ext_echo_external", "mcp__oubliette__myapp_send_notification",
            "mcp__oubliette__permission_prompt"} <= offered, sorted(offered)
    echoed, answered = results_seen(fake)
    assert not echoed.get("is_error") and not answered.get("is_error"), (echoed, answered)
    assert json.loads(result_text(echoed)) == {"echo": "hello from the sandbox"}
    assert json.loads(result_text(answered)) == {"status": "sent", "id": 7}


BASH = {"command": "touch ran-by-bash && echo approved-$((40 + 2))", "description": "Mark the run"}


async def permission_turn(deployment: Deployment, session: str, decision: dict[str, Any]) -> tuple[FakeAnthropic, Path, dict, dict]:
    """Claude Code (permission-prompt flags) is scripted to run Bash; the caller gets the
    `requires_approval` stop and answers with `decision` and `wait`. Returns the stand-in, the
    agent's working directory, the stop and the turn's end."""
    script = [
        [tool_use("Bash", BASH, id="toolu_bash_1")],
        [text("Finished.")],
    ]
    async with stand_in(script) as fake, claude_agent(deployment, fake, permission_prompt=True) as work, \
            deployment.caller(events=False) as (caller, _events):
        stop = await call(caller, "session_message", instance=INSTANCE, session_id=session,
                          message="Mark the run.", context=CONTEXT, wait=WAIT)
        assert stop["stop_reason"] == "requires_approval", stop
        [pending] = stop["pending"]
        assert not (work / "ran-by-bash").exists(), "Bash ran before the decision"
        end = await call(caller, "approval_response", session_id=session, request_id=pending["request_id"],
                         wait=WAIT, **decision)
    return fake, work, stop, end


def check_agent_request(stop: dict[str, Any]) -> None:
    """The approval request of Claude Code's Bash call, as the caller sees it (origin agent)."""
    [pending] = stop["pending"]
    assert pending["kind"] == "approval" and pending["tool"] == "Bash", pending
    assert pending["origin"] == "agent" and pending["arguments"] == BASH, pending


async def test_permission_prompt_approved_runs_the_agents_bash(deployment: Deployment) -> None:
    """Claude Code asks the caller through `mcp__oubliette__permission_prompt` before it runs
    Bash; approved, the command runs and the model sees its output."""
    fake, work, stop, end = await permission_turn(deployment, "cc-allow", {"approve": True})
    check_agent_request(stop)
    assert end["stop_reason"] == "end_turn" and end["text"].strip() == "Finished.", end
    assert (work / "ran-by-bash").exists()
    [seen] = results_seen(fake)
    assert seen["tool_use_id"] == "toolu_bash_1" and not seen.get("is_error"), seen
    assert "approved-42" in result_text(seen)


async def test_permission_prompt_denied_tells_the_model_why(deployment: Deployment) -> None:
    """Denied, Bash never runs and the model gets the caller's reason as the tool's error."""
    fake, work, stop, end = await permission_turn(
        deployment, "cc-deny", {"approve": False, "reason": "not on this machine"})
    check_agent_request(stop)
    assert end["stop_reason"] == "end_turn", end
    assert not (work / "ran-by-bash").exists()
    [seen] = results_seen(fake)
    assert seen["tool_use_id"] == "toolu_bash_1" and seen.get("is_error") is True, seen
    assert "'Bash' was denied: not on this machine" in result_text(seen)


async def test_permission_prompt_rewrite_runs_the_updated_input(deployment: Deployment) -> None:
    """Approved with `updated_arguments`, Claude Code runs the caller's rewrite (its
    `updatedInput`), not what the model asked for."""
    rewrite = {"command": "touch rewritten && echo rewritten-$((6 * 7))", "description": "Mark the run"}
    fake, work, stop, end = await permission_turn(
        deployment, "cc-rewrite", {"approve": True, "updated_arguments": rewrite})
    check_agent_request(stop)
    assert end["stop_reason"] == "end_turn", end
    assert (work / "rewritten").exists() and not (work / "ran-by-bash").exists()
    [seen] = results_seen(fake)
    assert not seen.get("is_error") and "rewritten-42" in result_text(seen), seen


PROMPT_INPUT = {"command": "rm -rf build", "description": "Remove the build output"}


async def test_permission_prompt_answers_are_claude_codes_json_byte_for_byte(deployment: Deployment) -> None:
    """The model calls `mcp__oubliette__permission_prompt` itself, with the arguments Claude Code
    passes it, so the tool's text reaches the stand-in untouched: compact JSON in Claude Code's
    contract, allow with the full input and deny with the reason."""
    session = "cc-bytes"

    def prompt(tool_use_id: str) -> list[dict[str, Any]]:
        return [tool_use("mcp__oubliette__permission_prompt",
                         {"tool_name": "Bash", "input": PROMPT_INPUT, "tool_use_id": tool_use_id})]

    script = [prompt("toolu_01AbC"), prompt("toolu_02XyZ"), [text("Both asked.")]]
    async with stand_in(script) as fake, claude_agent(deployment, fake), \
            deployment.caller(events=False) as (caller, _events):
        stop = await call(caller, "session_message", instance=INSTANCE, session_id=session,
                          message="Ask twice.", context=CONTEXT, wait=WAIT)
        assert stop["stop_reason"] == "requires_approval", stop
        [first] = stop["pending"]
        assert (first["tool"], first["arguments"], first["origin"]) == ("Bash", PROMPT_INPUT, "agent"), first
        stop = await call(caller, "approval_response", session_id=session, request_id=first["request_id"],
                          approve=True, wait=WAIT)
        assert stop["stop_reason"] == "requires_approval", stop
        [second] = stop["pending"]
        assert second["request_id"] != first["request_id"], stop
        end = await call(caller, "approval_response", session_id=session, request_id=second["request_id"],
                         approve=False, reason="keep the build output", wait=WAIT)
    assert end["stop_reason"] == "end_turn" and end["text"].strip() == "Both asked.", end
    allowed, denied = results_seen(fake)
    assert result_text(allowed) == (
        '{"behavior":"allow","updatedInput":{"command":"rm -rf build","description":"Remove the build output"}}')
    assert result_text(denied) == '{"behavior":"deny","message":"\'Bash\' was denied: keep the build output"}'
    assert not allowed.get("is_error") and not denied.get("is_error"), (allowed, denied)


# -- the setup ------------------------------------------------------------------------------------


def test_the_suite_command_installs_the_claude_code_these_tests_run() -> None:
    """README command 2 is .ci/run's command, it runs the install script, and the installed CLI
    is the version that script pins."""
    ci_line = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if "pytest" in line and not line.startswith("#"))
    assert ci_line in (ROOT / "README.md").read_text().splitlines()
    assert f"(bash {INSTALL})" in ci_line
    pinned = re.search(r"^VERSION=(\S+)$", (ROOT / INSTALL).read_text(), re.M)
    assert pinned is not None
    done = subprocess.run([claude_binary(), "--version"], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith(f"{pinned.group(1)} (Claude Code)"), done


def test_the_doc_lists_every_test_here() -> None:
    """docs/CLAUDE_CODE.md's "Tested with the real CLI" table names each Claude Code test."""
    names = re.findall(r"^async def (test_\w+)", Path(__file__).read_text(), re.M)
    doc = DOC.read_text()
    assert len(names) >= 8
    assert [name for name in names if f"`{name}`" not in doc] == []
