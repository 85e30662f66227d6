"""Whether this server can do its work now: its store answers and its relay listener is up.

`/readyz` (unauthenticated, for load balancers and orchestrators) and `/v1/health` (the
detailed, authenticated view) both ask `Readiness.check`; the HTTP routes only translate
its report (docs/CONFIG.md, "Health endpoints"). Liveness (`/livez`) needs nothing here: a
process that answers HTTP is alive.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import attrs

from ..store.api import StoreUnavailable

READY_TIMEOUT = 2.0
"""Seconds the store has to answer the readiness probe: short, as a probe's own timeout is."""


@attrs.frozen
class Check:
    """One check's outcome: `reason` is safe to show anyone (no addresses, no URLs); `detail`
    is the full error, for the authenticated view."""

    ok: bool
    reason: str = ""
    detail: str = ""

    def public(self) -> dict[str, Any]:
        """`{ok}` and, when failing, `reason`: what `/readyz` may tell an unauthenticated client."""
        return {"ok": True} if self.ok else {"ok": False, "reason": self.reason}

    def detailed(self) -> dict[str, Any]:
        """`public()` plus `detail`: what `/v1/health` tells the operator."""
        return self.public() if self.ok else {**self.public(), "detail": self.detail}


@attrs.frozen
class HealthReport:
    """The checks of one probe, by name (`store`, `relay`); `ok` when every one passed."""

    checks: dict[str, Check]

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(check.ok for check in self.checks.values())

    def reasons(self) -> list[str]:
        """`name: reason` of each failing check, in order."""
        return [f"{name}: {check.reason}" for name, check in self.checks.items() if not check.ok]


class Readiness:
    """Runs the readiness checks.

    Needs: `check_store(timeout)` (the store's `check_available`, raising `StoreUnavailable`)
    and `relay_up()` (whether the relay listener accepts sandboxes). Raises: nothing; a check
    that fails is a failing `Check`.
    """

    def __init__(
        self, check_store: Callable[[float], Awaitable[None]], relay_up: Callable[[], bool],
        timeout: float = READY_TIMEOUT,
    ) -> None:
        self._check_store = check_store
        self._relay_up = relay_up
        self.timeout = timeout

    async def check(self) -> HealthReport:
        """Ask the store (bounded by `timeout`) and the relay listener now."""
        try:
            await self._check_store(self.timeout)
            store = Check(True)
        except StoreUnavailable as exc:
            store = Check(False, "the frame store is unavailable", exc.message)
        relay = Check(True) if self._relay_up() else Check(
            False, "the relay listener is not up", "the relay listener is not bound (starting or stopping)")
        return HealthReport({"store": store, "relay": relay})
