"""Swapping pods to host memory and back on a real GPU, in one run: the
daemon (`hypervisor serve`, [swap] overcommit on) manages the pods; each
pod is a program of swap_pod.py under the limiter, on GPU 0. Results: a
Markdown table on stdout and in OUT/swap-bench.md, raw numbers in
OUT/swap-bench.json, the daemon's logs and the pods' in OUT (default: a
temporary folder, printed at the end).

  python3 -m scripts.bench swap --bundle DIR [--sizes 1,8,32] [--rounds 3] [--quick]
          [--out DIR] [--parts bandwidth,swap,infer,overcommit,move] [--budget-s 450]

Parts (a part that fails prints FAILED and why, and the run goes on):
1. bandwidth: pinned host memory <-> the GPU with torch, without the
   limiter (the physical limit): 4 GiB (less when host memory is short),
   GiB/s, median of 5 each way.
2. swap: per size S, a pod (quota S+4 GiB) holds S GiB of seeded random
   tensors; ROUNDS times: swap-out and swap-in through the admin API (the
   HTTP call's time and the daemon's last_swap_out_s/last_swap_in_s; GiB/s
   of what moved, the process's device memory as the daemon counts it),
   nvidia-smi's MiB of the process before, while swapped (expect none) and
   after; then the digests and a matmul recomputed on the GPU (bit-exact
   against those before any swap), and the quota (quota - S - 1 GiB more is
   granted, 2 GiB beyond that refused).
3. infer: an inference pod (quota 16 GiB, ~8 GiB of fp16 layers): a request
   after 3 s idle (T0) and a request right after a swap-out (T1: the
   limiter holds its first CUDA call and the daemon swaps the pod in),
   timed by the pod and by the bench; outputs bit-exact.
4. overcommit: three pods of quota 0.5xM each (M: GPU 0's memory), each
   holding ~0.45xM once it works (less where two of them would not fit
   the host memory), served in turn 1,2,3,1,2,3 with pauses longer than
   idle_after_ms: no out-of-memory anywhere, digests identical across a
   pod's turns; each request's time and the swaps the daemon made.
5. move (two GPUs or more): a pod on GPU 0 (quota 8+4 GiB, seen by the
   pod as its only GPU) holding 8 GiB is moved to GPU 1 and back through
   the admin API (POST …/pods/POD/move), then GPU 0 is drained (POST
   …/gpus/0/drain); each time: the seconds, nvidia-smi's GPU for the
   process, the UUID its CUDA device 0 reports, the digests and the quota.
   One GPU: not run.
6. the cost for pods never swapped: `python3 -m scripts.bench launch-ab`.

Targets: swap-in of 8 GiB <= 2 s; a swapped pod's first request <= 3 s;
stretch: swap bandwidth >= 50% of pinned. With the defaults the run should
take 4 to 6 minutes, mostly checkpoints (1.4 to 2.3 GiB/s on an H100 and an
H200, driver 580) and restores; --quick: sizes 1,8 and 2 rounds. A swap, or
a request waiting for one, that does not answer within a minute and 4 s a
GiB fails (the daemon's swaps are then not tried again until the next
part's daemon), and --budget-s bounds the whole run.
"""
import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from scripts.gpu.e2e.harness import hv
from scripts.gpu.e2e.harness.parse import compute_apps
from scripts.gpu.e2e.harness.parse import median as med
from scripts.gpu.e2e.harness.proc import SMI_APPS, SMI_MEM

from . import common

GIB = 1 << 30
MIB = 1 << 20
ADMIN = "admin"
POD_PROGRAM = common.HERE / "swap_pod.py"
# The pods run on NVML GPU 0, the index of the daemon's config; no managed
# memory, no expandable segments (the checkpoint cannot take them).
POD_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
HOST_LIMIT = 100 * GIB
QUOTA_MARGIN = 4 * GIB
INFER_QUOTA, INFER_WEIGHTS = 16 * GIB, 8 * GIB
IDLE_AFTER_MS, OVERCOMMIT_IDLE_MS, OVERCOMMIT_PAUSE_S = 2000, 1000, 1.5
# What a torch process's context and workspaces take besides its tensors.
CONTEXT = 1 * GIB
TARGET_SWAP_IN_8G_S, TARGET_FIRST_REQUEST_S, STRETCH_SHARE = 2.0, 3.0, 0.5


class BenchError(RuntimeError):
    pass


def parse_sizes(text):
    """"1,8,32" -> [1.0, 8.0, 32.0]: GiB, each > 0."""
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers of GiB separated by commas, not {text!r}")
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"at least one size, each above 0, not {text!r}")
    return sizes


def gib(nbytes):
    """Bytes as GiB, two decimals at most: "35.75", "8"."""
    return f"{nbytes / GIB:.2f}".rstrip("0").rstrip(".")


def swap_section(idle_after_ms, host_limit):
    return (f"[swap]\novercommit = true\nidle_after_ms = {idle_after_ms}\nlatency_pods = \"last\"\n"
            f"host_limit = {host_limit}\nroom_wait_ms = 120000\n\n")


