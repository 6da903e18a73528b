"""Co-run mode on a real GPU: a latency pod's inference step next to a batch
pod's long kernels, time-sliced and side by side as MPS clients, in one run.
Results: a Markdown table on stdout and in OUT/corun-bench.md, raw numbers in
OUT/corun-bench.json.

  python3 -m scripts.bench corun --bundle DIR [--out DIR] [--seconds S] [--period-us P]
          [--sizes N N] [--reserve PCT] [--mps-control PATH] [--rounds N]

The workers are the priority bench's (workers.py: the latency step, 64x2048
bf16 through four 2048^2 matmuls every P us; the batch pod, back-to-back NxN
bf16 matmuls, N=4096 ~0.2 ms, N=8192 ~1.7 ms on an H100). Runs, per batch size:
  batch alone (no MPS, no limiter: the baseline);
  latency + unlimited batch (no MPS, no limiter);
  latency + batch under the limiter's classes (time slicing, no MPS);
  co-run: the daemon (`hypervisor serve --corun-gpu 0`) runs and supervises
  the MPS control daemon and manages two pods on GPU 0 (a batch pod and a
  latency pod, 4 GiB quotas, from its config file); their workers are its
  MPS clients with the variables its provisioning gives (pipe folder, active
  thread percentage provisioned for the class beside the other class, client
  priority, pinned memory limit, CUDA_LIMITER_MPS=required) and the limiter
  under the daemon, which replaces the percentage by what the pod's limits
  give a client that starts now:
  - batch alone, co-run: only the batch pod configured (the whole GPU);
  - latency + batch, co-run: both configured before the workers start (the
    batch client keeps off the reserve); in ROUNDS rounds (3), each after a
    run of the latency pod alone (no MPS, no limiter: the baseline), and
    judged on the medians of the rounds;
  - latency + batch, co-run, batch first: the batch client starts alone
    (the whole GPU), then the latency pod is configured and its worker
    starts: the classes hold the batch client while the latency pod works.
Then, in co-run mode: the share of the SMs each client took, as the driver
reports it (cuCtxGetExecAffinity) alone and beside the latency pod; the
memory quota (4 GiB: 3 GiB taken, 2 GiB more refused), from inside and from
nvidia-smi; with the MPS daemon stopped, a client with
CUDA_LIMITER_MPS=required is refused CUDA (the driver would run it without
MPS, on every SM); and with a daemon whose MPS server fails to start (it
asks for more L2 set-aside than the card allows), a pod's client is refused
CUDA and the daemon reports the server's failure and reason.
Every run also reports the SM clock and the board's power draw (nvidia-smi,
sampled through the run) and the latency step's GPU time: a card at its
power limit runs every kernel at a lower clock, on reserved SMs too.
Targets (co-run, both configured first): latency p50 <= 1.2x and p99 <= 1.5x
alone, batch >= 0.85 of its solo throughput; a lone co-run batch pod >= 0.97
of solo.
"""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.gpu.e2e.harness import hv
from scripts.gpu.e2e.harness.parse import median as med
from scripts.gpu.e2e.harness.parse import percentile as pct
from scripts.gpu.e2e.harness.proc import SMI_APPS

from . import common
from . import priority as pb

QUOTA = 4 << 30
# The co-run pods the daemon manages: (pod id, token, class).
PODS = {"batch": ("corun-batch", "corun-batch-token", "batch"),
        "latency": ("corun-latency", "corun-latency-token", "latency")}
DAEMON_PODS = {pod for pod, _, _ in PODS.values()}
SIMULATE = ""  # the daemon's --simulate-gpus (the self tests' dry runs); "": the GPU
GPU = 0  # the GPU put in co-run mode and benched (--gpu); the others stay time-sliced


