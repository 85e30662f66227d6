"""Relay fuzz: thousands of hostile inputs against one running server, a healthy session beside them.

One real `oubliette-server` process serves a caller over stdio (this test owns the process, so it
can tell the moment it dies). The caller declares a tool in session `s1` of `box1`, and an agent
(the SDK's `Client` spawning the real `oubliette-client`) keeps calling it while the caller
answers from its events. Meanwhile more than 2,000 generated inputs (a seeded generator, so the
same set every run) go to the relay socket over a pool of concurrent raw connections: random
bytes, truncated and mis-shaped JSON-RPC, wrong types, deep nesting, lines over the 1 MiB limit,
slow and half lines, a valid `hello` then garbage, wrong roles and methods, someone else's
request ids, cancels of unknown ids, acks out of range. A list of hand-made cases makes sure the
rare ones (deep, oversize, held-open half lines, bursts of requests refused at once) are surely
in the set. Then a flood: 200 connections that never say hello, each opened again as soon as
the server closes it, past the relay's cap (64 here, `relay_max_connections`).

Asserted: the server never exits; each bad connection is answered or closed within its deadline
(a connection that is neither answered nor closed in time fails the test), and a connection
whose first line is not a valid `hello` always gets an error object before the close; a burst
of requests (more than the 64 queued frames that once held the answers too) gets every answer,
with the connection open; every line the server sends is a JSON-RPC object; every healthy call returns its own result, during
the fuzz, during the flood and after them; during the flood a new sandbox's hello is answered, and
the flood is evicted (the relay listener's flood WARNING says so).
"""

from __future__ import annotations

import functools
import json
import random
import re
import subprocess
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import attrs
import mcp_types as types
import trio
from mcp import Client
from mcp.shared.message import SessionMessage

from harness import (
    EVENT_TIMEOUT, PYTHON, Deployment, EventLog, Progress, RawRelay, hello_outcome, never_say_hello, structured, text_of,
)
from oubliette_server.core.server_owned import SERVER_OWNED_KEYS, SERVER_OWNED_TYPES, SESSION_RECORD
from oubliette_server.store.sqlite import MAX_LIMIT, FrameQuery, FrameStore

INSTANCE = "box1"
OTHER_INSTANCE = "box2"
SESSION = "s1"
SESSION_KEY = f"mcp:{SESSION}"
PROTOCOL = "oubliette-relay/1"
MAX_FRAME_BYTES = 1024 * 1024
HELLO_TIMEOUT = 5.0  # the server's (relay_hello_timeout, oubliette_server.doors.connection_limits.DEFAULT_RELAY_HELLO_TIMEOUT)

GENERATED = 2000  # seeded generated cases; the hand-made ones come on top
POOL = 16  # raw connections at a time
HEALTHY_EVERY = 40  # finished cases between two healthy calls (the calls overlap the cases in flight)
DEADLINE = 15.0  # for a connection that sends EOF (or a line over the limit): answered or closed by then (margin for a loaded machine)
HELD_OPEN_DEADLINE = HELLO_TIMEOUT + 15.0  # a half line held open before hello waits out the hello timeout
TEST_DEADLINE = 300.0  # the whole test, so that no failure mode can hang the run
RELAY_CAP = 64  # the server's relay_max_connections: above the cases at a time and the healthy session's
FLOOD = 200  # connections that never say hello, past RELAY_CAP
FLOOD_CALLS = 5  # healthy calls during the flood

NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}},
}
METHODS = ["hello", "caller_tool", "toolset_call", "append_frame", "ack", "cancel", "user_message",
           "caller_tools_config", "toolsets_config", "no_such_method", ""]


@attrs.frozen
class Case:
    """One bad connection: an optional valid `hello`, then `chunks`, then EOF (unless `eof` is False).

    `phase` is "pre" (no hello), "client", "client_session" (bound to the healthy session), or
    "guest", each of `instance` (the healthy session's by default). Guests of one instance replace
    each other, so a case that must see its own answer plays a guest of an instance of its own.
    `pace` seconds between chunks make a slow sender. `expect_error`: an error object must come
    before the close; `expect_code`: that error's code. `deadline`: seconds from connecting to
    the close. `answers`: a burst, the request ids 1..answers, each of which must be answered
    before the case ends (it ends when they are, without EOF; the server must not close first).
    `await_reply`: EOF only once a reply came (a peer's EOF ends its connection and the requests
    still in flight, so a request-level refusal is seen only by a peer that waits).
    """

    kind: str
    phase: str
    chunks: tuple[bytes, ...]
    eof: bool = True
    pace: float = 0.0
    expect_error: bool = False
    expect_code: int | None = None
    deadline: float = DEADLINE
    instance: str = INSTANCE
    answers: int = 0
    await_reply: bool = False

    def describe(self) -> str:
        data = b"".join(self.chunks)
        shown = repr(data[:160]) + (f"… ({len(data)} bytes)" if len(data) > 160 else "")
        return f"{self.kind}/{self.phase}@{self.instance} eof={self.eof} pace={self.pace} chunks={len(self.chunks)}: {shown}"


# -- generated inputs ---------------------------------------------------------------------
# A seeded generator rather than hypothesis: hypothesis's engine takes ~15 ms an example on this
# machine, 30 s for the set alone; this one makes the same 2,000 cases every run in well under 1 s.

SEED = 20261122
PARAM_FIELDS = {
    "hello": ["protocol", "role", "instance", "token", "session"],
    "caller_tool": ["tool", "arguments", "caller_id"],
    "toolset_call": ["name", "arguments"],
    "append_frame": ["session", "type", "payload", "reply_to"],
    "ack": ["seq"],
    "cancel": ["id"],
}
GOOD_FIELD_VALUES: dict[str, list[Any]] = {
    "protocol": [PROTOCOL, "oubliette-relay/2"], "role": ["client", "guest", "caller", "admin"],
    "instance": [INSTANCE, OTHER_INSTANCE, "boxA\n", "", "a" * 65], "token": ["0" * 64, "tøken", "\ud800"],
    "session": [SESSION_KEY, "", ":", "mcp:", "a@b", "\ud800", {"channel": "mcp", "id": SESSION}],
    "tool": ["send_notification", "nope", ""], "name": ["ext.echo", "nope"],
    "type": ["assistant.delta", "user.message", "caller_tool_result", "session.error", "x", "session_record",
             "approval_resolved"],
    "seq": [0, 1, -1, 2**63, 2**70, 1.5], "id": [0, 1, 2, 7, 2**63, -1, "1"],
    "caller_id": ["myapp", "someone_else", ""], "arguments": [{}, {"message": "fuzz"}],
    "payload": [{}, {"text": "fuzz"}, {"text": "fuzz", "caller_tools": {"caller_id": "myapp", "tools": []}},
                {"text": "fuzz", "owner": "key:fuzz"}], "reply_to": ["m-1", ""],
}
TEXT_ALPHABET = "ab:_.-@ \n\t\"\\{}[]é€\u0000\u0001\u2028\ud800\U0001F600"