def config_text(quotas, idle_after_ms, host_limit):
    """The daemon's config: the [swap] table and one pod on GPU 0 per
    (id, quota in bytes) of `quotas` (listen: --listen decides)."""
    return ('listen = "127.0.0.1:0"\n' f'admin_token = "{ADMIN}"\n\n' + swap_section(idle_after_ms, host_limit)
            + "".join(hv.pod_section(pod, f"memory = {quota}") for pod, quota in quotas.items()))


def overcommit_plan(total, free, host_room):
    """(quota, hold) of each of three pods on a GPU of `total` bytes with
    `free` free, two of them in `host_room` of host memory at once (one
    swapped, one swapped out to make room for its return); BenchError when
    two cannot share the GPU or three would not overcommit it."""
    quota = total // 2
    hold = min(int(0.45 * total), host_room // 2, (free - 3 * CONTEXT) // 2)
    hold -= hold % (256 * MIB)
    if hold <= 0 or 3 * hold <= free - 3 * CONTEXT:
        raise BenchError(f"no overcommit possible: {gib(free)} GiB free on the GPU, {gib(host_room)} GiB for"
                         f" swapped pods on the host: each pod could hold {gib(max(hold, 0))} GiB")
    return quota, hold


def host_available():
    """MemAvailable of /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def gpu_memory():
    """GPU 0's (total, used, free) bytes, from nvidia-smi."""
    text = subprocess.run(SMI_MEM, capture_output=True, text=True, timeout=30, env=common.clean_env()).stdout
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            return tuple(int(p) * MIB for p in parts)
    raise BenchError(f"nvidia-smi gave no memory line: {text.strip()[:200]!r}")


def smi_mib(pid):
    """(the process's MiB as nvidia-smi lists it, None when it is not listed;
    GPU 0's used MiB)."""
    text = subprocess.run(SMI_APPS, capture_output=True, text=True, timeout=30, env=common.clean_env()).stdout
    return compute_apps(text).get(pid), gpu_memory()[1] // MIB


class Pod:
    """A swap_pod.py program: commands on its stdin, its REPLY lines read
    as they come (a thread; the bench times requests to the millisecond),
    its stderr and other output in `log`."""

    def __init__(self, pod, argv, env, log):
        self.pod, self.log = pod, Path(log)
        self.chatter = []
        with open(self.log, "w") as f:
            f.write(f"# {pod}: {' '.join(argv)}\n")
            f.flush()
            self.p = subprocess.Popen([sys.executable, str(POD_PROGRAM), *argv], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=f, env=env, text=True, bufsize=1,
                                      start_new_session=True)
        self.replies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("REPLY "):
                try:
                    self.replies.put(json.loads(line[6:]))
                    continue
                except ValueError:
                    pass
            self.chatter.append(line)
        self.replies.put(None)

    def reply(self, timeout):
        try:
            answer = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.pod}: no answer within {timeout:g} s")
        if answer is None:
            tail = " ".join(self.log.read_text(errors="replace").splitlines()[-3:])[-300:]
            raise BenchError(f"{self.pod} exited (status {self.p.wait()}): {tail}")
        return answer

    def ask(self, command, timeout):
        """(its answer, seconds from the command sent to the answer read)."""
        start = time.monotonic()
        try:
            self.p.stdin.write(command + "\n")
            self.p.stdin.flush()
        except OSError as e:
            raise BenchError(f"{self.pod}: cannot send {command!r}: {e}")
        answer = self.reply(timeout)
        return answer, time.monotonic() - start

    def ready(self, timeout=300):
        answer = self.reply(timeout)
        if not answer.get("ready"):
            raise BenchError(f"{self.pod} not ready: {answer.get('error')}")
        return answer

    def stop(self, graceful=True):
        """`exit` (graceful) and 15 s to go, else SIGTERM then SIGKILL to its
        group. A swapped pod is killed: its exit would bring it back."""
        if self.p.poll() is None and graceful:
            with contextlib.suppress(OSError, BenchError):
                self.ask("exit", 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(timeout=15)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(self.p.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.p.wait(timeout=5)
        with open(self.log, "a") as f:
            f.write("".join(self.chatter) + f"# exit={self.p.poll()}\n")


class Bench:
    """The run's daemon (one per part), its pods, and the calls to both."""

    def __init__(self, args):
        self.args = args
        self.bundle = Path(args.bundle).resolve()
        self.lib = str(self.bundle / "libcuda_limiter.so")
        self.out = Path(args.out)
        tag = f"swap-bench-{os.getpid()}"
        self.tables = {"GPUSHARE_NODE_REGION": f"gpushare-node-{tag}",
                       "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{tag}"}
        self.host_limit = max(GIB, min(HOST_LIMIT, host_available() - 8 * GIB))
        self.daemon = None
        self.pods = []
        self.deadline = time.monotonic() + args.budget_s
        # Why the daemon's swaps cannot be trusted to answer any more (one
        # did not answer in time: the next swap would wait behind it).
        self.stuck = None

    def left(self):
        """Seconds left of the run's time (--budget-s)."""
        return self.deadline - time.monotonic()

    def timeout(self, nbytes, per_gib=4.0):
        """Seconds a swap of nbytes, or a request that waits for one, may
        take: a minute, and per_gib a GiB (the checkpoint ran at 2.3 GiB/s
        on an H200, the restore faster), within the run's time left."""
        return max(10.0, min(60 + per_gib * nbytes / GIB, self.left()))

    def begin(self, part):
        """BenchError when the run's time is spent."""
        if self.left() < 30:
            raise BenchError(f"{part} not run: the run's time (--budget-s) is spent")

    @contextlib.contextmanager
    def serving(self, part, quotas, idle_after_ms=IDLE_AFTER_MS):
        """A daemon for `part` with the pods of `quotas` (id: bytes); at the
        end its pods and it are stopped, their regions removed. Its log:
        OUT/PART-hypervisor.log."""
        config = self.out / f"{part}-hypervisor.toml"
        config.write_text(config_text(quotas, idle_after_ms, self.host_limit))
        common.remove_pod_regions(*quotas)
        self.stuck = None
        self.daemon = hv.Daemon(common.settings("", self.out, self.bundle / "hypervisor"), part, config,
                                env=self.tables, stop_s=10)
        try:
            self.daemon.start()
            yield self.daemon
        finally:
            self.stop_pods()
            self.daemon.stop()
            self.daemon = None
            common.remove_pod_regions(*quotas)
            self.remove_tables()

    def remove_tables(self):
        for name in self.tables.values():
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)

    def start_pod(self, pod, *argv):
        env = common.clean_env("PYTORCH_CUDA_ALLOC_CONF")
        env.update(LD_PRELOAD=self.lib, CUDA_LIMITER_POD=pod, CUDA_LIMITER_TOKEN=hv.hv_token(pod),
                   CUDA_LIMITER_HYPERVISOR=self.daemon.url, CUDA_LIMITER_LOG="info", PYTHONUNBUFFERED="1",
                   **self.tables, **POD_ENV)
        p = Pod(pod, [str(a) for a in argv], env, self.out / f"pod-{pod}.log")
        self.pods.append(p)
        return p

    def stop_pod(self, p):
        """Stops a pod's program: gracefully where its pod is resident."""
        graceful = self.daemon is not None and self.pod_swap(p.pod).get("state", "resident") == "resident"
        graceful = graceful and not self.stuck
        p.stop(graceful)
        self.pods.remove(p)

    def stop_pods(self):
        for p in list(self.pods):
            self.stop_pod(p)

    def swap(self, pod, action, nbytes):
        """POST …/pods/POD/ACTION (swap-out, swap-in) of a pod holding
        nbytes: status, seconds, the answer. BenchError when it does not
        answer in time."""
        start, limit = time.monotonic(), self.timeout(nbytes)
        code, body = hv.hvctl.request(f"{self.daemon.url}/api/v1/pods/{pod}/{action}", method="POST",
                                      token=ADMIN, timeout=limit)
        took = time.monotonic() - start
        if code == 0:
            self.stuck = f"{action} of {pod} not answered within {limit:.0f} s ({body})"
            raise BenchError(self.stuck)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {"error": body[:300]}
        return {"http": code, "seconds": took, **answer}

    def swapped(self, pod, nbytes):
        """Swaps the pod out; BenchError unless the daemon says it is swapped."""
        out = self.swap(pod, "swap-out", nbytes)
        if out["http"] != 200 or out.get("residency") != "swapped":
            raise BenchError(f"swap-out of {pod}: HTTP {out['http']} {out.get('residency') or out.get('error')}")
        return out

    def status(self):
        """The swap part of the daemon's status; {} once the daemon is stuck
        (a daemon whose swap hangs stops answering its status too)."""
        if self.stuck:
            return {}
        try:
            return self.daemon.status_json().get("swap") or {}
        except hv.HvError as e:
            self.stuck = f"the daemon's status does not answer: {e}"
            return {}

    def pod_swap(self, pod):
        return (self.status().get("pods") or {}).get(pod) or {}

    def totals(self):
        return self.status().get("totals") or {}

    def metrics(self):
        """The swap lines of GET /metrics."""
        if self.stuck:
            return []
        code, body = hv.hvctl.request(f"{self.daemon.url}/metrics", timeout=5)
        return [l for l in body.splitlines() if "swap" in (l.split("{")[0].split() or [""])[0]] if code == 200 else []


def guarded(name, fn, *args):
    """fn(*args), or {"failed": why} with "NAME: FAILED: why" printed."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(file=sys.stderr)
        return {"failed": f"{type(e).__name__}: {e}"}


def share(rate, pinned):
    return None if rate is None or not pinned else rate / pinned


def fmt(value, spec=".2f", none="n/a"):
    return none if value is None else format(value, spec)


def part_bandwidth(b):
    nbytes = min(4 * GIB, host_available() // 4)
    nbytes -= nbytes % (2 * MIB)
    env = {**common.clean_env("PYTORCH_CUDA_ALLOC_CONF"), **POD_ENV}
    out = subprocess.run([sys.executable, str(POD_PROGRAM), "bandwidth", str(nbytes)], capture_output=True,
                         text=True, env=env, timeout=300)
    (b.out / "pod-bandwidth.log").write_text(out.stdout + out.stderr)
    replies = [json.loads(l[6:]) for l in out.stdout.splitlines() if l.startswith("REPLY ")]
    if out.returncode != 0 or not replies or not replies[0].get("ready"):
        raise BenchError(f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}")
    r = replies[0]
    r.update(h2d_median=med(r["h2d"]), d2h_median=med(r["d2h"]))
    print(f"pinned bandwidth ({gib(nbytes)} GiB, {r['name']}): H2D {r['h2d_median']:.1f} GiB/s, D2H"
          f" {r['d2h_median']:.1f} GiB/s (raw H2D {[round(x, 1) for x in r['h2d']]},"
          f" D2H {[round(x, 1) for x in r['d2h']]})", flush=True)
    return r


def swap_round(b, p, pod, held, quota, before, r):
    """One swap-out and swap-in of the pod, and the checks after; the
    figures go into r as they come (a round that fails keeps those)."""
    r["smi_before_mib"], r["gpu_used_before_mib"] = smi_mib(p.p.pid)
    time.sleep(0.2)  # the daemon refuses a pod whose last CUDA call is this fresh
    out = b.swapped(pod, held)
    record = b.pod_swap(pod)
    # The rates count what moved: the process's device memory, as the daemon
    # reports it (the tensors, the context's and the allocator's cache).
    moved = record.get("bytes_on_host") or held
    r.update(out_s=out["seconds"], moved=moved, out_gibs=moved / GIB / out["seconds"],
             daemon_out_s=record.get("last_swap_out_s"))
    r["smi_swapped_mib"], r["gpu_used_swapped_mib"] = smi_mib(p.p.pid)
    back = b.swap(pod, "swap-in", held)
    if back["http"] != 200 or back.get("residency") != "resident":
        raise BenchError(f"swap-in of {pod}: HTTP {back['http']} {back.get('residency') or back.get('error')}")
    r.update(in_s=back["seconds"], in_gibs=moved / GIB / back["seconds"],
             daemon_in_s=b.pod_swap(pod).get("last_swap_in_s"))
    r["smi_after_mib"], r["gpu_used_after_mib"] = smi_mib(p.p.pid)
    check, _ = p.ask("check", 120)
    r["identical"] = all(check.get(k) == before[k] for k in ("data", "matmul", "matmul_sum"))
    more, _ = p.ask(f"alloc {quota - held - GIB}", 120)
    beyond, _ = p.ask(f"alloc {2 * GIB}", 120)
    p.ask("release", 120)
    r["quota_intact"] = more.get("alloc") == "ok" and beyond.get("alloc") == "oom"
    r["alloc"] = [more.get("alloc"), beyond.get("alloc")]


def swap_size(b, size, pinned):
    held = int(size * GIB)
    held -= held % (2 * MIB)
    pod, quota = f"swap-{size:g}g", held + QUOTA_MARGIN
    p = b.start_pod(pod, "hold", held)
    try:
        before = p.ready()
        print(f"swap {size:g} GiB: pod {pod} (pid {p.p.pid}, quota {gib(quota)} GiB) filled in"
              f" {before['fill_s']:.1f} s", flush=True)
        rounds = []
        for n in range(b.args.rounds):
            r = {}
            r.update(guarded(f"  swap {size:g} GiB round {n + 1}", swap_round, b, p, pod, held, quota, before, r)
                     or {})
            rounds.append(r)
            if "failed" in r:
                if b.stuck or b.pod_swap(pod).get("state", "resident") != "resident":
                    break
                continue
            print(f"  round {n + 1}: {gib(r['moved'])} GiB moved; out {r['out_s']:.2f} s ({r['out_gibs']:.2f} GiB/s,"
                  f" {fmt(share(r['out_gibs'], pinned.get('d2h_median')), '.0%')} of pinned D2H; daemon"
                  f" {fmt(r['daemon_out_s'])} s), in {r['in_s']:.2f} s ({r['in_gibs']:.2f} GiB/s,"
                  f" {fmt(share(r['in_gibs'], pinned.get('h2d_median')), '.0%')} of pinned H2D; daemon"
                  f" {fmt(r['daemon_in_s'])} s); nvidia-smi MiB {fmt(r['smi_before_mib'], 'd', 'absent')} /"
                  f" {fmt(r['smi_swapped_mib'], 'd', 'absent')} / {fmt(r['smi_after_mib'], 'd', 'absent')}"
                  f" (GPU used {r['gpu_used_before_mib']} / {r['gpu_used_swapped_mib']} /"
                  f" {r['gpu_used_after_mib']}); identical {yes(r['identical'])}; quota intact"
                  f" {yes(r['quota_intact'])} {r['alloc']}", flush=True)
    finally:
        b.stop_pod(p)
    done = [r for r in rounds if "failed" not in r]
    if not done:
        outs = [f"{r['out_s']:.2f}" for r in rounds if "out_s" in r]
        return {"held": held, "quota": quota, "rounds": rounds,
                "failed": (f"swap-out {', '.join(outs)} s; " if outs else "")
                + (rounds[0]["failed"] if rounds else "no round run")}
    summary = {k: med(r[k] for r in done) for k in (
        "moved", "out_s", "in_s", "out_gibs", "in_gibs", "daemon_out_s", "daemon_in_s", "smi_before_mib", "smi_swapped_mib",
        "smi_after_mib", "gpu_used_before_mib", "gpu_used_swapped_mib", "gpu_used_after_mib")}
    summary.update(identical=all(r["identical"] for r in done), quota_intact=all(r["quota_intact"] for r in done),
                   out_share=share(summary["out_gibs"], pinned.get("d2h_median")),
                   in_share=share(summary["in_gibs"], pinned.get("h2d_median")))
    print(f"  median of {len(done)}: out {summary['out_s']:.2f} s ({summary['out_gibs']:.2f} GiB/s),"
          f" in {summary['in_s']:.2f} s ({summary['in_gibs']:.2f} GiB/s)", flush=True)
    return {"held": held, "quota": quota, "rounds": rounds, "summary": summary}


def freed_on_gpu(summary, held):
    """Whether nvidia-smi saw the memory leave the GPU while the pod was
    swapped: the process listed before and not (or at 0) while swapped; or,
    where it lists no process of ours (another pid namespace), the GPU's
    used memory lower by 90% of what the pod held."""
    if summary["smi_before_mib"] is not None:
        return not summary["smi_swapped_mib"]
    before, swapped = summary["gpu_used_before_mib"], summary["gpu_used_swapped_mib"]
    return before is not None and swapped is not None and before - swapped >= 0.9 * held / MIB


def yes(flag):
    return "yes" if flag else "no"


def part_swap(b, pinned):
    b.begin("swap")
    total, _, free = gpu_memory()
    room = min(b.host_limit, host_available() - 8 * GIB)
    results, quotas = {}, {}
    for size in b.args.sizes:
        need = int(size * GIB)
        if need + QUOTA_MARGIN + CONTEXT > free or need > room:
            why = (f"{size:g} GiB + {gib(QUOTA_MARGIN)} GiB does not fit the GPU's {gib(free)} GiB free"
                   if need + QUOTA_MARGIN + CONTEXT > free else f"host room for swapped pods {gib(room)} GiB")
            print(f"swap {size:g} GiB: FAILED: not run: {why}", flush=True)
            results[f"{size:g}"] = {"failed": f"not run: {why}"}
            continue
        quotas[f"swap-{size:g}g"] = need - need % (2 * MIB) + QUOTA_MARGIN
    if quotas:
        with b.serving("swap", quotas):
            for size in b.args.sizes:
                if f"swap-{size:g}g" not in quotas:
                    continue
                if b.stuck or b.left() < 30:
                    why = f"not run: {b.stuck or 'the run time (--budget-s) is spent'}"
                    print(f"swap {size:g} GiB: FAILED: {why}", flush=True)
                    results[f"{size:g}"] = {"failed": why}
                    continue
                results[f"{size:g}"] = guarded(f"swap {size:g} GiB", swap_size, b, size, pinned)
            results["totals"], results["metrics"] = b.totals(), b.metrics()
    return results


def part_infer(b):
    b.begin("infer")
    pod = "swap-infer"
    with b.serving("infer", {pod: INFER_QUOTA}):
        p = b.start_pod(pod, "infer", INFER_WEIGHTS)
        ready = p.ready()
        print(f"infer: pod {pod} (pid {p.p.pid}), {ready['layers']} layers of 4096x4096 fp16"
              f" ({gib(ready['weight_bytes'])} GiB), loaded in {ready['load_s']:.1f} s", flush=True)
        resident, swapped = [], []
        for _ in range(b.args.infer_rounds):
            time.sleep(b.args.idle_s)
            answer, took = p.ask("infer", 60)
            resident.append({"bench_s": took, "pod_s": answer.get("s"), "digest": answer.get("digest")})
        for n in range(b.args.infer_rounds):
            time.sleep(1.0)
            r = {}
            try:
                r["out_s"] = b.swapped(pod, INFER_QUOTA)["seconds"]
                answer, took = p.ask("infer", b.timeout(INFER_QUOTA))
                record = b.pod_swap(pod)
                r.update(bench_s=took, pod_s=answer.get("s"), digest=answer.get("digest"),
                         state=record.get("state"), daemon_in_s=record.get("last_swap_in_s"),
                         swap_ins=record.get("swap_ins"))
            except BenchError as e:
                print(f"  swapped request {n + 1}: FAILED: {e}", flush=True)
                r["failed"] = str(e)
            swapped.append(r)
            if "failed" in r and (b.stuck or p.p.poll() is not None or "no answer" in r["failed"]):
                break
        totals = b.totals()
    ok = [r for r in swapped if "failed" not in r]
    result = {
        "ready": ready, "resident": resident, "swapped": swapped, "totals": totals,
        "t0_s": med(r["bench_s"] for r in resident), "t1_s": med(r["bench_s"] for r in ok),
        "t1_pod_s": med(r["pod_s"] for r in ok), "swapped_ok": len(ok),
        "identical": all(r["digest"] == ready["digest"] for r in resident + ok),
    }
    if not ok:
        result["failed"] = f"no swapped request: {swapped[0].get('failed') if swapped else 'none run'}"
    print(f"infer: T0 (resident, after {b.args.idle_s:g} s idle) median {fmt(result['t0_s'], '.4f')} s, raw"
          f" {[round(r['bench_s'], 4) for r in resident]}; T1 (swapped) median {fmt(result['t1_s'])} s"
          f" (pod's own {fmt(result['t1_pod_s'])} s), raw {[round(r['bench_s'], 2) for r in ok]}"
          f" (pod's own {[round(r['pod_s'], 2) for r in ok]}), daemon swap-in"
          f" {[fmt(r['daemon_in_s']) for r in ok]} s, swap-out {[round(r['out_s'], 2) for r in ok]} s;"
          f" outputs identical {yes(result['identical'])}", flush=True)
    return result


def part_overcommit(b):
    b.begin("overcommit")
    total, _, free = gpu_memory()
    room = min(b.host_limit, host_available() - 16 * GIB)
    quota, hold = overcommit_plan(total, free, room)
    pods = [f"swap-oc{n}" for n in (1, 2, 3)]
    print(f"overcommit: GPU 0 {gib(total)} GiB ({gib(free)} GiB free); 3 pods, quota {gib(quota)} GiB each"
          f" (sum {gib(3 * quota)} GiB), each holding {gib(hold)} GiB once it works; idle_after"
          f" {OVERCOMMIT_IDLE_MS} ms, {OVERCOMMIT_PAUSE_S:g} s between requests", flush=True)
    turns, totals = [], {}
    with b.serving("overcommit", {pod: quota for pod in pods}, OVERCOMMIT_IDLE_MS):
        procs = [b.start_pod(pod, "work", hold, 100 + n) for n, pod in enumerate(pods)]
        for p in procs:
            p.ready()
        for n in (0, 1, 2, 0, 1, 2):
            time.sleep(OVERCOMMIT_PAUSE_S)
            before = b.totals()
            try:
                # A swap-out of another pod and this one's swap-in, at most.
                answer, took = procs[n].ask("work", b.timeout(hold, per_gib=8.0))
            except BenchError as e:
                answer, took = {"ok": False, "error": str(e)}, None
                b.stuck = b.stuck or str(e)
            after = b.totals()
            totals = after or totals
            turn = {"pod": pods[n], "bench_s": took, **answer,
                    **{k: after[k] - before[k] if before and after else None for k in ("swap_outs", "swap_ins")}}
            turns.append(turn)
            print(f"  {pods[n]}: {'ok' if answer.get('ok') else 'FAILED ' + str(answer.get('error'))}"
                  f" in {fmt(took)} s (pod's own {fmt(answer.get('s'))} s), the daemon swapped"
                  f" {fmt(turn['swap_outs'], 'd', '?')} out and {fmt(turn['swap_ins'], 'd', '?')} in", flush=True)
            if took is None:
                break
        totals, metrics = b.totals() or totals, b.metrics()
    digests = {}
    for t in turns:
        if t.get("ok"):
            digests.setdefault(t["pod"], set()).add((t.get("data"), t.get("matmul")))
    why = [w for w, bad in (("out of memory", any(t.get("oom") for t in turns)),
                            ("a request failed", not all(t.get("ok") for t in turns)),
                            ("digests changed", any(len(d) > 1 for d in digests.values())),
                            ("no swap happened", not b.stuck and not totals.get("swap_outs"))) if bad]
    ok = not why
    print(f"overcommit: {'PASS' if ok else 'FAIL ' + ', '.join(why)}; daemon totals {totals}", flush=True)
    return {"total": total, "free": free, "quota": quota, "hold": hold, "turns": turns, "totals": totals,
            "metrics": metrics, "pass": ok, "why": why}


def gpu_uuids():
    """The GPUs' UUIDs by NVML index, from nvidia-smi."""
    text = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30, env=common.clean_env()).stdout
    rows = [[f.strip() for f in line.split(",")] for line in text.splitlines()]
    return [uuid for _, uuid in sorted((int(r[0]), r[1]) for r in rows if len(r) == 2 and r[0].isdigit())]


