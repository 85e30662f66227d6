"""A scripted stand-in for the Gemini API, so tests can drive the real Gemini CLI offline.

Gemini CLI (`GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:PORT`, any `GEMINI_API_KEY`) sends
`POST /v1beta/models/MODEL:generateContent` or `:streamGenerateContent?alt=sse`; this server
answers a request that offers tools (the main loop) with the next scripted reply, a list of
parts (`text(...)`, `function_call(...)`), as a `GenerateContentResponse` (one whole body, or
one server-sent event). A request without tools is one of the CLI's side calls: its routing
classifier, which must get a JSON complexity score, gets one; it does not consume the script.
The server and the script are tests/support/scripted_api.py's, shared with the Messages API stand-in.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import trio

from scripted_api import ScriptedAPI

Part = dict[str, Any]
CLASSIFIER_ANSWER = {"complexity_reasoning": "a scripted stand-in", "complexity_score": 10,
                     "reasoning": "a scripted stand-in", "model_choice": "flash"}
"""What each of Gemini CLI's routing classifiers accepts (its bundle's `NumericalClassifierStrategy`
and `ClassifierResponseSchema`): a simple task, for the flash model."""


def text(value: str) -> Part:
    """A text part of a scripted reply."""
    return {"text": value}


def function_call(name: str, args: dict[str, Any]) -> Part:
    """A functionCall part of a scripted reply: the CLI runs tool `name` with `args`."""
    return {"functionCall": {"name": name, "args": args}}


def function_responses(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Every `functionResponse` of a recorded request's contents, oldest first."""
    return [part["functionResponse"] for content in request.get("contents", [])
            for part in content.get("parts", []) if "functionResponse" in part]


def offered_tools(request: dict[str, Any]) -> set[str]:
    """The function names a recorded request offers the model."""
    return {declaration["name"] for tool in request.get("tools", [])
            for declaration in tool.get("functionDeclarations", [])}


def response(parts: list[Part], model: str) -> dict[str, Any]:
    """One `GenerateContentResponse` holding `parts`."""
    return {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
            "modelVersion": model}


class FakeGemini(ScriptedAPI[Part]):
    """The Gemini API stand-in; `requests` records every generate call, side calls included."""

    def _reply_for(self, body: dict[str, Any]) -> list[Part]:
        self.requests.append(body)
        if not body.get("tools"):
            return [text(json.dumps(CLASSIFIER_ANSWER))]
        return self.next_reply(body, [text("(script exhausted)")], lambda said: [text(said)])

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> None:
        path = request.target.decode().split("?", 1)[0]
        model, _, method = path.rpartition("/")[2].partition(":")
        if request.method == b"POST" and path.startswith("/v1beta/models/") and method.endswith("enerateContent"):
            answer = response(self._reply_for(json.loads(body)), model)
            if method == "streamGenerateContent":
                await self._stream(conn, stream, [f"data: {json.dumps(answer)}\n\n".encode()])
                return
            await self._json(conn, stream, 200, answer)
            return
        error = {"error": {"code": 404, "message": f"{request.method.decode()} {path}", "status": "NOT_FOUND"}}
        await self._json(conn, stream, 404, error, head=request.method == b"HEAD")