class Generator:
    """Seeded random JSON-RPC-ish inputs: values, envelopes, lines, cases."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self, size: int = 8) -> str:
        return "".join(self.rng.choice(TEXT_ALPHABET) for _ in range(self.rng.randint(0, size)))

    def scalar(self) -> Any:
        r = self.rng
        return r.choice([
            lambda: None, lambda: r.random() < 0.5, lambda: r.randint(-5, 5), lambda: r.randint(-(2**70), 2**70),
            lambda: r.uniform(-1e300, 1e300), lambda: self.text(),
        ])()

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.random()
        if depth > 3 or kind < 0.5:
            return self.scalar()
        if kind < 0.75:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        return {self.text(5): self.value(depth + 1) for _ in range(r.randint(0, 3))}

    def envelope(self) -> dict[str, Any]:
        """Each JSON-RPC member present or not, of the right type or not."""
        r = self.rng
        method = r.choice(METHODS) if r.random() < 0.8 else self.value()
        message: dict[str, Any] = {}
        if r.random() < 0.8:
            message["jsonrpc"] = r.choice(["2.0", "2.0", "2.0", "1.0", 2.0, None, ""]) if r.random() < 0.9 else self.value()
        if r.random() < 0.6:
            message["id"] = r.choice([r.randint(0, 50), r.randint(-(2**70), 2**70), self.text(), True, 1.0, None, [1]])
        if r.random() < 0.85:
            message["method"] = method
        if r.random() < 0.8:
            fields = PARAM_FIELDS.get(method if isinstance(method, str) else "", [])
            if fields and r.random() < 0.7:
                message["params"] = {
                    field: r.choice(GOOD_FIELD_VALUES[field]) if r.random() < 0.6 else self.value()
                    for field in fields if r.random() < 0.7
                }
            else:
                message["params"] = self.value()
        for extra in ("result", "error"):
            if r.random() < 0.15:
                message[extra] = self.value() if r.random() < 0.5 else {"code": self.value(), "message": self.value()}
        return message

    def line(self) -> bytes:
        """One input line (maybe without its newline): random bytes, a mis-shaped message, or a truncated one."""
        r = self.rng
        how = r.choice(["bytes", "envelope", "envelope", "truncated", "value"])
        if how == "bytes":
            return r.randbytes(r.randint(0, 200))
        if how == "value":
            return encode(self.value()) + b"\n"
        body = encode(self.envelope())
        if how == "truncated":
            return body[: r.randint(0, max(len(body) - 1, 0))] + r.choice([b"\n", b""])
        return body + b"\n"

    def split(self, data: bytes) -> tuple[bytes, ...]:
        """`data` cut at a few random points (a sender whose lines arrive in pieces)."""
        cuts = sorted({self.rng.randint(0, len(data)) for _ in range(self.rng.randint(1, 12))})
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        return tuple(p for p in pieces if p) or (data,)

    def case(self) -> Case:
        r = self.rng
        phase = r.choice(["pre", "pre", "client", "client_session", "guest", "other"])
        instance = INSTANCE
        if phase == "other":
            phase, instance = "client", OTHER_INSTANCE
        data = b"".join(self.line() for _ in range(r.randint(1, 4)))
        delivery = r.choice(["whole", "split", "slow"])
        chunks = (data,) if delivery == "whole" else self.split(data)
        # Slow: a sender that dribbles its pieces; the pause is the input's pacing, not a wait for an event.
        pace = 0.002 if delivery == "slow" else 0.0
        # Before hello, anything but EOF alone must be refused with an error object.
        return Case("generated", phase, chunks, pace=pace, expect_error=phase == "pre" and bool(data), instance=instance)


def encode(message: Any) -> bytes:
    """JSON as a careless peer writes it: not ASCII-escaped, lone surrogates passed through as bytes."""
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")


def generated_cases(count: int, seed: int = SEED) -> list[Case]:
    """`count` cases, the same ones for the same seed."""
    generator = Generator(seed)
    return [generator.case() for _ in range(count)]


# -- hand-made cases: the rare ones, surely in the set --------------------------------------


def nested(depth: int, leaf: Any = 0) -> str:
    """JSON text of `depth` nested arrays and objects around `leaf`."""
    opening = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opening + json.dumps(leaf) + closing


def request(request_id: Any, method: str, params_text: str) -> bytes:
    return f'{{"jsonrpc":"2.0","id":{json.dumps(request_id)},"method":"{method}","params":{params_text}}}\n'.encode()


def notification(method: str, params: Any) -> bytes:
    return encode({"jsonrpc": "2.0", "method": method, "params": params}) + b"\n"


def explicit_cases(token: str) -> list[Case]:
    out: list[Case] = []
    # Deep nesting, in every place a peer can put it (depth >= 256 once crashed a peer).
    for depth in (63, 64, 65, 128, 255, 256, 300, 500, 990, 5000, 100_000):
        value = nested(depth)
        out += [
            Case(f"deep{depth}-line", "pre", (value.encode() + b"\n",), expect_error=True),
            Case(f"deep{depth}-hello", "pre", (request(0, "hello", f'{{"protocol":"{PROTOCOL}","role":"client",'
                 f'"instance":"{INSTANCE}","token":"{token}","session":{value}}}'),), expect_error=True),
            Case(f"deep{depth}-caller_tool", "client_session",
                 (request(1, "caller_tool", f'{{"tool":"send_notification","arguments":{{"message":{value}}}}}'),)),
            Case(f"deep{depth}-caller_tool-args", "client",
                 (request(1, "caller_tool", f'{{"tool":"send_notification","arguments":{{"x":{value}}}}}'),)),
            Case(f"deep{depth}-append_frame", "guest", (request(
                1, "append_frame", f'{{"session":{{"channel":"mcp","id":"{SESSION}"}},"type":"assistant.delta",'
                f'"payload":{{"text":"deep","x":{value}}}}}'),)),
            Case(f"deep{depth}-cancel", "client", (f'{{"jsonrpc":"2.0","method":"cancel","params":{{"id":{value}}}}}\n'.encode(),)),
            Case(f"deep{depth}-ack", "guest", (f'{{"jsonrpc":"2.0","method":"ack","params":{{"seq":{value}}}}}\n'.encode(),)),
            Case(f"deep{depth}-response", "client", (f'{{"jsonrpc":"2.0","id":1,"result":{value}}}\n'.encode(),)),
        ]
    # Over the 1 MiB line limit: whole, in pieces, without a newline and held open (the reader
    # must refuse it as soon as it is too long), just under and just over the limit.
    big = request(5, "caller_tool", json.dumps({"tool": "send_notification", "arguments": {"message": "x" * (MAX_FRAME_BYTES + 10)}}))
    for phase, instance in (("pre", INSTANCE), ("client_session", INSTANCE), ("guest", "lone-oversize")):
        out += [attrs.evolve(case, instance=f"{instance}-{i}" if phase == "guest" else instance) for i, case in enumerate([
            Case("oversize", phase, (big,), expect_error=True, expect_code=-32600),
            Case("oversize-pieces", phase, tuple(big[i:i + 100_000] for i in range(0, len(big), 100_000)),
                 expect_error=True, expect_code=-32600),
            Case("oversize-held-open", phase, (big[:-1],), eof=False, expect_error=True, expect_code=-32600),
            Case("oversize-no-newline", phase, (b"y" * (MAX_FRAME_BYTES + 1),), eof=False,
                 expect_error=True, expect_code=-32600),
            Case("limit+1", phase, (b" " * (MAX_FRAME_BYTES + 1) + b"\n",), expect_error=True, expect_code=-32600),
            Case("at-limit", phase, (b" " * MAX_FRAME_BYTES + b"\n",), expect_error=True),
            # Under the limit as sent (U+0001 escaped), well over it once a caller event carries it.
            Case("escaped-control-chars", phase, (json.dumps({"jsonrpc": "2.0", "id": 9, "method": "caller_tool", "params": {
                "tool": "send_notification", "arguments": {"message": "\u0001" * 170_000}}}).encode() + b"\n",)),
        ])]
    # Session keys at every door (the hypothesis test at the end plays every door and checks the
    # answers): here, a guest's append_frame with keys outside the rule, beside the healthy session
    # (the connection ends at EOF, before its answer: the server must just stay well).
    bad_keys = [("mcp", "x" * 500_000), ("mcp", "s\n"), ("mcp", "s\u0000"), ("mcp", "\ud800"), ("mcp", ""),
                ("", SESSION), ("c" * 65, SESSION), ("c\ud800", SESSION)]
    for i, (channel, session_id) in enumerate(bad_keys):
        params = json.dumps({"session": {"channel": channel, "id": session_id}, "type": "assistant.delta", "payload": {}})
        out.append(Case("session-key-append_frame", "guest", (request(1, "append_frame", params),),
                        instance=f"lone-keys-{i}"))
    # Half lines held open before hello: the hello deadline must answer them.
    for data in (b'{"jsonrpc":"2.0","id":0,"method":"hel', b"{", b"garbage", b" "):
        out.append(Case("half-held-open", "pre", (data,), eof=False, expect_error=True,
                        expect_code=-32600, deadline=HELD_OPEN_DEADLINE))
    # Half lines ended by EOF, in every phase (a final line without a newline still counts).
    for phase in ("pre", "client", "client_session", "guest"):
        for data in (b'{"jsonrpc":"2.0","id":3,"method":"caller_tool","params":{"tool":"send_notif', b'{"a":', b"\xff\xfe"):
            out.append(Case("half-eof", phase, (data,), expect_error=phase == "pre"))
        # A message dribbled in 3 bytes at a time.
        slow = request(4, "caller_tool", '{"tool":"nope","arguments":{}}')
        out.append(Case("slow-line", phase, tuple(slow[i:i + 3] for i in range(0, len(slow), 3)),
                        pace=0.001, expect_error=phase == "pre"))
    # Someone else's request ids: cancels and responses for ids the healthy agent uses on its own
    # connection, and a duplicate id in flight.
    for request_id in range(0, 40):
        out.append(Case("cancel-others-id", "client_session", (notification("cancel", {"id": request_id}),)))
        out.append(Case("response-others-id", "client", (encode({"jsonrpc": "2.0", "id": request_id, "result": {"echo": "forged"}}) + b"\n",)))
    duplicate = request(7, "caller_tool", '{"tool":"send_notification","arguments":{"message":"dup"}}')
    out.append(Case("duplicate-id", "client_session", (duplicate, duplicate)))
    # Cancels of unknown ids, acks out of range, wrong roles and methods.
    for value in (10**6, -1, 2**63, 2**70, "nope", 1.5, None, [], {}, True):
        out.append(Case("cancel-unknown", "client", (notification("cancel", {"id": value}),)))
        out.append(Case("ack-out-of-range", "guest", (notification("ack", {"seq": value}),)))
        out.append(Case("ack-from-client", "client", (notification("ack", {"seq": value}),)))
    # What only the server states (oubliette_server/core/server_owned.py): each type, and each record key in
    # an otherwise ordinary frame, refused with -32602 (a guest of an instance of its own, so that
    # it surely sees its answer).
    owned: list[tuple[str, dict[str, Any]]] = [(t, {}) for t in sorted(SERVER_OWNED_TYPES)]
    owned += [(t, {"text": "rm", key: value}) for t in ("assistant.done", "assistant.delta", "status.presence")
              for key, value in (("caller_tools", {"caller_id": "myapp", "tools": [{"name": "rm", "requires_approval": False}]}),
                                 ("owner", "key:" + "0" * 32))]
    for i, (type_, payload) in enumerate(owned):
        out.append(Case(f"server-owned-{type_}", "guest", (encode({"jsonrpc": "2.0", "id": 12, "method": "append_frame", "params": {
            "session": {"channel": "mcp", "id": SESSION}, "type": type_, "payload": payload}}) + b"\n",),
            expect_error=True, expect_code=-32602, instance=f"lone-owned-{i}", await_reply=True))
    for phase, instance in (("client", INSTANCE), ("client_session", INSTANCE), ("guest", INSTANCE), ("client", OTHER_INSTANCE)):
        for method, params in (("append_frame", {"session": {"channel": "mcp", "id": SESSION}, "type": "assistant.delta"}),
                               ("caller_tool", {"tool": "send_notification", "arguments": {}}),
                               ("hello", {"protocol": PROTOCOL, "role": "client", "instance": INSTANCE, "token": token}),
                               ("user_message", {}), ("caller_tools_config", {}), ("no_such_method", {})):
            out.append(Case("role-method", phase, (encode({"jsonrpc": "2.0", "id": 11, "method": method, "params": params}) + b"\n",),
                            instance=instance))
    # Response bursts: more requests than the 64 queued frames (and than the 256 a connection may
    # hold at once), each refused at once, in one write or in pieces: every one is answered.
    for phase, instance, method, params in (
        ("client", INSTANCE, "no_such_method", {}),
        ("client_session", INSTANCE, "caller_tool", {"tool": "nope", "arguments": {}}),
        ("client", INSTANCE, "toolset_call", {"name": "nope.nope", "arguments": {}}),
        ("guest", "lone-burst", "caller_tool", {"tool": "send_notification", "arguments": {}}),
    ):
        burst = b"".join(
            encode({"jsonrpc": "2.0", "id": i, "method": method, "params": params}) + b"\n" for i in range(1, BURST + 1))
        out.append(Case(f"burst-{method}", phase, (burst,), eof=False, instance=instance, answers=BURST))
        out.append(Case(f"burst-pieces-{method}", phase, tuple(burst[i:i + 1000] for i in range(0, len(burst), 1000)),
                        eof=False, instance=f"{instance}-pieces" if phase == "guest" else instance, answers=BURST))
    return out


BURST = 300  # requests in one response burst


# -- the running server, owned by the test -----------------------------------------------


@asynccontextmanager
async def stdio_transport(process: trio.Process) -> AsyncIterator[tuple[Any, Any]]:
    """An MCP client transport over a process's stdin/stdout (what `stdio_client` does, but the
    test keeps the process, so it can see the server exit)."""
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    to_client, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_client = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        async with to_client:
            buffer = b""
            while chunk := await stdout.receive_some(65536):
                *complete, buffer = (buffer + chunk).split(b"\n")
                for line in complete:
                    try:
                        message: SessionMessage | Exception = SessionMessage(
                            types.jsonrpc_message_adapter.validate_json(line, by_name=False))
                    except ValueError as exc:  # as the SDK's stdio transport: a bad line is an error value
                        message = exc
                    await to_client.send(message)

    async def write() -> None:
        async with from_client:
            async for message in from_client:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await stdin.send_all(data.encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)
        try:
            yield from_server, to_server
        finally:
            nursery.cancel_scope.cancel()


def stderr_excerpt(path: Any, lines: int = 30) -> str:
    """The server's distinct exception lines (where a crash names its cause), its first error and
    its last lines."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    causes = list(dict.fromkeys(
        line.strip() for line in text if re.search(r"\b\w*(Error|Exception)\b[^:]*:|raised exception", line)))
    first = next((i for i, line in enumerate(text) if " ERROR " in line or line.startswith("Traceback")), None)
    head = text[first: first + lines] if first is not None else []
    return "\n".join(["exception lines:", *causes[:12], "first error:", *head, "last lines:", *text[-lines:]])