class CorunBench(pb.Bench):
    """The priority bench's runner; a class of `corun-latency` or `corun-batch`
    makes the worker an MPS client of the supervised daemon, as the daemon's
    pod of that class; `corun-latency-at-N`, the latency pod's MPS client on
    N percent of the SMs, without the limiter."""

    def __init__(self, args):
        super().__init__(args)
        self.daemon = None
        self.reserve = args.reserve
        # Each daemon pod's priority counters after its last run.
        self.seen = {}

    def env(self, cls, region, extra):
        if not (cls or "").startswith("corun-"):
            return super().env(cls, region, extra)
        env = common.clean_env("CUDA_MPS_")
        # As a process on the node is started: the limiter sets
        # CUDA_VISIBLE_DEVICES to the GPU the MPS server serves (named by
        # the daemon beside the pipe folder), so that NVML-counting PyTorch
        # and the MPS client's CUDA agree on a node of several GPUs.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        latency = cls.startswith("corun-latency")
        pod, token, _ = PODS["latency" if latency else "batch"]
        env.update(
            LD_PRELOAD=self.lib, CUDA_LIMITER_POD=pod, CUDA_LIMITER_TOKEN=token,
            CUDA_LIMITER_HYPERVISOR=self.daemon.url, CUDA_LIMITER_LOG="warn",
            CUDA_LIMITER_MPS="required", **self.daemon.tables,
            # As provisioning gives a co-run GPU's client (provision/mps.rs).
            CUDA_MPS_PIPE_DIRECTORY=str(self.daemon.pipe),
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(self.reserve if latency else 100 - self.reserve),
            CUDA_MPS_CLIENT_PRIORITY="0" if latency else "1",
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={QUOTA >> 20}M",
        )
        if cls.startswith("corun-latency-at-"):
            env.update(LD_PRELOAD="", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=cls.rsplit("-", 1)[1])
        env.update(extra)
        return env, pod

    def counters(self, region, pod):
        if pod not in DAEMON_PODS:
            return super().counters(region, pod)
        # The daemon's table: this run's share of the pod's counters.
        now = pb.priority_counters(self.daemon.tables["GPUSHARE_PRIORITY_REGION"], pod) or {}
        before = self.seen.get(pod, {})
        self.seen[pod] = now
        return {k: v - before.get(k, 0) if k != "queue_max_ns" else v for k, v in now.items()}

    def forget(self, pod):
        # The daemon's pods: their objects stay while it runs.
        if pod not in DAEMON_PODS:
            super().forget(pod)


class CorunDaemon(hv.Daemon):
    """The harness's daemon: `hypervisor serve` in local mode with GPU 0 in
    co-run mode, managing the pods of PODS named in its config file, ready
    once its MPS control daemon is up (/readyz); `env`, more variables for it
    (and so for the MPS control daemon it starts). Its log: self.log."""

    def __init__(self, bundle, work, reserve, control, env=None):
        self.work = work
        self.reserve = reserve
        tag = f"corun-bench-{os.getpid()}"
        self.tables = {"GPUSHARE_NODE_REGION": f"gpushare-node-{tag}",
                       "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{tag}"}
        self.pods = []
        # The MPS control daemon quits its servers on the daemon's SIGTERM: 20 s for it.
        super().__init__(common.settings("", work, Path(bundle) / "hypervisor", SIMULATE), "corun",
                         work / "hypervisor.toml",
                         serve_args=["--corun-gpu", str(GPU), "--corun-dir", str(work / "mps"),
                                     "--corun-latency-reserve", str(reserve), "--mps-control", str(control)],
                         env={**self.tables, **(env or {})}, ready="/readyz", ready_s=60, stop_s=20)
        self.write_config([])

    def start(self, port=None):
        super().start(port)
        gpu = self.status_json()["corun"][0]
        self.uuid = gpu["gpu"]
        self.pipe = self.work / "mps" / self.uuid / "pipe"
        # The MPS control daemon's log and its servers', as the daemon keeps it.
        self.mps_log = self.work / "mps" / self.uuid / "log" / "control.log"

    def write_config(self, roles):
        # The port it listens on once started (--listen): a reload then keeps it.
        text = f'listen = "127.0.0.1:{self.port or 0}"\n'
        for role in roles:
            pod, token, cls = PODS[role]
            text += (f'[[pods]]\nid = "{pod}"\ntoken = "{token}"\n'
                     f'[[pods.gpus]]\nindex = {GPU}\nmemory = "{QUOTA >> 30}g"\nclass = "{cls}"\n')
        # In one rename: the daemon also reloads when it sees the file change,
        # and a half-written file has no pods.
        part = self.config.with_suffix(".part")
        part.write_text(text)
        os.replace(part, self.config)
        self.pods = [PODS[r][0] for r in roles]

    def set_pods(self, roles):
        """Configures the pods of `roles` (SIGHUP) and waits until the batch
        pod's limits give its next client the share that goes with them."""
        self.write_config(roles)
        self.reload()
        want = 100 - self.reserve if "latency" in roles else 100
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pods = {p["id"]: p for p in self.status_json().get("pods", [])}
            listed = sorted(pods)
            # What the batch pod's limits give its next client, as the
            # daemon reports it.
            batch = pods.get(PODS["batch"][0], {})
            share = (batch.get("gpus") or [{}])[0].get("sm_percent")
            if listed == sorted(self.pods) and share == want:
                return
            time.sleep(0.05)
        raise RuntimeError(f"pods {roles} not in force: status lists {listed},"
                           f" batch share {share}, want {want}")

    def stop(self):
        super().stop()
        common.remove_pod_regions(*DAEMON_PODS)
        for name in self.tables.values():
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def mps_processes():
    out = subprocess.run(["pgrep", "-a", "nvidia-cuda-mps"], capture_output=True, text=True).stdout
    # A zombie left by a daemon that quit is no daemon.
    return [l for l in out.splitlines() if l.strip() and not l.rstrip().endswith("<defunct>")]


