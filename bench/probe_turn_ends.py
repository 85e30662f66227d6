"""Turn ends per message when a burst of messages meets an instance whose start command fails.

    python bench/probe_turn_ends.py [--messages N] [--rounds R] [--postgres]

One real server (tests/support/harness.py; SQLite, or with ``--postgres`` a throwaway PostgreSQL 15 from
tests/support/postgres.py) whose instance ``box2`` has a start command that exits 1 at once. Each round
(a fresh server) posts ``--messages`` (default 60) ``user.message`` frames to its tether endpoint
all at once (every message wakes the instance; each failed start ends the turns waiting for it
with ``session.error``), waits until every message has a turn end, stops the server and counts
the turn ends of each message in its log (``burst_to_a_failing_start``, the fault test's burst,
tests/support/turn_end_bursts.py): a turn ends once (docs/SECURITY.md, "One turn end per message"). Not part of the test suite.
Exit status 1 when a message has no end or more than one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

from harness import Deployment  # noqa: E402
from turn_end_bursts import burst_to_a_failing_start  # noqa: E402


async def main_async(args: argparse.Namespace) -> int:
    pg = None
    if args.postgres:
        from postgres import PostgresServer

        pg = PostgresServer(fsync=True)
        pg.start()
    ok = True
    try:
        print(f"{args.messages} messages at once to an instance whose start command exits 1, "
              f"{args.rounds} rounds, {'PostgreSQL' if pg else 'SQLite'} store")
        for n in range(args.rounds):
            deployment = Deployment(store=pg.new_database() if pg else None)
            try:
                ends = list((await burst_to_a_failing_start(deployment, args.messages)).values())
            finally:
                deployment.cleanup()
            twice = sum(1 for count in ends if count > 1)
            never = sum(1 for count in ends if count == 0)
            print(f"   round {n + 1}: turn ends stored {sum(ends)}; messages with 2+ ends {twice}, with none {never} "
                  f"(most ends of one message: {max(ends)})   (target {args.messages}, 0, 0)")
            ok = ok and twice == 0 and never == 0 and len(ends) == args.messages
    finally:
        if pg is not None:
            pg.stop()
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=60, help="messages posted at once per round (default 60)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh server (default 3)")
    parser.add_argument("--postgres", action="store_true", help="the server's log on a throwaway PostgreSQL")
    return trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
