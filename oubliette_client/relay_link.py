"""RelayLink: the sandbox side's connection to the relay, kept up with backoff.

Each connection is one `protocol.RelayPeer` (requests multiplexed by id, each with a
deadline; `cancel` on timeout or cancellation; one writer with a write deadline). This
module adds only reconnection: when a connection drops, every waiting request fails at
once with `PEER_DISCONNECTED`, and the link reconnects with exponential backoff, to the next
address when the relay setting lists several (servers of one deployment sharing a PostgreSQL
store: the instance moves to whichever one answers, docs/SCALING.md). While it
is down, `request` fails at once saying why (or, with `wait_for_connection`, waits for the
link to come back).

Why it cannot connect, or that the relay refused it, is logged at WARNING/ERROR once per
distinct reason (not once per retry), so a misconfigured client says so at its default level.

The peer, the sans-IO core and the message models (`protocol.peer`, `protocol.core`,
`protocol.messages`) are imported when the link first connects, not with this module: `oubliette-client` answers `initialize` without them
when the relay is down, and imports less before it when it is up (its cold start).

Owns: the current connection (closed when `run` is cancelled). Needs: `run` in a nursery
(`await nursery.start(link.run)`). Raises: `request` and `notify` raise only `RelayError`;
`run` raises `RelayRefused` when the relay refuses the hello and `give_up_on_refusal` is set.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from protocol import RelayError, connect_relay, errors, parse_relay_address

if TYPE_CHECKING:
    from protocol import HandlerEntry, PeerLimits, RelayPeer

from .settings import DEFAULT_REQUEST_TIMEOUT, RelaySettings, relay_addresses

log = logging.getLogger("oubliette.client.relay")

#: Called with a notification's method and its params, already validated and structured
#: into the method's params class (e.g. `messages.CallerToolsConfig`).
NotificationHandler = Callable[[str, Any], Awaitable[None]]

BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
#: Hello answers the server refuses for good (wrong token, bad instance, wrong protocol).
FATAL_HELLO_CODES = (errors.UNAUTHORIZED, errors.NOT_FOUND, errors.INVALID_REQUEST)


class RelayUnavailable(Exception):
    """A command that cannot work without the relay found it unreachable; the message is one line for a person."""


class RelayRefused(RelayUnavailable):
    """The relay refused this instance for good (wrong token, unknown instance, wrong protocol): waiting cannot help."""


#: What to check when the relay cannot be reached (a server that is starting has no socket yet).
CONNECT_HINT = "is oubliette-server running, or still starting? set OUBLIETTE_RELAY or --relay"


class RelayLink:
    """One role's (`client` or `guest`) link to the relay, reconnected with backoff.

    `on_notification(method, params)` gets each server notification, in order, with
    structured params; the configuration the server sends before answering `hello`
    arrives before `on_connected()` is called. `request_timeout` is the default deadline
    of `request` (`DEFAULT_REQUEST_TIMEOUT`, 120 s: a caller tool waits up to the server's
    caller timeout, 60 s by default, and the server answers at that deadline, so this
    leaves it its full timeout plus a margin); `limits` holds the write and hello deadlines
    (None: `PeerLimits()`'s defaults, resolved when connecting).
    """

    def __init__(
        self,
        settings: RelaySettings,
        role: str,
        on_notification: NotificationHandler,
        on_connected: Callable[[], None] | None = None,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        limits: PeerLimits | None = None,
        give_up_on_refusal: bool = False,
    ) -> None:
        self.settings = settings
        self.role = role
        self.request_timeout = request_timeout
        self.limits = limits
        self._on_connected = on_connected
        self._on_notification = on_notification
        self._handler_table: dict[str, HandlerEntry[Any]] | None = None
        self._peer: RelayPeer | None = None
        self.addresses = relay_addresses(settings.relay)
        """Where the link connects: one relay address, or several servers of a deployment tried in turn."""
        self.address = self.addresses[0]
        """The address the link uses now (it moves to the next one after a failure)."""
        self.last_error = "not connected yet"
        self._hint: str | None = CONNECT_HINT
        self.connected = False
        self.handshakes = 0
        """Completed handshakes: only a connection that was up makes the next attempt start quick again."""
        self._state_changed = trio.Event()
        self.attempted = trio.Event()
        """Set after the first connection attempt (to each address of a list), whatever its outcome."""
        self.refused: str | None = None
        """Why the relay refused the last hello for good (None while it has not)."""
        self.refused_code: int | None = None
        """The error code of that refusal (`UNAUTHORIZED` for a wrong token)."""
        self.give_up_on_refusal = give_up_on_refusal
        self._logged_reason: str | None = None
        self.report_failures = True
        """Log why the link is down (False: the owner reports `failure_line()` itself, e.g. `tools`)."""
        self.features: frozenset[str] = frozenset()
        """What the server of the current connection listed in its hello result (empty while down):
        a request whose params depend on it is built for the connection it goes out on (`request`)."""

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, connected: bool, error: str | None = None, hint: str | None = CONNECT_HINT) -> None:
        """`hint`: what a person should check for `error` (`failure_line`); None when it says so itself."""
        self.connected = connected
        if error is not None:
            self.last_error = error
            self._hint = hint
        self._state_changed.set()
        self._state_changed = trio.Event()

    async def wait_connected(self) -> None:
        """Until the link is connected (returns at once if it is)."""
        while not self.connected:
            await self._state_changed.wait()

    async def wait_settled(self) -> None:
        """Until the link is connected or the relay has refused it (waiting longer cannot help)."""
        while not self.connected and self.refused is None:
            await self._state_changed.wait()

    def failure_line(self, waited: float | None = None) -> str:
        """One line for a person: why the link is not up (unreachable relay, or refused); `waited`:
        the seconds a command gave the relay before giving up, said with the option that sets them."""
        if self.refused is not None:
            line = f"the relay at {self.address} refused instance {self.settings.instance!r}: {self.refused}"
            if "oubliette-server token" in self.refused:
                return line  # the server said how to print its token (with --store when it needs it)
            return f"{line} (check OUBLIETTE_TOKEN: `oubliette-server token {self.settings.instance}` prints it)"
        if self._hint is None:
            return self.last_error if waited is None else f"{self.last_error}; gave up after {waited:g} s"
        if waited is not None:
            return f"{self.last_error}; no relay within {waited:g} s ({self._hint}; --connect-wait waits longer)"
        return f"{self.last_error} ({self._hint})"

    def unavailable_error(self) -> RelayError:
        """The error requests get while the link is down, with the last reason."""
        return RelayError(
            errors.PEER_DISCONNECTED,
            f"the Oubliette relay at {self.address} is unavailable ({self.last_error}); retrying in the background",
        )

    # -- requests ------------------------------------------------------------------------

    async def request(
        self, method: str, params: dict[str, Any] | Callable[[frozenset[str]], dict[str, Any]], *,
        wait_for_connection: bool = False, timeout: float | None = None,
    ) -> Any:
        """Send a request and return its result; `timeout` defaults to `request_timeout`.

        `params` may be a function of the connection's `features`, called for the connection
        the request is sent on (a resend after a reconnect may reach another server).

        Raises `RelayError`: `TIMEOUT` when the deadline passes (the server is told
        `cancel`), `PEER_DISCONNECTED` when the link is or goes down, the server's error.
        """
        if wait_for_connection:
            # A peer that has closed while the link has not yet noticed counts as down: wait for
            # the link to change state, so a retry loop around this call never spins.
            while not self.connected or self._peer is None or self._peer.is_closed:
                await self._state_changed.wait()
        peer = self._peer
        if not self.connected or peer is None:
            raise self.unavailable_error()
        if callable(params):
            params = params(self.features)
        return await peer.request(method, params, timeout=self.request_timeout if timeout is None else timeout)

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        """Queue a notification (it never waits for the socket); `RelayError` when the link is down."""
        peer = self._peer
        if not self.connected or peer is None:
            raise self.unavailable_error()
        try:
            peer.notify(method, params)
        except RelayError as err:
            if err.code == errors.PEER_DISCONNECTED:
                raise self.unavailable_error() from None
            raise

    # -- connection loop -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a connection up until cancelled (or, with `give_up_on_refusal`, until refused).

        Reports started once its connection loop runs, before the first attempt: the relay may be
        down, and nothing waits for it (`wait_connected`, `request(wait_for_connection=True)` do).
        Raises: `RelayRefused` when the relay refuses the hello and `give_up_on_refusal` is set.
        """
        backoff = BACKOFF_INITIAL
        index = 0
        task_status.started()
        while True:
            fatal = False
            self.address = self.addresses[index]
            try:
                stream = await connect_relay(parse_relay_address(self.address))
            except OSError as exc:
                self.refused = None  # a refusal by a relay that is now gone no longer explains anything
                self._set_state(False, f"cannot connect to {self.address}: {exc.strerror or exc}")
                self._log_once(logging.WARNING, f"{self.failure_line()}; retrying")
            else:
                handshakes = self.handshakes
                fatal = await self._serve(stream)
                if self.handshakes != handshakes:  # it was up; a refused hello keeps backing off
                    backoff = BACKOFF_INITIAL
            index = (index + 1) % len(self.addresses)  # several servers: the next one takes over
            if index == 0 or fatal:
                self.attempted.set()  # every address was tried (or one refused us for good)
            else:
                continue  # the next server of the list, at once; the backoff is between rounds
            if fatal:
                self.refused = self.last_error
                self._set_state(False)
                if self.give_up_on_refusal:
                    raise RelayRefused(self.failure_line())
                self._log_once(logging.ERROR, f"{self.failure_line()}; retrying every {BACKOFF_MAX:g} s")
            delay = (BACKOFF_MAX if fatal else backoff) * random.uniform(0.8, 1.2)
            log.debug("reconnecting to %s in %.2f s (%s)", self.address, delay, self.last_error)
            await trio.sleep(delay)  # backoff between attempts, not a wait for an event
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _handlers(self) -> dict[str, HandlerEntry[Any]]:
        """The server notifications this role receives, each with its params class; built on first use."""
        if self._handler_table is None:
            from protocol import messages
            from protocol.core import METHOD_RULES, ROLE_SERVER
            from protocol.peer import HandlerEntry

            self._handler_table = {
                method: HandlerEntry(messages.PARAMS_TYPES[method], functools.partial(self._on_notification, method))
                for method, rule in METHOD_RULES.items()
                if rule.kind == "notification" and (ROLE_SERVER, self.role) in rule.routes and method != messages.CANCEL
            }
        return self._handler_table

    def _log_once(self, level: int, line: str) -> None:
        """Log why the link is down, once per distinct reason (not on every retry)."""
        if line != self._logged_reason:
            self._logged_reason = line
            log.log(level if self.report_failures else logging.DEBUG, "%s", line)

    async def _serve(self, stream: trio.abc.Stream) -> bool:
        """One connection: hello, then serve until it ends. True if the server refused us."""
        from protocol import messages
        from protocol.core import RelayCore
        from protocol.peer import PeerLimits, RelayPeer

        limits = self.limits if self.limits is not None else PeerLimits()
        handlers = self._handlers()
        peer = RelayPeer(stream, RelayCore(self.role), name=f"relay {self.address}", limits=limits)
        hello = messages.Hello(
            protocol=messages.PROTOCOL_VERSION, role=self.role, instance=self.settings.instance,
            token=self.settings.token, session=self.settings.session,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(peer.serve, handlers)
                try:
                    result = await peer.request(messages.HELLO, hello, timeout=limits.hello_timeout)
                except RelayError as err:
                    nursery.cancel_scope.cancel()
                    return self._hello_failed(err, peer.refusal)
                self.features = messages.server_features(result)
                self._peer = peer
                self.handshakes += 1
                self.refused = self._logged_reason = None
                if self._on_connected is not None:
                    self._on_connected()  # the handshake's configuration is complete
                self._set_state(True, "connected")
                self.attempted.set()
                log.info("connected to the relay at %s as %s of %s", self.address, self.role, self.settings.instance)
            self._set_state(False, f"connection to {self.address} lost: {peer.close_reason}")
            return False
        finally:
            self._peer = None
            self.features = frozenset()
            if self.connected:
                self._set_state(False)

    def _hello_failed(self, err: RelayError, protocol_error: str | None) -> bool:
        """Why the hello failed; True if the relay refused it for good. `protocol_error`: what the
        peer sent that is not the relay protocol (an HTTP server, another program's port)."""
        if protocol_error is not None:
            self._set_state(False, (
                f"the peer at {self.address} is not an oubliette-server relay ({protocol_error}); check that "
                "OUBLIETTE_RELAY or --relay names the server's relay address (its --relay), not its --http"
            ), hint=None)
            self._log_once(logging.WARNING, f"{self.failure_line()}; retrying")
            return False
        if err.code in (errors.TIMEOUT, errors.PEER_DISCONNECTED):
            if err.code == errors.TIMEOUT:
                self._set_state(False, f"the relay at {self.address} did not answer hello")
            else:
                self._set_state(
                    False, f"the relay at {self.address} closed the connection during the handshake ({err.message})"
                )
            self._log_once(logging.WARNING, f"{self.failure_line()}; retrying")
            return False
        self._set_state(False, err.message)
        if err.code in FATAL_HELLO_CODES:
            self.refused_code = err.code
            return True
        # Refused for now (e.g. the instance has as many client connections as the server allows).
        self._log_once(logging.WARNING, f"the relay at {self.address} refused the connection for now: {err.message}; retrying")
        return False