def say_mps_left():
    """Prints the MPS processes still running, if any (a bench's daemons
    quit theirs)."""
    left = mps_processes()
    if left:
        print(f"MPS processes left: {left}", flush=True)


@contextlib.contextmanager
def daemon_for(args, bundle, control, reserve, label, env=None):
    """A started CorunDaemon (`env` for it) in a folder of its own, both pods
    configured; when the block ends it is stopped, its log is copied to OUT
    as hypervisor-LABEL.log and its folder removed."""
    work = Path(tempfile.mkdtemp(prefix=f"corun-{label}-"))
    daemon = CorunDaemon(bundle, work, reserve, control, env=env)
    try:
        daemon.start()
        daemon.set_pods(["batch", "latency"])
        yield daemon
    finally:
        daemon.stop()
        keep_log(args, daemon, f"hypervisor-{label}.log")
        shutil.rmtree(work, ignore_errors=True)


def keep_log(args, daemon, name):
    """The daemon's log, copied to OUT/name (when it got as far as writing one)."""
    if daemon.log.exists():
        shutil.copy(daemon.log, Path(args.out) / name)


MEMORY_PROBE = r"""
import os, subprocess, torch
GIB = 1 << 30
free, total = torch.cuda.mem_get_info()
a = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    more = "ok"
except torch.OutOfMemoryError:
    more = "oom"
torch.cuda.synchronize()
smi = subprocess.run(%r, capture_output=True, text=True).stdout
mine = [l for l in smi.splitlines() if l.split(",")[0].strip() == str(os.getpid())]
print(f"total={total} first=ok more={more} smi_own={mine} smi_all={smi.strip().splitlines()}", flush=True)
""" % SMI_APPS

INIT_PROBE = r"""
import torch
try:
    torch.cuda.init()
    print(f"cuda=ok devices={torch.cuda.device_count()}", flush=True)
except Exception as e:
    print(f"cuda=refused {type(e).__name__}: {str(e)[:200]}", flush=True)
"""

SM_PROBE = r"""
import ctypes, torch
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
cuda = ctypes.CDLL("libcuda.so.1")
class Affinity(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]
affinity = Affinity()
rc = cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), 0)  # CU_EXEC_AFFINITY_TYPE_SM_COUNT
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
percent = libc.getenv(b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"rc={rc} sm_count={affinity.sm_count} of {sms}"
      f" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent.decode() if percent else None}", flush=True)
"""


def probe(bench, script, cls="corun-batch"):
    env, _ = bench.env(cls, "unused", {})
    return run_probe(script, env)


def run_probe(script, env):
    """A probe's stdout and the end of its stderr, on one line."""
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    return (out.stdout.strip() + " " + out.stderr.strip()[-300:]).strip()


def common_args(p, name, seconds):
    """The options every co-run bench takes; `name` names its output."""
    p.add_argument("--bundle", required=True, help="the bundle folder: libcuda_limiter.so, hypervisor")
    p.add_argument("--out", default=os.environ.get("OUT") or f"{name}-out")
    p.add_argument("--seconds", type=float, default=seconds)
    p.add_argument("--period-us", type=float, default=2000)
    p.add_argument("--sizes", type=int, nargs=2, default=[4096, 8192], metavar=("SHORT", "LONG"))
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")


