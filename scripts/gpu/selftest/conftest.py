"""Tests of the GPU harness that run without a GPU (here, in CI):
  python3 -m pytest scripts/gpu/selftest"""

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))  # harness
sys.path.insert(0, str(HERE.parent))  # hvctl, hv_intervals


def pytest_configure(config):
    # Temporary directories in one place of our own, removed at the end:
    # the tests leave nothing in /tmp (pytest would keep its last three runs).
    if not config.option.basetemp:
        config.option.basetemp = tempfile.mkdtemp(prefix="gpu-selftest-")
        config.selftest_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    basetemp = getattr(config, "selftest_basetemp", None)
    if basetemp:
        shutil.rmtree(basetemp, ignore_errors=True)