@attrs.define
class Server:
    """The server process and where its stderr goes."""

    process: trio.Process
    stderr_path: Any

    def diagnosis(self) -> str:
        state = "still runs" if self.process.returncode is None else f"exited with {self.process.returncode}"
        return f"oubliette-server {state}; stderr:\n{stderr_excerpt(self.stderr_path)}"

    def check_alive(self) -> None:
        assert self.process.returncode is None, self.diagnosis()


@asynccontextmanager
async def running_server(deployment: Deployment) -> AsyncIterator[tuple[Server, Client, EventLog]]:
    """The real oubliette-server with this test as its stdio caller; a watcher fails the test at
    once if the process exits while the test runs."""
    stderr_path = deployment.root / "server.stderr"
    config = deployment.root / "fuzz.toml"
    config.write_text(f"[server]\nrelay_max_connections = {RELAY_CAP}\n")
    with open(stderr_path, "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_server", "--relay", deployment.relay, "--data-dir", str(deployment.data_dir),
             "--log-level", "WARNING", "--config", str(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        )
    server = Server(process, stderr_path)
    stopping = False
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await process.wait()
                if not stopping:
                    server.check_alive()

            nursery.start_soon(watch)
            log = EventLog()
            async with Client(stdio_transport(process), mode="legacy", logging_callback=log.on_log) as client:
                yield server, client, log
                server.check_alive()
                stopping = True
            nursery.cancel_scope.cancel()
    finally:
        stopping = True
        # As an MCP client ends a stdio server: close its stdin, then a signal if it lingers.
        # (today SIGTERM alone does not stop a server whose stdin is still open: its stdin read blocks.)
        with trio.CancelScope(shield=True):
            assert process.stdin is not None
            await process.stdin.aclose()
            with trio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


# -- one bad connection ------------------------------------------------------------------


REPLACED = "replaced"


async def run_case(case: Case, deployment: Deployment, token_for: Callable[[str], str]) -> str | None:
    """Play `case` on a fresh connection; None if the server behaved, `REPLACED` if a guest was
    replaced by a newer one before its input went out, else what went wrong."""
    with trio.fail_after(case.deadline):  # a listener that stops accepting fails here
        stream = await trio.open_unix_socket(str(deployment.socket))
    received = bytearray()
    closed = False
    replied = trio.Event()

    async def receive_until_close(done: trio.CancelScope) -> None:
        nonlocal closed
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                closed = True
                replied.set()
                return
            received.extend(chunk)
            if b"\n" in received:
                replied.set()
            if case.answers and len(answered()) >= case.answers:
                done.cancel()  # the burst is answered: the case ends here, the connection open

    def answered() -> list[Any]:
        """Ids of the responses received so far (notifications have none; a line that is not
        JSON is reported by the checks at the end)."""
        ids = []
        for line in bytes(received).split(b"\n")[:-1]:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and "id" in message:
                ids.append(message["id"])
        return ids

    async def messages_so_far() -> list[dict[str, Any]]:
        out = []
        for line in bytes(received).split(b"\n")[:-1]:
            out.append(json.loads(line))
        return out

    try:
        with trio.move_on_after(case.deadline) as scope:
            if case.phase != "pre":
                role = "guest" if case.phase == "guest" else "client"
                params: dict[str, Any] = {"protocol": PROTOCOL, "role": role, "instance": case.instance,
                                          "token": token_for(case.instance)}
                if case.phase == "client_session":
                    params["session"] = SESSION_KEY
                try:
                    await stream.send_all(encode({"jsonrpc": "2.0", "id": "hello-0", "method": "hello", "params": params}) + b"\n")
                except trio.BrokenResourceError as exc:
                    return f"closed before a valid hello was read: {exc}"
                while not any(m.get("id") == "hello-0" for m in await messages_so_far()):
                    try:
                        chunk = await stream.receive_some(65536)
                    except trio.BrokenResourceError:
                        chunk = b""
                    if not chunk:
                        if case.phase == "guest" and case.instance == INSTANCE:
                            return REPLACED  # a newer guest of the instance took over: the server's rule
                        return f"closed during a valid hello: {bytes(received)[:300]!r}"
                    received.extend(chunk)
                hello = next(m for m in await messages_so_far() if m.get("id") == "hello-0")
                if "result" not in hello:
                    return f"valid hello refused: {hello}"
                del received[: received.rindex(b"\n") + 1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_until_close, nursery.cancel_scope)

                async def send() -> None:
                    try:
                        for i, chunk in enumerate(case.chunks):
                            if i and case.pace:
                                await trio.sleep(case.pace)
                            await stream.send_all(chunk)
                        if case.await_reply:
                            await replied.wait()
                        if case.eof:
                            await stream.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the server may close before it has read everything

                nursery.start_soon(send)
        if scope.cancelled_caught and not closed:
            return f"neither answered nor closed within {case.deadline:g} s; got {bytes(received)[:300]!r}"
        if case.answers and closed:
            return f"closed after {len(answered())} of {case.answers} answers to a burst"
    finally:
        await stream.aclose()

    try:
        answers = await messages_so_far()
    except ValueError as exc:
        return f"server sent a line that is not JSON ({exc}): {bytes(received)[:300]!r}"
    for message in answers:
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return f"server sent a non-JSON-RPC message: {message!r}"
        if "error" in message:
            error = message["error"]
            if not (isinstance(error.get("code"), int) and isinstance(error.get("message"), str)):
                return f"malformed error object: {message!r}"
    errors = [m for m in answers if "error" in m]
    if case.answers and sorted(answered()) != list(range(1, case.answers + 1)):
        return f"a burst of {case.answers} requests got answers to {sorted(answered())[:20]}…"
    if case.expect_error and not errors:
        return f"closed without an error object; got {answers!r}"
    if case.expect_code is not None and not any(e["error"]["code"] == case.expect_code for e in errors):
        return f"expected error {case.expect_code}, got {answers!r}"
    return None


# -- the test ------------------------------------------------------------------------------


async def declare(caller: Client) -> None:
    result = await caller.call_tool("session_message", {
        "instance": INSTANCE, "session_id": SESSION, "message": "hi",
        "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
    })
    assert not result.is_error, text_of(result)


async def healthy_call(server: Server, agent: Client, caller: Client, events: EventLog, label: str) -> None:
    """One relayed call, answered by the caller from its events; the agent must get exactly its result."""
    try:
        await _healthy_call(agent, caller, events, label)
    except Exception as exc:  # TooSlowError, an MCP error, an exception group of those, a wrong result
        raise AssertionError(f"healthy call {label} failed ({exc!r}, within {EVENT_TIMEOUT:g} s); "
                             f"{server.diagnosis()}") from exc


async def _healthy_call(agent: Client, caller: Client, events: EventLog, label: str) -> None:
    outcome: dict[str, Any] = {}

    async def call() -> None:
        outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": label})

    with trio.fail_after(EVENT_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            request = await events.wait_for(
                lambda e: e.get("type") == "caller_tool_request" and e.get("arguments") == {"message": label})
            reply = await caller.call_tool("caller_tool_response", {
                "session_id": SESSION, "request_id": request["request_id"], "result": {"echo": label},
            })
            assert not reply.is_error, text_of(reply)
            assert structured(reply) == {"resolved": True}
    result = outcome["result"]
    assert not result.is_error, f"healthy call {label} failed: {text_of(result)}"
    assert result.structured_content == {"echo": label}


def test_the_generated_set_is_large_and_varied() -> None:
    """The fuzz set is what the issue asks for, and the same every run."""
    first = generated_cases(GENERATED)
    assert len(first) == GENERATED
    assert first == generated_cases(GENERATED), "the generated set must be deterministic"
    assert {(c.phase, c.instance) for c in first} == {
        ("pre", INSTANCE), ("client", INSTANCE), ("client_session", INSTANCE), ("guest", INSTANCE), ("client", OTHER_INSTANCE)}
    assert any(c.pace for c in first) and any(len(c.chunks) > 1 for c in first)
    explicit = explicit_cases("t" * 64)
    kinds = {c.kind.split("-")[0] for c in explicit}
    assert {"deep256", "oversize", "half", "cancel", "ack", "role", "burst", "server", "session"} <= kinds


async def test_relay_fuzz_keeps_server_and_healthy_session_alive(deployment: Deployment) -> None:
    token_for = functools.cache(deployment.token)
    token = token_for(INSTANCE)
    all_cases = explicit_cases(token) + generated_cases(GENERATED)
    assert len(all_cases) >= 2000
    failures: list[str] = []
    replaced: list[Case] = []
    healthy_calls: dict[str, Any] = {"during": 0, "in_flood": 0, "new_sandbox": None, "after": 0}

    with trio.fail_after(TEST_DEADLINE):
        await fuzz_against_a_healthy_session(deployment, token_for, all_cases, failures, replaced, healthy_calls)

    assert not failures, f"{len(failures)} of {len(all_cases)} bad connections misbehaved:\n" + "\n".join(failures[:40])
    assert await server_owned_in_log(deployment) == []
    assert healthy_calls["during"] >= 10, healthy_calls  # the session was used throughout, not just before and after
    assert healthy_calls["in_flood"] == FLOOD_CALLS and healthy_calls["new_sandbox"] == "ok", healthy_calls
    assert f"connections without a valid hello evicted at the cap of {RELAY_CAP}" in (deployment.root / "server.stderr").read_text()
    # Concurrent guests of one instance replace each other; most must still have been played.
    guests = sum(1 for c in all_cases if c.phase == "guest")
    assert len(replaced) < guests / 2, f"{len(replaced)} of {guests} guest cases were replaced before playing"


async def server_owned_in_log(deployment: Deployment) -> list[str]:
    """Frames of the (stopped) server's log that carry a server-owned payload key, or a
    `session_record` other than the server's own of the healthy caller's `declare`: none of the
    fuzz's may have got in."""
    store = FrameStore(deployment.data_dir / "frames.sqlite3")
    found: list[str] = []
    try:
        for instance in await store.instances():
            after = 0
            while page := await store.query(instance, FrameQuery(after_seq=after, limit=MAX_LIMIT)):
                after = page[-1].seq
                found += [f"{instance} #{f.seq} {f.type} {f.payload!r:.120}" for f in page
                          if (f.type == SESSION_RECORD or SERVER_OWNED_KEYS.intersection(f.payload))
                          and not declared_by_the_server(f)]
    finally:
        store.close()
    return found


def declared_by_the_server(frame: Any) -> bool:
    """The server's `session_record` of the healthy session: what `declare` declared, and nothing else."""
    declared = frame.payload.get("caller_tools") or {}
    return frame.type == SESSION_RECORD and frame.session.key == SESSION_KEY and frame.instance == INSTANCE \
        and set(frame.payload) == {"owner", "caller_tools"} and declared.get("caller_id") == "myapp" \
        and [tool.get("name") for tool in declared.get("tools", [])] == [NOTIFY["name"]]


async def fuzz_against_a_healthy_session(
    deployment: Deployment, token_for: Callable[[str], str], all_cases: list[Case],
    failures: list[str], replaced: list[Case], healthy_calls: dict[str, int],
) -> None:
    """Start the server and the healthy session, play every case beside it, then call again."""
    async with running_server(deployment) as (server, caller, events):
        await declare(caller)
        async with deployment.agent(INSTANCE, SESSION_KEY) as agent:
            await healthy_call(server, agent, caller, events, "healthy-before")
            progress = Progress()  # cases finished: the healthy session paces itself on it

            async def keep_calling() -> None:
                """A healthy call every HEALTHY_EVERY finished cases, until the last case is done."""
                n = 0
                while progress.done < len(all_cases):
                    await healthy_call(server, agent, caller, events, f"healthy-during-{n}")
                    n += 1
                    healthy_calls["during"] = n
                    await progress.reach(min(progress.done + HEALTHY_EVERY, len(all_cases)))

            async def fuzz() -> None:
                limiter = trio.CapacityLimiter(POOL)
                relay_gone: list[str] = []

                async def one(case: Case, pool: trio.Nursery) -> None:
                    async with limiter:
                        try:
                            problem = await run_case(case, deployment, token_for)
                        except OSError as exc:  # the relay listener is gone: nothing else can pass
                            relay_gone.append(f"cannot connect to the relay ({exc}) at {case.describe()}")
                            pool.cancel_scope.cancel()
                            return
                    if problem == REPLACED:
                        replaced.append(case)
                    elif problem:
                        failures.append(f"{case.describe()}\n    -> {problem}")
                    progress.advance()

                async with trio.open_nursery() as pool:
                    for case in all_cases:
                        pool.start_soon(one, case, pool)
                if relay_gone:
                    with trio.move_on_after(EVENT_TIMEOUT):  # a dying server prints its cause on the way out
                        await server.process.wait()
                    raise AssertionError(f"{relay_gone[0]}; {server.diagnosis()}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_calling)
                nursery.start_soon(fuzz)

            server.check_alive()
            async with trio.open_nursery() as flood:  # the cases are done: a flood past the relay's cap
                closed = Progress()
                for _ in range(FLOOD):
                    flood.start_soon(never_say_hello, deployment, closed)
                with trio.fail_after(EVENT_TIMEOUT):
                    await closed.reach(FLOOD)  # as many closed by the server as there are flooders
                for n in range(FLOOD_CALLS):
                    await healthy_call(server, agent, caller, events, f"healthy-in-flood-{n}")
                    healthy_calls["in_flood"] = n + 1
                healthy_calls["new_sandbox"] = await hello_outcome(deployment, EVENT_TIMEOUT)
                flood.cancel_scope.cancel()
            server.check_alive()
            for n in range(5):
                await healthy_call(server, agent, caller, events, f"healthy-after-{n}")
                healthy_calls["after"] += 1
        server.check_alive()


# -- the class "session keys at every door" (hypothesis) -----------------------------------------
# Session keys a guest, a client, an HTTP client or a caller names (docs/SECURITY.md, "Session keys
# at every door"). Hypothesis draws them around the length limits and from an alphabet of the
# characters that broke things (newline, NUL, lone surrogates, non-ASCII); each pair is played at
# every door of one in-process server and judged against the rule written again here, by hand:
# outside it, -32602 / HTTP 400 and nothing stored or held; inside it, never refused for its key.

KEY_ALPHABET = "abXY09_.-:@ \n\r\t\x00\x01\x7f/é€\u2028\ud800\udfff\U0001F600"
_CHANNEL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_ID_CHARS = _CHANNEL_CHARS | {":", "@"}
KEY_REFUSALS = ("invalid channel", "invalid session_id", "does not match", "should be non-empty")


def channel_ok(channel: str) -> bool:
    return 1 <= len(channel) <= 64 and set(channel) <= _CHANNEL_CHARS


def id_ok(session_id: str) -> bool:
    return 1 <= len(session_id) <= 128 and set(session_id) <= _ID_CHARS


def session_keys_strategy() -> Any:
    from hypothesis import strategies as st

    near_limits = st.sampled_from([63, 64, 65, 127, 128, 129, 500_000]).flatmap(
        lambda n: st.sampled_from(["a" * n, "a" * (n - 1) + "\n", "\ud800" + "a" * (n - 1)]))
    return st.one_of(st.text(alphabet=KEY_ALPHABET, max_size=20), near_limits, st.sampled_from(["mcp", "host", "s1"]))


async def play_session_keys(deployment: Deployment, pairs: list[tuple[str, str]]) -> list[str]:
    """Every door once per (channel, id); what went against the rule."""
    from raw_relay_calls import response_to
    from serving_server import serving

    wrong: list[str] = []
    async with serving(deployment) as served, served.http.rest() as rest:
        caller, _ = served.callers.open_caller()
        opened = await served.callers.call(caller, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "hi"})
        assert not opened.is_error, text_of(opened)
        token = served.app.tokens.token_for(INSTANCE)
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, token, role="guest")
            for n, (channel, session_id) in enumerate(pairs):
                valid = channel_ok(channel) and id_ok(session_id)
                shown = f"({channel[:30]!r}, {session_id[:30]!r}, lengths {len(channel)}, {len(session_id)})"

                async def door(name: str, refused: bool, message: str, key_valid: bool = valid) -> None:
                    """One door's verdict; a refusal of a bad key must leave the log and memory as they were."""
                    about_key = any(needle in message for needle in KEY_REFUSALS)
                    if not key_valid and not (refused and about_key and len(message) < 400):
                        wrong.append(f"{name} {shown}: bad key not refused clearly: {message[:200]!r}")
                    if key_valid and refused and about_key:
                        wrong.append(f"{name} {shown}: good key refused: {message[:200]!r}")

                async def state() -> tuple[int, int]:
                    return len(served.app.sessions.all()), await served.app.store.last_seq(INSTANCE)

                # The doors that take the whole key.
                before = await state()
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                    "session": {"channel": channel, "id": session_id}, "type": "status.presence", "payload": {}}})
                error = (await response_to(guest, n)).get("error", {})
                await door("append_frame", error.get("code") == -32602, error.get("message", ""))
                if ":" not in channel:  # a key splits at its first colon
                    async with RawRelay.connect(deployment) as client:
                        error = (await client.hello(INSTANCE, token, session=f"{channel}:{session_id}")).get("error", {})
                        await door("hello", error.get("code") == -32602, error.get("message", ""))
                body = {"type": "user.message", "session": {"channel": channel, "id": session_id}, "payload": {"text": "x"}}
                response = await rest.post(f"/v1/instances/{INSTANCE}/tether", content=json.dumps(body).encode(),
                                           headers={"content-type": "application/json"})
                await door("POST tether", response.status_code == 400, response.text)
                result = await served.callers.call(caller, "session_events", {
                    "instance": INSTANCE, "session_id": session_id, "channel": channel})
                await door("session_events", result.is_error, text_of(result))
                if not valid and await state() != before:
                    wrong.append(f"{shown}: a refused key stored or held something: {before} -> {await state()}")
                # The doors that take an id (their channel is fixed).
                before = await state()
                result = await served.callers.call(caller, "tether_send", {"instance": INSTANCE, "text": "x", "session_id": session_id})
                await door("tether_send", result.is_error, text_of(result), id_ok(session_id))
                result = await served.callers.call(caller, "caller_tool_response", {
                    "session_id": session_id, "request_id": "ctr-1", "result": {}})
                await door("caller_tool_response", result.is_error, text_of(result), id_ok(session_id))
                if not id_ok(session_id) and await state() != before:
                    wrong.append(f"{shown}: a refused id stored or held something: {before} -> {await state()}")
    return wrong


