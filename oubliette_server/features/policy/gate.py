"""The one place an agent's tool call is decided by the deployment's policies, before anything runs.

`PolicyGate.check` is asked by the caller tool relay and the toolset service as soon as they
have found the tool a `caller_tool` or `toolset_call` names, on every path a call reaches the
server (both arrive as those relay requests). It decides with the current `PolicyRules`,
stores the decision (a `policy_decision` frame of the calling session, pushed to nobody),
counts it (`on_decided`, the metrics) and marks the relay request's span; a forbidden call
raises `RelayError(DENIED)` with the policy's reason, so nothing is relayed or run.

`PolicyGate.require` is the one place an HTTP principal's request is decided (docs/POLICY.md,
"HTTP principals"): the caller API's tools and the HTTP routes ask it once they know the instance
(or endpoint) a request is for; a refusal is `RelayError(DENIED)` naming the principal, the
action and the resource, and what to do.

Reloads (`reload`: SIGHUP, or a change of a policy file seen by `watch`) build a new
`PolicyRules` and swap the reference: a call keeps the set it was decided by, and none waits.
An invalid set is refused with one log line, and the previous set stays.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any, Callable, Protocol

import attrs
import trio

from protocol import RelayError, errors
from oubliette_runtime.trace_spans import record_policy_decision

from ...core.server_owned import POLICY_DECISION
from ...core.sessions import Session
from .rules import OPERATE, PolicyError, PolicyRules, Ruling, ToolCall

log = logging.getLogger("oubliette.server.policy")


class RecordFrame(Protocol):
    """`FrameLog.record`: store a server's own frame of a session, pushed to nobody."""

    async def __call__(self, session: Session, type: str, payload: dict[str, Any]) -> Any:
        """Store the frame."""
        ...


class PolicyCheck(Protocol):
    """What the tool-calling services are given: decide a call they found, before running it."""

    async def __call__(self, call: ToolCall, session: Session | None, carried: frozenset[str] = frozenset()) -> Ruling:
        """The ruling on `call` (never `forbid` when it returns); raises `RelayError(DENIED)` for a
        forbidden call. `carried`: the effects whose decision the service records itself, as
        `ruling.record` under `POLICY_KEY` in the request frame it appends next."""
        ...


async def as_declared(call: ToolCall, session: Session | None, carried: frozenset[str] = frozenset()) -> Ruling:
    """The check of a service built without a gate (a test, a piece embedded alone): the tool's own flag."""
    gated = call.declared_approval
    return Ruling("approval" if gated else "permit", (), approval_by=gated)


def owner_principal(session: Session | None) -> str:
    """The identity of the session's owning caller, as `context.caller_principal` names it."""
    if session is None:
        return ""
    return session.owner.identity if session.owner is not None else session.owner_identity or ""


