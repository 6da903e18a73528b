"""Tests of the GPU harness that run without a GPU (here, in CI):
  python3 -m pytest scripts/gpu/selftest"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))  # harness
sys.path.insert(0, str(HERE.parent))  # hvctl, hv_intervals
