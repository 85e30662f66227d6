"""Soak: many relayed calls in flight at once, then a flood of ingress frames followed by two readers.

    python bench/soak.py [--calls N] [--instances I] [--agents-per-instance A] [--frames F]
                         [--posters P] [--skip-calls] [--skip-frames]
    python bench/soak.py --duration SECONDS [--rate CALLS_PER_S] [--frame-rate FRAMES_PER_S] [--sample SECONDS]

One real ``oubliette-server`` (a caller on its stdio, an HTTP listener on a Unix socket), and:

1. **calls**: I instances (default 4), each with a session of its own in which the caller declared
   the caller tool ``echo``, and A agents per instance (default 2; the SDK's ``mcp.Client``
   spawning ``oubliette-client`` bound to that session). The agents start all N calls (default
   1,000) at once; the caller holds every ``caller_tool_request`` until all N are in flight, then
   answers them all. Each agent must get exactly its own result. The log is then read back
   (``session_events``): each request must have exactly one ``caller_tool_request`` and one
   ``caller_tool_result`` frame.
2. **frames**: F ``user.message`` frames (default 100,000) posted by P concurrent HTTP clients
   (default 16) to ``POST /v1/instances/soak-ingress/tether``, while one long-poll reader
   (``GET …/tether/poll``, ``wait_ms``) and one SSE reader (``GET …/tether/stream``) follow the
   session from the start. Each reader must see every frame exactly once, in ``seq`` order.

3. **steady** (``--duration``, instead of 1 and 2): moderate load held for a while, to tell a leak
   from a warm-up. One agent calls ``echo`` at ``--rate`` calls/s (default 20), the caller answering
   each request as its event arrives, while an HTTP client posts ``user.message`` frames at
   ``--frame-rate`` frames/s (default 20) and a long-poll reader follows them. Every ``--sample``
   seconds (default 60) it records the server's RSS and open file descriptors (``/proc/PID/fd``).
   It reports both at the start and the end, and the growth rate over the last two thirds of the
   run (the first third is warm-up: caches and the allocator's arenas filling); a leak shows as
   steady growth there, a plateau as none. It also says where RSS levelled off (the first sample
   within 1 MiB of the run's highest: its time, calls and RSS), and ``--samples`` prints every
   sample (seconds, calls, RSS, fds). Lost or wrong calls and frames fail the run as above.

It prints the throughput of each part, the server's RSS (``VmRSS`` of ``/proc/PID/status``)
before, between and after, and the lost and duplicated counts for the calls and for each reader
(all must be 0: otherwise the exit status is 1). Not part of the test suite; see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

PYTHON = sys.executable
CALLER_ID = "soak"
CALLER_TOOL = {
    "name": "echo",
    "description": "Echo the text back",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}
RELAYED_NAME = f"{CALLER_ID}_echo"
INGRESS_INSTANCE = "soak-ingress"
INGRESS_SESSION = "soak"
ANSWERS_IN_FLIGHT = 64  # caller_tool_response calls at a time
CALL_TIMEOUT = 600.0  # the server's caller timeout for this run: the caller holds every answer on purpose
PART_TIMEOUT = 1800.0
PLATEAU_KIB = 1024  # the steady part's RSS has levelled off once it stays this close to its highest
Sample = tuple[float, int, int, int]  # seconds into the steady part, RSS KiB, open fds, calls done


class SoakError(RuntimeError):
    pass


def text_of(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


def structured(result: Any) -> Any:
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(result.content[0].text)


def rss_kib(pid: int) -> int:
    """The process's resident set size, from /proc/PID/status (VmRSS, in KiB)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise SoakError(f"no VmRSS for pid {pid}")