def play_on_a_new_server(play: Callable[[Deployment, Any], Any], drawn: Any) -> None:
    """One hypothesis example: `play(deployment, drawn)` on a deployment of its own; it lists what went wrong."""
    deployment = Deployment()
    try:
        wrong = trio.run(play, deployment, drawn)
    finally:
        deployment.cleanup()
    assert not wrong, "\n".join(wrong)


def test_session_keys_at_every_door() -> None:
    """Hypothesis-drawn session keys at every door: the rule holds at each (docs/SECURITY.md)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(st.tuples(session_keys_strategy(), session_keys_strategy()), min_size=6, max_size=6))
    def check(pairs: list[tuple[str, str]]) -> None:
        play_on_a_new_server(play_session_keys, pairs)

    check()


# -- the class "an append_id names one frame" (hypothesis) ---------------------------------------
# A guest's `append_id` makes a resend store once (docs/TETHER.md, "Exactly-once appends"); a
# resend is only a resend if it is the same frame. Hypothesis draws a frame a guest may append and
# a second one under the same id: the same frame (its payload's keys perhaps in another order) is
# answered with the first's seq and msg_id; any other session, type, reply_to or payload is refused
# with -32602 naming the id, and the log is as it was. "The same frame" is written again here:
# equal fields and equal payloads as sorted-key JSON (so 1, 1.0 and true differ).

APPEND_TYPES = ("assistant.delta", "status.presence", "assistant.done", "session.error")
APPEND_SESSIONS = (SESSION, "s2")


def append_frames_strategy() -> Any:
    from hypothesis import strategies as st

    values = st.one_of(
        st.integers(-2, 2), st.sampled_from([0.0, -0.0, 1.0, 2.5]), st.booleans(), st.none(),
        st.text(alphabet="ab é\n\x00", max_size=4), st.lists(st.integers(0, 1), max_size=2),
    )
    payloads = st.dictionaries(st.sampled_from(["text", "state", "n", "k"]), values, max_size=3)
    frames = st.fixed_dictionaries({
        "session": st.sampled_from(APPEND_SESSIONS), "type": st.sampled_from(APPEND_TYPES),
        "reply_to": st.sampled_from([None, "a", "b"]), "payload": payloads,
    })
    # The second send: the first again (keys shuffled), or the first with some fields drawn anew.
    again = st.tuples(st.booleans(), st.sets(st.sampled_from(["session", "type", "reply_to", "payload"]), min_size=1))
    return st.lists(st.tuples(frames, again, frames), min_size=4, max_size=4)


def same_frame(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The rule, written again: every field equal, the payloads as sorted-key JSON."""
    return all(a[k] == b[k] for k in ("session", "type", "reply_to")) and \
        json.dumps(a["payload"], sort_keys=True) == json.dumps(b["payload"], sort_keys=True)


