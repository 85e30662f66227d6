"""Benchmark of a relayed caller tool call, against a direct stdio MCP call of the same SDK.

    python bench/bench_relay.py [--calls N] [--throughput-calls M] [--warmup W] [--quick]
                                [--tracing off|on|both] [--rounds R]

It starts, all on this machine, in one run:

- the relayed path, as in tests/support/harness.py: a *caller* (the SDK's ``mcp.Client``, mode
  "legacy") that spawned ``python -m oubliette_server --relay unix:… --data-dir <tmp>``,
  declared the caller tool ``echo`` (caller id ``bench``) with ``session_message``, and answers
  every ``caller_tool_request`` event (``notifications/message``, logger ``oubliette``) with
  ``caller_tool_response`` at once, from a task of its own; and an *agent* (the SDK's
  ``mcp.Client``, mode "legacy") that spawned ``python -m oubliette_client`` with
  ``OUBLIETTE_RELAY/INSTANCE/TOKEN/SESSION`` and calls ``bench_echo``.  One call is
  agent → client (stdio) → server (relay socket) → caller (event on stdio) → server
  (``caller_tool_response``) → client → agent.
- the baseline: the same SDK ``mcp.Client`` calling ``echo`` on bench/echo_server.py, a minimal
  low-level ``mcp.server.Server`` over stdio under Trio (one stdio hop, no work).

and measures:

1. latency of one call, N sequential calls after W warm-up calls: median and p99, both paths,
   and the ratio relayed/direct;
2. throughput (calls/s) with 1 call in flight (the wall time of the sequential run of 1.) and
   with 64 calls in flight (64 tasks sharing the one agent client, M calls in all), both paths,
   and the ratio relayed/direct;
3. CPU time per call of every process taking part, over the sequential run of 1.: the agent
   (this process), oubliette-client, oubliette-server and the caller (a process of its own,
   this script with ``--as-caller``), and for the direct path the agent and echo_server;
   read from ``/proc/PID/stat`` (utime + stime) before and after the run (this process:
   ``time.process_time``);
4. the machine's load average before and after, since the figures are only comparable on a
   similarly quiet machine.

With ``--tracing on`` the programs export their spans over OTLP/HTTP to bench/otlp_sink.py,
started by the bench as a process of its own on a free loopback port (its CPU is reported apart:
a collector's work is not the programs'); ``--tracing both`` runs the whole bench with tracing
off and on, with fresh programs each time, alternating for ``--rounds`` rounds (off first in odd
rounds, on first in even ones), and prints the CPU per relayed call of both and the difference,
overall and by process (the medians of the rounds).

The caller runs in its own process so that its CPU time is not mixed with the agent's; it
spawns oubliette-server, declares the tool, prints one JSON line ``{"server_pid": …}`` and
answers events until its stdin closes, then prints ``{"answered": …, "failures": […]}``.

``BENCH_SERVER_ARGS`` adds its words to oubliette-server's command line (``BENCH_SERVER_ARGS="--policy
p.cedar"`` measures a relayed call decided by a policy file, docs/POLICY.md).

The frame store lives in a temporary directory; every process and the directory are removed
at the end.  Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

PYTHON = sys.executable
HERE = Path(__file__).resolve().parent
INSTANCE = "bench"
SESSION_ID = "bench-s1"
CALLER_ID = "bench"
CALLER_TOOL = {
    "name": "echo",
    "description": "Echo the text back",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}
RELAYED_NAME = f"{CALLER_ID}_echo"
CONCURRENCY = 64
SETUP_TIMEOUT = 30.0  # seconds, on top of the run's
RUN_TIMEOUT = 300.0

CallFn = Callable[[int], Awaitable[None]]


class BenchError(RuntimeError):
    pass


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


# -- the caller ------------------------------------------------------------------------------


class Responder:
    """Answers every caller_tool_request event with caller_tool_response, each in its own task."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.answered = 0
        self.failures: list[str] = []

    async def on_log(self, params: Any) -> None:
        # Runs in the client's receive loop: never await a request here, just hand the event on.
        if getattr(params, "logger", None) == "oubliette" and isinstance(params.data, dict):
            if params.data.get("type") == "caller_tool_request":
                self.send.send_nowait(params.data)

    async def run(self, caller: Client) -> None:
        async with trio.open_nursery() as nursery:
            async for event in self.receive:
                nursery.start_soon(self._answer, caller, event)

    async def _answer(self, caller: Client, event: dict[str, Any]) -> None:
        # With tracing on, the request carries the server's span: the answer joins that trace.
        reply = await caller.call_tool("caller_tool_response", {
            "session_id": event["session_id"], "request_id": event["request_id"],
            "result": {"echo": event["arguments"].get("text")},
        }, meta=event.get("_meta"))
        if reply.is_error:
            self.failures.append(" ".join(getattr(b, "text", "") for b in reply.content))
        else:
            self.answered += 1


