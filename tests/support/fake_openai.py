"""A scripted stand-in for the OpenAI Chat Completions API, so tests can drive the real OpenCode
CLI offline.

OpenCode (a custom `@ai-sdk/openai-compatible` provider whose `baseURL` is this server's `/v1`)
sends `POST /v1/chat/completions` with `"stream": true`; this server answers a request that
offers tools (the main loop) with the next scripted reply, a list of parts (`text(...)`,
`tool_call(...)`), as server-sent `chat.completion.chunk` events ending in `[DONE]`. A request
without tools is one of the CLI's side calls (it asks for a session title): it gets a title and
does not consume the script. The server and the script are tests/support/scripted_api.py's.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import trio

from scripted_api import ScriptedAPI

Part = dict[str, Any]
TITLE = "A scripted title"


def text(value: str) -> Part:
    """A text part of a scripted reply."""
    return {"content": value}


def tool_call(name: str, args: dict[str, Any]) -> Part:
    """A tool call part of a scripted reply: the CLI runs tool `name` with `args`."""
    return {"tool_call": {"name": name, "arguments": json.dumps(args)}}


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `role: tool` message of a recorded request, oldest first."""
    return [message for message in request.get("messages", []) if message.get("role") == "tool"]


def offered_tools(request: dict[str, Any]) -> set[str]:
    """The function names a recorded request offers the model."""
    return {tool["function"]["name"] for tool in request.get("tools", []) if tool.get("type") == "function"}


def chunks(parts: list[Part], model: str) -> list[dict[str, Any]]:
    """The `chat.completion.chunk`s of one streamed reply holding `parts`, the last with its
    `finish_reason` and usage."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    out = [chunk({"role": "assistant", "content": ""})]
    calls = [part["tool_call"] for part in parts if "tool_call" in part]
    out += [chunk({"content": part["content"]}) for part in parts if "content" in part]
    out += [chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function", "function": call}]})
            for index, call in enumerate(calls)]
    last = chunk({}, "tool_calls" if calls else "stop")
    last["usage"] = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return [*out, last]


class FakeOpenAI(ScriptedAPI[Part]):
    """The Chat Completions stand-in; `requests` records every call, side calls included."""

    def _reply_for(self, body: dict[str, Any]) -> list[Part]:
        self.requests.append(body)
        if not body.get("tools"):
            return [text(TITLE)]
        return self.next_reply(body, [text("(script exhausted)")], lambda said: [text(said)])

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> None:
        path = request.target.decode().split("?", 1)[0]
        if request.method == b"POST" and path == "/v1/chat/completions":
            document = json.loads(body)
            answer = chunks(self._reply_for(document), document.get("model", "m1"))
            events = [f"data: {json.dumps(event)}\n\n".encode() for event in answer]
            await self._stream(conn, stream, [*events, b"data: [DONE]\n\n"])
            return
        error = {"error": {"message": f"{request.method.decode()} {path}", "type": "not_found"}}
        await self._json(conn, stream, 404, error, head=request.method == b"HEAD")
