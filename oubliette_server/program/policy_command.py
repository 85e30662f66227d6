"""`oubliette-server policy check|test`: a policy set checked, or one call decided, with no server.

    oubliette-server policy check FILE...
    oubliette-server policy test [FILE...] --tool NAME (--caller ID | --toolset ID) [--arguments JSON]
                                 [--instance I] [--session CHANNEL:ID] [--requires-approval]
                                 [--caller-principal P] [--time ISO-8601]
    oubliette-server policy test [FILE...] --principal NAME --action message|answer|read [--instance I]
    oubliette-server policy test [FILE...] --principal NAME --action operate --endpoint metrics|health

Both read the files as the server does (`PolicyRules.from_files`; none: the default policy) and
validate them against the shipped schema. `test` prints the decision, the deciding policies and
why (a forbid's reason, what asks for an approval), exactly as the server would rule on that call;
with `--principal`, whether that HTTP principal may do the action to the instance or endpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path

from oubliette_runtime.command_line import OneLineParser

from ..features.policy import CALLER_ACTIONS, OPERATE, PolicyError, PolicyRules, ToolCall

PROG = "oubliette-server policy"


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Check Cedar policy files against the tool-call schema, or "
                           "decide one tool call with them (docs/POLICY.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a policy set (the files together) against the schema")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    test = commands.add_parser("test", help="decide one tool call and print the decision and the deciding policies")
    test.add_argument("files", nargs="*", type=Path, metavar="FILE", help="the policy set (none: the default policy)")
    test.add_argument("--tool", help="the name the agent calls (myapp_send, fs.write_file)")
    owner = test.add_mutually_exclusive_group()
    owner.add_argument("--caller", metavar="ID", help="a caller tool of this caller id")
    owner.add_argument("--toolset", metavar="ID", help="a tool of this toolset id")
    test.add_argument("--arguments", default="{}", metavar="JSON", help="the call's arguments, a JSON object")
    test.add_argument("--instance", default="box1")
    test.add_argument("--principal", metavar="NAME", help="decide an HTTP principal's request instead of a tool call "
                      "(admin: the HTTP admin token's)")
    test.add_argument("--action", choices=[*CALLER_ACTIONS, OPERATE], help="the principal's action on --instance "
                      "(operate: on --endpoint)")
    test.add_argument("--endpoint", choices=["metrics", "health"], default="metrics", help="the endpoint of operate")
    test.add_argument("--session", default="", metavar="CHANNEL:ID", help="the calling session ('': none)")
    test.add_argument("--requires-approval", action="store_true", help="the tool's own requires_approval flag")
    test.add_argument("--caller-principal", default="", metavar="IDENTITY", help="the session owner's identity")
    test.add_argument("--time", metavar="ISO-8601", help="when the call is made (default now; local time "
                      "unless it names its offset), e.g. 2026-11-30T21:15")
    return parser


def run_policy_command(argv: list[str]) -> int:
    """The `policy` subcommand; returns the exit status (1: the set is not valid; 2: a usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        rules = PolicyRules.from_files(args.files) if args.files else PolicyRules.default()
    except PolicyError as exc:
        print(f"{PROG} {args.command}: invalid: {exc}")
        return 1
    if args.command == "check":
        print(f"ok: {len(rules)} policies in {rules.source} are valid")
        return 0
    if args.principal is not None:
        if args.action is None:
            parser.error("--principal needs --action")
        resource = args.endpoint if args.action == OPERATE else args.instance
        reason = rules.permits(args.principal, args.action, resource)
        print(f"decision: {'permit' if reason is None else 'forbid'}")
        if reason is not None:
            print(f"reason: {reason}")
        return 0
    if args.tool is None or (args.caller is None and args.toolset is None):
        parser.error("a tool call needs --tool and --caller or --toolset (or give --principal and --action)")
    try:
        arguments = json.loads(args.arguments)
        when = datetime.fromisoformat(args.time).timestamp() if args.time else time.time()
    except ValueError as exc:
        parser.error(f"--arguments must be a JSON object and --time an ISO-8601 time: {exc}")
    if not isinstance(arguments, dict):
        parser.error("--arguments must be a JSON object")
    call = ToolCall(
        instance=args.instance, session=args.session, tool=args.tool,
        kind="caller" if args.caller is not None else "toolset", owner=args.caller or args.toolset,
        arguments=arguments, requires_approval=args.requires_approval, caller_principal=args.caller_principal,
    )
    ruling = rules.decide(call, when)
    print(f"decision: {ruling.effect}")
    print(f"policies: {', '.join(ruling.policies) or '(none)'}")
    if ruling.reason:
        print(f"reason: {ruling.reason}")
    if ruling.approval_by:
        print(f"approval asked by: {', '.join(ruling.approval_by)}")
    return 0
