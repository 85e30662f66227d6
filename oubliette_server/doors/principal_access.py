"""What an HTTP principal may do on the HTTP routes: the policy asked once per request, by route.

The HTTP door's routes other than `/mcp` (whose tools ask the policy themselves, once they know
the instance: caller_api/tools.py) name what they act on in their path, so one table maps each to
an action and a resource (docs/POLICY.md, "HTTP principals"):

- `POST /v1/instances/{id}/tether`: `message` that instance;
- `GET  /v1/instances/{id}/tether/poll`, `…/tether/stream`: `read` it;
- `POST /v1/instances/{id}/sessions/{sid}/…` (approvals, caller tool answers): `answer` it;
- `GET /metrics`, `GET /v1/health`: `operate` the endpoint `metrics`, `health`.

`BearerAuth` found the principal (the scope's `oubliette_principal`); a request on a Unix socket
listener is the admin's (file access is its credential), and one made with an instance's own
token (its sandbox's, on that instance's routes only) is not a principal's: it passes as before.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from protocol import RelayError

from ..core.ids import ADMIN_PRINCIPAL

PRINCIPAL_STATE = "oubliette_principal"
"""The scope state key `BearerAuth` puts a request's HTTP principal under."""
Access = Callable[[str, str, str], None]
"""`PolicyGate.require(principal, action, resource)`: raises `RelayError(DENIED)` unless permitted."""

_INSTANCE_ROUTES = (
    (re.compile(r"^/v1/instances/([^/]+)/tether$"), "POST", "message"),
    (re.compile(r"^/v1/instances/([^/]+)/tether/(?:poll|stream)$"), "GET", "read"),
    (re.compile(r"^/v1/instances/([^/]+)/sessions/[^/]+/[^/]+$"), "POST", "answer"),
)
_OPERATOR_ROUTES = {"/metrics": "metrics", "/v1/health": "health"}


def route_access(method: str, path: str) -> tuple[str, str] | None:
    """The (action, resource) a request to `path` asks for, or None (a route the policy does not
    scope here: `/mcp`, the probes, an unknown path)."""
    endpoint = _OPERATOR_ROUTES.get(path)
    if endpoint is not None:
        return ("operate", endpoint) if method in ("GET", "HEAD") else None
    if not path.startswith("/v1/instances/"):
        return None
    for pattern, wanted, action in _INSTANCE_ROUTES:
        match = pattern.match(path)
        if match and method in (wanted, "HEAD" if wanted == "GET" else wanted):
            return action, match.group(1)
    return None


class PrincipalAccess:
    """ASGI middleware inside `BearerAuth`: a principal's request to a route of `route_access`
    goes on only when `access` permits it; else `refuse(err)` (the JSON 403 with the reason)."""

    def __init__(self, app: Any, access: Access, refuse: Callable[[RelayError], Any]) -> None:
        self.app = app
        self.access = access
        self.refuse = refuse

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        wanted = route_access(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if wanted is not None:
            principal = _principal(scope)
            if principal is not None:
                try:
                    self.access(principal, *wanted)
                except RelayError as err:
                    await self.refuse(err)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _principal(scope: dict[str, Any]) -> str | None:
    """The request's HTTP principal: `BearerAuth`'s, the admin on a Unix socket, None for an instance's token."""
    if scope.get("server") is None:
        return ADMIN_PRINCIPAL
    return scope.get("state", {}).get(PRINCIPAL_STATE)


def request_principal(state: Any) -> str:
    """The principal of an `/mcp` request from its Starlette `request.state` (a Unix socket's: the admin)."""
    return getattr(state, PRINCIPAL_STATE, None) or ADMIN_PRINCIPAL

