"""RelayLink: the sandbox side's connection to the relay, kept up with backoff.

Requests are multiplexed by id; each waits on its own event, so many calls can
be in flight at once. A caller that is cancelled while waiting sends `cancel
{id}` to the server. When the connection drops, every waiting request fails at
once with "relay connection lost", and the link reconnects with exponential
backoff. While it is down, `request` fails at once saying why (or, with
`wait_for_connection`, waits for the link to come back).
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Awaitable, Callable

import attrs
import trio

from protocol import (
    PROTOCOL_VERSION,
    FrameWriter,
    LineReader,
    Notification,
    RelayError,
    Request,
    Response,
    connect_relay,
    decode,
    errors,
    jsonrpc,
    messages,
    parse_message,
    parse_relay_address,
    unstructure,
)

from .settings import RelaySettings

log = logging.getLogger("oubliette.client.relay")

NotificationHandler = Callable[[str, dict[str, Any]], Awaitable[None]]

BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
HELLO_TIMEOUT = 10.0


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: RelayError | None = None


class RelayLink:
    def __init__(
        self,
        settings: RelaySettings,
        role: str,
        on_notification: NotificationHandler,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self._on_connected = on_connected
        self.role = role
        self._on_notification = on_notification
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._writer: FrameWriter | None = None
        self.last_error = "not connected yet"
        self.connected = False
        self._state_changed = trio.Event()
        self.attempted = trio.Event()
        """Set after the first connection attempt, whatever its outcome."""

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, connected: bool, error: str | None = None) -> None:
        self.connected = connected
        if error is not None:
            self.last_error = error
        self._state_changed.set()
        self._state_changed = trio.Event()

    async def wait_connected(self) -> None:
        while not self.connected:
            await self._state_changed.wait()

    def unavailable_error(self) -> RelayError:
        return RelayError(
            errors.PEER_DISCONNECTED,
            f"the Oubliette relay at {self.settings.relay} is unavailable ({self.last_error}); retrying in the background",
        )

    # -- requests ------------------------------------------------------------------------

    async def request(self, method: str, params: dict[str, Any], *, wait_for_connection: bool = False) -> Any:
        if wait_for_connection:
            await self.wait_connected()
        writer = self._writer
        if not self.connected or writer is None:
            raise self.unavailable_error()
        request_id = next(self._ids)
        waiter = _Waiter()
        self._waiters[request_id] = waiter
        try:
            try:
                await writer.send(jsonrpc.request(request_id, method, params))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise self.unavailable_error() from None
            await waiter.done.wait()
        except trio.Cancelled:
            if not waiter.done.is_set() and self._writer is writer:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await writer.send(jsonrpc.notification(messages.CANCEL, {"id": request_id}))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
            raise
        finally:
            self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        writer = self._writer
        if writer is None:
            raise self.unavailable_error()
        try:
            await writer.send(jsonrpc.notification(method, params))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self.unavailable_error() from None

    # -- connection loop -----------------------------------------------------------------

    async def run(self) -> None:
        """Keep a connection up until cancelled."""
        backoff = BACKOFF_INITIAL
        address = parse_relay_address(self.settings.relay)
        while True:
            fatal = False
            try:
                stream = await connect_relay(address)
            except OSError as exc:
                self._set_state(False, f"cannot connect: {exc.strerror or exc}")
            else:
                try:
                    fatal = await self._serve(stream)
                    backoff = BACKOFF_INITIAL
                finally:
                    self._writer = None
                    self._fail_waiters("the relay connection was lost")
                    self._set_state(False)
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
            self.attempted.set()
            if fatal:
                log.error("relay refused this %s: %s", self.role, self.last_error)
            delay = (BACKOFF_MAX if fatal else backoff) * random.uniform(0.8, 1.2)
            log.debug("reconnecting to %s in %.2f s", self.settings.relay, delay)
            await trio.sleep(delay)  # backoff between attempts, not a wait for an event
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _fail_waiters(self, why: str) -> None:
        for waiter in list(self._waiters.values()):
            if not waiter.done.is_set():
                waiter.error = RelayError(errors.PEER_DISCONNECTED, why)
                waiter.done.set()

    async def _serve(self, stream: trio.abc.Stream) -> bool:
        """Handshake, then read until the connection ends. Returns True if the server refused us."""
        reader = LineReader(stream)
        writer = FrameWriter(stream)
        hello = messages.Hello(
            protocol=PROTOCOL_VERSION, role=self.role, instance=self.settings.instance,
            token=self.settings.token, session=self.settings.session,
        )
        await writer.send(jsonrpc.request(0, messages.HELLO, unstructure(hello)))
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                while True:
                    message = await self._next_message(reader)
                    if message is None:
                        self._set_state(False, "the relay closed the connection during the handshake")
                        return False
                    if isinstance(message, Response) and message.id == 0:
                        break
                    if isinstance(message, Notification):
                        await self._on_notification(message.method, message.params)
        except trio.TooSlowError:
            self._set_state(False, "the relay did not answer hello")
            return False
        except RelayError as err:
            self._set_state(False, f"protocol error during handshake: {err.message}")
            return False
        if message.error is not None:
            self._set_state(False, message.error.message)
            return message.error.code in (errors.UNAUTHORIZED, errors.NOT_FOUND, errors.INVALID_REQUEST)
        self._writer = writer
        if self._on_connected is not None:
            self._on_connected()  # before reading on: the handshake's configuration is complete
        self._set_state(True, "connected")
        self.attempted.set()
        log.info("connected to the relay at %s as %s of %s", self.settings.relay, self.role, self.settings.instance)
        try:
            while True:
                message = await self._next_message(reader)
                if message is None:
                    self._set_state(False, "the relay closed the connection")
                    return False
                if isinstance(message, Response):
                    self._resolve(message)
                elif isinstance(message, Notification):
                    await self._on_notification(message.method, message.params)
                elif isinstance(message, Request):
                    await writer.send(jsonrpc.error_response(message.id, RelayError(
                        errors.METHOD_NOT_FOUND, f"this {self.role} serves no method {message.method!r}")))
        except RelayError as err:
            self._set_state(False, f"protocol error: {err.message}")
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._set_state(False, f"connection broken: {exc}")
            return False

    @staticmethod
    async def _next_message(reader: LineReader) -> Request | Response | Notification | None:
        line = await reader.read_line()
        return None if line is None else parse_message(decode(line))

    def _resolve(self, response: Response) -> None:
        waiter = self._waiters.get(response.id)  # type: ignore[arg-type]
        if waiter is None or waiter.done.is_set():
            return
        waiter.result, waiter.error = response.result, response.error
        waiter.done.set()