def smi_where(pid):
    """[(GPU UUID, MiB)] of the process as nvidia-smi lists it."""
    text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                          env=common.clean_env()).stdout
    rows = [[f.strip() for f in line.split(",")] for line in text.splitlines()]
    return [(r[1], int(r[2])) for r in rows if len(r) == 3 and r[0] == str(pid) and r[2].isdigit()]


def move_step(b, p, pod, held, quota, before, gpus, action, to):
    """One move of the pod (action: ("move", index) or ("drain", index of
    the GPU drained)) and the checks after; its figures."""
    kind, index = action
    url = (f"{b.daemon.url}/api/v1/pods/{pod}/move" if kind == "move"
           else f"{b.daemon.url}/api/v1/gpus/{index}/drain")
    time.sleep(0.2)
    start = time.monotonic()
    code, body = hv.hvctl.request(url, method="POST", token=ADMIN, timeout=b.timeout(held),
                                  body=json.dumps({"to": index}) if kind == "move" else None)
    took = time.monotonic() - start
    if code != 200:
        raise BenchError(f"{kind} {index}: HTTP {code} {body[:300]}")
    answer = json.loads(body)
    moved = answer if kind == "move" else (answer.get("moved") or [{}])[0]
    where = smi_where(p.p.pid)
    device, _ = p.ask("device", 60)
    check, _ = p.ask("check", 120)
    more, _ = p.ask(f"alloc {quota - held - GIB}", 120)
    beyond, _ = p.ask(f"alloc {2 * GIB}", 120)
    p.ask("release", 120)
    r = {"action": f"{kind} {index}", "http_s": took, "daemon_s": moved.get("seconds"),
         "bytes": moved.get("bytes"), "to": moved.get("to"), "smi": where, "device_uuid": device.get("uuid"),
         "identical": all(check.get(k) == before[k] for k in ("data", "matmul", "matmul_sum")),
         "alloc": [more.get("alloc"), beyond.get("alloc")]}
    r["quota_intact"] = r["alloc"] == ["ok", "oom"]
    r["on_target"] = [u for u, _ in where] == [gpus[to]] and r["device_uuid"] == gpus[to] and r["to"] == gpus[to]
    gibs = (r["bytes"] or 0) / GIB / took
    print(f"  {r['action']}: {took:.2f} s ({gibs:.2f} GiB/s of {gib(r['bytes'] or 0)} GiB; daemon"
          f" {fmt(r['daemon_s'])} s); nvidia-smi {where}; device 0 reports {r['device_uuid']}; on GPU {to}"
          f" {yes(r['on_target'])}; identical {yes(r['identical'])}; quota intact {yes(r['quota_intact'])}"
          f" {r['alloc']}", flush=True)
    return r


