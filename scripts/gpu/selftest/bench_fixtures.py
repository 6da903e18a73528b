"""What the benchmarks' tests share: fakebench.py as the programs the
benches run, and the real daemon with the fake MPS control daemon."""

import os
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
if str(REPO) not in sys.path:  # python3 -m pytest from elsewhere than the repository root
    sys.path.append(str(REPO))  # the package by its own name, scripts.bench, as the entry point has it

from scripts.bench import common, compute, corun, priority  # noqa: E402

from builds import built  # noqa: E402

FAKE = HERE / "fakebench.py"


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """fakebench.py as nvidia-smi and nvcc on PATH and as the programs the
    benches run; an empty limiter in a bundle folder; the results folder."""
    path = tmp_path / "path"
    path.mkdir()
    for name in ("nvidia-smi", "nvcc", "workers.py", "torch_workloads.py"):
        (path / name).symlink_to(FAKE)
    monkeypatch.setenv("PATH", f"{path}:{os.environ['PATH']}")
    monkeypatch.setenv("NVCC", str(path / "nvcc"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(common, "WORKERS", path / "workers.py")
    monkeypatch.setattr(common, "TORCH_WORKLOADS", path / "torch_workloads.py")
    monkeypatch.setattr(priority, "START_S", 0.05)
    monkeypatch.setattr(compute, "SAMPLE_MS", 20)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "libcuda_limiter.so").write_bytes(b"")  # preloaded by nothing real: the fakes only read the variables
    return bundle, tmp_path / "out"


corun_built = pytest.mark.skipif(not (built("hypervisor") and built("nvidia-cuda-mps-control")),
                                 reason="needs the daemon and the fake nvidia-cuda-mps-control built (builds.py)")


@pytest.fixture
def corun_env(fakes, monkeypatch):
    bundle, out = fakes
    (bundle / "hypervisor").symlink_to(built("hypervisor"))
    monkeypatch.setattr(corun, "SIMULATE", "1")
    if corun.mps_processes():
        pytest.skip(f"an MPS daemon runs: {corun.mps_processes()}")
    yield bundle, out, ["--bundle", str(bundle), "--out", str(out), "--seconds", "0.3", "--mps-control",
                        str(built("nvidia-cuda-mps-control"))]
    assert corun.mps_processes() == []
    left = [p for p in os.listdir("/dev/shm") if re.match(rf"gpushare-.*(corun-|bench-{os.getpid()})", p)]
    assert not left, left
