"""Helpers of tests/server/features/test_toolsets.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
import trio.testing

from harness import Deployment
from oubliette_client.sandbox_tools import SandboxTools
from oubliette_client.settings import RelaySettings
from oubliette_server.features.toolsets import (
    FunctionToolset,
    ToolSpec,
)
from oubliette_server.program.app import OublietteServer

BOUND = 20.0


ECHO_SPEC = ToolSpec(
    name="echo",
    description="Echo the text back",
    input_schema={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    result_schema={"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]},
)


class ClosingToolset(FunctionToolset):
    """A FunctionToolset whose `aclose` also sets an event the test can wait on."""

    def __init__(self, handlers: dict[str, Any]) -> None:
        super().__init__(handlers)
        self.closed_event = trio.Event()
        self.close_count = 0

    async def aclose(self) -> None:
        await super().aclose()
        self.close_count += 1
        self.closed_event.set()


async def echo_handler(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"echo": arguments["text"]}


class EchoFactory:
    """A toolset factory that keeps every toolset it made (one per session)."""

    def __init__(self) -> None:
        self.made: list[ClosingToolset] = []

    def __call__(self) -> ClosingToolset:
        toolset = ClosingToolset({"echo": echo_handler})
        self.made.append(toolset)
        return toolset


class Running:
    def __init__(self, server: OublietteServer, nursery: trio.Nursery, deployment: Deployment) -> None:
        self.server = server
        self.nursery = nursery
        self.deployment = deployment

    async def client(self, instance: str = "box1", session: str | None = None,
                     tool_separator: str | None = None) -> tuple[SandboxTools, trio.CancelScope]:
        """The client side over the relay socket; cancel the scope to disconnect it."""
        tools = SandboxTools(RelaySettings(
            relay=self.deployment.relay, instance=instance, token=self.server.tokens.token_for(instance),
            session=session, tool_separator=tool_separator,
        ))
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await tools.link.run()

        self.nursery.start_soon(run)
        with trio.fail_after(BOUND):
            await tools.link.wait_connected()
        return tools, scope


@asynccontextmanager
async def running(deployment: Deployment, **config: Any) -> AsyncIterator[Running]:
    async with deployment.embedded(**config) as embedded:
        yield Running(embedded.app, embedded.nursery, deployment)