class PolicyGate:
    """Decides every agent's tool call with the deployment's policy set, and keeps that set current.

    Needs: the rules to start with (`PolicyRules.from_files`, or the default), the policy files
    to read again on a reload (none: nothing to reload), whether to only observe (a call the
    policies forbid runs, as its tool's flag says, and the decision is stored and logged as
    `observe_only`), `record` (`FrameLog.record`), `on_decided(effect, enforced)` (the metrics),
    and a clock (seconds since the epoch: the policies' `context.time`).
    Owns: with files, a task that reloads them when they change (`watch`, started with `nursery.start`).
    Raises: `RelayError(DENIED)` from `check` for a forbidden call; nothing else of its own.
    Cancellation: `check` may be cancelled while the decision is stored; nothing ran.
    """

    def __init__(
        self,
        rules: PolicyRules,
        *,
        files: list[Path] | None = None,
        observe_only: bool = False,
        record: RecordFrame | None = None,
        on_decided: Callable[[str, bool], None] = lambda effect, enforced: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        """The policy set in force; a reload replaces it whole."""
        self.files = list(files or [])
        self.observe_only = observe_only
        self.record = record
        self.on_decided = on_decided
        self.clock = clock
        self.reloaded = trio.Event()
        """Set (and replaced) after each reload attempt, for whoever waits to see one land."""

    async def check(self, call: ToolCall, session: Session | None, carried: frozenset[str] = frozenset()) -> Ruling:
        """Decide `call`: its ruling (`permit` or `approval`), or `RelayError(DENIED)` when forbidden.

        The decision is stored in `session`'s log before the call goes on: in the request frame
        the calling service appends next when it says it carries this effect (`carried`: a
        permitted caller tool call's `caller_tool_request`, a gated call's `approval_request`),
        else first, as a `policy_decision` frame of its own (a forbid always: nothing else is
        appended). A client bound to no session has no log: its decisions are in the metrics
        and, when forbidden, the log line."""
        rules = self.rules  # one set for the whole decision, whatever a reload does meanwhile
        ruling = rules.decide(call, self.clock())
        enforced = not (ruling.effect == "forbid" and self.observe_only)
        if session is not None and self.record is not None and ruling.effect not in carried:
            payload: dict[str, Any] = {"tool": call.tool, "kind": call.kind, "owner": call.owner, **ruling.record}
            if not enforced:
                payload["observe_only"] = True
            await self.record(session, POLICY_DECISION, payload)
            ruling = attrs.evolve(ruling, stored=True)
        self.on_decided(ruling.effect, enforced)
        record_policy_decision(ruling.effect, ruling.policies, enforced)
        if ruling.effect != "forbid":
            return ruling
        where = f"{call.instance} {call.session or '(no session)'}"
        if enforced:
            log.info("policy forbids %s of %s: %s (policies: %s)", call.tool, where, ruling.reason,
                     ", ".join(ruling.policies) or "none")
            raise RelayError(errors.DENIED, f"forbidden by policy: {ruling.reason}")
        log.warning("observe only: policy would forbid %s of %s: %s (policies: %s)", call.tool, where, ruling.reason,
                    ", ".join(ruling.policies) or "none")
        return attrs.evolve(await as_declared(call, session), stored=True)  # the forbid is the decision stored

    def require(self, principal: str, action: str, resource: str) -> None:
        """Refuse (`RelayError(DENIED)`, with why and what to do) unless the current set lets
        `principal` do `action` to `resource` (an instance's id; an endpoint's name for `operate`)."""
        reason = self.rules.permits(principal, action, resource)
        if reason is None:
            return
        what = f"the {resource} endpoint" if action == OPERATE else f"instance '{resource}'"
        raise RelayError(errors.DENIED, (
            f"principal '{principal}' may not {action} {what}: {reason}; a policy that permits it "
            f"(docs/POLICY.md, \"HTTP principals\") or another principal's token is needed"
        ))

    def reload(self) -> bool:
        """Read the policy files again and swap the set in; an invalid set keeps the current one
        and says why in one log line. Returns whether the new set is in force."""
        try:
            if not self.files:
                log.info("no policy file to reload: the default policy stays")
                return False
            try:
                rules = PolicyRules.from_files(self.files)
            except PolicyError as exc:
                log.error("policy reload refused, the previous policy set stays: %s", exc)
                return False
            self.rules = rules
            log.info("policy reloaded: %d policies from %s", len(rules), rules.source)
            return True
        finally:
            self.reloaded.set()
            self.reloaded = trio.Event()

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reload whenever a policy file changes (written, replaced, removed and written again),
        until cancelled. The files' directories are watched (inotify, through `watchfiles`), so an
        editor's write-then-rename is seen too; started once the watch is set up."""
        if not self.files:
            task_status.started()
            await trio.sleep_forever()
        import watchfiles

        wanted = {path.resolve() for path in self.files}
        directories = sorted({str(path) for path in {p.parent for p in wanted}})
        stop = trio.Event()  # ends the watcher's thread (it looks every `step` ms) when we are cancelled
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_set_when_cancelled, stop)
            watching = watchfiles.awatch(*directories, stop_event=stop, debounce=50, step=20, recursive=False)
            async with aclosing(watching) as changes_seen:
                # The watch is set up in the generator's first step, before its first checkpoint:
                # the files are watched by the time whoever started this task runs again.
                task_status.started()
                async for changes in changes_seen:
                    if any(Path(path).resolve() in wanted for _, path in changes):
                        self.reload()


async def _set_when_cancelled(event: trio.Event) -> None:
    """Set `event` once this task is cancelled."""
    try:
        await trio.sleep_forever()
    finally:
        event.set()