def server_pid(data_dir: Path) -> int:
    """The pid of our oubliette-server child (the SDK's stdio transport does not hand it out)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"oubliette_server" in argv and str(data_dir).encode() in argv:
            return int(entry)
    raise SoakError("cannot find the oubliette-server process")


def token_for(data_dir: Path, instance: str) -> str:
    out = subprocess.run(
        [PYTHON, "-m", "oubliette_server", "token", instance, "--data-dir", str(data_dir)],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


# -- part 1: calls in flight --------------------------------------------------------------


class HeldRequests:
    """The caller's side: collects caller_tool_request events; answers nothing until told to."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.requests: list[dict[str, Any]] = []
        self.all_in_flight = trio.Event()

    async def on_log(self, params: Any) -> None:
        # Runs in the client's receive loop: only record here.
        data = getattr(params, "data", None)
        if getattr(params, "logger", None) == "oubliette" and isinstance(data, dict) and data.get("type") == "caller_tool_request":
            self.requests.append(data)
            if len(self.requests) >= self.expected:
                self.all_in_flight.set()


async def part_calls(caller: Client, held: HeldRequests, data_dir: Path, relay: str, args: argparse.Namespace) -> dict[str, Any]:
    instances = [f"soak{i}" for i in range(args.instances)]
    for i, instance in enumerate(instances):
        declared = await caller.call_tool("session_message", {
            "instance": instance, "session_id": f"s{i}", "message": "soak",
            "context": {"caller_id": CALLER_ID, "caller_tools": [CALLER_TOOL]},
        })
        if declared.is_error:
            raise SoakError(f"session_message failed: {text_of(declared)}")
    # Which agent makes which call: call n goes to agent n % agents.
    agents_spec = [(i, instance, a) for i, instance in enumerate(instances) for a in range(args.agents_per_instance)]
    labels = [f"call-{n}" for n in range(args.calls)]
    results: dict[str, Any] = {}
    wrong: list[str] = []
    answered = Counter[str]()
    refused: list[str] = []

    async def run_agent(index: int, spec: tuple[int, str, int], task_status: trio.TaskStatus[Client]) -> None:
        i, instance, _ = spec
        params = StdioServerParameters(
            command=PYTHON, args=["-m", "oubliette_client", "--log-level", "WARNING"],
            env={"OUBLIETTE_RELAY": relay, "OUBLIETTE_INSTANCE": instance,
                 "OUBLIETTE_TOKEN": token_for(data_dir, instance), "OUBLIETTE_SESSION": f"mcp:s{i}"},
        )
        async with Client(params, mode="legacy") as agent:
            tools = [t.name for t in (await agent.list_tools()).tools]
            if RELAYED_NAME not in tools:
                raise SoakError(f"agent {index} ({instance}) does not see {RELAYED_NAME}; it sees {tools}")
            task_status.started(agent)
            await trio.sleep_forever()  # until the part ends and cancels it

    async def call(agent: Client, label: str) -> None:
        result = await agent.call_tool(RELAYED_NAME, {"text": label})
        if label in results:
            wrong.append(f"{label}: a second result")
        results[label] = result
        if result.is_error or result.structured_content != {"echo": label}:
            wrong.append(f"{label}: {text_of(result) if result.is_error else result.structured_content!r}")

    async def answer(request: dict[str, Any], limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            label = request["arguments"].get("text")
            reply = await caller.call_tool("caller_tool_response", {
                "session_id": request["session_id"], "request_id": request["request_id"], "result": {"echo": label},
            })
            answered[label] += 1
            if reply.is_error:
                refused.append(f"{label}: {text_of(reply)}")

    print(f"  calls: starting {len(agents_spec)} agents on {len(instances)} instances", file=sys.stderr, flush=True)
    async with trio.open_nursery() as agents_nursery:
        agents = [await agents_nursery.start(run_agent, n, spec) for n, spec in enumerate(agents_spec)]
        print(f"  calls: {args.calls} calls, all in flight before the caller answers", file=sys.stderr, flush=True)
        start = time.perf_counter()
        async with trio.open_nursery() as calls:
            for n, label in enumerate(labels):
                calls.start_soon(call, agents[n % len(agents)], label)
            with trio.move_on_after(CALL_TIMEOUT / 2):
                await held.all_in_flight.wait()
            in_flight_at = time.perf_counter()
            in_flight = len(held.requests)
            limiter = trio.CapacityLimiter(ANSWERS_IN_FLIGHT)
            async with trio.open_nursery() as answers:
                for request in list(held.requests):
                    answers.start_soon(answer, request, limiter)
            # Every call was answered; one that still has no result by then is lost, not awaited forever.
            calls.cancel_scope.deadline = trio.current_time() + 120
        done = time.perf_counter()
        agents_nursery.cancel_scope.cancel()

    # Read the log back: one request frame and one result frame per call.
    frame_counts: Counter[tuple[str, str]] = Counter()
    for i, instance in enumerate(instances):
        after = 0
        while True:
            page = structured(await caller.call_tool("session_events", {
                "session_id": f"s{i}", "instance": instance, "after_seq": after, "limit": 200,
                "types": ["caller_tool_request", "caller_tool_result"],
            }))
            for frame in page["frames"]:
                frame_counts[(frame["type"], frame["payload"]["request_id"])] += 1
            if not page["frames"]:
                break
            after = page["next_seq"]
    request_ids = {r["request_id"] for r in held.requests}
    seen_labels = Counter(r["arguments"].get("text") for r in held.requests)
    lost = sorted(set(labels) - set(results)) + sorted(set(labels) - set(seen_labels))
    duplicated = ([f"{label}: {n} request events" for label, n in seen_labels.items() if n > 1]
                  + [f"{label}: answered {n} times" for label, n in answered.items() if n > 1])
    log_problems = [
        f"{rid}: {frame_counts[(kind, rid)]} {kind} frames"
        for rid in request_ids for kind in ("caller_tool_request", "caller_tool_result")
        if frame_counts[(kind, rid)] != 1
    ]
    return {
        "calls": args.calls, "agents": len(agents_spec), "instances": len(instances),
        "in_flight": in_flight, "to_all_in_flight": in_flight_at - start, "wall": done - start,
        "answer_wall": done - in_flight_at, "lost": lost, "duplicated": duplicated,
        "wrong": wrong, "refused": refused, "log_problems": log_problems,
    }


# -- part 2: ingress frames and two readers -----------------------------------------------


async def part_frames(http_socket: Path, args: argparse.Namespace) -> dict[str, Any]:
    total = args.frames
    base = f"/v1/instances/{INGRESS_INSTANCE}/tether"
    query = {"channel": "host", "session_id": INGRESS_SESSION, "types": "user.message"}
    seen: dict[str, list[int]] = {"poll": [], "sse": []}
    order_errors: dict[str, int] = {"poll": 0, "sse": 0}
    caught_up: dict[str, float] = {}
    both_caught_up = trio.Event()
    rejected: list[str] = []

    def client() -> httpx2.AsyncClient:
        return httpx2.AsyncClient(
            transport=httpx2.AsyncHTTPTransport(uds=str(http_socket)), base_url="http://oubliette", timeout=60,
        )

    def record(reader: str, frame: dict[str, Any], last_seq: int) -> int:
        if frame["seq"] <= last_seq:
            order_errors[reader] += 1
        seen[reader].append(int(frame["payload"]["text"]))
        if len(seen[reader]) >= total and reader not in caught_up:
            caught_up[reader] = time.perf_counter()
            if len(caught_up) == 2:
                both_caught_up.set()
        return frame["seq"]

    async def poll_reader(task_status: trio.TaskStatus[None]) -> None:
        async with client() as http:
            after, last = 0, 0
            task_status.started()
            while len(seen["poll"]) < total:
                response = await http.get(base + "/poll", params={**query, "after_seq": after, "limit": 200, "wait_ms": 10000})
                response.raise_for_status()
                page = response.json()
                for frame in page["frames"]:
                    last = record("poll", frame, last)
                after = page["next_seq"]

    async def sse_reader(task_status: trio.TaskStatus[None]) -> None:
        async with client() as http, http.stream("GET", base + "/stream", params={**query, "after_seq": 0}) as response:
            response.raise_for_status()
            task_status.started()
            last = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    last = record("sse", json.loads(line[len("data: "):]), last)
                    if len(seen["sse"]) >= total:
                        return

    next_n = 0

    async def poster() -> None:
        nonlocal next_n
        async with client() as http:
            while next_n < total:
                n = next_n
                next_n += 1
                response = await http.post(base, json={
                    "type": "user.message", "session": {"channel": "host", "id": INGRESS_SESSION}, "payload": {"text": str(n)},
                })
                if response.status_code != 201:
                    rejected.append(f"{n}: {response.status_code} {response.text[:200]}")

    async def progress(done: trio.Event) -> None:
        while not done.is_set():
            with trio.move_on_after(10):
                await done.wait()
            print(f"  frames: posted {next_n}, poll reader {len(seen['poll'])}, SSE reader {len(seen['sse'])}",
                  file=sys.stderr, flush=True)

    print(f"  frames: {total} frames by {args.posters} HTTP clients, a long-poll and an SSE reader following",
          file=sys.stderr, flush=True)
    finished = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress, finished)
        async with trio.open_nursery() as readers:
            await readers.start(poll_reader)
            await readers.start(sse_reader)
            start = time.perf_counter()
            async with trio.open_nursery() as posters:
                for _ in range(args.posters):
                    posters.start_soon(poster)
            posted = time.perf_counter()
            with trio.move_on_after(PART_TIMEOUT / 4):  # a reader that never catches up is reported, not awaited forever
                await both_caught_up.wait()
            readers.cancel_scope.cancel()
        finished.set()

    expected = set(range(total))
    figures: dict[str, Any] = {"frames": total, "posters": args.posters, "post_wall": posted - start, "rejected": rejected}
    for reader in ("poll", "sse"):
        counts = Counter(seen[reader])
        figures[reader] = {
            "seen": len(seen[reader]),
            "lost": len(expected - counts.keys()),
            "duplicated": sum(n - 1 for n in counts.values() if n > 1),
            "out_of_order": order_errors[reader],
            "caught_up_after_last_post": (caught_up[reader] - posted) if reader in caught_up else None,
            "wall": (caught_up[reader] - start) if reader in caught_up else None,
        }
    return figures


