"""A scripted stand-in for the Messages API, so tests can drive the real Claude Code CLI offline.

Claude Code (`ANTHROPIC_BASE_URL=http://127.0.0.1:PORT`) sends `HEAD /` and then streaming
`POST /v1/messages?beta=true`; this server answers each main-loop request with the next
scripted reply as Server-Sent Events (`message_start`, `content_block_start` / `_delta` /
`_stop`, `message_delta` with `stop_reason`, `message_stop`), exactly the events the real API
sends. It is not a model: a reply is a list of content blocks (`text(...)`, `tool_use(...)`),
or a function of the request that returns one (to answer with what an earlier tool result
said). Every request body is recorded, so a test asserts on the `tool_result` blocks the
"model" was shown. A request that offers no tools (Claude Code's own side requests, such as a
title) gets a short text and does not consume the script.

The HTTP server and the script are tests/support/scripted_api.py's, shared with the Gemini stand-in.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Union

import h11
import trio

from scripted_api import ScriptedAPI

Block = dict[str, Any]
Reply = Union[list[Block], Callable[[dict[str, Any]], list[Block]]]

_ids = itertools.count(1)


def text(value: str) -> Block:
    """A text block of a scripted reply."""
    return {"type": "text", "text": value}


def tool_use(name: str, input: dict[str, Any], id: str | None = None) -> Block:
    """A tool_use block of a scripted reply: the CLI runs tool `name` with `input`."""
    return {"type": "tool_use", "id": id or f"toolu_{next(_ids):04d}", "name": name, "input": input}


def tool_results(request: dict[str, Any]) -> list[Block]:
    """Every `tool_result` block in a recorded request's messages, oldest first."""
    found: list[Block] = []
    for message in request.get("messages", []):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, list):
            found.extend(block for block in content if isinstance(block, dict) and block.get("type") == "tool_result")
    return found


def result_text(block: Block) -> str:
    """The text of a `tool_result` block (a string, or a list of text blocks)."""
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def last_result_json(request: dict[str, Any]) -> Any:
    """The newest tool result of a request, parsed as JSON (what a model would read in it)."""
    results = tool_results(request)
    assert results, "the request holds no tool result"
    body = result_text(results[-1])
    try:
        return json.loads(body)
    except ValueError:
        raise AssertionError(f"the tool result is not JSON: {results[-1]!r}") from None


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def stream_events(blocks: list[Block], model: str) -> list[bytes]:
    """The SSE events of one assistant message holding `blocks`, as the Messages API streams it."""
    stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    events = [_sse("message_start", {"type": "message_start", "message": {
        "id": f"msg_{next(_ids):04d}", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}})]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            start: Block = {"type": "text", "text": ""}
            delta: Block = {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(_sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
        events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(_sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                         "usage": {"output_tokens": 5}}))
    events.append(_sse("message_stop", {"type": "message_stop"}))
    return events


def whole_message(blocks: list[Block], model: str) -> dict[str, Any]:
    """The same message as one JSON body, for a request that did not ask to stream."""
    stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    return {"id": f"msg_{next(_ids):04d}", "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5}}


class FakeAnthropic(ScriptedAPI[Block]):
    """The Messages API stand-in: a request that offers tools consumes the next scripted reply;
    when the script is used up, a further one gets the text "(script exhausted)"."""

    def _reply_for(self, body: dict[str, Any]) -> list[Block]:
        self.requests.append(body)
        if not body.get("tools"):
            return [text("ok")]
        return self.next_reply(body, [text("(script exhausted)")], lambda said: [text(said)])

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> None:
        path = request.target.decode().split("?", 1)[0]
        if request.method == b"POST" and path == "/v1/messages":
            payload = json.loads(body)
            blocks = self._reply_for(payload)
            model = str(payload.get("model", "claude-stand-in"))
            if payload.get("stream"):
                await self._stream(conn, stream, stream_events(blocks, model))
                return
            await self._json(conn, stream, 200, whole_message(blocks, model))
            return
        error = {"type": "error", "error": {"type": "not_found_error", "message": f"{request.method.decode()} {path}"}}
        await self._json(conn, stream, 404, error, head=request.method == b"HEAD")
