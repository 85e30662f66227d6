"""A scripted stand-in for the OpenAI Responses API, so tests can drive the real Codex CLI offline.

Codex (`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`, any `OPENAI_API_KEY`) sends
`POST /v1/responses` with `"stream": true`; this server answers each with the next scripted
reply, a list of output items (`text(...)`, `function_call(...)`), as server-sent events:
`response.created`, one `response.output_item.done` per item, `response.completed`. The server
and the script are tests/support/scripted_api.py's, shared with the other stand-ins.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import trio

from scripted_api import ScriptedAPI

Item = dict[str, Any]


def text(value: str) -> Item:
    """An assistant message item of a scripted reply."""
    return {"type": "message", "role": "assistant", "id": "msg_1",
            "content": [{"type": "output_text", "text": value, "annotations": []}]}


def function_call(namespace: str, name: str, args: dict[str, Any], call_id: str = "call_1") -> Item:
    """A function_call item of a scripted reply: the CLI runs tool `name` of `namespace` (an MCP
    server's tools are one namespace, `mcp__<server>`) with `args`."""
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "namespace": namespace,
            "name": name, "arguments": json.dumps(args)}


def function_outputs(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `function_call_output` item of a recorded request's input, oldest first."""
    return [item for item in request.get("input", []) if item.get("type") == "function_call_output"]


def deferred_namespaces(request: dict[str, Any]) -> list[str]:
    """The tool namespaces a recorded request names as deferred (Codex lists MCP servers so)."""
    said = json.dumps(request.get("input", []))
    listed = said.split("Deferred tool namespaces:", 1)[1].split("</tools>", 1)[0] if "Deferred tool namespaces:" in said else ""
    return [line.strip()[2:] for line in listed.split("\\n") if line.strip().startswith("- ")]


def events(items: list[Item], number: int) -> list[bytes]:
    """One response's server-sent events: created, each output item, completed."""
    response = {"id": f"resp_{number}", "object": "response", "status": "in_progress", "output": []}
    sent = [{"type": "response.created", "response": response}]
    sent += [{"type": "response.output_item.done", "output_index": index, "item": item}
             for index, item in enumerate(items)]
    usage = {"input_tokens": 10, "input_tokens_details": None, "output_tokens": 5,
             "output_tokens_details": None, "total_tokens": 15}
    sent.append({"type": "response.completed", "response": {**response, "status": "completed", "usage": usage}})
    return [f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode() for event in sent]


class FakeCodexAPI(ScriptedAPI[Item]):
    """The Responses API stand-in; `requests` records every request body."""

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> None:
        path = request.target.decode().split("?", 1)[0]
        if request.method == b"POST" and path == "/v1/responses":
            value = json.loads(body)
            self.requests.append(value)
            items = self.next_reply(value, [text("(script exhausted)")], lambda said: [text(said)])
            await self._stream(conn, stream, events(items, len(self.requests)))
            return
        error = {"error": {"message": f"{request.method.decode()} {path}", "type": "not_found"}}
        await self._json(conn, stream, 404, error, head=request.method == b"HEAD")
