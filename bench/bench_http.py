"""Benchmark of a relayed caller tool call for a caller over Streamable HTTP, against a direct
call of the MCP SDK's own `MCPServer` over Streamable HTTP, with the stdio caller for reference.

    python bench/bench_http.py [--calls N] [--warmup W] [--rounds R] [--new-connection] [--answer-with-wait] [--quick]

In one run, for each round (the paths' order turns each round, so drifting load hits all):

- relayed, 2026-07-28 era: a *caller* (the SDK's `mcp.Client`, mode "auto", which speaks
  2026-07-28 to oubliette-server) in a process of its own declares the caller tool `echo` with
  `session_message` and long-polls `session_events` for `caller_tool_request` frames, answering
  each with `caller_tool_response`; an *agent* (this process, the SDK's `mcp.Client` over stdio
  to `python -m oubliette_client`) calls `bench_echo`. The server runs with `--http` and
  `--no-stdio`.
- relayed, 2025-11-25 (handshake) era: the same, the caller in mode "legacy" with a logging
  callback, answering the `caller_tool_request` events the server sends on its stream.
- direct, each era: this process's SDK client calls `echo` on bench/echo_http_server.py (the
  SDK's `MCPServer` under hypercorn's Trio worker), with the same HTTP client settings.
- stdio, for reference: the stdio caller of bench/bench_relay.py (it spawns the server on its
  stdio) and the same agent: what a relayed call costs the server on the one-host path.

It prints, per path, the median latency of N sequential calls after W warm-up calls, the ratio
relayed/direct of the same era, and the server's CPU per relayed call (utime + stime from
/proc), with the HTTP paths' CPU as a multiple of the stdio path's; the medians of the rounds.
`--new-connection` makes every HTTP request of the caller and of the direct client open a new
TCP connection (a caller behind a plain balancer); the default keeps connections alive.
`--answer-with-wait` makes the 2026-07-28 caller answer each request with `wait`, the turn's next
stop (the next request in its `pending`) coming back in the same request: one request per relayed
call instead of a `session_events` long poll and an answer. `--quick` is the smoke run CI makes:
a few calls, one round; it fails on a wrong answer, never on a time. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from bench_relay import (CALLER_ID, CALLER_TOOL, INSTANCE, PYTHON, RELAYED_NAME, SESSION_ID, SETUP_TIMEOUT,
                         BenchError, CpuMeter, checked_call, passed_env, profiled,
                         read_json_line, run_in_workdir, sequential, token_for)

HERE = Path(__file__).resolve().parent
ERAS = {"2026-07-28": "auto", "2025-11-25": "legacy"}
RUN_TIMEOUT = 600.0
POLL_MS = 10_000


def http_client(token: str | None, new_connection: bool) -> Any:
    """The caller's or the direct client's HTTP client: keep-alive, or a new connection per request."""
    import httpx2

    limits = httpx2.Limits(max_keepalive_connections=0) if new_connection else httpx2.Limits()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx2.AsyncClient(headers=headers, timeout=60, limits=limits)


@asynccontextmanager
async def http_mcp(url: str, token: str | None, mode: str, new_connection: bool, **options: Any) -> AsyncIterator[Client]:
    from mcp.client.streamable_http import streamable_http_client

    http = http_client(token, new_connection)
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode, **options) as client:
        yield client


# -- the HTTP caller (a process of its own) --------------------------------------------------


class HttpCaller:
    """Answers every caller_tool_request with caller_tool_response, each in its own task: from
    `session_events` long polls (2026-07-28) or from the events on the caller's stream (legacy)."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.answered = 0
        self.failures: list[str] = []
        self.owner: dict[str, str] = {}  # 2026-07-28: the `owner_key` session_message returned
        self.polls = 0

    async def on_log(self, params: Any) -> None:
        if getattr(params, "logger", None) == "oubliette" and isinstance(params.data, dict):
            if params.data.get("type") == "caller_tool_request":
                self.send.send_nowait(params.data)

    async def poll(self, caller: Client) -> None:
        after = 0
        while True:
            read = await caller.call_tool("session_events", {
                "instance": INSTANCE, "session_id": SESSION_ID, "types": ["caller_tool_request"],
                "after_seq": after, "wait_ms": POLL_MS, **self.owner})
            if read.is_error:
                raise BenchError("session_events failed: " + " ".join(getattr(b, "text", "") for b in read.content))
            frames = (read.structured_content or {}).get("frames", [])
            self.polls += 1
            for frame in frames:
                self.send.send_nowait(frame["payload"])
            if frames:
                after = frames[-1]["seq"]

    async def answer_and_wait(self, caller: Client) -> None:
        """The loop of a model caller (`--answer-with-wait`): each answer waits for the turn's next
        stop in the same request, whose `pending` list brings the next request; a long poll only
        when nothing is pending (the first request, a wait that timed out)."""
        pending: list[dict[str, Any]] = []
        answered: set[str] = set()
        after = 0
        while True:
            if not pending:
                read = await caller.call_tool("session_events", {
                    "instance": INSTANCE, "session_id": SESSION_ID, "types": ["caller_tool_request"],
                    "after_seq": after, "wait_ms": POLL_MS, **self.owner})
                frames = (read.structured_content or {}).get("frames", [])
                self.polls += 1
                pending = [f["payload"] for f in frames if f["payload"]["request_id"] not in answered]
                after = frames[-1]["seq"] if frames else after
                continue
            event = pending.pop(0)
            reply = await caller.call_tool("caller_tool_response", {
                "session_id": SESSION_ID, "request_id": event["request_id"],
                "result": {"echo": event["arguments"].get("text")}, "wait": POLL_MS / 1000, **self.owner})
            answered.add(event["request_id"])
            stop = reply.structured_content or {}
            if reply.is_error or stop.get("resolved") is not True:
                self.failures.append(" ".join(getattr(b, "text", "") for b in reply.content))
                continue
            self.answered += 1
            pending = [p for p in stop.get("pending", []) if p.get("kind") == "caller_tool" and p["request_id"] not in answered]

    async def answer_all(self, caller: Client) -> None:
        async with trio.open_nursery() as nursery:
            async for event in self.receive:
                nursery.start_soon(self._answer, caller, event)

    async def _answer(self, caller: Client, event: dict[str, Any]) -> None:
        reply = await caller.call_tool("caller_tool_response", {
            "session_id": SESSION_ID, "request_id": event["request_id"],
            "result": {"echo": event["arguments"].get("text")}, **self.owner})
        if reply.is_error:
            self.failures.append(" ".join(getattr(b, "text", "") for b in reply.content))
        else:
            self.answered += 1


