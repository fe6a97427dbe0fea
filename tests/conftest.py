import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """Spawned gloo worlds of 2, 3 and 4 ranks, started on first use and reused."""
    p = Pools()
    yield p
    p.close()
