"""The server's Prometheus metrics: the one home of every metric's name, type, labels and help.

Each `OublietteServer` owns one `ServerMetrics` with a registry of its own (never
prometheus_client's global one), so several servers in one process (tests, embedders) do not
collide. The services are handed only the hook they call (`relayed_call_ended`,
`approval_decided`, `frame_stored`, ...), never this module's state; gauges that mirror state a
service already keeps (pending calls, connected guests, long-poll waiters) are read from it at
scrape time (`watch`), so nothing is counted twice. `page()` is the text exposition format
served at `GET /metrics` (docs/OBSERVABILITY.md, "Metrics").

Label values are bounded: outcomes and decisions are fixed words, a frame type outside the
known set is "other" (a tether ingress may append any type), an HTTP status is the number.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol import RelayError, errors
from protocol.frames import FRAME_TYPES

from .server_owned import SERVER_OWNED_TYPES

#: The `Content-Type` of `page()`.
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: The frame types counted by name; any other is counted as "other".
KNOWN_FRAME_TYPES = frozenset(FRAME_TYPES) | SERVER_OWNED_TYPES

#: The effects of a policy decision (features/policy/rules.py).
POLICY_EFFECTS = ("permit", "approval", "forbid")

#: How a relayed call or a toolset call ends, by the error it ended with (None: a result).
OUTCOME_OF_CODE = {
    errors.TOOL_ERROR: "tool_error",
    errors.TIMEOUT: "timed_out",
    errors.PEER_DISCONNECTED: "disconnected",
    errors.CANCELLED: "cancelled",
    errors.DENIED: "denied",
    errors.INVALID_PARAMS: "refused",
    errors.NOT_FOUND: "refused",
    errors.INVALID_REQUEST: "refused",
}
RELAYED_OUTCOMES = ("answered", "tool_error", "timed_out", "disconnected", "cancelled", "failed")
APPROVAL_DECISIONS = ("approved", "denied", "tool_return", "timed_out", "disconnected", "cancelled", "failed")
#: `Decision.who` of the decisions nobody made (approvals/service.py), as decision labels.
UNANSWERED_DECISIONS = {"timeout": "timed_out", "disconnect": "disconnected", "cancelled": "cancelled"}
AUTH_REFUSALS = (("relay", "bad_token"), ("http", "missing_token"), ("http", "bad_token"))

#: Seconds: a caller's tool answers in milliseconds to minutes (the default timeout is 60 s).
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Seconds: a person decides in seconds to an hour (the default approval timeout is 600 s).
DECISION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Seconds: one append is a commit (SQLite WAL or a PostgreSQL round trip).
APPEND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Verdict(Protocol):
    """An approval's decision as far as its label goes (`approvals.Decision` is one)."""

    @property
    def approve(self) -> bool:
        """Whether the call may run."""
        ...

    @property
    def who(self) -> str:
        """Who decided: the caller, or "timeout", "disconnect", "cancelled" when nobody did."""
        ...

    @property
    def kind(self) -> str:
        """"approval", or "tool" for an answer with the tool's own result."""
        ...


def outcome_of(error: BaseException | None, success: str) -> str:
    """The outcome label of a call that ended with `error` (None: `success`)."""
    if error is None:
        return success
    if isinstance(error, RelayError):
        return OUTCOME_OF_CODE.get(error.code, "failed")
    return "cancelled" if isinstance(error, trio.Cancelled) else "failed"


def decision_of(decision: Verdict | None) -> str:
    """The decision label of an approval (None: it ended without one, e.g. the store failed)."""
    if decision is None:
        return "failed"
    unanswered = UNANSWERED_DECISIONS.get(decision.who)
    if unanswered is not None:
        return unanswered
    if decision.kind == "tool":
        return "tool_return"
    return "approved" if decision.approve else "denied"


