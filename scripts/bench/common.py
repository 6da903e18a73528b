"""What the benchmarks share besides the GPU check's harness: paths, the
limiter's options, the CPUs runs are pinned to, the nvcc build of
compute_bench.cu, the environment without the limiter, and the harness's
settings for its runs and its daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.gpu.e2e.harness import proc

HERE = Path(__file__).resolve().parent  # scripts/bench
GPU = HERE.parent / "gpu"  # scripts/gpu
# Run as programs of their own (a process that imports only what it measures).
TORCH_WORKLOADS = HERE / "torch_workloads.py"
WORKERS = HERE / "workers.py"
COMPUTE_BENCH_CU = HERE / "compute_bench.cu"


def limiter_arguments(p) -> None:
    p.add_argument("--bundle", help="the bundle folder (scripts/make-gpu-bundle.sh): its libcuda_limiter.so")
    p.add_argument("--lib", help="the limiter library itself (in place of --bundle)")


def limiter(p, args) -> str:
    """The limiter library of --lib or --bundle, an absolute path; a usage
    error when neither names an existing file."""
    if not (args.lib or args.bundle):
        p.error("--bundle (or --lib) is required")
    lib = Path(args.lib or Path(args.bundle) / "libcuda_limiter.so").resolve()
    if not lib.is_file():
        p.error(f"no {lib}")
    return str(lib)


def gpu_local_cpus(count=4):
    """`count` CPUs local to GPU 0 (CPU 0 left out), as a taskset list."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout.strip()
        text = Path(f"/sys/bus/pci/devices/{bus[-12:].lower()}/local_cpulist").read_text().strip()
        local = set()
        for part in text.split(","):
            first, _, last = part.partition("-")
            local.update(range(int(first), int(last or first) + 1))
        allowed = [cpu for cpu in allowed if cpu in local] or allowed
    except (OSError, ValueError, subprocess.CalledProcessError):
        pass
    chosen = [cpu for cpu in allowed if cpu != 0][:count] or allowed[:count]
    return ",".join(map(str, chosen))


def build_compute_bench(folder) -> str:
    """compute_bench.cu built with nvcc (NVCC overrides it) into folder."""
    binary = str(Path(folder) / "compute_bench")
    cmd = [os.environ.get("NVCC") or "nvcc", "-O2", "-arch=native", "-o", binary, str(COMPUTE_BENCH_CU), "-ldl"]
    try:
        rc = subprocess.run(cmd).returncode
    except OSError as e:
        raise SystemExit(f"{cmd[0]}: {e}")
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {rc}")
    return binary


def build_folder(name):
    """A temporary folder for a build, removed at the end (a context manager)."""
    return tempfile.TemporaryDirectory(prefix=f"{name}.")


def clean_env(*prefixes: str) -> dict:
    """This process's environment without the limiter: neither its preload
    nor any of its variables, nor variables starting with `prefixes`."""
    drop = ("CUDA_LIMITER_",) + prefixes
    return {k: v for k, v in os.environ.items() if k not in proc.LIMITER_VARS and not k.startswith(drop)}


def remove_pod_regions(*pods: str) -> None:
    """What a pod's processes left in /dev/shm."""
    for pod in pods:
        for prefix in ("gpushare-pod-", "gpushare-limits-"):
            Path(f"/dev/shm/{prefix}{pod}").unlink(missing_ok=True)


def settings(lib: str, work: Path, hypervisor: str = "", simulate: str = "") -> proc.Settings:
    """The harness's settings for the runs and the daemon of a benchmark,
    their logs in `work`; the daemon logs at HYPERVISOR_LOG's level where
    set (as the daemon itself reads it), info otherwise."""
    work = Path(work)
    return proc.Settings(lib=str(lib), bin_dir=work, src=GPU, work=work, log_dir=work, python=sys.executable,
                         hypervisor=str(hypervisor), hv_simulate=simulate,
                         hv_log=os.environ.get("HYPERVISOR_LOG") or "info")
