"""A scripted stand-in for an LLM agent, for the demo and the tests. It is not an LLM.

It does what an agent such as Claude Code does with Oubliette, minus the
thinking: it spawns `oubliette-client` as an MCP server (from the MCP config
file the guest runtime wrote, or from the `OUBLIETTE_*` environment), lists
its tools, and, if the message names one of them followed by a JSON object,
calls it with that object and prints the result. Each printed line becomes an
`assistant.delta` frame; the whole output the `assistant.done` answer.

    Please call myapp_send_notification {"message": "hello"}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import trio


def _server_parameters(config_path: str | None) -> Any:
    from mcp.client.stdio import StdioServerParameters

    if config_path:
        with open(config_path) as handle:
            server = next(iter(json.load(handle)["mcpServers"].values()))
        return StdioServerParameters(command=server["command"], args=server.get("args", []), env=server.get("env"))
    env = {k: v for k, v in os.environ.items() if k.startswith("OUBLIETTE_")}
    return StdioServerParameters(command=sys.executable, args=["-m", "oubliette_client"], env=env)


def find_call(message: str, tool_names: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The first listed tool the message names, and the JSON object after it."""
    for match in re.finditer(r"[A-Za-z0-9_.-]+", message):
        if match.group(0) in tool_names:
            rest = message[match.end():]
            start = rest.find("{")
            arguments: dict[str, Any] = {}
            if start >= 0:
                arguments = json.loads(rest[start: rest.rindex("}") + 1])
            return match.group(0), arguments
    return None


async def run_agent(message: str, config_path: str | None, mode: str) -> int:
    """Spawn `oubliette-client` over MCP, list its tools, and call the one `message` names, printing each step.

    Owns: the MCP client session and its child process (closed on return or cancellation).
    Needs: `config_path` from the guest runtime, or the `OUBLIETTE_*` environment.
    Raises: whatever the MCP client raises when the child cannot start; a tool that fails is
    printed, not raised. Returns 0.
    """
    from mcp import Client

    async with Client(_server_parameters(config_path), mode=mode) as client:
        tools = [tool.name for tool in (await client.list_tools()).tools]
        print(f"I can use: {', '.join(tools) or 'no tools'}", flush=True)
        call = find_call(message, tools)
        if call is None:
            print(f"You said: {message.strip()}", flush=True)
            return 0
        name, arguments = call
        print(f"Calling {name} with {json.dumps(arguments)}", flush=True)
        result = await client.call_tool(name, arguments)
        text = " ".join(getattr(block, "text", "") for block in result.content)
        if result.is_error:
            print(f"The tool failed: {text}", flush=True)
        else:
            print(f"{name} returned {text}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `demo-agent` command: read the message from stdin and run `run_agent` on it; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mcp-config", help="MCP config file naming the oubliette-client to start")
    parser.add_argument("--mode", default="legacy", help="MCP era: legacy (handshake) or auto")
    args = parser.parse_args(argv)
    message = sys.stdin.read()
    return trio.run(run_agent, message, args.mcp_config, args.mode)


if __name__ == "__main__":
    sys.exit(main())
