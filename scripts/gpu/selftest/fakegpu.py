#!/usr/bin/env python3
"""A test double of the GPU check programs, for the harness's dry run here
(no GPU, no nvcc): linked under each program's name (mem_runtime, spin,
nvidia-smi, python for the .py helpers, ...), it prints the key=value lines
the real program prints, with the numbers a working limiter gives when the
limiter's variables are set. FAKEGPU_CRASH=name makes that program die of
SIGSEGV, to check that a crash becomes a FAIL row and the run goes on.
FAKEGPU_GREEN_MIB=N: what one green context takes (default 5 MiB, as
measured on the H100 with driver 580: 16 fit the quota; 300: they do not).
FAKEGPU_IPC_CHARGED=1: the fake limiter charges an IPC import to the
importer too (a limiter that counts shared memory twice).

Only for scripts/gpu/selftest: it shows that every check's plumbing runs
and parses; it says nothing about the limiter.
"""

import os
import signal
import subprocess
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
            "library": ("load", True), "pool": ("malloc", False), "custom_pool": ("alloc", False),
            "contexts": ("create", True),
            "lazy_global": ("launch", False), "green_contexts": ("create", True)}
CONTEXT_MIB = 500
CONTEXTS = 16
QUOTA_MIB = 4096
LAZY_GLOBAL_MIB = 3072


