from __future__ import annotations

from typing import Iterator

import pytest

from harness import Deployment


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    d = Deployment()
    try:
        yield d
    finally:
        d.cleanup()