async def play_append_ids(deployment: Deployment, drawn: list[tuple[dict, tuple[bool, set[str]], dict]]) -> list[str]:
    """Each drawn pair sent under one fresh id at the guest door; what went against the rule."""
    from raw_relay_calls import response_to
    from serving_server import serving

    wrong: list[str] = []
    async with serving(deployment) as served:
        caller, _ = served.callers.open_caller()
        for session_id in APPEND_SESSIONS:
            opened = await served.callers.call(caller, "session_message", {"instance": INSTANCE, "session_id": session_id, "message": "hi"})
            assert not opened.is_error, text_of(opened)
        token = served.app.tokens.token_for(INSTANCE)
        async with RawRelay.connect(deployment) as guest:
            await guest.hello(INSTANCE, token, role="guest")
            n = 0

            async def send(frame: dict[str, Any], append_id: str) -> dict[str, Any]:
                nonlocal n
                n += 1
                params = {"session": {"channel": "mcp", "id": frame["session"]}, "type": frame["type"],
                          "payload": frame["payload"], "reply_to": frame["reply_to"], "append_id": append_id}
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": params})
                return await response_to(guest, n)

            for i, (first, (resend, redrawn), other) in enumerate(drawn):
                append_id = f"fuzz-{i}"
                # A turn ends once: each pair replies to messages of its own (the names drawn are a, b).
                first, other = ({**f, "reply_to": f["reply_to"] and f"m-{i}-{f['reply_to']}"} for f in (first, other))
                if resend:
                    second = {**first, "payload": dict(reversed(list(first["payload"].items())))}
                else:
                    second = {**first, **{field: other[field] for field in redrawn}}
                stored = await send(first, append_id)
                if "result" not in stored:
                    wrong.append(f"{first}: the first send was refused: {stored}")
                    continue
                last = await served.app.store.last_seq(INSTANCE)
                answer = await send(second, append_id)
                if same_frame(first, second):
                    if answer.get("result") != stored["result"]:
                        wrong.append(f"{first} resent as {second}: {answer}, not the first answer {stored['result']}")
                else:
                    error = answer.get("error", {})
                    if error.get("code") != -32602 or repr(append_id) not in error.get("message", ""):
                        wrong.append(f"{first} then {second} under one id: {answer}, not -32602 naming {append_id!r}")
                if await served.app.store.last_seq(INSTANCE) != last:
                    wrong.append(f"{first} then {second} under one id: the second send stored a frame")
    return wrong