def implicit_mem(args):
    """Under the 4 GiB quota every path is refused (2) and the process holds
    its context, what fitted and the 64 MiB of the usable step; otherwise it
    takes what it was asked (the pool gives its half back when trimmed). The
    printf FIFO takes no device memory, so it is never refused. Green
    contexts (FAKEGPU_GREEN_MIB each) are refused only once they do not fit;
    the lazy global's plain cudaMalloc fits, the load of its global at the
    launch does not."""
    path, size = args[0], int(args[1])
    step, driver = IMPLICIT[path]
    host_side = path == "printf_fifo"
    rc = 2 if LIMITED and not host_side else 0
    out(pid=os.getpid(), path=path, bytes=size, ctx_rc=0)
    fp = CONTEXT_MIB + 64
    if path == "contexts":
        n = 7 if LIMITED else CONTEXTS
        out(contexts=n, create_rc=rc, restore_rc=0)
        fp += n * CONTEXT_MIB
    elif path == "pool":
        out(stream_rc=0, pool_rc=0, threshold_rc=0, kept_rc=0, reserved=size // 2, malloc_rc=rc, trim_rc=0,
            retried=int(LIMITED), after_trim_rc=0)
        fp += size // 2 // MiB
    elif path == "custom_pool":  # 1 GiB at a time, every third freeing the one before: what fits is made
        made, live = (4, 3) if LIMITED else (8, size // GiB)
        out(stream_rc=0, create_rc=0, threshold_rc=0, allocations=made, live=live * GiB, reserved=live * GiB,
            used=live * GiB, alloc_rc=rc, sync_rc=0)
        fp += live * GiB // MiB
    elif path == "green_contexts":  # what fits is made
        green = int(E.get("FAKEGPU_GREEN_MIB", "5"))
        n = min(CONTEXTS, (QUOTA_MIB - CONTEXT_MIB) // green) if LIMITED else CONTEXTS
        rc = 0 if n == CONTEXTS else 2
        out(device_rc=0, resource_rc=0, split_rc=0, sms=132, groups=1, green_sms=8, desc_rc=0, contexts=n,
            create_rc=rc, restore_rc=0)
        fp += n * green
    elif path == "lazy_global":  # the plain part fits; the global's load at the launch does not
        plain = size // MiB - LAZY_GLOBAL_MIB
        rc = 2 if LIMITED and CONTEXT_MIB + plain + LAZY_GLOBAL_MIB > QUOTA_MIB else 0
        out(global_bytes=LAZY_GLOBAL_MIB * MiB, plain_bytes=plain * MiB, malloc_rc=0, memset_rc=0, launch_rc=rc)
        if not rc:
            out(sync_rc=0)
        fp += plain + (0 if rc else LAZY_GLOBAL_MIB)
    elif path in ("module", "library"):  # 1 GiB a load: what fits is loaded
        n = 3 if LIMITED else size // GiB
        out(modules=n, global_bytes=GiB, loaded_bytes=n * GiB, **{f"{step}_rc": rc})
        fp += n * GiB // MiB
    else:
        out(**{f"{step}_rc": rc})
        fp += 0 if LIMITED or host_side else size // MiB
    names = ("CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY") if driver else ("cudaSuccess", "cudaErrorMemoryAllocation")
    usable = fp <= QUOTA_MIB or not LIMITED
    out(op_rc=rc, op_name=names[rc // 2], usable_rc=0 if usable else 2, usable=int(usable))
    show_footprint(fp)
    out(holding=1)
    end = time.time() + float(args[3] if len(args) > 3 else 120)
    while not os.path.exists(args[2]) and time.time() < end:
        time.sleep(0.05)
    out(done=1)


#: ipc_share's sizes (MiB): what the exporter shares, the importer's own, then more.
IPC_SHARED_MIB, IPC_OWN_MIB, IPC_MORE_MIB = 2048, 256, 1024


def admit(pod, mib):
    """The fake limiter's answer to mib more for the pod: 0 (and the pod is
    charged) when it fits the 4 GiB quota, else 2; without the quota, 0."""
    if LIMITED and pod_usage(pod) + mib * MiB > 4 * GiB:
        return 2
    mark(pod, mib * MiB)
    return 0


def ipc_share(args):
    """ipc_share.cu as a working limiter makes it run: the exporter starts the
    importer, a process of its own with the pod's environment; each charges
    its context and its own memory to the pod; the import is charged to no
    one (FAKEGPU_IPC_CHARGED=1: to the importer too). As NVML does, the
    importer's footprint never holds the import."""
    if args[0] == "import":
        ipc_import(*args[1:5])
        return
    kind, release = args[0], args[1]
    max_s = float(args[2]) if len(args) > 2 else 120
    pod = E.get("CUDA_LIMITER_POD", "-")
    out(pid=os.getpid(), mode=kind, ctx_rc=admit(pod, CONTEXT_MIB))
    rc = admit(pod, IPC_SHARED_MIB)
    out(alloc_rc=rc)
    if rc:
        out(done=1)
        return
    fds = ()
    if kind == "vmm":
        fds = (os.open(os.devnull, os.O_RDONLY),)  # the exported handle, kept open across exec
        out(reserve_rc=0, map_rc=0, access_rc=0, memset_rc=0, export_rc=0, fd=fds[0], cloexec_rc=0)
        handle = str(fds[0])
    else:
        out(memset_rc=0, export_rc=0)
        handle = os.urandom(64).hex()
    child = subprocess.Popen([sys.argv[0], "import", kind, handle, release, str(int(max_s))], pass_fds=fds,
                             stdin=subprocess.DEVNULL)
    out(spawn_rc=0, importer_pid=child.pid)
    show_footprint(CONTEXT_MIB + IPC_SHARED_MIB)
    end = time.time() + max_s
    while not os.path.exists(release) and time.time() < end and child.poll() is None:
        time.sleep(0.05)
    rc = child.wait()
    out(importer_exit=rc if rc >= 0 else 128 - rc, done=1)


def ipc_import(kind, handle, release, max_s):
    pod = E.get("CUDA_LIMITER_POD", "-")
    out(import_pid=os.getpid(), import_ctx_rc=admit(pod, CONTEXT_MIB))
    rc = 1  # CUDA_ERROR_INVALID_VALUE, unless the handle is what ipc_share.cu passes:
    try:  # an open fd (vmm), or the 64 bytes of a cudaIpcMemHandle_t in hex (legacy)
        if kind == "vmm":
            os.fstat(int(handle))
            rc = 0
        elif len(bytes.fromhex(handle)) == 64:
            rc = 0
    except (OSError, ValueError):
        pass
    if rc == 0 and E.get("FAKEGPU_IPC_CHARGED") == "1":
        rc = admit(pod, IPC_SHARED_MIB)
    out(import_open_rc=rc)
    if rc == 0 and kind == "vmm":
        out(import_reserve_rc=0, import_map_rc=0, import_access_rc=0)
    out(import_rc=rc)
    if rc == 0:
        out(import_read_rc=0)
    out(import_ok=int(rc == 0))
    own = admit(pod, IPC_OWN_MIB)
    more = admit(pod, IPC_MORE_MIB)
    out(own_rc=own, more_rc=more)
    show_footprint(CONTEXT_MIB + (0 if own else IPC_OWN_MIB) + (0 if more else IPC_MORE_MIB))
    if release != "-":
        out(holding=1)
    end = time.time() + float(max_s)
    while release != "-" and not os.path.exists(release) and time.time() < end:
        time.sleep(0.05)
    out(importer_done=1)


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
    elif script in ("train_step.py", "infer_loop.py"):
        examples_pytorch(script)
    else:  # the harness's own uses of python (preflight)
        os.execv(sys.executable, [sys.executable, *args])


def examples_pytorch(script):
    """examples/pytorch's programs: each sees its pod's quota in the daemon's
    examples/pytorch/hypervisor.toml when run by its run.sh under the limiter."""
    quota = {"train": 8192, "infer": 4096}.get(E.get("CUDA_LIMITER_POD", ""))
    limited = "LD_PRELOAD" in E and "CUDA_LIMITER_HYPERVISOR" in E and quota
    total = quota if limited else 81079
    if script == "train_step.py":
        print(f"train: steps=50 loss_first=2.353 loss_last=0.120 gpu_total_mib={total} steps_per_s=200.0", flush=True)
    else:
        print(f"infer: requests=200 p50_ms=0.40 p99_ms=0.90 gpu_total_mib={total}", flush=True)


def main():
    name = os.path.basename(sys.argv[0]).replace("-", "_")
    if E.get("FAKEGPU_CRASH") == name:
        os.kill(os.getpid(), signal.SIGSEGV)
    globals()[name](sys.argv[1:])


if __name__ == "__main__":
    main()
