"""`GET /metrics` (docs/OBSERVABILITY.md, "Metrics"): the real server with HTTP listeners, real
relayed calls, approvals and refusals, then a scrape parsed with prometheus_client's own parser.
Also the hooks alone: the metrics of one server are its own (not the global registry)."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from harness import Deployment, EventLog, RawRelay, text_of
from oubliette_server.core.metrics import ServerMetrics
from protocol import RelayError, errors

NOTIFY = {"name": "send_notification", "description": "Send notification",
          "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}}}
SLOW = {"name": "slow_tool", "description": "Never answered", "timeout_ms": 300}
DELETE = {"name": "delete_file", "description": "Delete a file on the host", "requires_approval": True,
          "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels (parsed by prometheus_client)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page) for sample in family.samples
    }


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


async def agent_call(agent: Any, name: str, arguments: dict, results: dict[str, Any]) -> None:
    results[name + repr(arguments)] = await agent.call_tool(name, arguments)


async def answer_next(caller: Any, events: EventLog, seen: set[str], tool: str, **answer: Any) -> dict:
    """Answer the next `caller_tool_request` of `tool` not answered yet."""
    request = await events.wait_for(
        lambda e: e.get("type") == "caller_tool_request" and e["tool"] == tool and e["request_id"] not in seen)
    seen.add(request["request_id"])
    reply = await caller.call_tool("caller_tool_response", {"session_id": "s1", "request_id": request["request_id"], **answer})
    assert not reply.is_error, text_of(reply)
    return request


async def decide_next(caller: Any, events: EventLog, seen: set[str], approve: bool) -> None:
    request = await events.wait_for(lambda e: e.get("type") == "approval_request" and e["request_id"] not in seen)
    seen.add(request["request_id"])
    reply = await caller.call_tool("approval_response", {
        "session_id": "s1", "request_id": request["request_id"], "approve": approve,
    })
    assert not reply.is_error, text_of(reply)


async def gauges_reach(server: Any, **expected: float) -> None:
    """Scrape (over the Unix socket listener) until the `oubliette_<name>` gauges read `expected`:
    the gauges are read from the server's state, which changes just after the event a test saw."""
    wanted = {f"oubliette_{name}": number for name, number in expected.items()}
    async with server.unix_rest() as rest:
        with trio.fail_after(20):
            while True:
                scraped = samples((await rest.get("/metrics")).text)
                read = {name: value(scraped, name) for name in wanted}
                if read == wanted:
                    return
                await trio.sleep(0.05)  # a gauge is read at scrape time: its change sends no line nor notice