def part_move(b):
    gpus = gpu_uuids()
    if len(gpus) < 2:
        line = "not run (one GPU)"
        print(f"move: {line}", flush=True)
        return {"line": line}
    b.begin("move")
    held = 8 * GIB
    pod, quota = "swap-move", held + QUOTA_MARGIN
    steps = []
    with b.serving("move", {pod: quota}):
        p = b.start_pod(pod, "hold", held)
        before = p.ready()
        print(f"move: pod {pod} (pid {p.p.pid}, quota {gib(quota)} GiB, {gib(held)} GiB held) on GPU 0 of"
              f" {len(gpus)}; nvidia-smi {smi_where(p.p.pid)}", flush=True)
        for action, to in ((("move", 1), 1), (("move", 0), 0), (("drain", 0), 1)):
            step = guarded(f"  {action[0]} {action[1]}", move_step, b, p, pod, held, quota, before, gpus, action, to)
            steps.append(step)
            if "failed" in step:
                break
        totals = b.totals()
    ok = len(steps) == 3 and all("failed" not in s and s["on_target"] and s["identical"] and s["quota_intact"]
                                 for s in steps)
    line = (f"{'PASS' if ok else 'FAIL'}: " + "; ".join(
        s.get("failed", f"{s['action']} {s['http_s']:.2f} s") for s in steps)
            + ("; on the other GPU, identical, quota intact" if ok else ""))
    print(f"move: {line}; daemon totals {totals}", flush=True)
    return {"steps": steps, "totals": totals, "pass": ok, "line": line}


