#!/usr/bin/env python3
"""A test double of the GPU check programs, for the harness's dry run here
(no GPU, no nvcc): linked under each program's name (mem_runtime, spin,
nvidia-smi, python for the .py helpers, ...), it prints the key=value lines
the real program prints, with the numbers a working limiter gives when the
limiter's variables are set. FAKEGPU_CRASH=name makes that program die of
SIGSEGV, to check that a crash becomes a FAIL row and the run goes on.

Only for scripts/gpu/selftest: it shows that every check's plumbing runs
and parses; it says nothing about the limiter.
"""

import os
import signal
import sys
import time

GiB, MiB = 1 << 30, 1 << 20
E = os.environ
LIMITED = "LD_PRELOAD" in E and E.get("CUDA_DEVICE_MEMORY_LIMIT") == "4g"
SM = next((int(E[k]) for k in ("CUDA_DEVICE_SM_LIMIT", "CUDA_LIMITER_SM_LIMIT") if k in E and "LD_PRELOAD" in E), 0)
DOWN_NO_LIMIT = "CUDA_LIMITER_HYPERVISOR" in E and "CUDA_DEVICE_MEMORY_LIMIT" not in E and "CUDA_LIMITER_TOKEN" in E \
    and E.get("CUDA_LIMITER_TOKEN") == "e2e-down"
TOTAL = 4 * GiB if LIMITED else 80 * GiB


def out(**kv):
    for k, v in kv.items():
        print(f"{k}={v}", flush=True)