@pytest.mark.real_programs
async def test_metrics_count_real_calls_approvals_and_refusals(deployment: Deployment) -> None:
    async with deployment.http_server() as server, server.caller() as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "s1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY, SLOW, DELETE]},
        })
        assert not declared.is_error, text_of(declared)
        results: dict[str, Any] = {}
        requests: set[str] = set()
        approvals: set[str] = set()
        async with deployment.agent("box1", "mcp:s1") as agent:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:  # answered
                    nursery.start_soon(agent_call, agent, "myapp_send_notification", {"message": "a"}, results)
                    await answer_next(caller, events, requests, "send_notification", result={"sent": True})
                await agent_call(agent, "myapp_slow_tool", {}, results)  # timed out (300 ms)
                async with trio.open_nursery() as nursery:  # approved, then answered; the gauges while each waits
                    nursery.start_soon(agent_call, agent, "myapp_delete_file", {"path": "/a"}, results)
                    await gauges_reach(server, pending_approvals=1, pending_calls=0)
                    await decide_next(caller, events, approvals, approve=True)
                    await gauges_reach(server, pending_approvals=0, pending_calls=1)
                    await answer_next(caller, events, requests, "delete_file", result={"deleted": True})
                async with trio.open_nursery() as nursery:  # denied: nothing is relayed
                    nursery.start_soon(agent_call, agent, "myapp_delete_file", {"path": "/b"}, results)
                    await decide_next(caller, events, approvals, approve=False)
            assert [r.is_error for r in results.values()] == [False, True, False, True], results
            assert "timed out" in text_of(results["myapp_slow_tool{}"])

            async with RawRelay.connect(deployment) as guest:  # a guest connection, counted while connected
                assert "result" in await guest.hello("box1", deployment.token("box1"), role="guest")
                await gauges_reach(server, guests_connected=1, clients_connected=1)
            await gauges_reach(server, guests_connected=0)
            async with server.rest() as rest, trio.open_nursery() as nursery:  # a long poll, counted while it waits
                nursery.start_soon(rest.get, "/v1/instances/box1/tether/poll?channel=host&wait_ms=20000")
                await gauges_reach(server, long_poll_waiters=1)
                nursery.cancel_scope.cancel()
            async with RawRelay.connect(deployment) as raw:  # a refused relay token
                refused = await raw.hello("box1", "not-the-token")
                assert refused["error"]["code"] == errors.UNAUTHORIZED
            async with server.rest(token="not-the-token") as rest:  # a refused HTTP token
                assert (await rest.get("/v1/health")).status_code == 401
            async with server.rest(token=None) as rest:  # no token, no metrics
                unauthorized = await rest.get("/metrics")
                assert unauthorized.status_code == 401, unauthorized.text
            async with server.rest(token=deployment.token("box1")) as rest:  # an instance's token is not enough
                instance_only = await rest.get("/metrics")
                assert instance_only.status_code == 401, instance_only.text
            async with server.rest() as rest:
                scrape = await rest.get("/metrics")
    assert scrape.status_code == 200, scrape.text
    assert scrape.headers["content-type"].startswith("text/plain")
    scraped = samples(scrape.text)

    assert value(scraped, "oubliette_relayed_calls_total", outcome="answered") == 2
    assert value(scraped, "oubliette_relayed_calls_total", outcome="timed_out") == 1
    assert value(scraped, "oubliette_relayed_calls_total", outcome="failed") == 0
    assert value(scraped, "oubliette_relayed_call_duration_seconds_count") == 3
    assert value(scraped, "oubliette_relayed_call_duration_seconds_bucket", le="0.1") <= 2
    assert value(scraped, "oubliette_relayed_call_duration_seconds_sum") >= 0.3  # the timed-out one waited 300 ms
    assert value(scraped, "oubliette_approvals_total", decision="approved") == 1
    assert value(scraped, "oubliette_approvals_total", decision="denied") == 1
    assert value(scraped, "oubliette_approvals_total", decision="timed_out") == 0
    assert value(scraped, "oubliette_approval_decision_seconds_count") == 2
    assert value(scraped, "oubliette_auth_refusals_total", door="relay", reason="bad_token") == 1
    assert value(scraped, "oubliette_auth_refusals_total", door="http", reason="bad_token") == 2
    assert value(scraped, "oubliette_auth_refusals_total", door="http", reason="missing_token") == 1
    assert value(scraped, "oubliette_frames_appended_total", type="caller_tool_request") == 3
    assert value(scraped, "oubliette_frames_appended_total", type="caller_tool_result") == 2
    assert value(scraped, "oubliette_frames_appended_total", type="caller_tool_cancelled") == 1
    assert value(scraped, "oubliette_frames_appended_total", type="approval_request") == 2
    assert value(scraped, "oubliette_frames_appended_total", type="approval_resolved") == 2
    assert value(scraped, "oubliette_frames_appended_total", type="user.message") == 1
    appended = sum(v for (name, _), v in scraped.items() if name == "oubliette_frames_appended_total")
    assert value(scraped, "oubliette_store_append_seconds_count") == appended
    assert value(scraped, "oubliette_http_requests_total", status="401") == 3
    assert value(scraped, "oubliette_http_requests_total", status="200") >= 1  # the caller's MCP requests
    # The gauges, read at the scrape: the agent (a client connection) and the HTTP caller are connected.
    assert value(scraped, "oubliette_pending_calls") == 0
    assert value(scraped, "oubliette_pending_approvals") == 0
    assert value(scraped, "oubliette_clients_connected") == 1
    assert value(scraped, "oubliette_guests_connected") == 0
    assert value(scraped, "oubliette_callers_connected") == 1
    assert value(scraped, "oubliette_long_poll_waiters") == 0


