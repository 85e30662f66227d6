"""In-memory fakes of what the server's services talk to, for testing a service alone.

As the MCP SDK tests its layers without a transport, the service tests (in the server's room folders)
give a service what it asks for and nothing more: the real frame store on SQLite's
`:memory:` (`FrameStore.in_memory()`, no files, no threads of its own) stands in for the store,
and the classes here stand in for the relay connections (a guest's, an agent's client's) and a
caller's MCP session. Each records what the service did to it and lets a test wait for it,
bounded, on an event rather than a sleep.
"""

from __future__ import annotations

from typing import Any

import trio

from protocol import RelayError


class FakeRelayConnection:
    """A relay connection (`GuestPeer`, `ClientPeer`) with nobody on the other end.

    Records every notification a service queues or sends (`notified`, as `(method, params)`),
    answers `request` from `replies` (a value, or a `RelayError` to raise), and `close`/`close_soon`/`close_after_answer`
    set `closed`. `refuse(seq)` makes `send_notification` raise for the frame with that seq, as a
    connection does for a frame it cannot send.
    """

    def __init__(self, instance: str | None = "box1", session_key: str | None = None) -> None:
        self.instance = instance
        self.session_key = session_key
        self.router: Any = None
        self.notified: list[tuple[str, Any]] = []
        self.requests: list[tuple[str, dict]] = []
        self.replies: dict[str, Any] = {}
        self.closed = trio.Event()
        self._refused: set[int] = set()
        self._changed = trio.Event()

    def __repr__(self) -> str:
        return f"<FakeRelayConnection {self.instance}>"

    def refuse(self, seq: int) -> None:
        """`send_notification` of the frame with `seq` raises `RelayError` from now on."""
        self._refused.add(seq)

    def _record(self, method: str, params: Any) -> None:
        self.notified.append((method, params))
        self._changed.set()
        self._changed = trio.Event()

    def notify(self, method: str, params: dict) -> None:
        """Record a queued notification (never waits, as the real one)."""
        self._record(method, params)

    def notify_encoded(self, note: Any) -> None:
        """Record a notification encoded once for many connections, as `(note.method, note)`."""
        self._record(note.method, note)

    async def send_notification(self, method: str, params: dict[str, Any]) -> None:
        """Record a notification sent to a guest, or raise as for a frame that cannot be sent."""
        await trio.lowlevel.checkpoint()
        seq = params.get("frame", {}).get("seq") if isinstance(params, dict) else None
        if seq in self._refused:
            raise RelayError(-32000, f"frame seq {seq} cannot be sent (refused by the test)")
        self._record(method, params)

    async def request(self, method: str, params: dict) -> Any:
        """Record a request and answer it from `replies`."""
        await trio.lowlevel.checkpoint()
        self.requests.append((method, params))
        reply = self.replies.get(method)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close_soon(self) -> None:
        """End the connection (sets `closed`)."""
        self.closed.set()

    def close_after_answer(self, reason: str) -> None:
        """End the connection after the answer being made (sets `closed`)."""
        self.closed.set()

    def close(self) -> None:
        """End the connection (sets `closed`)."""
        self.closed.set()

    def of_method(self, method: str) -> list[Any]:
        """The params of each notification of `method`, in order."""
        return [params for name, params in self.notified if name == method]

    async def wait_notified(self, method: str, count: int, timeout: float = 5.0) -> list[Any]:
        """Until `count` notifications of `method` were recorded (bounded by `timeout`); their params."""
        with trio.fail_after(timeout):
            while len(self.of_method(method)) < count:
                await self._changed.wait()
        return self.of_method(method)


class RecordingSink:
    """An `EventSink` (a caller, a request's event stream) that keeps the events pushed to it."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def push(self, event: dict) -> None:
        """Keep the event."""
        self.events.append(event)


class FakeMcpSession:
    """A caller's MCP session: records the notifications its event sender sends; `fail` makes the
    next send raise (a broken transport that is not a clean hang-up)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.fail = False
        self._changed = trio.Event()

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        """Record the notification, or raise `RuntimeError` when `fail` is set."""
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise RuntimeError("the test's MCP session failed")
        self.sent.append(notification)
        self._changed.set()
        self._changed = trio.Event()

    def data(self) -> list[Any]:
        """The event (`params.data`) of each notification sent, in order."""
        return [n.params.data for n in self.sent]

    async def wait_sent(self, count: int, timeout: float = 5.0) -> list[Any]:
        """Until `count` notifications were sent (bounded by `timeout`); their events."""
        with trio.fail_after(timeout):
            while len(self.sent) < count:
                await self._changed.wait()
        return self.data()
