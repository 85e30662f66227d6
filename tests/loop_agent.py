"""A scripted agent for tests/test_caller_loop.py and test_approvals_matrix.py, run by the guest
runtime (not an LLM).

The message on stdin is JSON: `{"steps": [[{"tool": NAME, "arguments": {...}}, ...], ...]}`,
optionally with `"client_args": [...]` (extra flags for its oubliette-client, e.g.
`--progress-interval`). Steps run one after the other; the calls of one step run at the same
time (an agent that issues several tool calls at once). Each outcome is printed as one line,
`NAME -> TEXT` or `NAME failed: TEXT`, so the turn's text (`assistant.done`) carries them.

A call with `"progress": true` passes a progress callback (the SDK puts a `progressToken` in the
call's `_meta` and routes only notifications carrying that token to it) and prints each report
at once as `NAME progress VALUE/TOTAL MESSAGE`, so the caller sees them as `assistant.delta`
frames while the call still waits. `"cancel_on_progress": true` cancels the call when its first
report arrives (an agent giving up on a long wait) and prints `NAME cancelled`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio

from oubliette_client.demo_agent import _server_parameters


async def main(config_path: str) -> None:
    from mcp import Client

    script = json.loads(sys.stdin.read() or "{}")
    params = _server_parameters(config_path)
    params.args = [*params.args, *script.get("client_args", [])]
    async with Client(params, mode="legacy") as client:
        await client.list_tools()
        for step in script.get("steps", []):
            async with trio.open_nursery() as nursery:
                for call in step:
                    nursery.start_soon(run_call, client, call)
        print("done", flush=True)


async def run_call(client: Any, call: dict[str, Any]) -> None:
    name, arguments = call["tool"], call.get("arguments", {})
    watch = bool(call.get("progress") or call.get("cancel_on_progress"))
    with trio.CancelScope() as scope:

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            print(f"{name} progress {progress:g}/{'' if total is None else f'{total:g}'} {message or ''}", flush=True)
            if call.get("cancel_on_progress"):
                scope.cancel()

        result = await client.call_tool(name, arguments, progress_callback=on_progress if watch else None)
        text = " ".join(getattr(block, "text", "") for block in result.content)
        print(f"{name} failed: {text}" if result.is_error else f"{name} -> {text}", flush=True)
    if scope.cancelled_caught:
        print(f"{name} cancelled", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
