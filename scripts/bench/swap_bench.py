"""The swap bench's harness: its daemon (one per part) and the config it
reads, the pods (swap_pod.py programs under the limiter) and their replies,
the admin API's swaps, and GPU 0's figures as nvidia-smi gives them."""
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from scripts.gpu.e2e.harness import hv
from scripts.gpu.e2e.harness.parse import compute_apps
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
IDLE_AFTER_MS = 2000
SIMULATE = ""  # the daemon's --simulate-gpus (selftests without a GPU); "": the GPU


class BenchError(RuntimeError):
    pass


def gib(nbytes):
    """Bytes as GiB, two decimals at most: "35.75", "8"."""
    return f"{nbytes / GIB:.2f}".rstrip("0").rstrip(".")


def swap_section(idle_after_ms, host_limit, overcommit=True, extra=None):
    """The [swap] table; `extra`: more keys, {key: its value as TOML text}."""
    more = "".join(f"{key} = {value}\n" for key, value in (extra or {}).items())
    return (f"[swap]\novercommit = {'true' if overcommit else 'false'}\nidle_after_ms = {idle_after_ms}\n"
            f"latency_pods = \"last\"\nhost_limit = {host_limit}\nroom_wait_ms = 120000\n{more}\n")


def config_text(quotas, idle_after_ms, host_limit, overcommit=True, extra=None):
    """The daemon's config: the [swap] table and one pod on GPU 0 per
    (id, quota in bytes) of `quotas` (listen: --listen decides)."""
    return ('listen = "127.0.0.1:0"\n' f'admin_token = "{ADMIN}"\n\n'
            + swap_section(idle_after_ms, host_limit, overcommit, extra)
            + "".join(hv.pod_section(pod, f"memory = {quota}") for pod, quota in quotas.items()))


def host_available():
    """MemAvailable of /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def nvidia_smi(cmd):
    """What nvidia-smi command `cmd` printed."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=common.clean_env()).stdout


def gpu_memory():
    """GPU 0's (total, used, free) bytes, from nvidia-smi."""
    text = nvidia_smi(SMI_MEM)
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            return tuple(int(p) * MIB for p in parts)
    raise BenchError(f"nvidia-smi gave no memory line: {text.strip()[:200]!r}")


def smi_mib(pid):
    """(the process's MiB as nvidia-smi lists it, None when it is not listed;
    GPU 0's used MiB)."""
    text = nvidia_smi(SMI_APPS)
    return compute_apps(text).get(pid), gpu_memory()[1] // MIB


def gpu_uuids():
    """The GPUs' UUIDs by NVML index, from nvidia-smi."""
    text = nvidia_smi(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"])
    rows = [[f.strip() for f in line.split(",")] for line in text.splitlines()]
    return [uuid for _, uuid in sorted((int(r[0]), r[1]) for r in rows if len(r) == 2 and r[0].isdigit())]


def smi_where(pid):
    """[(GPU UUID, MiB)] of the process as nvidia-smi lists it."""
    text = nvidia_smi(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                       "--format=csv,noheader,nounits"])
    rows = [[f.strip() for f in line.split(",")] for line in text.splitlines()]
    return [(r[1], int(r[2])) for r in rows if len(r) == 3 and r[0] == str(pid) and r[2].isdigit()]


class Pod:
    """A swap_pod.py program: commands on its stdin, its REPLY lines read
    as they come (a thread; the bench times requests to the millisecond),
    its stderr and other output in `log`. `route`, when given, is offered
    each answer first with the time it was read, and keeps those it
    returns True for (answers to requests in flight); the others are the
    replies `reply` and `ask` wait for."""

    def __init__(self, pod, argv, env, log, program=None, route=None):
        self.pod, self.log = pod, Path(log)
        self.chatter = []
        self.route = route
        with open(self.log, "w") as f:
            f.write(f"# {pod}: {' '.join(argv)}\n")
            f.flush()
            self.p = subprocess.Popen([sys.executable, str(program or POD_PROGRAM), *argv], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=f, env=env, text=True, bufsize=1,
                                      start_new_session=True)
        self.replies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("REPLY "):
                at = time.monotonic()
                try:
                    answer = json.loads(line[6:])
                except ValueError:
                    answer = None
                if answer is not None:
                    if not (self.route and self.route(answer, at)):
                        self.replies.put(answer)
                    continue
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

    def send(self, command):
        """Writes one command line to the program, not waiting for its answer."""
        try:
            self.p.stdin.write(command + "\n")
            self.p.stdin.flush()
        except OSError as e:
            raise BenchError(f"{self.pod}: cannot send {command!r}: {e}")

    def ask(self, command, timeout):
        """(its answer, seconds from the command sent to the answer read)."""
        start = time.monotonic()
        self.send(command)
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
    def serving(self, part, quotas, idle_after_ms=IDLE_AFTER_MS, host_limit=None, overcommit=True, extra=None):
        """A daemon for `part` with the pods of `quotas` (id: bytes), its
        host_limit the run's unless given, `extra` more [swap] keys; at the
        end its pods and it are stopped, their regions removed. Its log:
        OUT/PART-hypervisor.log."""
        config = self.out / f"{part}-hypervisor.toml"
        config.write_text(config_text(quotas, idle_after_ms, host_limit or self.host_limit, overcommit, extra))
        common.remove_pod_regions(*quotas)
        self.stuck = None
        self.daemon = hv.Daemon(common.settings("", self.out, self.bundle / "hypervisor", simulate=SIMULATE), part,
                                config, env=self.tables, stop_s=10)
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

    def start_pod(self, pod, *argv, program=None, env=None, route=None):
        """The pod's program (swap_pod.py unless `program`) under the
        limiter, with `env` over the pods' own; `route`: as Pod's."""
        environ = common.clean_env("PYTORCH_CUDA_ALLOC_CONF")
        environ.update(LD_PRELOAD=self.lib, CUDA_LIMITER_POD=pod, CUDA_LIMITER_TOKEN=hv.hv_token(pod),
                       CUDA_LIMITER_HYPERVISOR=self.daemon.url, CUDA_LIMITER_LOG=self.args.limiter_log,
                       PYTHONUNBUFFERED="1",
                       **self.tables)
        environ.update(POD_ENV)
        environ.update(env or {})
        if self.args.path == "fast":
            environ["CUDA_LIMITER_FAST_SWAP"] = "1"
        p = Pod(pod, [str(a) for a in argv], environ, self.out / f"pod-{pod}.log", program, route)
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
