"""An allowed toolset that could not start is reported as unavailable, with why, and started again.

The real programs: oubliette-server with a config file whose MCP toolset's command fails until
a flag file exists (then it becomes `mcp-server-time`), and the SDK's MCP client spawning the
real `oubliette-client` as the agent. Every wait is on an event (a tools/list_changed), bounded.
"""

from __future__ import annotations

import math

import trio

from harness import PYTHON, Deployment, ListChanged, text_of

from toolset_configs import agent_token, tool_names, write_config

# argv: STARTS_LOG FLAG. Logs each start; fails (as a missing dependency would) until FLAG exists.
FLAKY_SERVER = """
import os, runpy, sys
starts, flag = sys.argv[1:3]
with open(starts, "a") as handle:
    handle.write("start\\n")
if not os.path.exists(flag):
    sys.stderr.write("flaky: the database is not up yet\\n")
    sys.exit(1)
sys.argv = ["mcp_server_time", "--local-timezone", "UTC"]
runpy.run_module("mcp_server_time", run_name="__main__")
"""


async def test_an_mcp_toolset_that_cannot_start_is_unavailable_with_its_reason_then_retried(
    deployment: Deployment,
) -> None:
    script = deployment.root / "flaky_server.py"
    script.write_text(FLAKY_SERVER)
    starts, flag = deployment.root / "starts.log", deployment.root / "up"
    config = write_config(
        deployment, {"flaky": {"kind": "mcp", "prefix": "flaky", "command": PYTHON, "args": [str(script), str(starts), str(flag)]}},
        {"box1": ["flaky"]},
    )
    changes = ListChanged()
    async with deployment.http_server("--config", str(config)):
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1"), message_handler=changes) as agent:
            assert tool_names(await agent.list_tools()) == set()
            began = trio.current_time()
            for _ in range(20):  # calls while it is down start nothing: no storm of attempts
                refused = await agent.call_tool("flaky.get_current_time", {"timezone": "UTC"})
                assert refused.is_error
            elapsed = trio.current_time() - began
            text = text_of(refused)
            assert "Toolset unavailable: 'flaky' (toolset 'flaky' is allowed but could not start:" in text, text
            assert "flaky: the database is not up yet" in text, "the start failure's own words"
            assert "Toolset not found" not in text
            # Attempts 1 s, 2 s, 4 s ... apart: within `elapsed` at most 1 + log2(elapsed + 1) of them (+1 for slack).
            assert len(starts.read_text().splitlines()) <= 2 + math.log2(elapsed + 1), starts.read_text()

            flag.touch()  # what it needed is there now: the next attempt starts it
            seen = 0
            with trio.fail_after(90):
                while tool_names(await agent.list_tools()) != {"flaky.get_current_time", "flaky.convert_time"}:
                    seen = await changes.wait_beyond(seen, timeout=90)
            now = await agent.call_tool("flaky.get_current_time", {"timezone": "UTC"})
            assert not now.is_error, text_of(now)
