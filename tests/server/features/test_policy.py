"""The policy room (features/policy, docs/POLICY.md): Cedar policies decide every agent's tool call.

First the room alone (the rules, the gate, the `policy` command), then the real programs: a call
forbidden with its reason (the caller sees no request), one sent to approval, one permitted; an
observe-only server; reloads (SIGHUP, a file change, an invalid file) under load, no call dropped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import cedarpy
import pytest
import trio

from harness import PYTHON, Deployment, HttpServer, text_of
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from oubliette_server.core.metrics import ServerMetrics
from oubliette_server.core.sessions import Session
from oubliette_server.features.policy import DEFAULT_POLICIES, PolicyError, PolicyGate, PolicyRules, Ruling, ToolCall
from oubliette_server.program.policy_command import run_policy_command
from protocol import RelayError, errors

TMP_ONLY = """\
@id("rm-only-under-tmp")
@reason("myapp_rm deletes only under /tmp/")
forbid(principal, action == Oubliette::Action::"call_tool", resource == Oubliette::Tool::"myapp_rm")
unless { context.arguments has path && context.arguments.path like "/tmp/*" };

@id("send-needs-approval")
@requireApproval
permit(principal, action == Oubliette::Action::"call_tool", resource == Oubliette::Tool::"myapp_send");

@id("myapp-tools")
permit(principal, action == Oubliette::Action::"call_tool", resource in Oubliette::Caller::"myapp");
"""

LATE_WRITES = """\
@id("toolsets")
permit(principal, action == Oubliette::Action::"call_tool", resource);

@id("writes-after-hours")
@requireApproval
permit(principal, action == Oubliette::Action::"call_tool", resource)
when { context.kind == "toolset" && context.tool like "*write*" && (context.time.hour < 9 || context.time.hour >= 18) };
"""


def call(tool: str = "myapp_rm", arguments: dict[str, Any] | None = None, **facts: Any) -> ToolCall:
    kind = facts.pop("kind", "caller")
    return ToolCall(
        instance="box1", session="mcp:s1", tool=tool, kind=kind, owner=facts.pop("owner", "myapp"),
        arguments=arguments or {}, **facts,
    )


def at(hour: int) -> float:
    """A Monday of 2026 at `hour`, local time."""
    return datetime(2026, 11, 30, hour, 15).timestamp()


# -- the rules ---------------------------------------------------------------------------------


def test_the_default_policy_is_todays_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    """...and it decides without asking Cedar (its one permit applies to every call), named as the decision."""
    rules = PolicyRules.default()

    def not_asked(*args: Any) -> None:
        raise AssertionError("Cedar was asked")

    monkeypatch.setattr(cedarpy, "is_authorized", not_asked)
    assert rules.decide(call(), 0) == Ruling("permit", ("default-permit",))
    gated = rules.decide(call(requires_approval=True), 0)
    assert gated == Ruling("approval", ("default-permit",), approval_by=("requires_approval",))
    with pytest.raises(AssertionError, match="Cedar was asked"):  # a policy file is always Cedar's to decide
        PolicyRules.load(DEFAULT_POLICIES, "a file like the default").decide(call(), 0)


def test_a_forbid_gives_its_reason_and_a_permit_its_id() -> None:
    rules = PolicyRules.load(TMP_ONLY, "test")
    assert rules.decide(call(arguments={"path": "/etc/passwd"}), 0) == Ruling(
        "forbid", ("rm-only-under-tmp",), "myapp_rm deletes only under /tmp/")
    assert rules.decide(call(arguments={}), 0).effect == "forbid", "a missing argument is no way around a forbid"
    assert rules.decide(call(arguments={"path": "/tmp/x"}), 0) == Ruling("permit", ("myapp-tools",))


def test_require_approval_on_a_permit_and_the_tools_own_flag_both_gate() -> None:
    rules = PolicyRules.load(TMP_ONLY, "test")
    send = rules.decide(call("myapp_send"), 0)
    assert send.effect == "approval" and send.approval_by == ("send-needs-approval",)
    flagged = rules.decide(call("myapp_other", requires_approval=True), 0)
    assert flagged.effect == "approval" and flagged.approval_by == ("requires_approval",), (
        "a deployment's policy never drops the approval a tool's owner asked for")


def test_nothing_permitted_is_forbidden_and_says_so() -> None:
    rules = PolicyRules.load(TMP_ONLY, "test")
    ruling = rules.decide(call("fs.read", kind="toolset", owner="fs"), 0)
    assert ruling == Ruling("forbid", (), "no policy permits 'fs.read'")


def test_a_forbid_that_cannot_be_evaluated_forbids() -> None:
    """An argument of another type makes Cedar skip the policy; a forbid skipped so would let the call run."""
    rules = PolicyRules.load(TMP_ONLY, "test")
    ruling = rules.decide(call(arguments={"path": 7}), 0)
    assert ruling.effect == "forbid" and ruling.policies == ("rm-only-under-tmp",)
    assert "could not be evaluated" in ruling.reason


def test_business_hours_come_from_the_calls_time() -> None:
    rules = PolicyRules.load(LATE_WRITES, "test")
    write = call("fs.write_file", kind="toolset", owner="fs")
    assert rules.decide(write, at(10)).effect == "permit"
    late = rules.decide(write, at(21))
    assert late.effect == "approval" and late.approval_by == ("writes-after-hours",)
    assert rules.decide(call("fs.read_file", kind="toolset", owner="fs"), at(21)).effect == "permit"


@pytest.mark.parametrize(("text", "problem"), [
    ('permit(principal, action, resource) when { context.nope };', "attribute `nope`"),
    ('permit(principal, action, resource) when { context.arguments.path like "/tmp/*" };', "arguments.path"),
    ('@requireApproval forbid(principal, action, resource);', "belongs on a permit"),
    ('permit(principal, action, resource', "unexpected end of input"),
    ('permit(principal, action, resource == Oubliette::Nope::"x");', "Nope"),
])
def test_an_invalid_set_is_refused_with_why(text: str, problem: str) -> None:
    with pytest.raises(PolicyError, match="policies.cedar") as refused:
        PolicyRules.load(text, "policies.cedar")
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_an_unreadable_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy file"):
        PolicyRules.from_files([tmp_path / "missing.cedar"])


def counting_cedar(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The requests Cedar is asked from now on (it still decides them)."""
    asked: list[dict[str, Any]] = []
    real = cedarpy.is_authorized

    def counted(request: dict[str, Any], *args: Any) -> Any:
        asked.append(request)
        return real(request, *args)

    monkeypatch.setattr(cedarpy, "is_authorized", counted)
    return asked


