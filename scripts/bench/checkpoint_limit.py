"""How large a process the driver's checkpoint takes on this host, and what
it costs the host while it runs. No limiter and no daemon: a PyTorch
process (swap_pod.py hold) holds S GiB of seeded random tensors on GPU 0;
this process locks, checkpoints, restores and unlocks it by pid through
the driver's checkpoint API, as the daemon does, and samples the host
every 20 ms meanwhile: the process's resident memory (VmRSS), the host's
MemAvailable and Committed_AS, and the memory cgroup's usage where there
is one. The digests are compared after the restore.

  python3 -m scripts.bench checkpoint-limit [--sizes 8,16,24] [--stacked] [--out DIR]

--stacked: the pods of all sizes are started together (their memory on the
GPU at once) and checkpointed one after another, each staying in host
memory while the next is checkpointed (as the daemon's overcommit leaves
them), then restored in reverse order; a checkpoint that would leave the
host less than 4 GiB available is not tried.

Prints the host's facts (memory, overcommit policy and limit, the cgroup's
limit, the locked-memory limit) and one row per size: the checkpoint's
result and time, the restore's, the peak growth of the process's resident
memory and of the host's committed memory over S (the host memory a
checkpoint of S GiB needs), the lowest MemAvailable seen. Results:
OUT/checkpoint-limit.json.
"""
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 1 << 30
POD = Path(__file__).with_name("swap_pod.py")


