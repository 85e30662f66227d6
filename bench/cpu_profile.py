"""Run a module under cProfile on CPU time (`time.process_time`), as `python -m cProfile -o OUT -m
MODULE` does on wall time: under load, a wall-time profile charges a function with the time the
process waited for a core, a CPU-time one only with what it ran.

    python bench/cpu_profile.py OUT -m MODULE [ARGS...]

The profile is written when the program exits (read it with `python -m pstats OUT`).
`BENCH_PROFILE_DIR=DIR BENCH_PROFILE_CPU=1` makes the benches run their programs this way.
"""

from __future__ import annotations

import atexit
import cProfile
import runpy
import sys
import time


def main() -> None:
    """Profile `MODULE` run as `__main__` with the rest of the arguments; write the profile at exit."""
    out, *rest = sys.argv[1:]
    module, *rest = rest[1:] if rest[:1] == ["-m"] else rest
    sys.argv = [module, *rest]
    profile = cProfile.Profile(time.process_time)

    def write() -> None:
        profile.disable()
        profile.dump_stats(out)

    atexit.register(write)
    profile.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