async def test_metrics_listener_serves_metrics_alone_without_a_token(deployment: Deployment) -> None:
    async with deployment.http_server("--metrics", "127.0.0.1:0") as server:
        [metrics_url] = server.ready["metrics"]
        async with httpx2.AsyncClient(base_url=metrics_url, timeout=60) as plain:
            page = await plain.get("/metrics")
            health = await plain.get("/v1/health")
            mcp = await plain.post("/mcp", json={})
        async with server.rest(token=None) as rest:
            behind_token = await rest.get("/metrics")
    assert page.status_code == 200, page.text
    scraped = samples(page.text)
    assert value(scraped, "oubliette_pending_calls") == 0
    assert value(scraped, "oubliette_relayed_calls_total", outcome="answered") == 0
    assert health.status_code == 404 and mcp.status_code == 404, "only /metrics is served there"
    assert health.json()["error"]["code"] == errors.NOT_FOUND
    assert behind_token.status_code == 401, "the HTTP listener still wants the token"


def test_metrics_listener_option_and_config_key_are_checked(tmp_path: Any) -> None:
    from oubliette_server.program.cli import _serve_parser, build_config

    config = build_config(_serve_parser().parse_args(["--metrics", "127.0.0.1:9464", "--metrics", "unix:/tmp/m.sock"]))
    assert config.metrics == ["127.0.0.1:9464", "unix:/tmp/m.sock"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        build_config(_serve_parser().parse_args(["--metrics", "9464"]))
    toml = tmp_path / "oubliette.toml"
    toml.write_text('[server]\nmetrics = ["127.0.0.1:9464"]\n')
    assert build_config(_serve_parser().parse_args(["--config", str(toml)])).metrics == ["127.0.0.1:9464"]
    flagged = build_config(_serve_parser().parse_args(["--config", str(toml), "--metrics", "127.0.0.1:9465"]))
    assert flagged.metrics == ["127.0.0.1:9465"], "the flag overrides the file"
    toml.write_text('[server]\nmetrics = "127.0.0.1:9464"\n')
    with pytest.raises(ValueError, match="metrics must be a list"):
        build_config(_serve_parser().parse_args(["--config", str(toml)]))


# -- the hooks alone ----------------------------------------------------------------------


def test_each_server_has_its_own_registry() -> None:
    one, two = ServerMetrics(), ServerMetrics()
    one.relayed_call_ended(True, None, 0.01)
    assert value(samples(one.page().decode()), "oubliette_relayed_calls_total", outcome="answered") == 1
    assert value(samples(two.page().decode()), "oubliette_relayed_calls_total", outcome="answered") == 0


def test_outcomes_decisions_and_frame_types_are_bounded_words() -> None:
    metrics = ServerMetrics()
    metrics.relayed_call_ended(True, RelayError(errors.TOOL_ERROR, "no"), 0.1)
    metrics.relayed_call_ended(True, RelayError(errors.PEER_DISCONNECTED, "gone"), 0.1)
    metrics.relayed_call_ended(False, None, 0.1)  # never ended by an outcome: the store failed
    for type_ in ("assistant.delta", "my.custom.type", "another-one"):
        metrics.frame_stored(type_, 0.001)
    metrics.toolset_call_ended("fs", None)
    metrics.toolset_call_ended("fs", RelayError(errors.DENIED, "no"))
    metrics.toolset_call_ended("unknown", RelayError(errors.NOT_FOUND, "no such tool"))
    metrics.toolset_call_ended("fs", trio.Cancelled._create())  # type: ignore[attr-defined]
    metrics.http_answered(None)

    class Decided:
        def __init__(self, approve: bool, who: str, kind: str = "approval") -> None:
            self.approve, self.who, self.kind = approve, who, kind

    metrics.approval_decided(Decided(False, "timeout"), 600)
    metrics.approval_decided(Decided(False, "disconnect"), 1)
    metrics.approval_decided(Decided(True, "caller-1", kind="tool"), 1)
    metrics.approval_decided(None, 1)
    scraped = samples(metrics.page().decode())
    assert value(scraped, "oubliette_relayed_calls_total", outcome="tool_error") == 1
    assert value(scraped, "oubliette_relayed_calls_total", outcome="disconnected") == 1
    assert value(scraped, "oubliette_relayed_calls_total", outcome="failed") == 1
    assert value(scraped, "oubliette_frames_appended_total", type="assistant.delta") == 1
    assert value(scraped, "oubliette_frames_appended_total", type="other") == 2
    assert value(scraped, "oubliette_toolset_calls_total", toolset="fs", outcome="ok") == 1
    assert value(scraped, "oubliette_toolset_calls_total", toolset="fs", outcome="denied") == 1
    assert value(scraped, "oubliette_toolset_calls_total", toolset="fs", outcome="cancelled") == 1
    assert value(scraped, "oubliette_toolset_calls_total", toolset="unknown", outcome="refused") == 1
    assert value(scraped, "oubliette_http_requests_total", status="none") == 1
    for decision in ("timed_out", "disconnected", "tool_return", "failed"):
        assert value(scraped, "oubliette_approvals_total", decision=decision) == 1
    assert value(scraped, "oubliette_approval_decision_seconds_bucket", le="600.0") == 4


def test_state_gauges_are_read_at_scrape_time() -> None:
    metrics = ServerMetrics()
    pending: list[int] = []
    metrics.watch(pending_calls=lambda: len(pending))
    assert value(samples(metrics.page().decode()), "oubliette_pending_calls") == 0
    pending.extend([1, 2])
    assert value(samples(metrics.page().decode()), "oubliette_pending_calls") == 2
    with pytest.raises(ValueError, match="unknown state gauge"):
        metrics.watch(pending_cals=lambda: 0)


async def test_toolset_calls_are_counted_by_toolset_and_outcome(deployment: Deployment) -> None:
    """In process: an agent's `toolset_call`s through the real relay socket, then the server's page."""
    from echo_toolset import ECHO_SPEC, EchoFactory, running

    async with running(deployment) as run:
        await run.server.register_toolset("ext", "ext", [ECHO_SPEC], factory=EchoFactory())
        await run.server.update_allowed_toolsets("box1", ["ext"])
        tools, _scope = await run.client("box1", "mcp:s1")
        assert not (await tools.call("ext.echo", {"text": "hi"})).is_error
        for name, arguments in (("ext.echo", {"text": 1}), ("nope.echo", {})):  # bad arguments, no such toolset
            with pytest.raises(RelayError):
                await tools.link.request("toolset_call", {"name": name, "arguments": arguments})
        scraped = samples(run.server.metrics.page().decode())
    assert value(scraped, "oubliette_toolset_calls_total", toolset="ext", outcome="ok") == 1
    assert value(scraped, "oubliette_toolset_calls_total", toolset="ext", outcome="refused") == 1
    assert value(scraped, "oubliette_toolset_calls_total", toolset="unknown", outcome="refused") == 1
    assert value(scraped, "oubliette_clients_connected") == 1


def test_the_docs_list_every_metric_the_server_registers_and_no_other() -> None:
    """docs/OBSERVABILITY.md's table ("What is measured") is the metrics' contract: each metric a
    server exports is a row with its type and labels, and each row is a metric the server exports."""
    import re
    from pathlib import Path

    from oubliette_server.core.metrics import STATE_GAUGES

    metrics = ServerMetrics()
    metrics.watch(**{key: (lambda: 0) for key in STATE_GAUGES})
    metrics.http_answered(200)  # the labelled metrics exported only from their first value on
    metrics.toolset_call_ended("fs", None)
    exported = {}
    for family in metrics.registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        exported[name] = (family.type, labels)
    text = (Path(__file__).resolve().parents[3] / "docs" / "OBSERVABILITY.md").read_text()
    table = text.split("### What is measured", 1)[1].split("\n\n", 2)[1]
    documented = {}
    for row in table.splitlines()[2:]:
        name, type_, labels = (cell.strip() for cell in row.split("|")[1:4])
        documented[name.strip("`")] = (type_, set(re.findall(r"`(\w+)`", labels)))
    assert documented == exported