class LockArgs(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class Driver:
    """cuCheckpointProcess* by pid, as hypervisor/swap/src/driver.rs calls them."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", self.cu.cuInit(0))

    def name(self, rc):
        text = ctypes.c_char_p()
        self.cu.cuGetErrorName(rc, ctypes.byref(text))
        return (text.value or b"?").decode()

    def check(self, call, rc):
        if rc != 0:
            raise RuntimeError(f"{call}: {self.name(rc)} ({rc})")

    def call(self, call, pid, args=None):
        """(rc, seconds)."""
        fn = getattr(self.cu, call)
        start = time.perf_counter()
        rc = fn(ctypes.c_int(pid), args)
        return rc, time.perf_counter() - start

    def lock(self, pid):
        args = LockArgs(timeout_ms=30000)
        return self.call("cuCheckpointProcessLock", pid, ctypes.byref(args))


def meminfo():
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cgroup_dir():
    text = read("/proc/self/cgroup") or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    return None


def host_facts():
    mem = meminfo()
    cg = cgroup_dir()
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "mem_total": mem["MemTotal"], "mem_available": mem["MemAvailable"],
        "swap_total": mem.get("SwapTotal", 0),
        "commit_limit": mem["CommitLimit"], "committed_as": mem["Committed_AS"],
        "overcommit_memory": read("/proc/sys/vm/overcommit_memory"),
        "overcommit_ratio": read("/proc/sys/vm/overcommit_ratio"),
        "overcommit_kbytes": read("/proc/sys/vm/overcommit_kbytes"),
        "max_map_count": read("/proc/sys/vm/max_map_count"),
        "cgroup": str(cg) if cg else None,
        "cgroup_memory_max": read(cg / "memory.max") if cg else None,
        "cgroup_memory_current": read(cg / "memory.current") if cg else None,
        "memlock_soft": memlock[0], "memlock_hard": memlock[1],
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
    }


def rss(pid):
    for line in (read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def maps_count(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


class Sampler:
    """Peaks and troughs of the host and the process every 20 ms."""

    def __init__(self, pid):
        self.pid, self.stop_flag = pid, threading.Event()
        self.peak_rss = self.peak_committed = 0
        self.min_available = 1 << 62
        self.peak_cgroup = 0
        self.peak_maps = 0
        self.cg = cgroup_dir()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop_flag.is_set():
            mem = meminfo()
            self.peak_rss = max(self.peak_rss, rss(self.pid))
            self.peak_committed = max(self.peak_committed, mem["Committed_AS"])
            self.min_available = min(self.min_available, mem["MemAvailable"])
            current = read(self.cg / "memory.current") if self.cg else None
            if current and current.isdigit():
                self.peak_cgroup = max(self.peak_cgroup, int(current))
            self.peak_maps = max(self.peak_maps, maps_count(self.pid))
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join()


class Pod:
    def __init__(self, nbytes, log):
        self.proc = subprocess.Popen([sys.executable, str(POD), "hold", str(nbytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)

    def reply(self, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the pod exited")
            if line.startswith("REPLY "):
                return json.loads(line[6:])
        raise RuntimeError("no reply")

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def stop(self):
        try:
            self.ask("exit")
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def stacked(driver, sizes, log):
    """The pods of `sizes` resident together, checkpointed in turn and kept
    in host memory, then restored in reverse order."""
    pods, rows = [], []
    try:
        for size in sizes:
            pod = Pod(int(size * GIB), log)
            pods.append(pod)
            ready = pod.reply()
            rows.append({"gib": size, "pid": ready.get("pid"), "ready": ready})
        done = []
        for pod, row in zip(pods, rows):
            if not row["ready"].get("ready"):
                row["error"] = f"pod: {row['ready']}"
                continue
            pid = row["pid"]
            mem = meminfo()
            row["available_before"] = round(mem["MemAvailable"] / GIB, 2)
            row["gpu_free_before"] = gpu_free()
            if mem["MemAvailable"] < (row["gib"] + 4) * GIB:
                row["checkpoint"] = "skipped: host memory"
                continue
            rc, _ = driver.lock(pid)
            row["lock"] = driver.name(rc)
            if rc != 0:
                continue
            with Sampler(pid) as out:
                rc, s = driver.call("cuCheckpointProcessCheckpoint", pid)
            row.update(checkpoint=driver.name(rc), checkpoint_s=round(s, 2),
                       min_available_gib=round(out.min_available / GIB, 2))
            if rc == 0:
                done.append((pod, row))
            else:
                row["unlock"] = driver.name(driver.call("cuCheckpointProcessUnlock", pid)[0])
        for pod, row in reversed(done):
            rc, s = driver.call("cuCheckpointProcessRestore", row["pid"])
            row.update(restore=driver.name(rc), restore_s=round(s, 2))
            row["unlock"] = driver.name(driver.call("cuCheckpointProcessUnlock", row["pid"])[0])
            if rc == 0:
                row["identical"] = pod.ask("check").get("data") == row["ready"].get("data")
    except Exception as e:
        rows.append({"gib": "-", "error": f"{type(e).__name__}: {e}"})
    finally:
        for pod in pods:
            pod.stop()
    for row in rows:
        row.pop("ready", None)
    return rows


def gpu_free():
    """GPU 0's free MiB by nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def one(driver, size_gib, log):
    nbytes = int(size_gib * GIB)
    row = {"gib": size_gib}
    pod = Pod(nbytes, log)
    try:
        ready = pod.reply()
        if not ready.get("ready"):
            row["error"] = f"pod: {ready}"
            return row
        pid = ready["pid"]
        before_mem = meminfo()
        row["rss_before"] = rss(pid)
        row["committed_before"] = before_mem["Committed_AS"]
        row["available_before"] = before_mem["MemAvailable"]
        rc, s = driver.lock(pid)
        row["lock"] = driver.name(rc)
        if rc != 0:
            return row
        with Sampler(pid) as out:
            rc, s = driver.call("cuCheckpointProcessCheckpoint", pid)
        row.update(checkpoint=driver.name(rc), checkpoint_s=round(s, 2),
                   rss_growth_gib=round((out.peak_rss - row["rss_before"]) / GIB, 2),
                   committed_growth_gib=round((out.peak_committed - row["committed_before"]) / GIB, 2),
                   min_available_gib=round(out.min_available / GIB, 2),
                   peak_cgroup_gib=round(out.peak_cgroup / GIB, 2), peak_maps=out.peak_maps)
        if rc == 0:
            with Sampler(pid) as back:
                rc, s = driver.call("cuCheckpointProcessRestore", pid)
            row.update(restore=driver.name(rc), restore_s=round(s, 2),
                       restore_min_available_gib=round(back.min_available / GIB, 2))
        rc, _ = driver.call("cuCheckpointProcessUnlock", pid)
        row["unlock"] = driver.name(rc)
        if row.get("restore") == "CUDA_SUCCESS":
            check = pod.ask("check")
            row["identical"] = check.get("data") == ready.get("data")
        return row
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    finally:
        pod.stop()


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench checkpoint-limit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p):
    p.add_argument("--sizes", default="8,16,24", help="GiB held by the process, comma-separated")
    p.add_argument("--stacked", action="store_true", help="all sizes' pods at once, kept checkpointed in turn")
    p.add_argument("--out", default=None)


def run(args):
    out = Path(args.out or tempfile.mkdtemp(prefix="checkpoint-limit-"))
    out.mkdir(parents=True, exist_ok=True)
    facts = host_facts()
    print("host:", json.dumps(facts), flush=True)
    driver = Driver()
    rows = []
    sizes = [float(s) for s in args.sizes.split(",") if s]
    with open(out / "pods.log", "w") as log:
        if args.stacked:
            rows = stacked(driver, sizes, log)
            for row in rows:
                print(json.dumps(row), flush=True)
        for size in [] if args.stacked else sizes:
            row = one(driver, size, log)
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "checkpoint-limit.json").write_text(json.dumps({"host": facts, "rows": rows}, indent=1))
    print("| GiB | checkpoint | s | restore | s | RSS growth GiB | committed growth GiB | min available GiB | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['gib']} | {r.get('checkpoint', r.get('error', '-'))} | {r.get('checkpoint_s', '-')} | "
              f"{r.get('restore', '-')} | {r.get('restore_s', '-')} | {r.get('rss_growth_gib', '-')} | "
              f"{r.get('committed_growth_gib', '-')} | {r.get('min_available_gib', '-')} | {r.get('identical', '-')} |")
    return 0


def main_cli(p, args):
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