async def run_as_http_caller(url: str, token: str, era: str, new_connection: bool, with_wait: bool = False) -> None:
    """The caller process: declare the tool, answer requests until stdin closes, print a summary."""
    caller_side = HttpCaller()
    legacy = ERAS[era] == "legacy"
    options: dict[str, Any] = {"logging_callback": caller_side.on_log, "log_level": "info"} if legacy else {}
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with http_mcp(url, token, ERAS[era], new_connection, **options) as caller, trio.open_nursery() as nursery:
        declared = await caller.call_tool("session_message", {
            "instance": INSTANCE, "session_id": SESSION_ID, "message": "benchmark",
            "context": {"caller_id": CALLER_ID, "caller_tools": [CALLER_TOOL]}})
        if declared.is_error:
            raise BenchError("session_message failed: " + " ".join(getattr(b, "text", "") for b in declared.content))
        if key := (declared.structured_content or {}).get("owner_key"):
            caller_side.owner = {"owner_key": key}
        if with_wait and not legacy:
            nursery.start_soon(caller_side.answer_and_wait, caller)
        else:
            nursery.start_soon(caller_side.answer_all, caller)
        if not legacy and not with_wait:
            nursery.start_soon(caller_side.poll, caller)
        print(json.dumps({"server_pid": None}), flush=True)
        while await stdin.receive_some(4096):
            pass
        nursery.cancel_scope.cancel()
    print(json.dumps({"answered": caller_side.answered, "failures": caller_side.failures, "polls": caller_side.polls}),
          flush=True)


# -- the bench -------------------------------------------------------------------------------


async def read_stderr_line(process: trio.Process, marker: bytes, what: str) -> str:
    """The rest of the first stderr line of `process` holding `marker`; stderr is drained on after."""
    assert process.stderr is not None
    seen = b""
    while marker not in seen or b"\n" not in seen.split(marker, 1)[1]:
        chunk = await process.stderr.receive_some(65536)
        if not chunk:
            raise BenchError(f"{what} ended before it was ready:\n{seen.decode(errors='replace')[-2000:]}")
        seen += chunk
    return seen.split(marker, 1)[1].split(b"\n", 1)[0].decode()


async def drain(stream: Any) -> None:
    while await stream.receive_some(65536):
        pass