def prepare(args):
    """The bundle's folder and the control program's path; sets args.lib.
    Refuses to start beside an MPS daemon that already runs."""
    bundle = Path(args.bundle).resolve()
    args.lib = str(bundle / "libcuda_limiter.so")
    control = shutil.which(args.mps_control) or args.mps_control
    running = mps_processes()
    if running:
        raise SystemExit(f"an MPS daemon already runs: {running}")
    return bundle, control


def publish(args, name, text, data):
    """Writes OUT/name.md (`text`) and OUT/name.json (`data` and the
    arguments), and prints `text`."""
    out = Path(args.out)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"args": vars(args), **data}, indent=1, default=str))
    print()
    print(text)


def add_arguments(p):
    common_args(p, "corun-bench", 6.0)
    p.add_argument("--reserve", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the latency pod alone and of both pods co-run, alternated")
    p.add_argument("--gpu", type=int, default=0,
                   help="the GPU put in co-run mode and benched (index); every run uses it alone")


def use_gpu(index):
    """Runs the bench on GPU `index`: the co-run daemon's GPU, and, by its
    UUID in CUDA_VISIBLE_DEVICES, the GPU of every run without MPS."""
    global GPU
    GPU = index
    if index == 0:
        return
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", str(index)],
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid


def main(p, args):
    bundle, control = prepare(args)
    use_gpu(args.gpu)
    bench = CorunBench(args)
    t_begin = time.monotonic()
    short, long_ = args.sizes
    print(f"co-run bench: {args.seconds:.0f} s per run, a request every {args.period_us:.0f} us, batch"
          f" matmuls {short}^2 and {long_}^2, {args.reserve}% of the SMs kept for latency pods", flush=True)
    runs = {}
    for size in (short, long_):
        runs[f"batch alone {size}"] = bench.run(f"batch alone {size}", batch="", size=size)
        runs[f"unlimited {size}"] = bench.run(f"latency + unlimited batch {size}", latency="", batch="",
                                              size=size)
        runs[f"classes {size}"] = bench.run(f"latency + batch {size}, classes", latency="latency",
                                            batch="batch", size=size)
    work = Path(tempfile.mkdtemp(prefix="corun-bench-"))
    daemon = CorunDaemon(bundle, work, args.reserve, control)
    bench.daemon = daemon
    checks = {}
    try:
        daemon.start()
        # The bars' runs, in rounds: the latency pod alone (no MPS, no
        # limiter; the daemon's MPS serves no client meanwhile), then both
        # pods co-run, configured before their clients start.
        daemon.set_pods(["batch", "latency"])
        for r in range(args.rounds):
            runs[f"latency alone #{r}"] = bench.run(f"latency alone, round {r + 1}", latency="")
            for size in (short, long_):
                runs[f"corun {size} #{r}"] = bench.run(f"latency + batch {size}, co-run, round {r + 1}",
                                                       latency="corun-latency", batch="corun-batch", size=size)
        daemon.set_pods(["batch"])
        checks["SMs, batch client alone"] = probe(bench, SM_PROBE)
        for size in (short, long_):
            daemon.set_pods(["batch"])
            runs[f"corun batch alone {size}"] = bench.run(f"batch alone {size}, co-run",
                                                          batch="corun-batch", size=size)
            runs[f"corun late {size}"] = bench.run(
                f"latency + batch {size}, co-run, batch first", latency="corun-latency",
                batch="corun-batch", size=size, between=lambda: daemon.set_pods(["batch", "latency"]))
        daemon.set_pods(["batch", "latency"])
        checks["SMs, batch client beside the latency pod"] = probe(bench, SM_PROBE)
        checks["SMs, latency client"] = probe(bench, SM_PROBE, "corun-latency")
        checks["memory quota under MPS"] = probe(bench, MEMORY_PROBE)
        checks["MPS processes while up"] = mps_processes()
        checks["daemon status"] = daemon.status_json().get("corun")
        mps_log = daemon.mps_log.read_text().splitlines()
        checks["MPS log"] = (f"{len(mps_log)} lines, {sum('NEW CLIENT' in l for l in mps_log)} client"
                             f" connections, {sum('Failed' in l for l in mps_log)} 'Failed' lines")
        pipe = daemon.pipe
    finally:
        daemon.stop()
        # The daemon's folders (config, log, MPS pipes): the log is copied out.
        keep_log(args, daemon, "hypervisor.log")
    checks["MPS processes after stop"] = mps_processes()
    # The daemon stopped: a client of its (now dead) pipe folder, no
    # hypervisor, a local quota.
    env, _ = bench.env("corun-batch", "unused", {})
    for key in ("CUDA_LIMITER_HYPERVISOR", "CUDA_LIMITER_TOKEN", "CUDA_LIMITER_POD"):
        env.pop(key, None)
    env.update(CUDA_LIMITER_POD=f"corun-bench-stopped-{os.getpid()}", CUDA_DEVICE_MEMORY_LIMIT=str(QUOTA),
               CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    checks["required, MPS stopped"] = run_probe(INIT_PROBE, env)
    common.remove_pod_regions(env["CUDA_LIMITER_POD"])
    checks.update(server_refusing(args, bench, bundle, control))
    shutil.rmtree(work, ignore_errors=True)
    report(args, runs, checks, time.monotonic() - t_begin)


def server_refusing(args, bench, bundle, control):
    """A real MPS server that fails to start, its control daemon started
    asking more of the L2 cache set aside than the card allows (75%: the
    server says "Failed to start : invalid argument" on the H100 and the
    H200): a client of a pod is refused CUDA, and the daemon reports the
    failure with the server's reason (status, log). The checks, by name."""
    env = {"CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT": "75"}
    with daemon_for(args, bundle, control, args.reserve, "server-fails", env=env) as failing:
        bench.daemon = failing
        refused = probe(bench, INIT_PROBE)
        time.sleep(0.5)  # the supervisor reads the MPS log every 50 ms
        gpu = failing.status_json()["corun"][0]
        said = [l.strip() for l in failing.log.read_text().splitlines() if "exited with status" in l]
        mps_log = failing.mps_log
        failed_lines = sum("Failed to start" in l for l in mps_log.read_text().splitlines())
    return {
        "server refusing: client": refused,
        "server refusing: daemon status": {k: gpu.get(k) for k in
                                           ("state", "restarts", "server_failures", "last_server_failure")},
        "server refusing: daemon log": f"{len(said)} lines, first: {said[0][-240:] if said else None}",
        "server refusing: MPS log": f"{mps_log.relative_to(failing.work)}: {failed_lines} 'Failed to start' lines",
    }


def report(args, runs, checks, took):
    def percentiles(key):
        lat = runs.get(key, {}).get("latency")
        return (pct(lat["steps_us"], .5), pct(lat["steps_us"], .99)) if lat else None

    def on_gpu(key):
        """The latency step's GPU time (p50, events around it) and the SM
        clock and power through the run: whether its kernels ran slower."""
        run = runs.get(key, {})
        lat, gpu = run.get("latency"), run.get("gpu")
        parts = [f"step on the GPU p50 {pct(lat['gpu_us'], .5):.0f} us"] if lat else []
        if gpu:
            parts.append(pb.clocks(run))
        return ", ".join(parts)

    rounds = range(args.rounds)
    alone = [p for p in (percentiles(f"latency alone #{r}") for r in rounds) if p]
    if not alone:
        print(f"no baseline: {[runs.get(f'latency alone #{r}') for r in rounds]}")
        return
    # The baseline: the median of the rounds' percentiles.
    p50_alone, p99_alone = med(p[0] for p in alone), med(p[1] for p in alone)
    raw = [f"latency alone, p50/p99 us by round: {[f'{a:.0f}/{b:.0f}' for a, b in alone]}",
           f"latency alone by round: {[on_gpu(f'latency alone #{r}') for r in rounds]}"]
    rows = [(f"latency alone (no MPS, no limiter; median of {len(alone)})", f"{p50_alone:.0f}",
             f"{p99_alone:.0f}", "", "", "")]
    verdicts = []
    for size in args.sizes:
        solo = runs[f"batch alone {size}"].get("batch")
        if solo is None:
            rows.append((f"batch alone ({size}^2)", "failed", "", "", "", ""))
            continue
        # Both pods co-run: the medians of the rounds.
        corun = [(percentiles(f"corun {size} #{r}"), runs[f"corun {size} #{r}"]["batch"]["per_s"],
                  (runs[f"corun {size} #{r}"]["batch"].get("counters") or {}).get("held_ns"))
                 for r in rounds if "batch" in runs.get(f"corun {size} #{r}", {})
                 and percentiles(f"corun {size} #{r}")]
        if corun:
            p50, p99 = med(c[0][0] for c in corun), med(c[0][1] for c in corun)
            ratio = med(c[1] for c in corun) / solo["per_s"]
            ok = p50 <= 1.2 * p50_alone and p99 <= 1.5 * p99_alone and ratio >= 0.85
            verdict = f"{'PASS' if ok else 'FAIL'} (p50<=1.2x, p99<=1.5x, batch>=0.85)"
            verdicts.append(f"+ batch, co-run (MPS) {size}^2: {verdict}")
            solo_per_s = solo["per_s"]
            by_round = [f"{c[0][0]:.0f}/{c[0][1]:.0f}, {c[1] / solo_per_s:.3f}, held {c[2]}" for c in corun]
            raw.append(f"co-run {size}^2, p50/p99 us, batch ratio, batch held ns by round: {by_round}")
            raw.append(f"co-run {size}^2 by round: {[on_gpu(f'corun {size} #{r}') for r in rounds]}")
            raw.append(f"batch alone {size}^2: {on_gpu(f'batch alone {size}')}")
            corun_row = (f"+ batch, co-run (MPS) ({solo['kernel_ms']:.2f} ms kernels; median of {len(corun)})",
                         f"{p50:.0f} ({p50 / p50_alone:.2f}x)", f"{p99:.0f} ({p99 / p99_alone:.2f}x)",
                         f"{ratio * solo['per_s']:.1f} / {solo['per_s']:.1f}", f"{ratio:.3f}", verdict)
        else:
            corun_row = (f"+ batch, co-run (MPS) ({size}^2)", "failed", "", "", "", "")
        for key, label in ((f"unlimited {size}", "+ unlimited batch"), (f"classes {size}", "+ batch, classes"),
                           ("corun", None),
                           (f"corun late {size}", "+ batch, co-run, batch started first"),
                           (f"corun batch alone {size}", "batch alone, co-run (MPS)")):
            if label is None:
                rows.append(corun_row)
                continue
            run = runs[key]
            if "error" in run:
                rows.append((f"{label} ({size}^2)", "failed", "", "", "", str(run.get("error", ""))[-200:]))
                continue
            bat = run["batch"]
            ratio = bat["per_s"] / solo["per_s"]
            lat = run.get("latency")
            c50 = c99 = ""
            verdict = ""
            if lat:
                p50, p99 = pct(lat["steps_us"], .5), pct(lat["steps_us"], .99)
                c50, c99 = f"{p50:.0f} ({p50 / p50_alone:.2f}x)", f"{p99:.0f} ({p99 / p99_alone:.2f}x)"
            elif key.startswith("corun"):
                verdict = f"{'PASS' if ratio >= 0.97 else 'FAIL'} (lone batch >= 0.97)"
            held = (bat.get("counters") or {}).get("held_ns")
            if held is not None and key.startswith("corun"):
                verdict = (verdict + f" batch held {held / 1e6:.0f} ms").strip()
            if verdict:
                verdicts.append(f"{label} {size}^2: {verdict}")
            rows.append((f"{label} ({solo['kernel_ms']:.2f} ms kernels)", c50, c99,
                         f"{bat['per_s']:.1f} / {solo['per_s']:.1f}", f"{ratio:.3f}", verdict))
    head = ("| run | latency p50 us (vs alone) | p99 us (vs alone) | batch matmuls/s (run / solo) | ratio |"
            " verdict |\n|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Co-run bench, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run,"
            f" {args.reserve}% of the SMs kept ({took:.0f} s in all)\n\n{table}\n"
            + "".join(f"- {v}\n" for v in verdicts)
            + "".join(f"- {v}\n" for v in raw)
            + "".join(f"- {k}: {v}\n" for k, v in checks.items()))
    publish(args, "corun-bench", text, {"runs": runs, "checks": checks})
