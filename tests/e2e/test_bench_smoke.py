"""The benchmarks' quick modes, run once each as a smoke test: a benchmark that stops measuring
what it names (a relayed call that fails, a caller that never answers) fails here. Nothing here
looks at a time: the figures are the benchmark's to print (bench/README.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each quick run starts the real programs; a wrong answer ends it with status 1 and says why.
SMOKE = {
    "bench_relay.py": ["--quick"],
    "bench_http.py": ["--quick"],
    "bench_cluster.py": ["--quick"],
    "bench_many_sandboxes.py": ["--quick"],
}


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_the_benchmark_runs_in_its_quick_mode(script: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *SMOKE[script]],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "relayed" in done.stdout, done.stdout