def report(results, sizes):
    """The Markdown table of the figures and their targets (a part not run
    has no rows)."""
    rows = []
    bw = results.get("bandwidth")
    if bw is not None:
        rows.append(("pinned H2D / D2H, GiB/s", "FAILED" if "failed" in bw else
                     f"{fmt(bw.get('h2d_median'), '.1f')} / {fmt(bw.get('d2h_median'), '.1f')}",
                     "the physical limit", bw.get("failed", "")[:120]))
    swap = results.get("swap")
    if swap is not None and "failed" in swap:
        rows.append(("swap", "FAILED", "", swap["failed"][:120]))
    elif swap is not None:
        for size in sizes:
            rows += swap_rows(size, swap.get(f"{size:g}") or {"failed": "not run"})
    infer = results.get("infer") or {}
    if "t0_s" in infer:
        rows.append(("first request after idle, resident (T0), s", fmt(infer["t0_s"], ".4f"), "", ""))
    if "failed" in infer:
        rows.append(("first request after idle, swapped (T1)", "FAILED", "", infer["failed"][:120]))
    elif infer:
        rows.append(("first request after idle, swapped (T1), s (pod's own)",
                     f"{fmt(infer['t1_s'])} ({fmt(infer['t1_pod_s'])})", f"<= {TARGET_FIRST_REQUEST_S:g} s",
                     pass_fail(infer["t1_s"] is not None and infer["t1_s"] <= TARGET_FIRST_REQUEST_S)))
    if "identical" in infer:
        rows.append(("inference outputs identical (requests resident, swapped)",
                     f"{yes(infer['identical'])} ({len(infer['resident'])}, {infer['swapped_ok']})", "yes",
                     pass_fail(infer["identical"] and infer["swapped_ok"])))
    oc = results.get("overcommit") or {}
    if "failed" in oc:
        rows.append(("overcommit, 3 pods of 0.5xM", "FAILED", "", oc["failed"][:120]))
    elif oc:
        t = oc["totals"]
        rows.append((f"overcommit, 3 pods of quota {gib(oc['quota'])} GiB holding {gib(oc['hold'])} GiB",
                     f"{len(oc['turns'])} requests, {t.get('swap_outs')} swaps out, {t.get('swap_ins')} in",
                     "no OOM, digests identical", "PASS" if oc["pass"] else "FAIL " + ", ".join(oc["why"])))
    rows.append(("move between GPUs", (results.get("move") or {}).get("line", "not run"), "", ""))
    rows.append(("no cost for pods never swapped", "python3 -m scripts.bench launch-ab", "", ""))
    head = "| figure | value | target | verdict |\n|---|---|---|---|\n"
    return head + "".join("| " + " | ".join(str(c) for c in row) + " |\n" for row in rows)


