"""Checks 28-36, 38, 39 and 42: the quota holds where the CUDA driver takes device
memory without an allocation call of the program (scripts/gpu/implicit_mem.cu).

Each path runs three times: without the limiter, with the 4 GiB quota, and
with a quota large enough (mode pre, 60 GiB: the limiter loaded changes
nothing the path gets). While the program holds what it took, its footprint
is read from outside (nvidia-smi, by pid).
`bash scripts/gpu/run.sh gpu-bundle -k implicit` runs exactly these.
"""

from __future__ import annotations

import time

import pytest
from harness.checks import QUOTA_MIB, AtLeast, AtMost, Equal, GiB, MiB, Why, mibs, q
from harness.proc import Proc, clean_shm, footprints

NOT_BUILT = ("not built", "not built")
#: What every path is asked to take: half again the quota.
BYTES = 6 * GiB
#: How far past the quota the footprint read from outside may be (MiB), as in check 27.
SLACK_MIB = 64
#: Without the limiter a path takes at least this share of what it was asked.
TAKEN = 0.9
CONTEXTS = 16
#: Paths that take no device memory on driver 580 (the printf FIFO lives in
#: host memory): nothing to refuse, so the limiter must let them through.
HOST_SIDE = {"printf_fifo"}
CUBIN = "big_global.cubin"
#: The __device__ global of lazy_global.cu (implicit_mem's own unit, loaded at
#: its kernel's first launch); the path cudaMallocs the rest of BYTES first.
LAZY_GLOBAL = 3 * GiB
#: Paths whose memory per step is not known in advance (a green context's; on
#: the H100 with driver 580, 16 took about 80 MiB in all): with the quota, the
#: limiter must refuse exactly when the path does not fit without it, so the
#: expected op_rc follows from the footprint without.
UNKNOWN_SIZE = {"green_contexts"}
#: How long the program holds (s), and how long its path may take to get there.
HOLD_S, READY_S = 120, 90

PATHS = [
    ("28", "graph_node", "CUDA graph memory node (cudaGraphAddMemAllocNode), not freed in the graph"),
    ("29", "graph_capture", "captured cudaMallocAsync, the graph launched"),
    ("30", "heap", "device malloc heap (cudaLimitMallocHeapSize)"),
    ("31", "stack", "thread stacks (cudaLimitStackSize for every resident thread)"),
    ("32", "printf_fifo", "printf FIFO (cudaLimitPrintfFifoSize)"),
    ("33", "module", "module globals (cuModuleLoad of a 1 GiB __device__ global, until 6 GiB)"),
    ("34", "library", "library globals (cuLibraryLoadFromFile of the same cubin, until 6 GiB)"),
    ("35", "pool", "memory pool keeping 3 GiB freed (release threshold max), then cudaMalloc 3 GiB"),
    ("42", "custom_pool", "a pool of its own (cudaMemPoolCreate, release threshold max): cudaMallocFromPoolAsync "
                          "1 GiB at a time, every third freeing one (the pool keeps it), until 6 GiB are live"),
    ("36", "contexts", f"{CONTEXTS} more contexts (cuCtxCreate)"),
    ("38", "lazy_global", "lazily loaded global of the program's own kernels (cudaMalloc "
                          f"{(BYTES - LAZY_GLOBAL) // GiB} GiB, then the first launch of a kernel whose unit has a "
                          f"{LAZY_GLOBAL // GiB} GiB __device__ global)"),
    ("39", "green_contexts", f"{CONTEXTS} green contexts (cuGreenCtxCreate, one group of the fewest SMs)"),
]


def taken_mib(path: str) -> int:
    """The footprint (MiB) the path reaches without the limiter: the pool
    gives its 3 GiB back (cudaMemPoolTrimTo) before the program holds, so
    only the plain cudaMalloc of half the bytes is left."""
    asked = BYTES // 2 if path == "pool" else BYTES
    return int(TAKEN * asked / MiB)


def limited_rc(path: str, base_fp):
    """The op_rc the path must get under the 4 GiB quota; for a path of
    UNKNOWN_SIZE, 2 exactly when its footprint without the limiter (MiB)
    is over the quota and the slack, None when that footprint is unknown."""
    if path in HOST_SIDE:
        return 0
    if path not in UNKNOWN_SIZE:
        return 2
    if base_fp is None:
        return None
    return 0 if AtMost(QUOTA_MIB + SLACK_MIB).holds(base_fp) else 2


def expected(path: str) -> str:
    if path in UNKNOWN_SIZE:
        return (f"with: footprint<={QUOTA_MIB}+{SLACK_MIB}, usable=1, op_rc=2 if without's footprint>"
                f"{QUOTA_MIB}+{SLACK_MIB}, else op_rc=0 and contexts={CONTEXTS}; 60g quota: op_rc as without's; "
                f"without: op_rc=0, contexts={CONTEXTS} (footprint reported)")
    rc = 0 if path in HOST_SIDE else 2
    lim = f"with: footprint<={QUOTA_MIB}+{SLACK_MIB}, op_rc={rc}, usable=1"
    if path == "pool":
        lim += ", after_trim_rc=0"
    if path == "contexts":
        base = f"without: op_rc=0, contexts={CONTEXTS}"
    elif path in HOST_SIDE:
        base = "without: op_rc=0 (footprint reported)"
    elif path == "pool":
        base = f"without: op_rc=0, reserved>={mibs(BYTES // 2)}, footprint>={taken_mib(path)}"
    elif path == "custom_pool":
        base = f"without: op_rc=0, reserved>={mibs(BYTES)}, footprint>={taken_mib(path)}"
    else:
        base = f"without: op_rc=0, footprint>={taken_mib(path)}"
    return f"{lim}; 60g quota: op_rc as without's; {base}"


