"""Toolsets registered in code: a server in your own nursery, three kinds of toolset, one allowlist.

Run from anywhere:  python examples/toolsets_in_code.py   (Ctrl-C stops it)
It keeps its data in a temporary directory, logs to stderr, and prints how to list the tools
an agent of instance box1 sees. docs/TOOLSETS.md shows this file; tests/e2e/test_examples.py runs it.
"""

import importlib.util
import logging
import signal
import sys
import tempfile
from pathlib import Path

import trio

from oubliette_server import OublietteServer, ServerConfig
from oubliette_server.features.toolsets import FunctionToolset, ToolSpec

HERE = Path(__file__).resolve().parent


async def shout(arguments):
    return {"text": arguments["text"].upper()}


async def main(data_dir: Path) -> None:
    server = OublietteServer(ServerConfig(data_dir=data_dir))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        tools = [ToolSpec(name="shout", description="Upper-case a text",
                          input_schema={"type": "object", "properties": {"text": {"type": "string"}},
                                        "required": ["text"]})]
        # one toolset per agent session, stopped when the session ends:
        await server.register_toolset("shouter", "sh", tools, factory=lambda: FunctionToolset({"shout": shout}))
        # one shared toolset, never stopped by a session:
        await server.register_toolset("shared", "sh2", tools, ref=FunctionToolset({"shout": shout}))
        allowed = ["shouter", "echo"]
        # a stdio MCP server run by the host (shared; restarted on the next call if it dies, at most 3 times):
        if importlib.util.find_spec("mcp_server_time"):  # pip install mcp-server-time
            await server.register_mcp_toolset("time", "time", sys.executable, ["-m", "mcp_server_time"],
                                              env=None, cwd=None, roots=[str(data_dir)])
            allowed.append("time")
        # a command endpoint speaking the action contract (discovery failures are logged and tolerated):
        await server.register_command_toolset("echo", "ext", [sys.executable, str(HERE / "mcp_echo.py")])
        # nothing is visible until allowed (the allowlist is empty by default):
        await server.update_allowed_toolsets("box1", allowed)
        print(f"serving; the tools an agent of box1 sees:\n"
              f"  OUBLIETTE_RELAY={server.config.relay_address} OUBLIETTE_INSTANCE=box1 "
              f"OUBLIETTE_TOKEN={server.tokens.token_for('box1')} oubliette-client tools list", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break  # Ctrl-C: stop the server, its toolsets and their processes
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="oubliette-toolsets-") as tmp:
        trio.run(main, Path(tmp))