def swap_rows(size, one):
    """The rows of one size of the swap part: medians of its rounds."""
    if "failed" in one:
        return [(f"swap {size:g} GiB", "FAILED", "", one["failed"][:120])]
    s = one["summary"]
    stretch = {k: "n/a" if s[k] is None else pass_fail(s[k] >= STRETCH_SHARE) for k in ("out_share", "in_share")}
    target, verdict = f"stretch >= {STRETCH_SHARE:.0%} of pinned", f"stretch {stretch['in_share']}"
    if size == 8:
        target = f"<= {TARGET_SWAP_IN_8G_S:g} s; {target}"
        verdict = f"{pass_fail(s['in_s'] is not None and s['in_s'] <= TARGET_SWAP_IN_8G_S)}; {verdict}"
    smi = " / ".join(fmt(s[f"smi_{k}_mib"], ".0f", "absent") for k in ("before", "swapped", "after"))
    used = " / ".join(fmt(s[f"gpu_used_{k}_mib"], ".0f") for k in ("before", "swapped", "after"))
    return [
        (f"swap-out {size:g} GiB, s (GiB/s, of pinned D2H)",
         f"{fmt(s['out_s'])} ({fmt(s['out_gibs'])}, {fmt(s['out_share'], '.0%')})",
         f"stretch >= {STRETCH_SHARE:.0%} of pinned", f"stretch {stretch['out_share']}"),
        (f"swap-in {size:g} GiB, s (GiB/s, of pinned H2D)",
         f"{fmt(s['in_s'])} ({fmt(s['in_gibs'])}, {fmt(s['in_share'], '.0%')})", target, verdict),
        (f"{size:g} GiB: nvidia-smi MiB of the process before / swapped / after (GPU used)", f"{smi} ({used})",
         "none while swapped", pass_fail(freed_on_gpu(s, one["held"]))),
        (f"{size:g} GiB after swap: identical, quota intact", f"{yes(s['identical'])}, {yes(s['quota_intact'])}",
         "yes, yes", pass_fail(s["identical"] and s["quota_intact"])),
    ]