def test_an_append_id_names_one_frame() -> None:
    """Hypothesis-drawn pairs of frames under one `append_id` at a guest's door: a resend of the same
    frame is answered with the first's seq and msg_id, any other frame is refused (docs/SECURITY.md)."""
    from hypothesis import HealthCheck, Phase, given, settings

    # No shrinking: each example starts a server, and the failing pairs are printed as drawn.
    @settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(append_frames_strategy())
    def check(drawn: list[tuple[dict, tuple[bool, set[str]], dict]]) -> None:
        play_on_a_new_server(play_append_ids, drawn)

    check()


# -- the class "peer strings in log lines" (hypothesis) ---------------------------------------------
# Strings a peer chooses, drawn by hypothesis from the characters that forge a log line or drive a
# terminal (newline, CR, ESC, the 8-bit CSI U+009B, C1 controls, bidi overrides and isolates, line
# separators, NUL, lone surrogates) and around 900 KB, are played at the doors of one in-process
# server whose log goes through both real formats (oubliette_runtime/log_format.py), at DEBUG: a relay hello's
# claims, a relay request's tool and `_meta` trace context, a guest's frame type and reply_to, an HTTP
# frame's type and msg_id and an HTTP path. Every line either format writes must be bounded and
# hold no unprintable character (docs/SECURITY.md, "Peer strings in log lines and on the terminal").

