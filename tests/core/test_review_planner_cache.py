"""The planner's kernels load where numba has nowhere to keep its cache.

`kernels` compiles with `cache=True`; numba looks for a writable folder beside the module,
then `NUMBA_CACHE_DIR`, then the user's cache folder, and raises `RuntimeError` ("no locator
available") at decoration time when none is writable (a read-only install run by a user
without a writable home, outside the image that sets `NUMBA_CACHE_DIR`). The coordinator's
service imports the planner at start (`job` -> `stragglers` -> `schedulers.perseus`), so
the whole service failed to start, Perseus job or not. Here numba's locators are emptied in a
fresh interpreter, as when none is usable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from numba.core import caching
caching.CacheImpl._locator_classes = []  # No folder numba could write its cache to.
import numpy as np
from coordinator.pipeline.planner import kernels
print(kernels.forward(np.array([[1], [1]]), np.array([0]), np.array([2.5])).tolist())
"""


def test_the_kernels_load_and_run_without_a_writable_cache_folder() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[2.5, 0.0]"