def token_for(data_dir: Path, instance: str) -> str:
    out = subprocess.run(
        [PYTHON, "-m", "oubliette_server", "token", instance, "--data-dir", str(data_dir)],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()



async def run_as_caller(workdir: Path, server_args: Sequence[str] = ()) -> None:
    """The caller process: spawn the server (with `server_args` besides the bench's own), declare
    the tool, answer events until stdin closes."""
    data_dir = workdir / "data"
    relay = f"unix:{workdir / 'relay.sock'}"
    responder = Responder()
    server_params = StdioServerParameters(
        command=PYTHON,
        args=[*profiled("server"), "-m", "oubliette_server", "--relay", relay, "--data-dir", str(data_dir),
              "--log-level", "WARNING", *server_args, *shlex.split(os.environ.get("BENCH_SERVER_ARGS", ""))],
        env=passed_env() or None,
    )
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with Client(server_params, mode="legacy", logging_callback=responder.on_log) as caller, \
            trio.open_nursery() as nursery:
        nursery.start_soon(responder.run, caller)
        declared = await caller.call_tool("session_message", {
            "instance": INSTANCE, "session_id": SESSION_ID, "message": "benchmark",
            "context": {"caller_id": CALLER_ID, "caller_tools": [CALLER_TOOL]},
        })
        if declared.is_error:
            raise BenchError("session_message failed: " + " ".join(getattr(b, "text", "") for b in declared.content))
        servers = [pid for pid in child_pids(os.getpid()) if "oubliette_server" in cmdline(pid)]
        print(json.dumps({"server_pid": servers[0] if servers else None}), flush=True)
        while await stdin.receive_some(4096):
            pass
        nursery.cancel_scope.cancel()
    print(json.dumps({"answered": responder.answered, "failures": responder.failures}), flush=True)


def passed_env() -> dict[str, str]:
    """`PYTHONPATH` (`PYTHONPATH=/tmp/before python bench/bench_relay.py` measures the programs of
    another checkout), `OUBLIETTE_FAST_PATH` and the `OTEL_*` variables when set here, for the
    programs (the SDK gives a child only a minimal environment): `OUBLIETTE_FAST_PATH=0 python
    bench/bench_relay.py` measures the programs as the SDK and Python make them (every line the
    SDK's, the collector as Python sets it), `OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318` (with
    bench/otlp_sink.py listening there) the cost of exporting spans."""
    return {name: value for name, value in os.environ.items()
            if name in ("PYTHONPATH", "OUBLIETTE_FAST_PATH") or name.startswith("OTEL_")}


def profiled(name: str) -> list[str]:
    """`-m cProfile -o DIR/NAME.prof` when BENCH_PROFILE_DIR is set (the program's profile, written
    when it exits at the end of the run; read it with `python -m pstats`), else nothing; with
    BENCH_PROFILE_CPU=1 too, on CPU time (bench/cpu_profile.py), the profile to read under load."""
    where = os.environ.get("BENCH_PROFILE_DIR")
    if not where:
        return []
    out = str(Path(where) / f"{name}.prof")
    if os.environ.get("BENCH_PROFILE_CPU") == "1":
        return [str(Path(__file__).resolve().parent / "cpu_profile.py"), out]
    return ["-m", "cProfile", "-o", out]


# -- CPU time of the processes --------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (all its threads'), from /proc."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (its own threads, not its children); this process precisely."""
    if pid is None or pid == os.getpid():
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class CpuMeter:
    """CPU seconds used by named processes between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.used: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def start(self) -> None:
        self._at = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.used = {name: cpu_seconds(pid) - self._at[name] for name, pid in self.pids.items()}


# -- measuring -------------------------------------------------------------------------------


def checked_call(client: Client, tool: str) -> CallFn:
    async def call(n: int) -> None:
        text = f"call {n}"
        result = await client.call_tool(tool, {"text": text})
        if result.is_error or result.structured_content != {"echo": text}:
            detail = " ".join(getattr(b, "text", "") for b in result.content)
            raise BenchError(f"{tool}: unexpected result for {text!r}: {detail or result!r}")

    return call


async def sequential(call: CallFn, count: int) -> tuple[list[float], float]:
    """Per-call latencies (s) of `count` calls one after another, and the wall time of all."""
    latencies = []
    start = time.perf_counter()
    for n in range(count):
        t0 = time.perf_counter()
        await call(n)
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - start


async def concurrent(call: CallFn, count: int, in_flight: int) -> float:
    """Wall time of `count` calls made by `in_flight` tasks that each start a new call when one ends."""
    next_n = 0

    async def worker() -> None:
        nonlocal next_n
        while next_n < count:
            n = next_n
            next_n += 1
            await call(n)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(worker)
    return time.perf_counter() - start


class Figures:
    """One path under test: its call function and its figures."""

    def __init__(self, name: str, call: CallFn) -> None:
        self.name = name
        self.call = call
        self.latencies: list[float] = []
        self.seq_wall = 0.0
        self.seq_calls = 0
        self.conc_wall = 0.0
        self.conc_calls = 0
        self.cpu = CpuMeter({})
        self.cpu_conc = CpuMeter({})

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)

    @property
    def p99(self) -> float:
        return pct(self.latencies, 99)

    @property
    def rate_1(self) -> float:
        return self.seq_calls / self.seq_wall

    @property
    def rate_n(self) -> float:
        return self.conc_calls / self.conc_wall


async def measure(paths: list[Figures], args: argparse.Namespace) -> None:
    for p in paths:  # warm-up: imports, schema caches, SQLite pages, tool list fetch
        print(f"  warm-up {p.name}: {args.warmup} sequential + {2 * CONCURRENCY} at {CONCURRENCY} in flight",
              file=sys.stderr, flush=True)
        await sequential(p.call, args.warmup)
        await concurrent(p.call, 2 * CONCURRENCY, CONCURRENCY)
    for p in paths:
        print(f"  latency {p.name}: {args.calls} sequential calls", file=sys.stderr, flush=True)
        p.cpu.start()
        p.latencies, p.seq_wall = await sequential(p.call, args.calls)
        p.cpu.stop()
        p.seq_calls = args.calls
    for p in paths:
        print(f"  throughput {p.name}: {args.throughput_calls} calls, {CONCURRENCY} in flight",
              file=sys.stderr, flush=True)
        p.cpu_conc.start()
        p.conc_wall = await concurrent(p.call, args.throughput_calls, CONCURRENCY)
        p.cpu_conc.stop()
        p.conc_calls = args.throughput_calls


# -- report ----------------------------------------------------------------------------------


def report(relayed: Figures, direct: Figures, args: argparse.Namespace, caller_summary: dict[str, Any],
           load_before: tuple[float, ...], load_after: tuple[float, ...]) -> None:
    def ms(x: float) -> str:
        return f"{x * 1e3:10.3f} ms"

    def rate(x: float) -> str:
        return f"{x:10.0f} /s "

    def cpu_ms(f: Figures, meter: CpuMeter, calls: int) -> float:
        return sum(meter.used.values()) / calls * 1e3

    rows = [
        ("latency, median", ms(relayed.median), ms(direct.median), relayed.median / direct.median, "×"),
        ("latency, p99", ms(relayed.p99), ms(direct.p99), relayed.p99 / direct.p99, "×"),
        ("throughput, 1 in flight", rate(relayed.rate_1), rate(direct.rate_1), relayed.rate_1 / direct.rate_1, ""),
        (f"throughput, {CONCURRENCY} in flight", rate(relayed.rate_n), rate(direct.rate_n),
         relayed.rate_n / direct.rate_n, ""),
        ("CPU per call, 1 in flight", ms(cpu_ms(relayed, relayed.cpu, relayed.seq_calls) / 1e3),
         ms(cpu_ms(direct, direct.cpu, direct.seq_calls) / 1e3),
         cpu_ms(relayed, relayed.cpu, relayed.seq_calls) / cpu_ms(direct, direct.cpu, direct.seq_calls), "×"),
        (f"CPU per call, {CONCURRENCY} in flight", ms(cpu_ms(relayed, relayed.cpu_conc, relayed.conc_calls) / 1e3),
         ms(cpu_ms(direct, direct.cpu_conc, direct.conc_calls) / 1e3),
         cpu_ms(relayed, relayed.cpu_conc, relayed.conc_calls) / cpu_ms(direct, direct.cpu_conc, direct.conc_calls), "×"),
    ]
    try:
        mcp_version = metadata.version("mcp")
    except metadata.PackageNotFoundError:
        mcp_version = "?"
    print()
    print("Oubliette relay benchmark")
    print(f"  python {platform.python_version()}, trio {trio.__version__}, mcp {mcp_version}, "
          f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}")
    print(f"  load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after {', '.join(f'{x:.2f}' for x in load_after)}")
    print(f"  latency: {args.calls} sequential calls after {args.warmup} warm-up calls; "
          f"throughput: 1 in flight = the sequential run, {CONCURRENCY} in flight = {args.throughput_calls} calls")
    print("  relayed: agent → oubliette-client → oubliette-server → caller → back (caller_tool_response)")
    print("  direct:  agent → bench/echo_server.py (low-level mcp.server.Server over stdio)")
    print()
    header = f"  {'':<30}{'relayed':>14}{'direct':>14}{'relayed/direct':>17}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for label, r, d, ratio, unit in rows:
        ratio_text = f"{ratio:.2f}{unit}" if unit else f"{ratio:.3f}"
        print(f"  {label:<30}{r:>14}{d:>14}{ratio_text:>17}")
    print()
    print(f"  CPU ms per call by process (utime + stime; 1 in flight | {CONCURRENCY} in flight):")
    for f in (relayed, direct):
        parts = [f"{name} {f.cpu.used[name] / f.seq_calls * 1e3:.3f} | {f.cpu_conc.used[name] / f.conc_calls * 1e3:.3f}"
                 for name in f.cpu.pids]
        print(f"    {f.name:<8} " + "; ".join(parts))
    print()
    print(f"  relayed per-call extra, median: {(relayed.median - direct.median) * 1e3:.3f} ms; "
          f"latency min/max relayed {min(relayed.latencies) * 1e3:.3f}/{max(relayed.latencies) * 1e3:.3f} ms, "
          f"direct {min(direct.latencies) * 1e3:.3f}/{max(direct.latencies) * 1e3:.3f} ms")
    print(f"  caller answered {caller_summary.get('answered')} caller_tool_request events, "
          f"{len(caller_summary.get('failures', []))} caller_tool_response errors")


# -- main ------------------------------------------------------------------------------------


async def read_json_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> dict[str, Any]:
    """The next line of `stream` that is a JSON object (the caller process's reports)."""
    while True:
        if b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
            continue
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise BenchError("the caller process ended early (see its stderr above)")
        buffer += chunk


class Sink:
    """bench/otlp_sink.py in a process of its own on a free loopback port: the local collector of a
    tracing run. `endpoint` is its URL; `stop()` ends it (SIGTERM) and returns what it printed."""

    def __init__(self) -> None:
        self.process: trio.Process | None = None
        self.endpoint = ""

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            [PYTHON, str(HERE / "otlp_sink.py"), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.process.stderr is not None
        said = b""
        while b"\n" not in said:
            chunk = await self.process.stderr.receive_some(4096)
            if not chunk:
                raise BenchError("bench/otlp_sink.py ended before it listened")
            said += chunk
        self.endpoint = said.decode().split("listening on ", 1)[1].split()[0]

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid if self.process is not None else None)

    async def stop(self) -> str:
        if self.process is None:
            return ""
        self.process.terminate()
        assert self.process.stdout is not None
        out = b""
        while chunk := await self.process.stdout.receive_some(65536):
            out += chunk
        await self.process.wait()
        return out.decode().strip()


def tracing_env(endpoint: str) -> dict[str, str]:
    """The `OTEL_*` variables of a tracing run (passed on by `passed_env`): OTLP/HTTP to the sink,
    the SDK's batch defaults."""
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}


async def bench(workdir: Path, args: argparse.Namespace) -> tuple[Figures, Figures]:
    data_dir = workdir / "data"
    relay = f"unix:{workdir / 'relay.sock'}"
    token = token_for(data_dir, INSTANCE)
    agent_params = StdioServerParameters(
        command=PYTHON, args=[*profiled("client"), "-m", "oubliette_client", "--log-level", "WARNING"],
        env={"OUBLIETTE_RELAY": relay, "OUBLIETTE_INSTANCE": INSTANCE, "OUBLIETTE_TOKEN": token,
             "OUBLIETTE_SESSION": f"mcp:{SESSION_ID}", **passed_env()},
    )
    echo_params = StdioServerParameters(command=PYTHON, args=[str(HERE / "echo_server.py")])

    print("  starting the caller (with oubliette-server), oubliette-client (agent), echo_server (direct)",
          file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    with trio.fail_after(SETUP_TIMEOUT + RUN_TIMEOUT):
        caller_proc = await trio.lowlevel.open_process(
            [PYTHON, str(Path(__file__).resolve()), "--as-caller", str(workdir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            buffer = bytearray()
            assert caller_proc.stdout is not None and caller_proc.stdin is not None
            ready = await read_json_line(caller_proc.stdout, buffer)
            async with Client(agent_params, mode="legacy") as agent, Client(echo_params, mode="legacy") as direct_client:
                tools = [t.name for t in (await agent.list_tools()).tools]
                if RELAYED_NAME not in tools:
                    raise BenchError(f"the agent does not see {RELAYED_NAME}; it sees {tools}")
                await direct_client.list_tools()
                mine = child_pids(os.getpid())
                client_pid = next(pid for pid in mine if "oubliette_client" in cmdline(pid))
                echo_pid = next(pid for pid in mine if "echo_server.py" in cmdline(pid))
                relayed = Figures("relayed", checked_call(agent, RELAYED_NAME))
                relayed.cpu.pids = relayed.cpu_conc.pids = {
                    "agent": os.getpid(), "client": client_pid, "server": ready["server_pid"], "caller": caller_proc.pid,
                }
                direct = Figures("direct", checked_call(direct_client, "echo"))
                direct.cpu.pids = direct.cpu_conc.pids = {"agent": os.getpid(), "echo_server": echo_pid}
                await measure([direct, relayed], args)
            await caller_proc.stdin.aclose()
            summary = await read_json_line(caller_proc.stdout, buffer)
            await caller_proc.wait()
        finally:
            if caller_proc.returncode is None:
                caller_proc.kill()
                with trio.CancelScope(shield=True):
                    await caller_proc.wait()
    load_after = os.getloadavg()
    if summary.get("failures"):
        raise BenchError(f"caller_tool_response failed {len(summary['failures'])} times: {summary['failures'][0]}")
    report(relayed, direct, args, summary, load_before, load_after)
    return relayed, direct


async def bench_traced(workdir: Path, args: argparse.Namespace) -> tuple[Figures, Figures, float, str]:
    """One bench with the programs exporting spans to a sink of its own; the sink's CPU seconds and summary."""
    sink = Sink()
    await sink.start()
    saved = {name: os.environ.get(name) for name in tracing_env("")}
    os.environ.update(tracing_env(sink.endpoint))
    try:
        cpu_before = sink.cpu()
        relayed, direct = await bench(workdir, args)
        sink_cpu = sink.cpu() - cpu_before
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        with trio.CancelScope(shield=True):
            summary = await sink.stop()
    print(f"  collector (bench/otlp_sink.py, not counted above): {sink_cpu * 1e3:.0f} ms CPU; received: "
          + "; ".join(summary.splitlines()))
    return relayed, direct, sink_cpu, summary


def compare_tracing(rounds: list[tuple[Figures, Figures]]) -> None:
    """CPU per relayed call, tracing off against on, round by round and the median of the rounds:
    in all and by process, 1 and 64 in flight."""
    print()
    print(f"  tracing on against off: CPU ms per relayed call (1 in flight | {CONCURRENCY} in flight), "
          f"{len(rounds)} round(s) alternating, the median of the rounds' figures")
    for name in [*rounds[0][0].cpu.pids, "total"]:
        def per(meter: CpuMeter, calls: int) -> float:
            used = sum(meter.used.values()) if name == "total" else meter.used[name]
            return used / calls * 1e3

        a1 = statistics.median(per(off.cpu, off.seq_calls) for off, _ in rounds)
        b1 = statistics.median(per(on.cpu, on.seq_calls) for _, on in rounds)
        an = statistics.median(per(off.cpu_conc, off.conc_calls) for off, _ in rounds)
        bn = statistics.median(per(on.cpu_conc, on.conc_calls) for _, on in rounds)
        print(f"    {name:<8} off {a1:.3f} | {an:.3f}  on {b1:.3f} | {bn:.3f}  "
              f"extra {b1 - a1:+.3f} ({(b1 / a1 - 1) * 100:+.0f} %) | {bn - an:+.3f} ({(bn / an - 1) * 100:+.0f} %)")
    for n, (off, on) in enumerate(rounds, 1):
        t = [sum(f.cpu.used.values()) / f.seq_calls * 1e3 for f in (off, on)]
        c = [sum(f.cpu_conc.used.values()) / f.conc_calls * 1e3 for f in (off, on)]
        print(f"    round {n}: total off {t[0]:.3f} | {c[0]:.3f}  on {t[1]:.3f} | {c[1]:.3f}  "
              f"({(t[1] / t[0] - 1) * 100:+.0f} % | {(c[1] / c[0] - 1) * 100:+.0f} %)")


async def bench_modes(workdir: Path, args: argparse.Namespace) -> None:
    """The bench as `--tracing` asks: as the environment says (off), with a sink (on), or both,
    alternating for `--rounds` rounds (on first in every other round, so drifting load hits both)."""
    if args.tracing == "off":
        await bench(workdir, args)
        return
    if args.tracing == "on":
        await bench_traced(workdir, args)
        return
    rounds: list[tuple[Figures, Figures]] = []
    for n in range(args.rounds):
        figures: dict[str, Figures] = {}
        for mode in ("off", "on") if n % 2 == 0 else ("on", "off"):
            where = workdir / f"{mode}{n}"
            where.mkdir()
            print(f"\n== round {n + 1}: tracing {mode}", flush=True)
            if mode == "off":
                figures[mode], _ = await bench(where, args)
            else:
                figures[mode], _, _, _ = await bench_traced(where, args)
        rounds.append((figures["off"], figures["on"]))
    compare_tracing(rounds)


def bench_error_in(exc: BaseException) -> BenchError | None:
    """The BenchError in `exc`, which Trio's nurseries may have wrapped in exception groups."""
    if isinstance(exc, BenchError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := bench_error_in(inner)) is not None:
                return found
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, help="sequential calls for the latency figures (default 500; 100 with --quick)")
    parser.add_argument("--throughput-calls", type=int,
                        help=f"calls for the {CONCURRENCY}-in-flight figures (default 2000; 400 with --quick)")
    parser.add_argument("--warmup", type=int, help="sequential warm-up calls per path (default 50; 20 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument("--tracing", choices=("off", "on", "both"), default="off",
                        help="off: as the OTEL_* environment says; on: export spans to bench/otlp_sink.py, started "
                             "here; both: off then on, and the difference in CPU per relayed call")
    parser.add_argument("--rounds", type=int, default=1, help="with --tracing both: alternate off and on this many times")
    parser.add_argument("--as-caller", metavar="WORKDIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_caller:
        trio.run(run_as_caller, Path(args.as_caller))
        return 0
    if args.calls is None:
        args.calls = 100 if args.quick else 500
    if args.throughput_calls is None:
        args.throughput_calls = 400 if args.quick else 2000
    if args.warmup is None:
        args.warmup = 20 if args.quick else 50
    if min(args.calls, args.throughput_calls) < 1 or args.warmup < 0:
        parser.error("counts must be positive")
    return run_in_workdir("bench_relay", bench_modes, args)


def run_in_workdir(name: str, bench_fn: Callable[[Path, argparse.Namespace], Awaitable[None]],
                   args: argparse.Namespace) -> int:
    """`trio.run(bench_fn, workdir, args)` in a fresh directory under /tmp, removed at the end; the
    exit status: 1 with the BenchError's line when the bench found a wrong result."""
    # Short path: a Unix socket path is limited to ~100 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="oub-bench-", dir="/tmp"))
    try:
        trio.run(bench_fn, workdir, args)
    except BaseException as exc:  # noqa: B036 - only to find a BenchError inside exception groups
        err = bench_error_in(exc)
        if err is None:
            raise
        print(f"{name}: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
