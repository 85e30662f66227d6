"""Approvals (seed 002): the room for approval requests, decisions and their timeouts.

Empty until the approvals issue lands; a caller tool declared with `requires_approval`
is refused at declaration until then (fail closed).
"""