LOG_ALPHABET = "ab=,;-0 \n\r\t\x00\x1b\x7f\x85\x9b\u200f\u202a\u202e\u2066\u2069\u2028\u2029\ud800\U000e0001é"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def peer_strings_strategy() -> Any:
    from hypothesis import strategies as st

    huge = st.sampled_from([5_000, 100_000]).flatmap(  # escaped, each still fits one relay line
        lambda n: st.sampled_from(["x" * n, "k=" + "v" * n, "\n" * n, "\x9b" * n, "a=\u202e" + "b" * n]))
    return st.one_of(st.text(alphabet=LOG_ALPHABET, min_size=1, max_size=40), huge)


async def play_peer_strings(deployment: Deployment, strings: list[str]) -> None:
    """Each string at each door once; every answer awaited, so what the server logs for it is written."""
    import urllib.parse

    from raw_relay_calls import response_to
    from serving_server import serving

    async with serving(deployment) as served, served.http.rest() as rest:
        caller, _ = served.callers.open_caller()
        opened = await served.callers.call(caller, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "hi"})
        assert not opened.is_error, text_of(opened)
        token = served.app.tokens.token_for(INSTANCE)
        async with RawRelay.connect(deployment) as client, RawRelay.connect(deployment) as guest:
            await client.hello(INSTANCE, token)
            await guest.hello(INSTANCE, token, role="guest")
            for n, text in enumerate(strings):
                for claims in ({"role": text[:100], "instance": text, "token": "t"}, {"role": "client", "session": text}):
                    async with RawRelay.connect(deployment) as claimed:
                        await claimed.send({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": {
                            "protocol": PROTOCOL, "instance": INSTANCE, "token": token, **claims}})
                        assert await claimed.receive() is not None  # answered: what it logs is written
                for params in ({"tool": text}, {"tool": "t", "_meta": {"traceparent": TRACEPARENT, "tracestate": text}},
                               {"tool": "t", "_meta": {"baggage": text}}, {"tool": "t", "_meta": {"traceparent": text}}):
                    await client.send({"jsonrpc": "2.0", "id": n, "method": "caller_tool", "params": {"arguments": {}, **params}})
                    assert "error" in await response_to(client, n)
                for frame in ({"type": text}, {"type": "status.presence", "reply_to": text}):
                    await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                        "session": {"channel": "mcp", "id": SESSION}, "payload": {}, **frame}})
                    await response_to(guest, n)
                for fields in ({"type": text}, {"type": "note", "msg_id": text}):
                    body = {"session": {"channel": "host", "id": "s"}, "payload": {}, **fields}
                    response = await rest.post(f"/v1/instances/{INSTANCE}/tether", content=json.dumps(body).encode(),
                                               headers={"content-type": "application/json"})
                    assert response.status_code in (201, 400), response.text[:300]
                path = f"/v1/instances/{urllib.parse.quote(text[:5000], safe='', errors='surrogatepass')}/tether"
                assert (await rest.get(path)).status_code >= 400


