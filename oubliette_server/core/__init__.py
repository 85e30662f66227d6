"""The core services every feature shares: the session registry (`sessions`), the frame log
(`frame_log`), the pending-request engine (`pending_requests`), callers and client
connections, instances, identifiers, metrics and the rule for server-owned frames.

They import only the store below them.
"""