# -- part 3: steady load over time -------------------------------------------------------------


def open_fds(pid: int) -> int:
    """How many file descriptors the process holds (entries of /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


async def part_steady(caller: Client, answers: trio.MemoryReceiveChannel[dict[str, Any]], pid: int,
                      data_dir: Path, relay: str, http_socket: Path, args: argparse.Namespace) -> dict[str, Any]:
    instance, session = "soak-steady", "steady"
    declared = await caller.call_tool("session_message", {
        "instance": instance, "session_id": session, "message": "steady",
        "context": {"caller_id": CALLER_ID, "caller_tools": [CALLER_TOOL]},
    })
    if declared.is_error:
        raise SoakError(f"session_message failed: {text_of(declared)}")
    params = StdioServerParameters(
        command=PYTHON, args=["-m", "oubliette_client", "--log-level", "WARNING"],
        env={"OUBLIETTE_RELAY": relay, "OUBLIETTE_INSTANCE": instance,
             "OUBLIETTE_TOKEN": token_for(data_dir, instance), "OUBLIETTE_SESSION": f"mcp:{session}"},
    )
    counts = Counter[str]()
    problems: list[str] = []
    samples: list[Sample] = []
    base = f"/v1/instances/{INGRESS_INSTANCE}/tether"
    query = {"channel": "host", "session_id": "steady", "types": "user.message"}

    async def answerer() -> None:
        async for request in answers:
            reply = await caller.call_tool("caller_tool_response", {
                "session_id": request["session_id"], "request_id": request["request_id"],
                "result": {"echo": request["arguments"].get("text")},
            })
            if reply.is_error:
                problems.append(f"refused answer: {text_of(reply)[:200]}")

    async def caller_load(agent: Client) -> None:
        n = 0
        async with trio.open_nursery() as calls:
            while True:
                n += 1
                calls.start_soon(one_call, agent, f"steady-{n}")
                await trio.sleep(1 / args.rate)

    async def one_call(agent: Client, label: str) -> None:
        result = await agent.call_tool(RELAYED_NAME, {"text": label})
        counts["calls"] += 1
        if result.is_error or result.structured_content != {"echo": label}:
            problems.append(f"{label}: {text_of(result)[:200] if result.is_error else result.structured_content!r}")

    def http() -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=str(http_socket)),
                                  base_url="http://oubliette", timeout=60)

    async def frame_load() -> None:
        async with http() as client:
            n = 0
            while True:
                n += 1
                response = await client.post(base, json={
                    "type": "user.message", "session": {"channel": "host", "id": "steady"}, "payload": {"text": str(n)},
                })
                counts["posted"] += 1
                if response.status_code != 201:
                    problems.append(f"post {n}: {response.status_code} {response.text[:200]}")
                await trio.sleep(1 / args.frame_rate)

    async def reader() -> None:
        async with http() as client:
            after = 0
            while True:
                response = await client.get(base + "/poll", params={**query, "after_seq": after, "limit": 200, "wait_ms": 10000})
                response.raise_for_status()
                page = response.json()
                counts["read"] += len(page["frames"])
                after = page["next_seq"]

    print(f"  steady: {args.rate} calls/s and {args.frame_rate} frames/s for {args.duration:.0f} s, "
          f"a sample every {args.sample:.0f} s", file=sys.stderr, flush=True)
    async with Client(params, mode="legacy") as agent, trio.open_nursery() as nursery:
        nursery.start_soon(answerer)
        start = time.perf_counter()
        samples.append((0.0, rss_kib(pid), open_fds(pid), 0))
        nursery.start_soon(caller_load, agent)
        nursery.start_soon(frame_load)
        nursery.start_soon(reader)
        while (elapsed := time.perf_counter() - start) < args.duration:
            await trio.sleep(min(args.sample, args.duration - elapsed))
            samples.append((time.perf_counter() - start, rss_kib(pid), open_fds(pid), counts["calls"]))
            t, rss, fds, _ = samples[-1]
            print(f"  steady: {t:6.0f} s  RSS {rss / 1024:6.1f} MiB  fds {fds:4d}  calls {counts['calls']}  "
                  f"frames posted {counts['posted']} read {counts['read']}", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()
    return {"samples": samples, "counts": dict(counts), "problems": problems}


def growth_per_hour(samples: list[Sample], column: int) -> float:
    """Least-squares slope of one sample column over the last two thirds of the run, per hour."""
    end = samples[-1][0]
    tail = [s for s in samples if s[0] >= end / 3] or samples
    if len(tail) < 2:
        return 0.0
    mean_t = sum(s[0] for s in tail) / len(tail)
    mean_v = sum(s[column] for s in tail) / len(tail)
    var = sum((s[0] - mean_t) ** 2 for s in tail)
    if var == 0:
        return 0.0
    return 3600 * sum((s[0] - mean_t) * (s[column] - mean_v) for s in tail) / var


def levelled_off(samples: list[Sample]) -> Sample:
    """The first sample from which RSS stays within `PLATEAU_KIB` of the run's highest: where it
    levelled off (if that is in the last third of the run, it was still rising)."""
    highest = max(s[1] for s in samples)
    return next(s for s in samples if highest - s[1] <= PLATEAU_KIB)


def report_steady(steady: dict[str, Any], pid: int, show_samples: bool = False) -> bool:
    samples, counts, problems = steady["samples"], steady["counts"], steady["problems"]
    (_, rss0, fds0, _), (t1, rss1, fds1, _) = samples[0], samples[-1]
    print()
    print("Oubliette soak, steady load")
    print(f"  python {sys.version.split()[0]}, trio {trio.__version__}, {os.cpu_count()} CPUs, server pid {pid}")
    print(f"  {t1:.0f} s: {counts.get('calls', 0)} relayed calls ({counts.get('calls', 0) / t1:.1f}/s), "
          f"{counts.get('posted', 0)} frames posted, {counts.get('read', 0)} read back by the long poll")
    print(f"  RSS: start {rss0 / 1024:.1f} MiB, end {rss1 / 1024:.1f} MiB; "
          f"growth over the last two thirds {growth_per_hour(samples, 1) / 1024:+.1f} MiB/h")
    print(f"  fds: start {fds0}, end {fds1}; growth over the last two thirds {growth_per_hour(samples, 2):+.1f}/h")
    t, rss, _, calls = levelled_off(samples)
    print(f"  RSS {'levelled off' if t < 2 * t1 / 3 else 'still rising'}: within {PLATEAU_KIB // 1024} MiB of its highest ({max(s[1] for s in samples) / 1024:.1f} MiB) "
          f"from {t:.0f} s on, {calls} calls in ({rss / 1024:.1f} MiB then)")
    if show_samples:
        print("  samples:   seconds   calls  RSS MiB  fds")
        for t, rss, fds, calls in samples:
            print(f"           {t:9.0f} {calls:7d} {rss / 1024:8.1f} {fds:4d}")
    for line in problems[:10]:
        print(f"  problem: {line}")
    ok = not problems and counts.get("calls", 0) > 0
    print(f"  result: {'OK' if ok else 'FAILED'}")
    return ok


# -- main ------------------------------------------------------------------------------------


async def soak(workdir: Path, args: argparse.Namespace) -> bool:
    data_dir = workdir / "data"
    relay = f"unix:{workdir / 'relay.sock'}"
    http_socket = workdir / "http.sock"
    config = workdir / "oubliette.toml"
    config.write_text(f'[instances."{INGRESS_INSTANCE}"]\n')
    held = HeldRequests(args.calls)
    server_params = StdioServerParameters(
        command=PYTHON,
        args=["-m", "oubliette_server", "--relay", relay, "--data-dir", str(data_dir), "--config", str(config),
              "--http", f"unix:{http_socket}", "--caller-timeout", str(CALL_TIMEOUT), "--log-level", "WARNING"],
    )
    print("  starting oubliette-server (stdio caller, HTTP on a Unix socket)", file=sys.stderr, flush=True)
    calls: dict[str, Any] | None = None
    frames: dict[str, Any] | None = None
    if args.duration:
        return await soak_steady(server_params, data_dir, relay, http_socket, args)
    with trio.fail_after(2 * PART_TIMEOUT):
        async with Client(server_params, mode="legacy", logging_callback=held.on_log) as caller:
            pid = server_pid(data_dir)
            rss = {"start": rss_kib(pid)}
            if not args.skip_calls:
                calls = await part_calls(caller, held, data_dir, relay, args)
                rss["after calls"] = rss_kib(pid)
            if not args.skip_frames:
                frames = await part_frames(http_socket, args)
                rss["after frames"] = rss_kib(pid)
    return report(calls, frames, rss, pid)


async def soak_steady(server_params: StdioServerParameters, data_dir: Path, relay: str, http_socket: Path,
                      args: argparse.Namespace) -> bool:
    """Part 3 alone: the caller answers each request as its event arrives."""
    send, receive = trio.open_memory_channel[dict[str, Any]](1000)

    async def on_log(params: Any) -> None:
        data = getattr(params, "data", None)
        if getattr(params, "logger", None) == "oubliette" and isinstance(data, dict) and data.get("type") == "caller_tool_request":
            send.send_nowait(data)  # runs in the client's receive loop: hand over, never wait here

    with trio.fail_after(args.duration + 600):
        async with Client(server_params, mode="legacy", logging_callback=on_log) as caller:
            pid = server_pid(data_dir)
            steady = await part_steady(caller, receive, pid, data_dir, relay, http_socket, args)
    return report_steady(steady, pid, args.samples)


def report(calls: dict[str, Any] | None, frames: dict[str, Any] | None, rss: dict[str, int], pid: int) -> bool:
    ok = True
    print()
    print("Oubliette soak")
    print(f"  python {sys.version.split()[0]}, trio {trio.__version__}, {os.cpu_count()} CPUs")
    if calls is not None:
        c = calls
        print()
        print(f"  relayed caller tool calls: {c['calls']} by {c['agents']} agents on {c['instances']} instances")
        print(f"    in flight at once:        {c['in_flight']} (all started, none answered), reached in {c['to_all_in_flight']:.2f} s")
        print(f"    answered and returned in: {c['answer_wall']:.2f} s; whole run {c['wall']:.2f} s, "
              f"{c['calls'] / c['wall']:.0f} calls/s")
        print(f"    lost: {len(c['lost'])}   duplicated: {len(c['duplicated'])}   wrong results: {len(c['wrong'])}   "
              f"refused answers: {len(c['refused'])}   log (1 request + 1 result frame each): {len(c['log_problems'])} off")
        for name in ("lost", "duplicated", "wrong", "refused", "log_problems"):
            if c[name]:
                ok = False
                print(f"    {name}: {c[name][:10]}")
        if c["in_flight"] != c["calls"]:
            ok = False
    if frames is not None:
        f = frames
        print()
        print(f"  ingress frames: {f['frames']} by {f['posters']} HTTP clients in {f['post_wall']:.2f} s, "
              f"{f['frames'] / f['post_wall']:.0f} frames/s; refused: {len(f['rejected'])}")
        if f["rejected"]:
            ok = False
            print(f"    refused: {f['rejected'][:5]}")
        for reader, label in (("poll", "long-poll reader"), ("sse", "SSE reader")):
            r = f[reader]
            lag = r["caught_up_after_last_post"]
            print(f"    {label:<17} saw {r['seen']}; lost: {r['lost']}   duplicated: {r['duplicated']}   "
                  f"out of order: {r['out_of_order']}   "
                  + (f"had every frame {lag:+.2f} s from the last post's answer" if lag is not None else "NEVER caught up"))
            if r["lost"] or r["duplicated"] or r["out_of_order"] or lag is None:
                ok = False
    print()
    print(f"  server RSS (pid {pid}): " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in rss.items()))
    print(f"  result: {'OK (0 lost, 0 duplicated)' if ok else 'FAILED'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="relayed calls in flight at once (default 1000)")
    parser.add_argument("--instances", type=int, default=4, help="instances the calls are spread over (default 4)")
    parser.add_argument("--agents-per-instance", type=int, default=2, help="agents (oubliette-client) per instance (default 2)")
    parser.add_argument("--frames", type=int, default=100_000, help="ingress frames (default 100000)")
    parser.add_argument("--posters", type=int, default=16, help="concurrent HTTP clients posting frames (default 16)")
    parser.add_argument("--skip-calls", action="store_true", help="only the ingress part")
    parser.add_argument("--skip-frames", action="store_true", help="only the calls part")
    parser.add_argument("--duration", type=float, default=0,
                        help="run the steady part for this many seconds instead of parts 1 and 2")
    parser.add_argument("--rate", type=float, default=20, help="steady part: relayed calls per second (default 20)")
    parser.add_argument("--frame-rate", type=float, default=20, help="steady part: ingress frames per second (default 20)")
    parser.add_argument("--sample", type=float, default=60, help="steady part: seconds between RSS/fd samples (default 60)")
    parser.add_argument("--samples", action="store_true",
                        help="steady part: print every sample (seconds, calls, RSS, fds) in the report")
    args = parser.parse_args()
    if min(args.calls, args.instances, args.agents_per_instance, args.frames, args.posters) < 1:
        parser.error("counts must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="oub-soak-", dir="/tmp"))  # short: Unix socket paths are limited
    try:
        ok = trio.run(soak, workdir, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
