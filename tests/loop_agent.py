"""A scripted agent for tests/test_caller_loop.py, run by the guest runtime (not an LLM).

The message on stdin is JSON: `{"steps": [[{"tool": NAME, "arguments": {...}}, ...], ...]}`.
Steps run one after the other; the calls of one step run at the same time (an agent that
issues several tool calls at once). Each outcome is printed as one line,
`NAME -> TEXT` or `NAME failed: TEXT`, so the turn's text (`assistant.done`) carries them.
"""

from __future__ import annotations

import json
import sys

import trio

from oubliette_client.demo_agent import _server_parameters


async def main(config_path: str) -> None:
    from mcp import Client

    script = json.loads(sys.stdin.read() or "{}")
    async with Client(_server_parameters(config_path), mode="legacy") as client:
        await client.list_tools()
        for step in script.get("steps", []):
            async with trio.open_nursery() as nursery:
                for call in step:
                    nursery.start_soon(run_call, client, call["tool"], call.get("arguments", {}))
        print("done", flush=True)


async def run_call(client: object, name: str, arguments: dict) -> None:
    result = await client.call_tool(name, arguments)  # type: ignore[attr-defined]
    text = " ".join(getattr(block, "text", "") for block in result.content)
    print(f"{name} failed: {text}" if result.is_error else f"{name} -> {text}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