def pass_fail(flag):
    return "PASS" if flag else "FAIL"


PARTS = ("bandwidth", "swap", "infer", "overcommit", "move")


def add_arguments(p):
    p.add_argument("--bundle", required=True, help="the bundle folder: libcuda_limiter.so, hypervisor")
    p.add_argument("--out", help="folder of the results and logs (default: a new temporary folder)")
    p.add_argument("--sizes", type=parse_sizes, help="GiB a pod holds in the swap part (default 1,8,32)")
    p.add_argument("--rounds", type=int, help="swap cycles per size (default 3)")
    p.add_argument("--quick", action="store_true", help="sizes 1,8 and 2 rounds (unless given)")
    p.add_argument("--infer-rounds", type=int, default=5, help="requests resident and swapped (default 5)")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle time before a resident request (default 3)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default {','.join(PARTS)})")
    p.add_argument("--budget-s", type=float, default=450,
                   help="the run's time: a swap that does not answer fails within it, and parts left then"
                        " are not run (default 450)")


def resolve(p, args):
    """Fills the defaults that depend on --quick; checks the bundle and --parts."""
    args.sizes = args.sizes or ([1.0, 8.0] if args.quick else [1.0, 8.0, 32.0])
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}; known: {','.join(PARTS)}")
    for name in ("libcuda_limiter.so", "hypervisor"):
        if not (Path(args.bundle) / name).is_file():
            p.error(f"no {Path(args.bundle) / name}")
    args.out = args.out or tempfile.mkdtemp(prefix="swap-bench-")
    Path(args.out).mkdir(parents=True, exist_ok=True)