def test_peer_strings_in_log_lines() -> None:
    """Hypothesis-drawn hostile strings at every door: each log line bounded and escaped, in both formats."""
    import io
    import logging

    from hypothesis import HealthCheck, given, settings

    from oubliette_runtime.log_format import TEXT_FORMAT, JsonFormatter, TextFormatter
    from oubliette_runtime.peer_text import MESSAGE_CHARS

    @settings(max_examples=8, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st_lists_of_peer_strings())
    def check(strings: list[str]) -> None:
        outputs = {"text": io.StringIO(), "json": io.StringIO()}
        handlers = [logging.StreamHandler(outputs["text"]), logging.StreamHandler(outputs["json"])]
        handlers[0].setFormatter(TextFormatter(TEXT_FORMAT))
        handlers[1].setFormatter(JsonFormatter())
        for handler in handlers:  # the server's lines only, not those of this test's own HTTP client
            handler.addFilter(lambda record: not record.name.startswith(("httpx2", "httpcore2")))
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.DEBUG)
        for handler in handlers:
            root.addHandler(handler)
        deployment = Deployment()
        try:
            trio.run(play_peer_strings, deployment, strings)
        finally:
            for handler in handlers:
                root.removeHandler(handler)
            root.setLevel(level)
            deployment.cleanup()
        text, as_json = outputs["text"].getvalue(), outputs["json"].getvalue()
        assert "oubliette.access" in text, "the doors were played with the log at DEBUG"
        for line in text.splitlines():
            assert len(line) <= MESSAGE_CHARS + 400, f"{len(line)} characters: {line[:300]!r}"
            assert line.isprintable(), f"an unprintable character: {line[:300]!r}"
        for line in as_json.splitlines():
            assert len(line) <= 6 * MESSAGE_CHARS, f"{len(line)} characters: {line[:300]!r}"
            assert line.isprintable() and isinstance(json.loads(line), dict), f"{line[:300]!r}"

    check()


def st_lists_of_peer_strings() -> Any:
    from hypothesis import strategies as st

    return st.lists(peer_strings_strategy(), min_size=3, max_size=3)