class _StateGauges(Collector):
    """The gauges read at scrape time from the services that keep the state."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterable[Metric]:
        for name, (help_text, read) in self._gauges.items():
            yield GaugeMetricFamily(name, help_text, value=read())


STATE_GAUGES = {
    "pending_calls": ("oubliette_pending_calls", "Relayed caller tool calls of this server's agents waiting for their caller now."),
    "pending_approvals": ("oubliette_pending_approvals", "Gated calls of this server waiting for their approval decision now."),
    "guests": ("oubliette_guests_connected", "Guest relay connections (one per instance at most) connected now."),
    "clients": ("oubliette_clients_connected", "Client relay connections (agents' oubliette-client) connected now."),
    "callers": ("oubliette_callers_connected", "Caller connections (stdio, HTTP MCP sessions and 2026-07-28 principals) now."),
    "long_poll_waiters": ("oubliette_long_poll_waiters", "Reads waiting on the frame store for new frames now (HTTP poll and stream, tether waits)."),
}


class ServerMetrics:
    """One server's metrics and its own registry; the hooks the services call, and `page()`.

    Owns: a `CollectorRegistry`. Needs: `watch(...)` once, with the callables the state gauges
    read at scrape time. Every hook is synchronous and never raises for a value it does not know.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.relayed_calls = Counter(
            "oubliette_relayed_calls", "Relayed caller tool calls of this server's agents, by how they ended.",
            ["outcome"], registry=r)
        self.relayed_call_duration = Histogram(
            "oubliette_relayed_call_duration_seconds",
            "Seconds from a relayed call's request to its outcome (the caller's answer, the timeout, ...).",
            buckets=CALL_BUCKETS, registry=r)
        self.approvals = Counter(
            "oubliette_approvals", "Approvals of this server's gated calls, by decision.", ["decision"], registry=r)
        self.approval_decision_time = Histogram(
            "oubliette_approval_decision_seconds", "Seconds from an approval request to its decision.",
            buckets=DECISION_BUCKETS, registry=r)
        self.frames = Counter(
            "oubliette_frames_appended", "Frames this server stored in the frame log, by type (unknown types: other).",
            ["type"], registry=r)
        self.append_latency = Histogram(
            "oubliette_store_append_seconds", "Seconds one frame append to the store took (committed).",
            buckets=APPEND_BUCKETS, registry=r)
        self.log_tail_frames = Counter(
            "oubliette_log_tail_pushed", "Frames other servers appended that this server pushed to its "
            "callers (the log tail; shared store only).", registry=r)
        self.log_tail_delay = Histogram(
            "oubliette_log_tail_push_seconds", "Seconds from the notice of another server's append to the push "
            "of its frames here (one read of the log tail).", buckets=APPEND_BUCKETS, registry=r)
        self.http_requests = Counter(
            "oubliette_http_requests", "HTTP requests answered, by status (none: ended without an answer).",
            ["status"], registry=r)
        self.auth_refusals = Counter(
            "oubliette_auth_refusals", "Requests refused for their credentials, by door (relay, http) and reason.",
            ["door", "reason"], registry=r)
        self.relay_evictions = Counter(
            "oubliette_relay_evictions", "Relay connections closed before a valid hello to make room for a new one "
            "at relay_max_connections.", registry=r)
        self.toolset_calls = Counter(
            "oubliette_toolset_calls", "Calls of host toolsets by the agents, by toolset and outcome.",
            ["toolset", "outcome"], registry=r)
        self.policy_decisions = Counter(
            "oubliette_policy_decisions", "Agents' tool calls decided by the policies, by effect (permit, approval, "
            "forbid) and whether it was enforced (false: observe only, a forbidden call ran).",
            ["effect", "enforced"], registry=r)
        # Every known label value is exported from the start (at 0): a rate over a series that
        # appears only at its first event misses that event. The children of the hot paths (a
        # relayed call, a frame) are kept: `labels()` takes a lock and builds a key each time.
        self._relayed = {outcome: self.relayed_calls.labels(outcome) for outcome in RELAYED_OUTCOMES}
        self._frames = {type: self.frames.labels(type) for type in (*sorted(KNOWN_FRAME_TYPES), "other")}
        for decision in APPROVAL_DECISIONS:
            self.approvals.labels(decision)
        for door, reason in AUTH_REFUSALS:
            self.auth_refusals.labels(door, reason)
        self._policy = {
            (effect, enforced): self.policy_decisions.labels(effect, str(enforced).lower())
            for effect in POLICY_EFFECTS for enforced in (True, False) if enforced or effect == "forbid"
        }

    def watch(self, **reads: Callable[[], float]) -> None:
        """Export the state gauges (`STATE_GAUGES` keys), each read by its callable at scrape time."""
        unknown = set(reads) - set(STATE_GAUGES)
        if unknown:
            raise ValueError(f"unknown state gauge(s): {', '.join(sorted(unknown))}")
        self.registry.register(_StateGauges({
            STATE_GAUGES[key][0]: (STATE_GAUGES[key][1], read) for key, read in reads.items()
        }))

    def page(self) -> bytes:
        """Every metric in the Prometheus text exposition format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    # -- hooks -------------------------------------------------------------------------

    def relayed_call_ended(self, ended: bool, error: RelayError | None, seconds: float) -> None:
        """A relayed call's wait is over: `ended` by one outcome (`error`, None for a result), or not (a failure)."""
        self._relayed[outcome_of(error, "answered") if ended else "failed"].inc()
        self.relayed_call_duration.observe(seconds)

    def approval_decided(self, decision: Verdict | None, seconds: float) -> None:
        """A gated call's approval ended with `decision` after `seconds`."""
        self.approvals.labels(decision_of(decision)).inc()
        self.approval_decision_time.observe(seconds)

    def frame_stored(self, type: str, seconds: float) -> None:
        """A frame of `type` was stored; the append took `seconds`."""
        self._frames.get(type, self._frames["other"]).inc()
        self.append_latency.observe(seconds)

    def log_tail_pushed(self, count: int, seconds: float) -> None:
        """The log tail pushed `count` frames of other servers, `seconds` after their first notice."""
        self.log_tail_frames.inc(count)
        self.log_tail_delay.observe(seconds)

    def http_answered(self, status: int | None) -> None:
        """An HTTP request ended with `status` (None: no answer was sent)."""
        self.http_requests.labels(str(status) if status is not None else "none").inc()

    def auth_refused(self, door: str, reason: str) -> None:
        """A relay hello or an HTTP request was refused for its credentials."""
        self.auth_refusals.labels(door, reason).inc()

    def relay_evicted(self) -> None:
        """A relay connection without a valid hello was evicted at the relay's cap."""
        self.relay_evictions.inc()

    def toolset_call_ended(self, toolset: str, error: BaseException | None) -> None:
        """A `toolset_call` of `toolset` (its id; "unknown" for a name no toolset publishes) ended."""
        self.toolset_calls.labels(toolset, outcome_of(error, "ok")).inc()

    def policy_decided(self, effect: str, enforced: bool) -> None:
        """The policies decided an agent's tool call (`effect`); not `enforced`: observe only."""
        self._policy[effect, enforced].inc()

    def checking_relay_tokens(self, verify: Callable[[str, object], bool]) -> Callable[[str, object], bool]:
        """`verify`, counting each token it refuses as a relay refusal (the relay asks it once per hello)."""

        def checked(instance: str, token: object) -> bool:
            if verify(instance, token):
                return True
            self.auth_refused("relay", "bad_token")
            return False

        return checked