def test_a_tool_whose_policies_read_no_arguments_is_decided_by_cedar_once_per_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forbid on `myapp_rm`'s arguments cannot apply to `myapp_send`: its rulings are kept."""
    rules = PolicyRules.load(TMP_ONLY, "test")
    asked = counting_cedar(monkeypatch)
    for text in ("a", "b", "c"):
        assert rules.decide(call("myapp_send", {"text": text}), 0).approval_by == ("send-needs-approval",)
    assert rules.decide(call("myapp_list"), 0) == Ruling("permit", ("myapp-tools",))
    assert rules.decide(attrs.evolve(call("myapp_list"), session="mcp:s2"), 0) == Ruling("permit", ("myapp-tools",))
    assert len(asked) == 3, "one decision per tool and session"
    flagged = rules.decide(call("myapp_list", requires_approval=True), 0)
    assert flagged.approval_by == ("requires_approval",), "the tool's own flag is part of the key"
    reloaded = PolicyRules.load(TMP_ONLY.replace('resource == Oubliette::Tool::"myapp_send"', "resource"), "test")
    assert reloaded.decide(call("myapp_list"), 0).approval_by == ("send-needs-approval",), "a new set decides anew"


def test_a_tool_whose_policies_read_its_arguments_or_the_time_is_decided_by_them(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = PolicyRules.load(TMP_ONLY, "test")
    asked = counting_cedar(monkeypatch)
    for path, effect in (("/etc/passwd", "forbid"), ("/tmp/x", "permit"), ("/etc/passwd", "forbid"), ("/tmp/x", "permit")):
        assert rules.decide(call(arguments={"path": path}), 0).effect == effect
    assert len(asked) == 4, "a policy that reads the arguments makes every call Cedar's"
    late = PolicyRules.load(LATE_WRITES, "test")
    write = call("fs.write_file", kind="toolset", owner="fs")
    assert [late.decide(write, at(hour)).effect for hour in (10, 21, 10, 21, 22)] == [
        "permit", "approval", "permit", "approval", "approval"]
    assert len(asked) == 4 + 3, "kept by the hour the policies read"
    whole = PolicyRules.load(DEFAULT_POLICIES + 'forbid(principal, action, resource) unless { context == context };', "test")
    whole.decide(call(), 0), whole.decide(call(), 0)
    assert len(asked) == 4 + 3 + 2, "a policy that reads the context whole makes every call Cedar's"


# -- the gate ----------------------------------------------------------------------------------


class Recorded:
    def __init__(self) -> None:
        self.frames: list[tuple[str, dict[str, Any]]] = []
        self.decided: list[tuple[str, bool]] = []

    async def record(self, session: Session, type: str, payload: dict[str, Any]) -> None:
        self.frames.append((type, payload))

    def on_decided(self, effect: str, enforced: bool) -> None:
        self.decided.append((effect, enforced))


SESSION = Session("box1", "mcp", "s1")


async def test_the_gate_stores_counts_and_refuses_a_forbidden_call() -> None:
    seen = Recorded()
    gate = PolicyGate(PolicyRules.load(TMP_ONLY, "test"), record=seen.record, on_decided=seen.on_decided)
    with pytest.raises(RelayError) as refused:
        await gate.check(call(arguments={"path": "/etc"}), SESSION)
    assert refused.value.code == errors.DENIED
    assert refused.value.message == "forbidden by policy: myapp_rm deletes only under /tmp/"
    assert (await gate.check(call("myapp_send"), SESSION)).effect == "approval"
    assert seen.frames == [
        ("policy_decision", {"tool": "myapp_rm", "kind": "caller", "owner": "myapp", "effect": "forbid",
                             "policies": ["rm-only-under-tmp"], "reason": "myapp_rm deletes only under /tmp/"}),
        ("policy_decision", {"tool": "myapp_send", "kind": "caller", "owner": "myapp", "effect": "approval",
                             "policies": ["send-needs-approval", "myapp-tools"], "approval_by": ["send-needs-approval"]}),
    ]
    assert seen.decided == [("forbid", True), ("approval", True)]


async def test_a_decision_the_calls_request_frame_carries_is_no_frame_of_its_own() -> None:
    seen = Recorded()
    gate = PolicyGate(PolicyRules.load(TMP_ONLY, "test"), record=seen.record, on_decided=seen.on_decided)
    carried = frozenset({"permit", "approval"})
    permitted = await gate.check(call(arguments={"path": "/tmp/x"}), SESSION, carried)
    gated = await gate.check(call("myapp_send"), SESSION, carried)
    with pytest.raises(RelayError):
        await gate.check(call(arguments={"path": "/etc"}), SESSION, carried)
    assert permitted.to_carry == {"effect": "permit", "policies": ["myapp-tools"]}
    assert gated.to_carry == {"effect": "approval", "policies": ["send-needs-approval", "myapp-tools"],
                              "approval_by": ["send-needs-approval"]}
    assert [payload["effect"] for _, payload in seen.frames] == ["forbid"], "a forbid is always a frame of its own"
    assert seen.decided == [("permit", True), ("approval", True), ("forbid", True)]
    assert (await gate.check(call(arguments={"path": "/tmp/x"}), SESSION)).to_carry is None, "stored: nothing to carry"


async def test_observe_only_lets_a_forbidden_call_run_as_its_tool_asks(caplog: pytest.LogCaptureFixture) -> None:
    seen = Recorded()
    gate = PolicyGate(PolicyRules.load(TMP_ONLY, "test"), observe_only=True, record=seen.record, on_decided=seen.on_decided)
    with caplog.at_level(logging.WARNING, "oubliette.server.policy"):
        assert (await gate.check(call(arguments={"path": "/etc"}), SESSION)).effect == "permit"
        gated = await gate.check(call(arguments={"path": "/etc"}, requires_approval=True), SESSION,
                                 frozenset({"permit", "approval"}))
    assert gated.effect == "approval" and gated.to_carry is None, "the forbid stored is the decision: none carried"
    assert [payload.get("observe_only") for _, payload in seen.frames] == [True, True]
    assert seen.decided == [("forbid", False), ("forbid", False)]
    assert ["observe only: policy would forbid myapp_rm" in r.getMessage() for r in caplog.records] == [True, True]


async def test_a_reload_swaps_the_set_and_an_invalid_one_keeps_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    policy = tmp_path / "policies.cedar"
    policy.write_text(TMP_ONLY)
    gate = PolicyGate(PolicyRules.from_files([policy]), files=[policy])
    policy.write_text('@id("all") permit(principal, action, resource);')
    assert gate.reload() and gate.rules.decide(call(arguments={"path": "/etc"}), 0).policies == ("all",)
    policy.write_text("permit(principal, action, resource) when { context.nope };")
    with caplog.at_level(logging.ERROR, "oubliette.server.policy"):
        assert not gate.reload()
    assert gate.rules.decide(call(arguments={"path": "/etc"}), 0).policies == ("all",)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("policy reload refused, the previous policy set stays: ") and "nope" in line


async def test_the_gate_reloads_when_a_file_changes(tmp_path: Path) -> None:
    policy = tmp_path / "policies.cedar"
    policy.write_text(TMP_ONLY)
    gate = PolicyGate(PolicyRules.from_files([policy]), files=[policy])
    async with trio.open_nursery() as nursery:
        await nursery.start(gate.watch)
        reloaded = gate.reloaded
        replacement = tmp_path / "new.cedar"  # an editor's write, then rename
        replacement.write_text('@id("all") permit(principal, action, resource);')
        replacement.rename(policy)
        with trio.fail_after(10):
            await reloaded.wait()
        assert gate.rules.decide(call(arguments={"path": "/etc"}), 0).policies == ("all",)
        nursery.cancel_scope.cancel()


def test_decisions_are_counted_by_effect_from_zero() -> None:
    metrics = ServerMetrics()
    metrics.policy_decided("forbid", False)
    metrics.policy_decided("permit", True)
    page = metrics.page().decode()
    assert 'oubliette_policy_decisions_total{effect="forbid",enforced="false"} 1.0' in page
    assert 'oubliette_policy_decisions_total{effect="permit",enforced="true"} 1.0' in page
    assert 'oubliette_policy_decisions_total{effect="forbid",enforced="true"} 0.0' in page


def test_the_config_files_policy_keys(tmp_path: Path) -> None:
    from oubliette_server.program.config import ServerConfig, load_config_file

    config = tmp_path / "etc" / "oubliette.toml"
    config.parent.mkdir()
    config.write_text('[server]\npolicy_files = ["policies.cedar", "/srv/more.cedar"]\npolicy_observe_only = true\n')
    settings = ServerConfig(**load_config_file(config))
    assert settings.policy_files == [tmp_path / "etc" / "policies.cedar", Path("/srv/more.cedar")], "relative to the file"
    assert settings.policy_observe_only is True
    config.write_text('[server]\npolicy_observe_only = "yes"\n')
    with pytest.raises(ValueError, match="policy_observe_only must be true or false"):
        load_config_file(config)


# -- the command -------------------------------------------------------------------------------


def test_policy_check_and_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policies.cedar"
    policy.write_text(TMP_ONLY)
    assert run_policy_command(["check", str(policy)]) == 0
    assert capsys.readouterr().out == f"ok: 3 policies in {policy} are valid\n"
    assert run_policy_command(["test", str(policy), "--tool", "myapp_rm", "--caller", "myapp",
                               "--arguments", '{"path": "/etc/passwd"}']) == 0
    assert capsys.readouterr().out == (
        "decision: forbid\npolicies: rm-only-under-tmp\nreason: myapp_rm deletes only under /tmp/\n")
    assert run_policy_command(["test", "--tool", "fs.write_file", "--toolset", "fs", "--requires-approval"]) == 0
    assert capsys.readouterr().out == "decision: approval\npolicies: default-permit\napproval asked by: requires_approval\n"
    policy.write_text("permit(principal, action, resource) when { context.nope };")
    assert run_policy_command(["check", str(policy)]) == 1
    assert "invalid" in capsys.readouterr().out


# -- end to end, the real programs -------------------------------------------------------------

RM = {"name": "rm", "description": "Delete a file", "inputSchema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
SEND = {"name": "send", "description": "Send a message", "inputSchema": {
    "type": "object", "properties": {"text": {"type": "string"}}}}


def decisions(deployment: Deployment) -> list[dict[str, Any]]:
    """Every decision in the server's log, oldest first: a `policy_decision` frame's payload, or the
    decision a request frame carries (`policy`), with that frame's type as `carried_by`."""
    with sqlite3.connect(f"file:{deployment.data_dir / 'frames.sqlite3'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT type, payload FROM frames WHERE type IN ('policy_decision', 'caller_tool_request', 'approval_request') "
            "ORDER BY seq").fetchall()
    found = []
    for type, text in rows:
        payload = json.loads(text)
        if type == "policy_decision":
            found.append(payload)
        elif "policy" in payload:
            found.append({"tool": payload.get("tool_name") or payload["tool"], **payload["policy"], "carried_by": type})
    return found


async def declare(caller: Any, tools: list[dict[str, Any]], session_id: str = "s1") -> None:
    result = await caller.call_tool("session_message", {
        "instance": "box1", "session_id": session_id, "message": "hi",
        "context": {"caller_id": "myapp", "caller_tools": tools},
    })
    assert not result.is_error, text_of(result)


class Responder:
    """The caller: answers each `caller_tool_request` with its arguments, once."""

    def __init__(self, caller: Any, events: Any) -> None:
        self.caller = caller
        self.events = events
        self.answered: set[str] = set()

    async def run(self) -> None:
        while True:
            request = await self.events.wait_for(
                lambda e: e.get("type") == "caller_tool_request" and e["request_id"] not in self.answered, timeout=600)
            self.answered.add(request["request_id"])
            reply = await self.caller.call_tool("caller_tool_response", {
                "session_id": request["session_id"], "request_id": request["request_id"], "result": request["arguments"],
            })
            assert not reply.is_error, text_of(reply)


async def test_forbidden_with_its_reason_permitted_and_sent_to_approval(deployment: Deployment) -> None:
    policy = deployment.root / "policies.cedar"
    policy.write_text(TMP_ONLY)
    async with deployment.caller("--policy", str(policy)) as (caller, events):
        await declare(caller, [RM, SEND])
        async with deployment.agent("box1", "mcp:s1") as agent:
            with trio.fail_after(30):
                forbidden = await agent.call_tool("myapp_rm", {"path": "/etc/passwd"})
            assert forbidden.is_error
            assert text_of(forbidden) == "myapp_rm: forbidden by policy: myapp_rm deletes only under /tmp/"
            assert events.of_type("caller_tool_request") == [] and events.of_type("approval_request") == []

            async with trio.open_nursery() as nursery:
                results: dict[str, Any] = {}

                async def agent_call(tool: str, arguments: dict[str, Any]) -> None:
                    results[tool] = await agent.call_tool(tool, arguments)

                nursery.start_soon(agent_call, "myapp_rm", {"path": "/tmp/x"})
                permitted = await events.wait_type("caller_tool_request", tool="rm")
                await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": permitted["request_id"], "result": {"deleted": "/tmp/x"}})

                nursery.start_soon(agent_call, "myapp_send", {"text": "hello"})
                approval = await events.wait_type("approval_request")
                assert approval["tool_name"] == "myapp_send"
                assert [e["tool"] for e in events.of_type("caller_tool_request")] == ["rm"], "nothing runs before approval"
                await caller.call_tool("approval_response", {
                    "session_id": "s1", "request_id": approval["request_id"], "approve": True})
                sent = await events.wait_type("caller_tool_request", tool="send")
                await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": sent["request_id"], "result": {"sent": True}})
    assert results["myapp_rm"].structured_content == {"deleted": "/tmp/x"}
    assert results["myapp_send"].structured_content == {"sent": True}
    assert [(d["tool"], d["effect"], d["policies"], d.get("carried_by")) for d in decisions(deployment)] == [
        ("myapp_rm", "forbid", ["rm-only-under-tmp"], None),
        ("rm", "permit", ["myapp-tools"], "caller_tool_request"),
        ("myapp_send", "approval", ["send-needs-approval", "myapp-tools"], "approval_request"),
    ], "one record of each decision: a forbid's frame of its own, the others in the call's first request frame"
    assert [e.get("policy") for e in events.of_type("caller_tool_request")] == [
        {"effect": "permit", "policies": ["myapp-tools"]}, None], "the approved call's decision is its approval_request's"


async def test_observe_only_runs_the_forbidden_call_and_logs_it(deployment: Deployment) -> None:
    policy = deployment.root / "policies.cedar"
    policy.write_text(TMP_ONLY)
    async with deployment.http_server("--policy", str(policy), "--policy-observe-only") as server, \
            server.caller() as (caller, events):
        await declare(caller, [RM])
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}

            async def agent_call() -> None:
                outcome["result"] = await agent.call_tool("myapp_rm", {"path": "/etc/passwd"})

            nursery.start_soon(agent_call)
            request = await events.wait_type("caller_tool_request", tool="rm")
            await caller.call_tool("caller_tool_response", {
                "session_id": "s1", "request_id": request["request_id"], "result": {"deleted": "/etc/passwd"}})
        assert not outcome["result"].is_error, text_of(outcome["result"])
        [line] = await server.wait_stderr("observe only: policy would forbid myapp_rm")
        assert "myapp_rm deletes only under /tmp/" in line
    [decided] = decisions(deployment)
    assert decided["effect"] == "forbid" and decided["observe_only"] is True


async def reload_and_wait(server: HttpServer, reloads: int, how: str, policy: Path, text: str) -> None:
    """Write `text` to the policy file, then SIGHUP (or let the file watch see it); wait for the
    server's log to say it reloaded (`reloads` such lines in all)."""
    if how == "rename":
        (policy.parent / "next.cedar").write_text(text)
        (policy.parent / "next.cedar").rename(policy)
    else:
        policy.write_text(text)
        server.process.send_signal(signal.SIGHUP)
    await server.wait_stderr("policy reloaded", count=reloads, timeout=30)


async def test_reloads_under_load_drop_no_call_and_an_invalid_file_keeps_the_set(deployment: Deployment) -> None:
    policy = deployment.root / "policies.cedar"
    permit_a = '@id("a") permit(principal, action, resource);'
    permit_b = '@id("b") permit(principal, action, resource);'
    policy.write_text(permit_a)
    calls = 60
    async with deployment.http_server("--policy", str(policy), "--log-level", "INFO") as server, \
            server.caller() as (caller, events):
        responder = Responder(caller, events)
        await declare(caller, [SEND])
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            nursery.start_soon(responder.run)
            results: list[Any] = []
            half = trio.Event()

            async def agent_calls(worker: int) -> None:
                for n in range(calls // 4):
                    results.append(await agent.call_tool("myapp_send", {"text": f"{worker}-{n}"}))
                    if len(results) == calls // 2:
                        half.set()

            async with trio.open_nursery() as agents:
                for worker in range(4):
                    agents.start_soon(agent_calls, worker)
                await reload_and_wait(server, 1, "sighup", policy, permit_b)
                await reload_and_wait(server, 2, "rename", policy, permit_a)
                await half.wait()
                await reload_and_wait(server, 3, "sighup", policy, permit_b)
            nursery.cancel_scope.cancel()
        assert len(results) == calls
        assert [text_of(r) for r in results if r.is_error] == []
        assert sorted(r.structured_content["text"] for r in results) == sorted(
            f"{w}-{n}" for w in range(4) for n in range(calls // 4))
        # Invalid: one line says why, and the set in force stays.
        policy.write_text('@id("c") permit(principal, action, resource) when { context.nope };')
        server.process.send_signal(signal.SIGHUP)
        [refused] = await server.wait_stderr("policy reload refused, the previous policy set stays")
        assert "nope" in refused
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            nursery.start_soon(responder.run)
            last = await agent.call_tool("myapp_send", {"text": "after"})
            nursery.cancel_scope.cancel()
        assert not last.is_error, text_of(last)
    used = [d["policies"] for d in decisions(deployment)]
    assert len(used) == calls + 1 and used[-1] == ["b"]
    assert {"a", "b"} == {p for ps in used for p in ps}, "calls were decided by both sets while they were swapped"


ECHO_ONLY_HELLO = """\
@id("no-secrets-to-echo")
@reason("echo may not repeat secrets")
forbid(principal, action == Oubliette::Action::"call_tool", resource in Oubliette::Toolset::"echo")
when { context.arguments has message && context.arguments.message like "*secret*" };

@id("toolsets")
permit(principal, action == Oubliette::Action::"call_tool", resource in Oubliette::Toolset::"echo");
"""


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "SDK path"])
async def test_a_toolset_call_is_decided_on_both_paths_of_the_client(deployment: Deployment, fast: bool) -> None:
    """The client's fast path and the SDK's both reach the server as a `toolset_call`: decided there."""
    policy = deployment.root / "policies.cedar"
    policy.write_text(ECHO_ONLY_HELLO)
    echo = Path(__file__).resolve().parents[3] / "examples" / "mcp_echo.py"
    config = deployment.root / "oubliette.toml"
    config.write_text(
        f'[toolsets.echo]\nkind = "command"\nprefix = "ext"\ncommand = [{json.dumps(PYTHON)}, {json.dumps(str(echo))}]\n'
        '[allowlists]\nbox1 = ["echo"]\n'
    )
    agent = StdioServerParameters(command=PYTHON, args=["-m", "oubliette_client"], env={
        **os.environ, **deployment.client_env("box1", "mcp:s1"), "OUBLIETTE_FAST_PATH": "1" if fast else "0"})
    async with deployment.caller("--config", str(config), "--policy", str(policy)) as (caller, events):
        await declare(caller, [SEND])
        async with Client(agent, mode="legacy") as client:
            with trio.fail_after(30):
                forbidden = await client.call_tool("ext.echo_external", {"message": "the secret is 42"})
                permitted = await client.call_tool("ext.echo_external", {"message": "hello"})
    assert forbidden.is_error and text_of(forbidden) == "ext.echo_external: forbidden by policy: echo may not repeat secrets"
    assert not permitted.is_error and "hello" in text_of(permitted)
    assert [(d["tool"], d["kind"], d["owner"], d["effect"]) for d in decisions(deployment)] == [
        ("ext.echo_external", "toolset", "echo", "forbid"), ("ext.echo_external", "toolset", "echo", "permit")]


# -- HTTP principals: which instances each may message, answer and read ---------------------------

TEAMS = """\
@id("team-a-own-instances")
permit(principal == Oubliette::Principal::"team-a",
       action in [Oubliette::Action::"message", Oubliette::Action::"answer", Oubliette::Action::"read"], resource)
when { context.instance like "a-*" };

@id("team-b-own-instances")
permit(principal == Oubliette::Principal::"team-b",
       action in [Oubliette::Action::"message", Oubliette::Action::"answer", Oubliette::Action::"read"], resource)
when { context.instance like "b-*" };

@id("team-a-reads-metrics")
permit(principal == Oubliette::Principal::"team-a", action == Oubliette::Action::"operate",
       resource == Oubliette::Endpoint::"metrics");

@id("b-2-answered-by-its-operator")
@reason("b-2's requests are answered by its operator")
forbid(principal == Oubliette::Principal::"team-b", action == Oubliette::Action::"answer", resource)
when { context.instance == "b-2" };

@id("tools")
permit(principal, action == Oubliette::Action::"call_tool", resource);
"""


def test_the_admin_may_do_everything_and_a_named_principal_nothing_by_default() -> None:
    rules = PolicyRules.default()
    for action, resource in [("message", "a-1"), ("answer", "a-1"), ("read", "b-1"), ("operate", "metrics")]:
        assert rules.permits("admin", action, resource) is None
        assert rules.permits("team-a", action, resource) == "no policy permits it"


def test_a_principal_may_what_the_policies_permit_and_a_forbid_binds_the_admin() -> None:
    rules = PolicyRules.load(TEAMS + """
@id("admin-keeps-out-of-b") @reason("b- instances are team-b's alone")
forbid(principal == Oubliette::Principal::"admin", action in [Oubliette::Action::"read"], resource)
when { context.instance like "b-*" };
""", "teams")
    assert rules.permits("team-a", "message", "a-1") is None and rules.permits("team-a", "read", "a-7") is None
    assert rules.permits("team-a", "message", "b-1") == "no policy permits it"
    assert rules.permits("team-b", "answer", "a-1") == "no policy permits it"
    assert rules.permits("team-a", "operate", "metrics") is None and rules.permits("team-a", "operate", "health") is not None
    assert rules.permits("admin", "read", "b-1") == "b- instances are team-b's alone"
    assert rules.permits("admin", "message", "b-1") is None
    assert len(rules) == 6, "the admin's permit is the server's, not counted among the file's policies"


def test_the_gate_refuses_a_principal_with_who_what_which_and_what_to_do() -> None:
    gate = PolicyGate(PolicyRules.load(TEAMS, "teams"))
    gate.require("team-a", "message", "a-1")
    with pytest.raises(RelayError) as refused:
        gate.require("team-b", "read", "a-1")
    assert refused.value.code == errors.DENIED
    assert refused.value.message.startswith(
        "principal 'team-b' may not read instance 'a-1': no policy permits it; a policy that permits it")


def test_a_reload_decides_principals_with_the_new_set(tmp_path: Path) -> None:
    """Decisions are kept for the life of a set: a reload's set decides afresh."""
    policy = tmp_path / "teams.cedar"
    policy.write_text(TEAMS)
    gate = PolicyGate(PolicyRules.from_files([policy]), files=[policy])
    gate.require("team-a", "read", "a-1")
    policy.write_text('@id("tools") permit(principal, action == Oubliette::Action::"call_tool", resource);')
    assert gate.reload()
    with pytest.raises(RelayError, match="principal 'team-a' may not read instance 'a-1'"):
        gate.require("team-a", "read", "a-1")
    gate.require("admin", "read", "a-1")


def test_policy_test_decides_a_principals_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "teams.cedar"
    policy.write_text(TEAMS)
    assert run_policy_command(["test", str(policy), "--principal", "team-a", "--action", "message", "--instance", "a-1"]) == 0
    assert capsys.readouterr().out == "decision: permit\n"
    assert run_policy_command(["test", str(policy), "--principal", "team-a", "--action", "answer", "--instance", "b-1"]) == 0
    assert capsys.readouterr().out == "decision: forbid\nreason: no policy permits it\n"
    assert run_policy_command(["test", "--principal", "admin", "--action", "operate", "--endpoint", "health"]) == 0
    assert capsys.readouterr().out == "decision: permit\n"


def test_the_config_files_principal_keys(tmp_path: Path) -> None:
    from oubliette_server.core.auth import HttpPrincipals, TokenAuthority
    from oubliette_server.program.config import ServerConfig, load_config_file

    config = tmp_path / "etc" / "oubliette.toml"
    config.parent.mkdir()
    (config.parent / "team-b.token").write_text("b" * 40 + "\n")
    config.write_text('[server]\nhttp_principals = ["team-a"]\n'
                      '[server.http_principal_token_files]\nteam-b = "team-b.token"\n')
    settings = ServerConfig(**load_config_file(config))
    assert settings.http_principal_token_files == {"team-b": tmp_path / "etc" / "team-b.token"}, "relative to the file"
    authority = TokenAuthority(b"s" * 32)
    principals = HttpPrincipals(authority, settings.http_principals, settings.http_principal_token_files)
    assert principals.principal_of(authority.token_for("http:team-a")) == "team-a"
    assert principals.principal_of("b" * 40) == "team-b"
    assert principals.principal_of(authority.token_for("http:admin")) == "admin"
    assert principals.principal_of(authority.token_for("http:team-c")) is None, "only configured names"
    assert principals.principal_of(authority.token_for("a-1")) is None, "an instance's token is no principal's"
    with pytest.raises(ValueError, match="'admin' is the HTTP admin token's principal"):
        HttpPrincipals(authority, ["admin"], {})


def test_http_principals_derive_their_tokens_once_per_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every HTTP request's token is checked against `admin`'s and the named principals' tokens:
    they are derived once (an HMAC each), not at each check, and again when the authority adopts
    another secret (a shared store's), after which the old ones name nobody."""
    from oubliette_server.core.auth import HttpPrincipals, TokenAuthority

    authority = TokenAuthority(b"s" * 32)
    principals = HttpPrincipals(authority, ["team-a"], {})
    derive = authority.token_for
    derived: list[str] = []
    monkeypatch.setattr(authority, "token_for", lambda key: derived.append(key) or derive(key))
    old_admin = derive("http:admin")
    for _ in range(5):
        assert principals.principal_of(old_admin) == "admin"
    assert derived == ["http:admin", "http:team-a"]
    authority.use_secret(b"t" * 32)
    assert principals.principal_of(old_admin) is None
    assert principals.principal_of(derive("http:team-a")) == "team-a"
    assert len(derived) == 4


async def test_two_principals_reach_only_their_own_instances_at_every_door(deployment: Deployment) -> None:
    policy = deployment.root / "teams.cedar"
    policy.write_text(TEAMS)
    token_a, token_b = deployment.http_token("team-a"), deployment.http_token("team-b")
    async with deployment.http_server(
        "--policy", str(policy), "--http-principal", "team-a", "--http-principal", "team-b",
    ) as server, server.caller(token=token_a) as (team_a, _), \
            server.caller(token=token_b, mode="2026-07-28", events=False) as (team_b, _):
        # Each reaches its own instances, on /mcp of either era.
        for caller, instance in [(team_a, "a-1"), (team_b, "b-1")]:
            sent = await caller.call_tool("session_message", {"instance": instance, "session_id": "s1", "message": "hi"})
            assert not sent.is_error, text_of(sent)
        own_key = sent.structured_content["owner_key"]
        read = await team_a.call_tool("session_events", {"instance": "a-1", "session_id": "s1"})
        assert not read.is_error, text_of(read)

        # Neither reaches the other's: every tool refuses with who, what, which and what to do.
        refusals = [
            (team_a, "session_message", {"instance": "b-1", "session_id": "s1", "message": "hi"}, "team-a", "message", "b-1"),
            (team_a, "tether_send", {"instance": "b-1", "text": "hi"}, "team-a", "message", "b-1"),
            (team_a, "tether_read", {"instance": "b-1"}, "team-a", "read", "b-1"),
            (team_a, "session_events", {"instance": "b-1", "session_id": "t", "channel": "tether"}, "team-a", "read", "b-1"),
            (team_b, "session_message", {"instance": "a-1", "session_id": "s1", "message": "hi", "owner_key": own_key},
             "team-b", "message", "a-1"),
            (team_b, "tether_read", {"instance": "a-1", "owner_key": own_key}, "team-b", "read", "a-1"),
            (team_b, "session_events", {"instance": "a-1", "session_id": "s1", "owner_key": own_key}, "team-b", "read", "a-1"),
        ]
        for caller, tool, arguments, principal, action, instance in refusals:
            refused = await caller.call_tool(tool, arguments)
            assert refused.is_error, (tool, arguments)
            assert text_of(refused).startswith(
                f"{tool}: principal '{principal}' may not {action} instance '{instance}': no policy permits it; "
                "a policy that permits it"), text_of(refused)
        # A forbid with its reason: team-b messages b-2, but its requests are not team-b's to answer.
        sent = await team_b.call_tool("session_message", {
            "instance": "b-2", "session_id": "s2", "message": "hi", "owner_key": own_key})
        assert not sent.is_error, text_of(sent)
        for tool, arguments in [("caller_tool_response", {"request_id": "r1", "result": 1}),
                                ("approval_response", {"request_id": "r1", "approve": True, "instance": "b-2"})]:
            refused = await team_b.call_tool(tool, {"session_id": "s2", "owner_key": own_key, **arguments})
            assert text_of(refused).startswith(
                f"{tool}: principal 'team-b' may not answer instance 'b-2': b-2's requests are answered by its operator;"
            ), text_of(refused)

        # The tether REST API and the answer routes: 403 with the reason.
        async with server.rest(token_b) as rest_b, server.rest(token_a) as rest_a, server.rest() as admin:
            doors = [
                ("GET", "/v1/instances/a-1/tether/poll", None, "read"),
                ("GET", "/v1/instances/a-1/tether/stream", None, "read"),
                ("POST", "/v1/instances/a-1/tether", {"type": "user.message", "payload": {"text": "hi"}}, "message"),
                ("POST", "/v1/instances/a-1/sessions/s1/approvals", {"request_id": "x", "approve": True}, "answer"),
                ("POST", "/v1/instances/a-1/sessions/s1/caller_tool_response", {"request_id": "x", "result": 1}, "answer"),
            ]
            for method, path, body, action in doors:
                answer = await rest_b.request(method, path, json=body)
                assert answer.status_code == 403, (path, answer.text)
                assert answer.json()["error"]["message"].startswith(
                    f"principal 'team-b' may not {action} instance 'a-1': no policy permits it"), answer.text
            polled = await rest_a.get("/v1/instances/a-1/tether/poll")
            assert polled.status_code == 200 and polled.json()["frames"], polled.text
            answered = await rest_a.post("/v1/instances/a-1/sessions/s1/caller_tool_response",
                                         json={"request_id": "r1", "result": 1})
            assert answered.status_code == 404 and "unknown request_id 'r1'" in answered.text, answered.text
            # b-2's operator answers for team-b, which may not answer there itself: the door asks for its own principal.
            for route, body in [("caller_tool_response", {"request_id": "r1", "result": 1}),
                                ("caller_tool_progress", {"request_id": "r1", "progress": 1}),
                                ("approvals", {"request_id": "r1", "approve": True})]:
                answered = await admin.post(f"/v1/instances/b-2/sessions/s2/{route}", json=body)
                assert answered.status_code == 404 and "'r1'" in answered.text, (route, answered.text)

            # The operator endpoints: the admin uses them, team-a /metrics only, team-b neither.
            assert (await admin.get("/metrics")).status_code == 200
            assert (await admin.get("/v1/health")).status_code == 200
            assert (await rest_a.get("/metrics")).status_code == 200
            for rest, path, principal, endpoint in [(rest_b, "/metrics", "team-b", "metrics"),
                                                    (rest_a, "/v1/health", "team-a", "health")]:
                answer = await rest.get(path)
                assert answer.status_code == 403, answer.text
                assert answer.json()["error"]["message"].startswith(
                    f"principal '{principal}' may not operate the {endpoint} endpoint: no policy permits it")
        async with server.rest(deployment.http_token("team-c")) as stranger:
            unknown = await stranger.get("/metrics")
            assert unknown.status_code == 401, "a principal the server was not given has no token"

        # A handshake-era MCP session is its opener's: team-b's token with team-a's Mcp-Session-Id is refused.
        async with server.rest(token_a) as rest_a, server.rest(token_b) as rest_b:
            opened = await _mcp_post(rest_a, None, "initialize", {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "a", "version": "1"}})
            session = opened.headers["mcp-session-id"]
            await _mcp_post(rest_a, session, "notifications/initialized", None)
            own = await _mcp_post(rest_a, session, "tools/call", {"name": "tether_read", "arguments": {"instance": "a-1"}})
            assert not _mcp_result(own).get("isError"), own.text
            hijack = await _mcp_post(rest_b, session, "tools/call", {"name": "tether_read", "arguments": {"instance": "b-1"}})
            assert _mcp_result(hijack)["isError"] is True, hijack.text
            assert "this MCP session acts as principal 'team-a' (its first call's token), not 'team-b'" in _mcp_result(hijack)["content"][0]["text"]


async def _mcp_post(rest: Any, session: str | None, method: str, params: dict[str, Any] | None) -> Any:
    """One handshake-era JSON-RPC message to `/mcp` (a request when it has params, else a notification)."""
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
    if session is not None:
        headers["Mcp-Session-Id"] = session
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message.update(id=1, params=params)
    return await rest.post("/mcp", json=message, headers=headers)


def _mcp_result(response: Any) -> dict[str, Any]:
    """The JSON-RPC result of an `/mcp` response, an SSE stream or a JSON body."""
    if response.headers["content-type"].startswith("text/event-stream"):
        data = [line[len("data:"):] for line in response.text.splitlines() if line.startswith("data:")]
        return json.loads(data[-1])["result"]
    return response.json()["result"]


async def test_a_forbid_and_an_approval_decided_on_a_server_sharing_postgres_the_approval_answered_on_the_other(
    pg_url: str,
) -> None:
    """Servers A and B on one PostgreSQL, the same policy file: the caller on A, the agent on B.
    B forbids `myapp_rm` of /etc with the policy's reason (A's caller sees no request) and sends
    `myapp_send` to approval; the caller answers it on A, and the call then runs, relayed to A.
    The log holds each decision once: the forbid a frame of its own, the approval in the
    `approval_request` B stored."""
    from oubliette_server.store.api import FrameQuery
    from oubliette_server.store.postgres import PostgresFrameStore
    from loop_caller import IDLE, INSTANCE, LOOP_AGENT, LoopCaller, ends_with

    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    policy = a.root / "policies.cedar"
    policy.write_text(TMP_ONLY)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE)), "--policy", str(policy)) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE)), "--policy", str(policy)) as server_b, \
                b.guest(INSTANCE, LOOP_AGENT), server_a.caller(events=False) as (client, _):
            await server_b.wait_connected(INSTANCE)
            caller = LoopCaller(client)
            ends_with(await caller.message("s1", IDLE, [RM, SEND], wait=60), "end_turn")
            async with b.agent(INSTANCE, "mcp:s1") as agent, trio.open_nursery() as nursery:
                with trio.fail_after(30):
                    forbidden = await agent.call_tool("myapp_rm", {"path": "/etc/passwd"})
                assert forbidden.is_error
                assert text_of(forbidden) == "myapp_rm: forbidden by policy: myapp_rm deletes only under /tmp/"
                outcome: dict[str, Any] = {}

                async def gated_call() -> None:
                    outcome["result"] = await agent.call_tool("myapp_send", {"text": "hello"})

                nursery.start_soon(gated_call)
                asked = await caller.call("session_events", session_id="s1", types=["approval_request"], wait_ms=20_000)
                [approval] = [f["payload"] for f in asked["frames"]]
                assert approval["tool_name"] == "myapp_send"
                answered = await caller.call("approval_response", session_id="s1", request_id=approval["request_id"],
                                             approve=True)
                assert answered.get("resolved") is True, answered
                relayed = await caller.call("session_events", session_id="s1", types=["caller_tool_request"], wait_ms=20_000)
                [request] = [f["payload"] for f in relayed["frames"]]
                assert request["tool"] == "send", "nothing of the forbidden call reached the caller"
                await caller.answer("s1", request["request_id"], result={"sent": True})
            assert outcome["result"].structured_content == {"sent": True}, text_of(outcome["result"])
    finally:
        a.cleanup()
        b.cleanup()
    store = PostgresFrameStore(pg_url)
    async with store.running():
        frames = await store.query(INSTANCE, FrameQuery(channel="mcp", session_id="s1", limit=200))
    decided = [(f.type, f.payload.get("effect") or f.payload.get("policy", {}).get("effect"))
               for f in frames if f.type == "policy_decision" or "policy" in f.payload]
    assert decided == [("policy_decision", "forbid"), ("approval_request", "approval")], decided
    [resolved] = [f.payload for f in frames if f.type == "approval_resolved"]
    assert resolved["approve"] is True
