"""The server's own caller-facing tools carry tool descriptors, and their results match them."""

from __future__ import annotations

import jsonschema

from harness import Deployment, structured
from protocol import validate_params


async def test_every_server_tool_has_a_descriptor_whose_result_schema_holds(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, _events):
        tools = (await caller.list_tools()).tools
        names = {tool.name for tool in tools}
        assert {"session_message", "caller_tool_response", "session_events", "tether_send", "tether_read"} <= names
        descriptors = {}
        for tool in tools:
            descriptor = tool.meta["oubliette/descriptor"]
            validate_params("tool_descriptor", descriptor)
            assert descriptor["name"] == tool.name and descriptor["origin"] == "local"
            assert descriptor["input_schema"] == tool.input_schema
            descriptors[tool.name] = descriptor

        sent = structured(await caller.call_tool("session_message", {"instance": "box1", "message": "hi", "session_id": "s1"}))
        jsonschema.validate(sent, descriptors["session_message"]["result_schema"])
        waited = structured(await caller.call_tool(
            "session_message", {"instance": "box1", "message": "again", "session_id": "s1", "wait": 0.1}))
        jsonschema.validate(waited, descriptors["session_message"]["result_schema"])
        assert waited["stop_reason"] == "timeout"
        events = structured(await caller.call_tool("session_events", {"session_id": "s1"}))
        jsonschema.validate(events, descriptors["session_events"]["result_schema"])
        # The server's own record of the session's owner comes first (docs/PROTOCOL.md), then the messages.
        assert [f["type"] for f in events["frames"]] == ["session_record", "user.message", "user.message"]
        tether = structured(await caller.call_tool("tether_send", {"instance": "box1", "text": "hello"}))
        jsonschema.validate(tether, descriptors["tether_send"]["result_schema"])
        read = structured(await caller.call_tool("tether_read", {"instance": "box1"}))
        jsonschema.validate(read, descriptors["tether_read"]["result_schema"])