def main(p, args):
    resolve(p, args)
    started = time.monotonic()
    b = Bench(args)
    results = {}
    print(f"swap bench: sizes {[f'{s:g}' for s in args.sizes]} GiB, {args.rounds} rounds; host memory for"
          f" swapped pods {gib(b.host_limit)} GiB; out {args.out}", flush=True)
    try:
        bandwidth = {}
        if "bandwidth" in args.parts:
            bandwidth = results["bandwidth"] = guarded("bandwidth", part_bandwidth, b)
        if "swap" in args.parts:
            results["swap"] = guarded("swap", part_swap, b, bandwidth)
        if "infer" in args.parts:
            results["infer"] = guarded("infer", part_infer, b)
        if "overcommit" in args.parts:
            results["overcommit"] = guarded("overcommit", part_overcommit, b)
        if "move" in args.parts:
            results["move"] = guarded("move", part_move, b)
        print("no cost for pods never swapped: measured by `python3 -m scripts.bench launch-ab`", flush=True)
    finally:
        # Each part stops its pods and its daemon and removes the regions.
        b.remove_tables()
    took = time.monotonic() - started
    text = f"Swap bench ({took:.0f} s)\n\n{report(results, args.sizes)}"
    out = Path(args.out)
    (out / "swap-bench.md").write_text(text)
    (out / "swap-bench.json").write_text(json.dumps({"args": vars(args), "seconds": took, **results},
                                                    indent=1, default=str))
    print()
    print(text)
    print(f"raw numbers: {out / 'swap-bench.json'}; logs: {out}")
    return 0
