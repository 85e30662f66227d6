"""What both programs run on: the plumbing `oubliette-server` and `oubliette-client` share that is
not the relay wire.

The wire (its framing, messages, schemas, the peer) is `protocol`, which imports nothing of this
package; this package may import `protocol`, never either program. Here: the stdio streams of the
stdio MCP servers (``stdio_streams``), the MCP fast path for plain `tools/call` lines
(``fast_tool_calls``), the start-up heap frozen out of the collector (``gc_freeze``), a quiet
Ctrl-C and a failure's one line (``interrupts``), the command lines' parser (``command_line``),
the log formats (``log_format``) and the escaping of peer strings in them (``peer_text``),
OpenTelemetry set up from ``OTEL_*`` (``telemetry``) and the spans both programs make
(``trace_spans``). Its modules form layers, listed once as the ``runtime-layers`` contract of
``pyproject.toml`` (``[tool.importlinter]``). Each module is imported by its own path (``from
oubliette_runtime.telemetry import ...``): importing the package loads none of them.
"""
