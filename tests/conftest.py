from __future__ import annotations

from typing import Iterator

import pytest

from harness import Deployment, InProcessDeployment


@pytest.fixture
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """The real programs as subprocesses; in a module marked `in_process`, the same programs
    in the test's Trio loop (`InProcessDeployment`), except for tests marked `real_programs`."""
    in_process = request.node.get_closest_marker("in_process") is not None
    real = request.node.get_closest_marker("real_programs") is not None
    d = InProcessDeployment() if in_process and not real else Deployment()
    try:
        yield d
    finally:
        d.cleanup()