def hold(check, num: str, path: str, mode: str):
    """Runs the path in one mode; reads the process's footprint (MiB) while it
    holds, then releases it. Returns (the run, the footprint or None)."""
    s = check.s
    flag = s.work / f"release-{num}-{path}-{mode}"
    flag.unlink(missing_ok=True)
    clean_shm()
    pod = "-" if mode == "base" else f"e2e-implicit-{path.replace('_', '-')}"
    cmd = [s.bin("implicit_mem"), path, str(BYTES), str(flag), str(HOLD_S)]
    if path in ("module", "library"):
        cmd.append(s.bin(CUBIN))
    p = Proc(s, mode, pod, check.log / f"{num}-implicit-{path}-{mode}.log", HOLD_S + READY_S, cmd,
             header=f" (holds until {flag})").start()
    fp = None
    if p.wait_for_line("holding=", limit_s=READY_S):
        time.sleep(1)  # as check 27: NVML's per-process numbers settle
        fp = footprints(s).get(p.pid)
    flag.touch()
    p.wait()
    return p, fp


@pytest.mark.parametrize("num,path,label", [
    pytest.param(n, p, label, marks=pytest.mark.check(n), id=f"{n}-{p}") for n, p, label in PATHS])
def test_implicit(check, num, path, label):
    """28-36, 38, 39, 42: each path asks the driver for 6 GiB (16 contexts for 36
    and 39) under the 4 GiB quota: it is refused with out of memory (2), the
    process's footprint read from outside stays within the quota, and the
    process goes on working. Without the limiter the same path takes the
    memory; with a quota large enough, the same path gets what it gets
    without. What 16 green contexts take is not known: with the quota they
    are refused exactly when they do not fit without it, and otherwise
    every one is made."""
    row = check.row(f"{num}. implicit memory: {label}: footprint (MiB, nvidia-smi), op_rc", expected(path))
    if not check.s.built("implicit_mem"):
        return row.done(*NOT_BUILT, "build failed")
    if path in ("module", "library") and not (check.s.bin_dir / CUBIN).is_file():
        return row.done(*NOT_BUILT, f"no-{CUBIN}")
    b, bfp = hold(check, num, path, "base")
    lm, lfp = hold(check, num, path, "lim")
    pr, pfp = hold(check, num, path, "pre")
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"), pr.exit_why("pre"))
    why.need(Equal(0).holds(b.kv("op_rc")), "base-op_rc!=0")
    if path in ("contexts", "green_contexts"):
        why.need(Equal(CONTEXTS).holds(b.kv("contexts")), f"base-contexts!={CONTEXTS}")
    elif path not in HOST_SIDE:
        why.need(AtLeast(taken_mib(path)).holds(bfp), f"base-footprint<{taken_mib(path)}")
    rc = limited_rc(path, bfp)
    why.need(rc is not None, "no-base-footprint")
    if path == "pool":
        why.need(AtLeast(BYTES // 2).holds(b.kv("reserved")), "base-pool-not-kept")
    if path == "custom_pool":
        why.need(AtLeast(BYTES).holds(b.kv("reserved")), "base-pool-reserved<asked")
    if why.need(lfp is not None, "no-footprint"):
        why.need(AtMost(QUOTA_MIB + SLACK_MIB).holds(lfp), "footprint-over-quota")
    if rc is not None:
        why.need(Equal(rc).holds(lm.kv("op_rc")), f"op_rc!={rc}")
    if path in UNKNOWN_SIZE and rc == 0:  # it fits without: nothing may be refused
        why.need(Equal(CONTEXTS).holds(lm.kv("contexts")), f"contexts!={CONTEXTS}")
    why.need(Equal(1).holds(lm.kv("usable")), "not-usable")
    if path == "pool":
        why.need(Equal(0).holds(lm.kv("after_trim_rc")), "after-trim!=0")
    why.need(pr.kv("op_rc") is not None and pr.kv("op_rc") == b.kv("op_rc"), "pre-op_rc!=without's")
    extra_b = extra_l = ""
    if path in ("contexts", "green_contexts"):
        extra_b, extra_l = f" contexts={q(b.kv('contexts'))}", f" contexts={q(lm.kv('contexts'))}"
    elif path == "pool":
        extra_b = f" reserved={mibs(b.kv('reserved'))}"
        extra_l = f" reserved={mibs(lm.kv('reserved'))} after_trim_rc={q(lm.kv('after_trim_rc'))}"
    elif path == "custom_pool":
        extra_b = f" reserved={mibs(b.kv('reserved'))} allocations={q(b.kv('allocations'))}"
        extra_l = f" reserved={mibs(lm.kv('reserved'))} allocations={q(lm.kv('allocations'))}"
    elif path in ("module", "library"):
        extra_b, extra_l = f" modules={q(b.kv('modules'))}", f" modules={q(lm.kv('modules'))}"
    row.done(f"fp={q(bfp)}MiB op_rc={q(b.kv('op_rc'))}{extra_b}",
             f"fp={q(lfp)}MiB op_rc={q(lm.kv('op_rc'))} ({q(lm.kv('op_name'))}) usable={q(lm.kv('usable'))}"
             f"{extra_l}; 60g: op_rc={q(pr.kv('op_rc'))} fp={q(pfp)}MiB", why)