class PathFigures:
    """One measured path: its latencies and the CPU its server spent on them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.latencies: list[float] = []
        self.server_cpu = 0.0
        self.calls = 0

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)

    @property
    def server_cpu_per_call(self) -> float:
        return self.server_cpu / self.calls


async def measure(call: Any, server_pid: int | None, name: str, args: argparse.Namespace) -> PathFigures:
    print(f"  {name}: {args.warmup} warm-up, {args.calls} sequential calls", file=sys.stderr, flush=True)
    await sequential(call, args.warmup)
    figures = PathFigures(name)
    meter = CpuMeter({"server": server_pid})
    meter.start()
    figures.latencies, _ = await sequential(call, args.calls)
    meter.stop()
    figures.server_cpu, figures.calls = meter.used["server"], args.calls
    return figures


@asynccontextmanager
async def process(command: list[str], **options: Any) -> AsyncIterator[trio.Process]:
    proc = await trio.lowlevel.open_process(command, **options)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            with trio.move_on_after(10) as waited, trio.CancelScope(shield=True):
                await proc.wait()
            if waited.cancelled_caught:
                proc.kill()


async def relayed(workdir: Path, caller_command: list[str], server_pid: int | None, name: str,
                  args: argparse.Namespace, token: str) -> PathFigures:
    """The agent's relayed calls while `caller_command` (a caller process) answers them; `token`
    is the instance's, asked before the server starts (the command and the server both make the
    data directory's secret when it is missing)."""
    agent = StdioServerParameters(
        command=PYTHON, args=[*profiled(f"client-{name}"), "-m", "oubliette_client", "--log-level", "WARNING"],
        env={"OUBLIETTE_RELAY": f"unix:{workdir / 'relay.sock'}", "OUBLIETTE_INSTANCE": INSTANCE,
             "OUBLIETTE_TOKEN": token, "OUBLIETTE_SESSION": f"mcp:{SESSION_ID}", **passed_env()})
    async with process(caller_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as caller:
        assert caller.stdout is not None and caller.stdin is not None
        buffer = bytearray()
        ready = await read_json_line(caller.stdout, buffer)
        async with Client(agent, mode="legacy") as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            if RELAYED_NAME not in tools:
                raise BenchError(f"the agent does not see {RELAYED_NAME}; it sees {tools}")
            figures = await measure(checked_call(client, RELAYED_NAME), server_pid or ready["server_pid"], name, args)
        await caller.stdin.aclose()
        summary = await read_json_line(caller.stdout, buffer)
    print(f"  {name}: caller answered {summary.get('answered')}, in {summary.get('polls', '-')} session_events polls",
          file=sys.stderr, flush=True)
    if summary.get("failures"):
        raise BenchError(f"caller_tool_response failed {len(summary['failures'])} times: {summary['failures'][0]}")
    return figures


async def relayed_over_http(workdir: Path, era: str, args: argparse.Namespace) -> PathFigures:
    data_dir = workdir / "data"
    token = token_for(data_dir, INSTANCE)
    server_command = [PYTHON, *profiled(f"server-{era}"), "-m", "oubliette_server", "--no-stdio",
                      "--relay", f"unix:{workdir / 'relay.sock'}", "--data-dir", str(data_dir),
                      "--http", "127.0.0.1:0", "--log-level", "WARNING"]
    async with process(server_command, stderr=subprocess.PIPE, env={**os.environ, **passed_env()}) as server, \
            trio.open_nursery() as nursery:
        ready = json.loads(await read_stderr_line(server, b"oubliette-server ready ", "oubliette-server"))
        nursery.start_soon(drain, server.stderr)
        url = next(u for u in ready["http"] if u.startswith("http://127.0.0.1")) + "/mcp"
        http_token = subprocess.run([PYTHON, "-m", "oubliette_server", "http-token", "--data-dir", str(data_dir)],
                                    check=True, capture_output=True, text=True).stdout.strip()
        caller = [PYTHON, str(Path(__file__).resolve()), "--as-http-caller", url, http_token, era,
                  *(["--new-connection"] if args.new_connection else []),
                  *(["--answer-with-wait"] if args.answer_with_wait else [])]
        figures = await relayed(workdir, caller, server.pid, f"relayed {era}", args, token)
        nursery.cancel_scope.cancel()
    return figures


async def direct_over_http(era: str, args: argparse.Namespace) -> PathFigures:
    async with process([PYTHON, str(HERE / "echo_http_server.py")], stderr=subprocess.PIPE) as server, \
            trio.open_nursery() as nursery:
        url = (await read_stderr_line(server, b"listening on ", "bench/echo_http_server.py")).strip()
        nursery.start_soon(drain, server.stderr)
        async with http_mcp(url, None, ERAS[era], args.new_connection) as client:
            figures = await measure(checked_call(client, "echo"), server.pid, f"direct {era}", args)
        nursery.cancel_scope.cancel()
    return figures


async def relayed_over_stdio(workdir: Path, args: argparse.Namespace) -> PathFigures:
    caller = [PYTHON, str(HERE / "bench_relay.py"), "--as-caller", str(workdir)]
    return await relayed(workdir, caller, None, "relayed stdio", args, token_for(workdir / "data", INSTANCE))


async def one_round(workdir: Path, n: int, args: argparse.Namespace) -> dict[str, PathFigures]:
    jobs = [(f"relayed {era}", era) for era in ERAS] + [(f"direct {era}", era) for era in ERAS] + [("relayed stdio", "")]
    shift = n % len(jobs)
    found: dict[str, PathFigures] = {}
    for name, era in jobs[shift:] + jobs[:shift]:
        where = workdir / f"r{n}-{name.replace(' ', '-')}"
        where.mkdir()
        if name.startswith("relayed") and era:
            found[name] = await relayed_over_http(where, era, args)
        elif era:
            found[name] = await direct_over_http(era, args)
        else:
            found[name] = await relayed_over_stdio(where, args)
    return found


def report(rounds: list[dict[str, PathFigures]], args: argparse.Namespace, load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    def med(name: str, of: Any) -> float:
        return statistics.median(of(r[name]) for r in rounds)

    stdio_cpu = med("relayed stdio", lambda p: p.server_cpu_per_call)
    print()
    print("Oubliette relay over HTTP benchmark")
    print(f"  {args.calls} sequential calls after {args.warmup} warm-up per path, {len(rounds)} round(s), "
          f"{'a new TCP connection per request' if args.new_connection else 'keep-alive'}; 2026-07-28 caller "
          f"{'answers with wait' if args.answer_with_wait else 'long-polls session_events, answers without wait'}; "
          "medians of the rounds")
    print(f"  load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load[0])}; "
          f"after {', '.join(f'{x:.2f}' for x in load[1])}")
    print()
    print(f"  {'caller':<14}{'relayed':>12}{'direct':>12}{'relayed/direct':>17}{'server CPU/call':>18}{'÷ stdio':>10}")
    for era in ERAS:
        relayed_median = med(f"relayed {era}", lambda p: p.median)
        direct_median = med(f"direct {era}", lambda p: p.median)
        ratio = statistics.median(r[f"relayed {era}"].median / r[f"direct {era}"].median for r in rounds)
        cpu = med(f"relayed {era}", lambda p: p.server_cpu_per_call)
        to_stdio = f"{cpu / stdio_cpu:>9.2f}×" if stdio_cpu > 0 else f"{'-':>10}"
        print(f"  {era:<14}{relayed_median * 1e3:>9.2f} ms{direct_median * 1e3:>9.2f} ms{ratio:>16.2f}×"
              f"{cpu * 1e3:>15.2f} ms{to_stdio}")
    print(f"  {'stdio':<14}{med('relayed stdio', lambda p: p.median) * 1e3:>9.2f} ms{'':>12}{'':>17}"
          f"{stdio_cpu * 1e3:>15.2f} ms{1:>9.2f}×")
    if stdio_cpu == 0:  # /proc counts CPU in ticks (10 ms): too few calls to see the stdio server's
        print(f"  (÷ stdio: '-', the stdio server's CPU over {args.calls} calls was below /proc's tick; run more calls)")
    for n, r in enumerate(rounds, 1):
        print(f"    round {n}: " + "; ".join(f"{name} {p.median * 1e3:.2f} ms, server {p.server_cpu_per_call * 1e3:.2f} ms"
                                          for name, p in r.items()))


async def bench(workdir: Path, args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rounds = []
    with trio.fail_after(SETUP_TIMEOUT + RUN_TIMEOUT * args.rounds):
        for n in range(args.rounds):
            print(f"== round {n + 1}", file=sys.stderr, flush=True)
            rounds.append(await one_round(workdir, n, args))
    report(rounds, args, (load_before, os.getloadavg()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, help="sequential calls per path (default 300; 20 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up calls per path (default 30; 5 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds, the paths' order turning each round (default 2; 1 with --quick)")
    parser.add_argument("--new-connection", action="store_true", help="a new TCP connection per HTTP request")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few calls, one round")
    parser.add_argument("--answer-with-wait", action="store_true",
                        help="the 2026-07-28 caller answers with wait (one request per relayed call) instead of "
                             "long-polling session_events and answering without wait")
    parser.add_argument("--as-http-caller", nargs=3, metavar=("URL", "TOKEN", "ERA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_http_caller:
        url, token, era = args.as_http_caller
        trio.run(run_as_http_caller, url, token, era, args.new_connection, args.answer_with_wait)
        return 0
    args.calls = args.calls or (20 if args.quick else 300)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.quick else 30)
    args.rounds = args.rounds or (1 if args.quick else 2)
    return run_in_workdir("bench_http", bench, args)

if __name__ == "__main__":
    sys.exit(main())