def mem_runtime(_):
    if "CUDA_LIMITER_HYPERVISOR" in E and LIMITED:
        print("cuda-limiter: the hypervisor does not answer; the local limits apply", file=sys.stderr, flush=True)
    got = 4 * GiB - 256 * MiB if LIMITED else 79 * GiB
    out(info0_rc=0, free0=TOTAL - 500 * MiB, total0=TOTAL, chunks=got // (256 * MiB), obtained=got, fail_code=2,
        capped=0, info1_rc=0, free1=100 * MiB, total1=TOTAL, footprint_mib=got // MiB, done=1)


mem_runtime_shared = mem_runtime


def mem_hold(args):
    if DOWN_NO_LIMIT:
        print("cuda-limiter: no limits from the hypervisor; CUDA refuses to initialise", file=sys.stderr, flush=True)
        out(info_rc=3, alloc_name="cudaErrorInitializationError", alloc_rc=3)
        return
    size = int(args[0])
    pod = E.get("CUDA_LIMITER_POD", "-")
    used = pod_usage(pod) if LIMITED else 0
    rc = 2 if LIMITED and used + size > 4 * GiB else 0
    out(pid=os.getpid(), bytes=size, info_rc=0, free0=TOTAL - used, total0=TOTAL, alloc_rc=rc)
    if rc or len(args) < 2:
        out(done=1)
        return
    mark(pod, size)
    show_footprint(size // MiB)
    out(holding=1)
    end = time.time() + float(args[2] if len(args) > 2 else 120)
    while not os.path.exists(args[1]) and time.time() < end:
        time.sleep(0.05)
    out(kept=1, done=1)


#: implicit_mem's paths: the step that takes the memory, and whether it is a
#: driver API one (its error names are CUDA_*).
IMPLICIT = {"graph_node": ("instantiate", False), "graph_capture": ("capture", False), "heap": ("setlimit", False),
            "stack": ("setlimit", False), "printf_fifo": ("setlimit", False), "module": ("load", True),
            "library": ("load", True), "pool": ("malloc", False), "contexts": ("create", True)}
CONTEXT_MIB = 500


def implicit_mem(args):
    """Under the 4 GiB quota every path is refused (2) and the process holds
    its context, what fitted and the 64 MiB of the usable step; otherwise it
    takes what it was asked (the pool gives its half back when trimmed). The
    printf FIFO takes no device memory, so it is never refused."""
    path, size = args[0], int(args[1])
    step, driver = IMPLICIT[path]
    host_side = path == "printf_fifo"
    rc = 2 if LIMITED and not host_side else 0
    out(pid=os.getpid(), path=path, bytes=size, ctx_rc=0)
    fp = CONTEXT_MIB + 64
    if path == "contexts":
        n = 7 if LIMITED else 16
        out(contexts=n, create_rc=rc, restore_rc=0)
        fp += n * CONTEXT_MIB
    elif path == "pool":
        out(stream_rc=0, pool_rc=0, threshold_rc=0, kept_rc=0, reserved=size // 2, malloc_rc=rc, trim_rc=0,
            retried=int(LIMITED), after_trim_rc=0)
        fp += size // 2 // MiB
    elif path in ("module", "library"):  # 1 GiB a load: what fits is loaded
        n = 3 if LIMITED else size // GiB
        out(modules=n, global_bytes=GiB, loaded_bytes=n * GiB, **{f"{step}_rc": rc})
        fp += n * GiB // MiB
    else:
        out(**{f"{step}_rc": rc})
        fp += 0 if LIMITED or host_side else size // MiB
    names = ("CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY") if driver else ("cudaSuccess", "cudaErrorMemoryAllocation")
    out(op_rc=rc, op_name=names[rc // 2], usable_rc=0, usable=1)
    show_footprint(fp)
    out(holding=1)
    end = time.time() + float(args[3] if len(args) > 3 else 120)
    while not os.path.exists(args[2]) and time.time() < end:
        time.sleep(0.05)
    out(done=1)


def state_file(name):
    """Where the fakes keep what they share: FAKEGPU_STATE_DIR (the test's own
    directory), else /tmp."""
    return os.path.join(os.environ.get("FAKEGPU_STATE_DIR", "/tmp"), f"fakegpu-{os.getuid()}-{name}")


def pod_file(pod):
    """Where a fake pod's usage is kept."""
    return state_file(pod)


def pod_usage(pod):
    """Bytes held by live processes of the pod (dead ones give back)."""
    try:
        lines = open(pod_file(pod)).read().split()
    except OSError:
        return 0
    total = 0
    for entry in lines:
        pid, size = entry.split(":")
        if alive(pid):
            total += int(size)
    return total


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def show_footprint(mib):
    """What nvidia-smi --query-compute-apps lists for this process while it lives (MiB)."""
    with open(state_file("footprints"), "a") as f:
        f.write(f"{os.getpid()}:{mib}\n")


def footprints():
    """(pid, MiB) of the live processes that showed a footprint."""
    try:
        lines = open(state_file("footprints")).read().split()
    except OSError:
        return
    for entry in lines:
        pid, mib = entry.split(":")
        if alive(pid):
            yield pid, mib


def mark(pod, size):
    if LIMITED:
        with open(pod_file(pod), "a") as f:
            f.write(f"{os.getpid()}:{size}\n")


def mem_apis(args):
    out(total=TOTAL, device_total=TOTAL, ptsz_symbols="1,1,1")
    for api in ("cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync",
                "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuMemCreate",
                "cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate"):
        over = "2" if LIMITED else ("n/a" if api == "cuMemAllocManaged" else "0")
        print(f"API {api} alloc=0 drop={GiB} over={over} back=ok free_rc=0", flush=True)
    out(done=1)


def mem_pairs(_):
    out(init_rc=0, info0_rc=0, free0=TOTAL, total0=TOTAL, pairs=10000, alloc_errors=0, free_errors=0,
        first_err=0, free_diff=0, big_bytes=TOTAL - 64 * MiB, big_rc=0, done=1)


def mem_bench(_):
    out(pairs=10000, ns_per_pair=f"{1000.0 + (10.0 if LIMITED else 0):.1f}")


def launch_overhead(args):
    if args[0] == "throughput":
        out(pid=os.getpid(), mode="throughput", n=200000, throughput_ns_per_launch="2000.0", ok=1)
    else:
        out(pid=os.getpid(), mode="pace", n=20000, busy_us=20, pace_ns_per_iter="22000.0", pace_launch_ns="1500.0",
            ok=1)


def nvidia_smi(args):
    if any(a.startswith("-lms") for a in args):
        print("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
              "temperature.gpu, utilization.gpu [%]", flush=True)
        util = int(E.get("FAKEGPU_UTIL", "100"))
        while True:
            print(f"2026/01/01 00:00:00.000, 1980 MHz, 2619 MHz, 300.00 W, 40, {util} %", flush=True)
            time.sleep(0.2)
    if any("memory.total" in a for a in args):
        print("4096, 0, 4096" if LIMITED else "81559, 0, 81000")
    elif any("compute-apps" in a for a in args):
        for pid, limited in oversub_holders():
            print(f"{pid}, {3900 if limited else 6600}")
        for pid, mib in footprints():
            print(f"{pid}, {mib}")
    else:
        print("fake nvidia-smi")


def oversub_holders():
    """(pid, limited) of the fake oversub_torch.py matmul runs alive now."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if not any(c.endswith(b"oversub_torch.py") for c in cmd) or b"matmul" not in cmd:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        yield int(entry), b"CUDA_DEVICE_MEMORY_LIMIT=4g" in env and any(e.startswith(b"LD_PRELOAD=") for e in env)


def oversub_torch(args):
    """oversub_torch.py as a working limiter makes it run (see its docstring)."""
    over = LIMITED and E.get("CUDA_OVERSUBSCRIBE") == "true"
    cap = E.get("CUDA_LIMITER_SPILL_LIMIT", "8g")
    if args[0] == "matmul":
        n = 6 if over or not LIMITED else 3
        types = ",".join("1" if over and i >= 3 else "2" for i in range(n))
        out(blocks=n, types=types, ranges=",".join(f"0:{GiB}" for _ in range(n)))
        if LIMITED and not over:
            out(oom_msg="CUDA out of memory.", alloc="oom", done=1)
            return
        out(alloc="ok", free=TOTAL // 8, total=TOTAL, dev_sum="1234.5", dev_abs="5678.25", spill_sum="-42.0",
            spill_abs="99.5", dev_c00="1.0", spill_c00="2.0", ready=1)
        end = time.time() + float(args[2])
        while time.time() < end and not os.path.exists(args[1]):
            time.sleep(0.05)
        out(released=int(os.path.exists(args[1])), done=1)
    elif args[0] == "cap":
        spilled = 1 if over and cap == "1536m" else 0
        out(blocks=3 + spilled if LIMITED else 8, spilled=spilled, oom=int(LIMITED), done=1)
    else:
        out(dev_gbps="3000.0", dev_sum="268435456.0", spill_gbps="50.00" if over else "none",
            spill_sum="268435456.0", done=1)


def spin(args):
    if args[0] == "union":  # shares from 1 s over the common span, as spin.cu's union mode
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."))
        import hv_intervals

        r = hv_intervals.analyse(args[1:], origin="common", wins=["after1s:start+1:end"])
        out(file0_share_after1s_pct=r["win_after1s_f0_pct"], file1_share_after1s_pct=r["win_after1s_f1_pct"],
            share_after1s_pct=r["win_after1s_union_pct"], settle_ms=300, kernels=100, ok=1)
        return
    share = SM or 96
    secs = float(args[2])
    dump = args[3] if len(args) > 3 and args[3] != "-" else None
    go = args[4] if len(args) > 4 and args[4] != "-" else None
    out(pid=os.getpid(), mode=args[0], dur_us=args[1], ready=1)
    if go:
        while not os.path.exists(go):
            time.sleep(0.01)
    t0 = time.time_ns()
    time.sleep(min(secs, 0.2))
    if dump:  # 2 ms kernels at the share, from t0 for secs seconds
        period = int(2e6 * 100 / share)
        with open(dump, "w") as f:
            for i in range(int(secs * 1e9) // period):
                f.write(f"{t0 + i * period} {t0 + i * period + 2_000_000}\n")
    n = int(secs * 500)
    pm = ",".join([str(share * 10)] * int(secs))
    out(launches=n, kernels=n, busy_pct=f"{share:.2f}", max_stall_us="50.0", stalls_over_1ms=0,
        share_first1s_pct=f"{share:.2f}", share_after1s_pct=f"{share:.2f}", windows_pm=pm,
        windows100_pm=",".join([str(share * 10)] * int(secs * 10)), settle_ms=100, settled=1, ok=1)


def python(args):
    script = os.path.basename(args[0]) if args else ""
    if script == "mem_ctypes.py":
        for p in ("direct", "pa"):
            out(**{f"{p}_total_mem": TOTAL, f"{p}_info_total": TOTAL, f"{p}_alloc3g_rc": 0,
                   f"{p}_alloc2g_rc": 2 if LIMITED else 0, f"{p}_free_back_diff": 0})
    elif script == "mem_torch.py":
        out(total=TOTAL, free=TOTAL - GiB, alloc2g="ok", over="oom" if LIMITED else "ok")
    elif script == "mem_frameworks.py":
        fw = args[1]
        total_mib = 4096 if LIMITED else 81079
        seen = {"limit_mib": total_mib * 3 // 4} if fw == "jax" else {"total_mib": total_mib}
        out(sum=8192 if fw == "jax" else (256 << 20) + 4096, **seen, **{fw: "ok"})
    elif script == "oversub_torch.py":
        oversub_torch(args[1:])
    elif script == "torch_matmul.py":
        time.sleep(float(args[1]))
        out(matmuls_per_s="100.0" if not SM else f"{SM:.1f}", tflops="110.0", ok=1)
    else:  # the harness's own uses of python (preflight)
        os.execv(sys.executable, [sys.executable, *args])


def main():
    name = os.path.basename(sys.argv[0]).replace("-", "_")
    if E.get("FAKEGPU_CRASH") == name:
        os.kill(os.getpid(), signal.SIGSEGV)
    globals()[name](sys.argv[1:])


if __name__ == "__main__":
    main()
