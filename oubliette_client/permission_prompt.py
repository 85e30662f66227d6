"""Claude Code's permission prompt as an MCP tool: the agent's own actions, decided by the session's caller.

Claude Code started with `--permission-prompt-tool mcp__oubliette__permission_prompt` calls
this tool for each of its own actions (Bash, Edit, another MCP tool) that its settings neither
allow nor deny, with `{"tool_name", "input", "tool_use_id"}` (extra keys are accepted). The
client relays the question as the `approval` request; the server asks the owning caller of the
client's session (an `approval_request` with origin "agent") and answers with the decision.
The answer is one text block holding exactly Claude Code's JSON: `{"behavior": "allow",
"updatedInput": …}` (always the full input, or the caller's rewrite) or `{"behavior": "deny",
"message": …}`. Every failure is a denial (fail closed): non-JSON text would count as one
anyway, but a clear message tells the agent why.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from protocol import RelayError, errors

log = logging.getLogger("oubliette.client.permission")

#: The tool's name; through the generated {mcp_config} (server `oubliette`) Claude Code calls it
#: `mcp__oubliette__permission_prompt`.
PERMISSION_PROMPT = "permission_prompt"
#: The server's default approval timeout; the client waits that long (plus a margin) for a decision.
APPROVAL_WAIT = 600.0
APPROVAL_MARGIN = 10.0

DESCRIPTION = (
    "Permission prompt for the agent's own actions (Claude Code --permission-prompt-tool): asks the "
    "caller that owns this session whether the action may run, and answers {behavior: allow, updatedInput} "
    "or {behavior: deny, message}."
)
INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool_name": {"type": "string", "minLength": 1, "description": "The agent's tool that wants to run, e.g. Bash."},
        "input": {"type": "object", "description": "The input it would run with."},
        "tool_use_id": {"type": "string", "description": "The agent's id of this tool use."},
    },
    "required": ["tool_name", "input"],
    "additionalProperties": True,
}

class Request(Protocol):
    """`RelayLink.request` as the prompt is given it: one relay request and its result."""

    async def __call__(self, method: str, params: dict[str, Any], *, timeout: float | None = None) -> Any:
        """Send `method` with `params`; its result, or `RelayError` within `timeout` seconds."""
        ...


def allow(updated_input: dict[str, Any]) -> str:
    """Claude Code's allow answer; `updatedInput` is always present (the full input or a rewrite)."""
    return json.dumps({"behavior": "allow", "updatedInput": updated_input}, ensure_ascii=False, separators=(",", ":"))


def deny(message: str) -> str:
    """Claude Code's deny answer, with a message the agent sees."""
    return json.dumps({"behavior": "deny", "message": message}, ensure_ascii=False, separators=(",", ":"))


def _problem(arguments: Any) -> str | None:
    if not isinstance(arguments, dict):
        return "permission_prompt needs a JSON object"
    if not isinstance(arguments.get("tool_name"), str) or not arguments["tool_name"]:
        return "permission_prompt needs tool_name (a non-empty string)"
    if not isinstance(arguments.get("input"), dict):
        return "permission_prompt needs input (an object)"
    if "tool_use_id" in arguments and not isinstance(arguments["tool_use_id"], str):
        return "permission_prompt: tool_use_id must be a string"
    return None


async def permission_prompt(
    request: Request, arguments: Any, *, timeout: float, progress_ref: str | None = None,
) -> str:
    """Ask the session's caller about one action; the answer text in Claude Code's JSON (never raises)."""
    problem = _problem(arguments)
    if problem:
        return deny(problem)
    tool_name, original = arguments["tool_name"], arguments["input"]
    params: dict[str, Any] = {"tool_name": tool_name, "arguments": original}
    if arguments.get("tool_use_id") is not None:
        params["tool_use_id"] = arguments["tool_use_id"]
    if progress_ref is not None:
        params["progress_ref"] = progress_ref
    try:
        from protocol import messages  # loaded by the relay link by now; not at import (cold start)

        reply = await request(messages.APPROVAL, params, timeout=timeout)
    except RelayError as err:
        why = "no decision in time" if err.code == errors.TIMEOUT else err.message
        log.info("permission for %s denied: %s", tool_name, why)
        return deny(f"'{tool_name}' was not approved: {why}")
    if not isinstance(reply, dict) or reply.get("approve") is not True:
        reason = reply.get("reason") if isinstance(reply, dict) else None
        return deny(f"'{tool_name}' was denied: {reason or 'no reason given'}")
    updated = reply.get("updated_arguments")
    return allow(updated if isinstance(updated, dict) else original)
