"""On start: close the caller tool requests a previous run of the server left without an outcome.

A `caller_tool_request` whose wait died with the server (kill -9, power loss)
has no `caller_tool_result` or `caller_tool_cancelled` frame. Nobody can answer
it any more: the agent's relay request died with the process. Each one gets a
`caller_tool_cancelled` frame (reason "server restarted"), so a reader of the log
sees every request end exactly once.
"""

from __future__ import annotations

import logging
from typing import Any

from ...core.frame_log import AppendFrame as Append
from ...core.sessions import SessionRegistry
from ...store.api import MAX_LIMIT, CursorPruned, FrameQuery, FrameStoreAPI

log = logging.getLogger("oubliette.server.calls")

RESTART_REASON = "server restarted"
REQUEST_TYPES = ("caller_tool_request", "caller_tool_result", "caller_tool_cancelled")



async def unanswered_requests(store: FrameStoreAPI, instance: str) -> list[Any]:
    """The `caller_tool_request` frames of `instance` with no outcome frame in the retained log."""
    open_requests: dict[str, Any] = {}
    after = await store.pruned_below(instance)
    while True:
        try:
            frames = await store.query(instance, FrameQuery(after_seq=after, types=REQUEST_TYPES, limit=MAX_LIMIT))
        except CursorPruned as exc:  # pruned while we read: go on from what is left
            after = exc.first_seq - 1
            continue
        for frame in frames:
            request_id = frame.payload.get("request_id")
            if not isinstance(request_id, str):
                continue
            if frame.type == "caller_tool_request":
                open_requests[request_id] = frame
            else:
                open_requests.pop(request_id, None)
        if len(frames) < MAX_LIMIT:
            return list(open_requests.values())
        after = frames[-1].seq


async def cancel_unanswered_requests(store: FrameStoreAPI, sessions: SessionRegistry, append: Append) -> int:
    """Append `caller_tool_cancelled` (reason "server restarted") for each request left open; how many."""
    closed = 0
    for instance in await store.instances():
        for frame in await unanswered_requests(store, instance):
            session = sessions.get_or_create(instance, frame.channel, frame.session_id)
            await append(session, "caller_tool_cancelled", {
                "request_id": frame.payload["request_id"], "tool": frame.payload.get("tool"), "reason": RESTART_REASON,
            })
            closed += 1
    if closed:
        log.warning("closed %d caller tool request(s) left open by the previous run: %s", closed, RESTART_REASON)
    return closed
