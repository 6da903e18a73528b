"""Dense packing on a real GPU: N pods on GPU 0, each one process under the
limiter and registered with the daemon, time-sliced and co-run (MPS), beside
the same N processes without the limiter and one process alone, in one run.
Results: a Markdown table on stdout and in OUT/packing-bench.md, every pod's
throughput of every run in OUT/packing-bench.json, the workers' and the
daemons' logs in OUT/logs.

  python3 -m scripts.bench packing --bundle DIR [--out DIR] [--counts 1,4,8,16,32] [--seconds 5]
          [--modes timeslice,corun] [--workloads kernels,infer] [--budget-s 420] [--mps-control PATH]

About 7 minutes with the defaults on an H100: 32 runs, each a 5 s window
and its start (3 to 20 s: the most for 32 PyTorch processes under MPS); the
estimate is printed at the start and each run's wall time in the JSON.
--budget-s bounds the whole run: a run whose estimate no longer fits is
skipped and its row says so. The runs go the largest N first and the
second lone runs last, so a short budget skips those and the fewest pods.
OUT: --out, else $OUT, else ./packing-bench-out.

Workloads (one process a pod, each a program of its own):
  kernels  packing_kernels.cu (built with nvcc; NVCC overrides it):
           fixed-work kernels of ~0.45 ms back to back, dependent FMAs on
           every SM at full occupancy (one wave; the iterations calibrated
           once, alone, and the same grid for every run, so a kernel is the
           same work wherever it runs) -> kernels/s
  infer    packing_infer.py: a small inference step in PyTorch, 1,024
           tokens through a 4-layer MLP (4096 wide, bf16, GELU) -> steps/s
Both keep at most 4 kernels, or two steps, queued behind the host, and wait
for the oldest on its event, which sleeps the host thread (32 processes on
16 CPUs): a process alone keeps the GPU busy, and a pod's throughput over
the lone process's is its share of the GPU. Each process warms up (CUDA,
the limiter's calibration and first measurements), prints ready=1 and reads
the common start time from stdin: the N processes start their window
together, once every one is up and registered with the daemon, and count
what completed inside it, read off the events' GPU timestamps (against an
event whose completion each saw at a known time before the window), so the
work still queued as the window ends is left out.

Runs, per workload:
  solo         one process alone, no limiter: 100% (first, and again at the
               end; the baseline is their mean, the drift is printed)
  no limiter   N processes, no limiter, no daemon: the driver's time slicing
  timeslice    N pods under the daemon (`hypervisor serve`, a [[pods]]
               section and token for each in its config), GPU 0
               time-sliced; each pod a fixed cap of floor(90/N)% (the
               config takes whole percents: caps that sum to at most 90%)
  corun        the daemon with `--corun-gpu 0` (it runs GPU 0's MPS control
               daemon), the N pods elastic with weight 1; their processes
               are its MPS clients with the variables its provisioning
               gives (pipe folder, active thread percentage, client
               priority, CUDA_LIMITER_MPS=required), and the limiter keeps
               the time shares between them
  timeslice-elastic, corun-fixed (with --modes): the other policy of each
               (a fixed share on a co-run GPU is a share of the SMs)
  corun-unmetered (with --modes): co-run pods of policy none, memory
               limits only: what MPS alone gives, with no time shares kept
A new daemon for every run: its CPU and memory are that run's alone.

Per run: the aggregate throughput (the pods' sum over the lone process's),
each pod's share of the GPU's time against its target (its cap, else its
weight's fair share of the GPU, 100/N%) with the largest deviation and the
spread (a pod's share: its throughput over the lone process's, times the
GPU time the lone process keeps busy: its rate times a unit's GPU time
alone, the calibrated kernel or the step's CUDA-event time in its warm-up;
so a workload that leaves the GPU idle between steps is not counted as
holding it); the GPU time the limiter charged each pod over the window,
% of the window, from the daemon's status (charged_ns at its start and
end): against the pod's share, how far its prices are from what its work
took; and of the daemon over the window, from its /metrics scraped
as the window starts and as it ends: the admission latency histogram's p50
and p99 (interpolated in its buckets as Prometheus does; bounds 50 us to
1 s), requests and timeouts; its CPU (utime + stime of /proc/PID/stat, % of
one core) and its RSS at the end (VmRSS, MiB). An admission is a launch of
a pod the daemon does not count as wanting the GPU yet that found its
bucket empty: the daemon answers once the pod has budget again, or after
50 ms, so its latency holds that wait. The daemons log at warn, their
default. Also the SM clock and board power through the window (nvidia-smi).
Targets (PASS/FAIL columns): corun at N=16, aggregate >= 97% of one
process; where the targets sum to at most 90% (the fixed caps), every pod
within 1 pp of its cap; under the daemon at N=32, its CPU <= 5% of a core
and admission p99 <= 2 ms.
Refuses to start beside a running MPS daemon. After every run each
worker's process group is killed, the daemon stopped (it quits its MPS
control daemon; one still up then gets a quit through its pipe, and the
daemon's process group is killed), and the pods' /dev/shm regions and the
run's node tables removed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu.e2e.harness import hv, proc
from scripts.gpu.e2e.harness.parse import fields

from . import common, corun
from .priority import clock_sampler, gpu_window

FILL_PCT = 90  # fixed caps sum to at most this
KERNEL_US = 450.0  # the kernels workload's kernel, alone
START_S = 0.5  # from the last worker ready and registered to the common start
READY_S = 120.0  # the longest a run waits for its workers' ready=1
REGISTER_S = 20.0  # ... and for their registration with the daemon
DRAIN_S = 60.0  # the longest a worker may take past its window
MAX_PODS = 48  # MPS clients of one GPU (Volta and later)
# The targets.
AGGREGATE_N, AGGREGATE_PCT = 16, 97.0
SHARE_PP = 1.0
DAEMON_N, DAEMON_CPU_PCT, ADMISSION_P99_MS = 32, 5.0, 2.0

WORKLOADS = {"kernels": "kernels/s", "infer": "steps/s"}
SIMULATE = ""  # the daemon's --simulate-gpus (dry runs without a GPU); "": the GPU


@dataclass(frozen=True)
class Mode:
    """How a run's pods run: under the daemon or not, co-run or time-sliced,
    and the policy of their shares (fixed: caps of floor(90/N)%; elastic:
    weight 1 each)."""

    name: str
    daemon: bool
    corun: bool
    policy: str | None


MODES = {
    "timeslice": Mode("timeslice", True, False, "fixed"),
    "corun": Mode("corun", True, True, "elastic"),
    "timeslice-elastic": Mode("timeslice-elastic", True, False, "elastic"),
    "corun-fixed": Mode("corun-fixed", True, True, "fixed"),
    "corun-unmetered": Mode("corun-unmetered", True, True, "none"),
}
SOLO = Mode("solo", False, False, None)
UNLIMITED = Mode("no limiter", False, False, None)


@dataclass(frozen=True)
class Spec:
    """One run: `n` processes of `workload` in `mode`; `label` names it."""

    workload: str
    mode: Mode
    n: int
    label: str


def cap_percent(n: int) -> int:
    """A pod's fixed cap with n pods: whole percents summing to at most 90."""
    return max(1, FILL_PCT // n)


def targets(mode: Mode, n: int, busy: float = 1.0) -> list[float]:
    """Each pod's target share of the GPU's time, percent: its cap, else
    100/n; at most what the workload keeps busy alone (`busy`, a fraction)."""
    share = float(cap_percent(n)) if mode.policy == "fixed" else 100.0 / n
    return [min(share, busy * 100)] * n


def plan(workloads, counts, modes) -> list[Spec]:
    """The runs in the order they run: per workload the lone process, then
    for each N, the largest first, the unlimited processes (N > 1) and each
    mode; last, each workload's lone process again. A budget that runs
    short skips the end: the drift check and the fewest pods."""
    runs = []
    for workload in workloads:
        runs.append(Spec(workload, SOLO, 1, "solo"))
        for n in sorted(set(counts), reverse=True):
            if n > 1:
                runs.append(Spec(workload, UNLIMITED, n, f"no limiter N={n}"))
            for mode in modes:
                runs.append(Spec(workload, mode, n, f"{mode.name} N={n}"))
    runs += [Spec(workload, SOLO, 1, "solo again") for workload in workloads]
    return runs


def table_order(specs, workloads, modes) -> list[int]:
    """The indices of `specs` in the table's order: by workload, then N
    (the lone runs first and last), then the unlimited run and the modes."""
    rank = {UNLIMITED.name: 0, **{m.name: i + 1 for i, m in enumerate(modes)}}

    def key(i):
        s = specs[i]
        n = (-1 if s.label == "solo" else math.inf) if s.mode is SOLO else s.n
        return workloads.index(s.workload), n, rank.get(s.mode.name, 0)

    return sorted(range(len(specs)), key=key)


def estimate_s(spec: Spec, seconds: float) -> float:
    """A run's expected wall time: its window, its workers' start (PyTorch's
    import and CUDA's start, N processes on 16 CPUs), its daemon's start and
    stop (co-run: the MPS control daemon's too), the workers' exits."""
    start = {"kernels": 1.5 + 0.08 * spec.n, "infer": 5.0 + 0.3 * spec.n}[spec.workload]
    daemon = (3.0 if spec.mode.corun else 1.0) if spec.mode.daemon else 0.0
    return seconds + START_S + start + daemon + 1.5


# ---------------------------------------------------------------- statistics

_BUCKET = re.compile(r'^gpushare_admission_latency_seconds_bucket\{le="([^"]+)"\}\s+(\S+)\s*$')
_SCALAR = re.compile(r"^(gpushare_admission_latency_seconds_(?:sum|count)|gpushare_admission_timeouts_total)"
                     r"\s+(\S+)\s*$")


def parse_admission(text: str) -> dict | None:
    """The admission histogram of a /metrics text: {"buckets": [(upper
    bound s, cumulative count)] by bound, "sum", "count", "timeouts"}; None
    without its buckets."""
    buckets, scalars = [], {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m:
            bound = math.inf if m.group(1) == "+Inf" else float(m.group(1))
            buckets.append((bound, int(float(m.group(2)))))
            continue
        m = _SCALAR.match(line)
        if m:
            scalars[m.group(1)] = float(m.group(2))
    if not buckets:
        return None
    return {"buckets": sorted(buckets), "sum": scalars.get("gpushare_admission_latency_seconds_sum", 0.0),
            "count": int(scalars.get("gpushare_admission_latency_seconds_count", buckets[-1][1])),
            "timeouts": int(scalars.get("gpushare_admission_timeouts_total", 0))}


def admission_delta(before: dict, after: dict) -> dict:
    """What the histogram gained between two scrapes of one daemon."""
    old = dict(before["buckets"])
    return {"buckets": [(bound, n - old.get(bound, 0)) for bound, n in after["buckets"]],
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"],
            "timeouts": after["timeouts"] - before["timeouts"]}


def quantile(buckets, q: float) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram [(bound, count)],
    linear inside its bucket from the bucket below's bound (0 for the first),
    as Prometheus's histogram_quantile; inf when it falls in +Inf; None
    when the histogram is empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    low, below = 0.0, 0
    for bound, cum in buckets:
        if cum >= rank and cum > below:
            if math.isinf(bound):
                return math.inf
            return low + (bound - low) * (rank - below) / (cum - below)
        low, below = bound, cum
    return math.inf


def admission_summary(delta: dict) -> dict:
    """Requests, timeouts, p50, p99 and mean of a window's admissions, in ms."""
    def ms(q):
        seconds = quantile(delta["buckets"], q)
        return None if seconds is None else seconds * 1e3

    return {"requests": delta["count"], "timeouts": delta["timeouts"], "p50_ms": ms(0.5), "p99_ms": ms(0.99),
            "mean_ms": delta["sum"] / delta["count"] * 1e3 if delta["count"] else None}


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time so far (/proc/PID/stat), seconds."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the command's name, which may hold spaces and parentheses:
    # field 3 (state) is index 0, utime (14) index 11, stime (15) index 12.
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float | None:
    """The process's resident memory (VmRSS), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shares(per_s: list[float], solo: float, busy: float, want: list[float]) -> dict:
    """Each pod's share of the GPU's time, percent (its throughput over the
    lone process's `solo`, times the fraction `busy` of the time the lone
    process keeps the GPU busy), how far they are from their targets
    `want`, and the aggregate: the pods' throughput over the lone
    process's, percent."""
    got = [x / solo * busy * 100 for x in per_s]
    dev = [g - w for g, w in zip(got, want)]
    return {"shares": got, "aggregate": sum(per_s) / solo * 100, "busy": busy,
            "max_dev_pp": max(dev, key=abs), "spread_pp": max(got) - min(got)}


def unit_gpu_s(runs, workload, calibration) -> float | None:
    """The GPU time of one unit of `workload` alone, seconds: the calibrated
    kernel, or the least warm-up step time of its lone runs (a warm-up at a
    low clock reads long, and would count the lone process busier than it
    is: one read 0.368 ms where the others read 0.21)."""
    if workload == "kernels":
        us = calibration.get("kernel_us")
        return float(us) / 1e6 if us else None
    steps = [r["result"]["pods"][0].get("step_ms") for r in runs
             if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]
    steps = [x for x in steps if x]
    return min(steps) / 1e3 if steps else None


def verdicts(spec: Spec, summary: dict, want: list[float], daemon: dict | None) -> dict:
    """The targets that apply to a run: {name: True/False}; a figure the
    run lacks fails."""
    out = {}
    if spec.mode.corun and spec.mode.policy == "elastic" and spec.n == AGGREGATE_N:
        out["aggregate"] = summary["aggregate"] >= AGGREGATE_PCT
    if spec.mode.daemon and sum(want) <= FILL_PCT:
        out["shares"] = abs(summary["max_dev_pp"]) <= SHARE_PP
    if spec.mode.daemon and spec.n == DAEMON_N:
        cpu = (daemon or {}).get("cpu_pct")
        out["cpu"] = cpu is not None and cpu <= DAEMON_CPU_PCT
        adm = (daemon or {}).get("admission") or {}
        # No admission in the window: nothing waited for the daemon.
        out["p99"] = adm.get("requests") == 0 or (adm.get("p99_ms") is not None
                                                  and adm["p99_ms"] <= ADMISSION_P99_MS)
    return out


# ---------------------------------------------------------------- the workers

KERNELS_CU = common.HERE / "packing_kernels.cu"
INFER = common.HERE / "packing_infer.py"


def build_kernels(folder: Path) -> Path:
    """packing_kernels.cu built with nvcc (NVCC overrides it) into folder."""
    binary = Path(folder) / "packing_kernels"
    cmd = [os.environ.get("NVCC") or "nvcc", "-O2", "-arch=native", "-o", str(binary), str(KERNELS_CU)]
    try:
        rc = subprocess.run(cmd, timeout=300).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"{cmd[0]}: {e}")
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {rc}")
    return binary


# ---------------------------------------------------------------- the daemon


class PackingDaemon(hv.Daemon):
    """`hypervisor serve` for one run: its config names the run's pods (all
    on GPU 0, each with the policy of `mode`), GPU 0 co-run where the mode
    says so (ready once its MPS control daemon answers: /readyz), node
    tables of its own. Its config and log in `logs`; its MPS folders in
    `work`."""

    def __init__(self, bundle: Path, logs: Path, work: Path, tag: str, mode: Mode, pods, control: str):
        self.mode, self.work, self.pod_ids = mode, work, list(pods)
        self.tables = {"GPUSHARE_NODE_REGION": f"gpushare-node-{tag}",
                       "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{tag}"}
        settings = dataclasses.replace(common.settings("", logs, bundle / "hypervisor", SIMULATE), hv_log="warn")
        config = logs / f"{tag}.toml"
        n = len(self.pod_ids)
        lines = {"fixed": ('policy = "fixed"', f"cap = {cap_percent(n)}"),
                 "elastic": ('policy = "elastic"', "weight = 1"),
                 "none": ('policy = "none"',)}[mode.policy]
        hv.write_config(config, f"admin-{tag}", *(hv.pod_section(pod, *lines) for pod in self.pod_ids))
        serve_args, ready, stop_s = [], None, 5.0
        self.control = control
        if mode.corun:
            # The MPS control daemon quits its servers on the daemon's SIGTERM: 20 s for it.
            serve_args = ["--corun-gpu", "0", "--corun-dir", str(work / "mps"), "--mps-control", control]
            ready, stop_s = "/readyz", 20.0
        super().__init__(settings, tag, config, serve_args=serve_args, env=self.tables, ready=ready, ready_s=60,
                         stop_s=stop_s)
        self.pipe = self.mps_log = None

    def start(self, port=None):
        super().start(port)
        if self.mode.corun:
            uuid = self.status_json()["corun"][0]["gpu"]
            self.pipe = self.work / "mps" / uuid / "pipe"
            self.mps_log = self.work / "mps" / uuid / "log" / "control.log"

    def placed(self, limit_s: float = 20.0) -> dict:
        """Waits until every pod is listed on a GPU (and, co-run, with the
        share of the SMs its next client takes); {pod: its GPU's status}."""
        deadline = time.monotonic() + limit_s
        listed = {}
        while time.monotonic() < deadline:
            listed = {p["id"]: (p.get("gpus") or [{}])[0] for p in self.status_json().get("pods", [])}
            if all(listed.get(pod, {}).get("uuid") and (not self.mode.corun or listed[pod].get("sm_percent"))
                   for pod in self.pod_ids):
                return listed
            time.sleep(0.05)
        missing = [pod for pod in self.pod_ids if not listed.get(pod, {}).get("uuid")]
        raise RuntimeError(f"pods not placed after {limit_s:g} s: {missing[:4]}"
                           f" ({len(missing)} of {len(self.pod_ids)})")

    def sample(self, scrape_first: bool) -> dict:
        """The daemon's CPU time, RSS, admission histogram and the GPU time
        charged to each pod so far. Its answers cost the daemon CPU: before
        the window they come first, after it last, so that neither is
        counted in the window's."""
        pid = self.p.pid if self.p else 0

        def scrape():
            code, text = hv.hvctl.request(self.url + "/metrics", timeout=5.0)
            return parse_admission(text) if code == 200 else None

        def charged():
            return {pod: f.get("charged_ns") for pod, f in self.pod_figures().items()}

        first = (charged(), scrape()) if scrape_first else None
        out = {"t": time.monotonic(), "cpu_s": cpu_seconds(pid), "rss_mib": rss_mib(pid)}
        charged_ns, admission = first or (charged(), scrape())
        return {**out, "admission": admission, "charged_ns": charged_ns}

    def pod_figures(self) -> dict:
        """Each pod's rate (the share granted), achieved share over the last
        second, share of the SMs (co-run) and workers, as the status says
        them; {} when it does not answer."""
        try:
            pods = self.status_json().get("pods", [])
        except hv.HvError:
            return {}
        keys = ("rate_ppm", "achieved_ppm", "sm_percent", "charged_ns")
        return {p["id"]: {**{k: (p.get("gpus") or [{}])[0].get(k) for k in keys}, "workers": p.get("workers")}
                for p in pods}

    def stop(self):
        """Stops the daemon; an MPS control daemon still up then gets its
        quit through the pipe, and what is left of the daemon's process
        group is killed."""
        pid = self.p.pid if self.p else None
        super().stop()
        if self.mode.corun and corun.mps_processes() and self.pipe is not None:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe)
            try:
                subprocess.run([self.control], input="quit\n", env=env, capture_output=True, text=True, timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
            deadline = time.monotonic() + 10
            while corun.mps_processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in self.tables.values():
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)


# ---------------------------------------------------------------- the runs



class Runner:
    """Runs the plan's runs: each one's workers (and daemon), their common
    window, their results."""

    def __init__(self, args, bundle: Path, control: str, kernels: Path | None, work: Path):
        self.args, self.bundle, self.control, self.kernels, self.work = args, bundle, control, kernels, work
        self.lib = args.lib
        self.logs = Path(args.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.settings = common.settings(self.lib, self.logs)
        self.serial = 0
        self.kernel: dict | None = None  # the kernels workload's calibration

    def calibrate(self) -> dict:
        """The kernels workload's iterations and grid for KERNEL_US, alone,
        without the limiter: {"iters", "grid", "kernel_us", ...}."""
        p = proc.run(self.settings, "base", "-", self.logs / "kernels-calibrate.log", 120,
                     [str(self.kernels), "calibrate", str(KERNEL_US)], env=self.base_env())
        lines = [l for l in p.text().splitlines() if l.startswith("result=")]
        if p.rc != 0 or not lines:
            raise RuntimeError(f"calibration failed ({p.rc}{p.note}): {tail(p)}")
        self.kernel = fields(lines[-1])
        return self.kernel

    def argv(self, workload: str) -> list[str]:
        seconds = str(self.args.seconds)
        if workload == "kernels":
            return [str(self.kernels), "run", self.kernel["iters"], self.kernel["grid"], seconds]
        return [sys.executable, str(INFER), seconds]

    @staticmethod
    def base_env() -> dict:
        """No limiter, no MPS; GPU 0 in NVML's order (PCI bus order)."""
        env = common.clean_env("CUDA_MPS_")
        env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES="0")
        return env

    def pod_env(self, daemon: PackingDaemon, pod: str, gpu: dict) -> dict:
        """A pod's process under the daemon; co-run, an MPS client of its GPU."""
        if daemon.mode.corun:
            # The client sees the GPU its server serves, and only that one.
            env = common.clean_env("CUDA_MPS_")
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env = self.base_env()
        env.update(LD_PRELOAD=self.lib, CUDA_LIMITER_POD=pod, CUDA_LIMITER_TOKEN=proc.hv_token(pod),
                   CUDA_LIMITER_HYPERVISOR=daemon.url, CUDA_LIMITER_LOG="info", **daemon.tables)
        if daemon.mode.corun:
            # As provisioning gives a co-run GPU's client (provision/mps.rs); the
            # limiter sets the percentage to what the pod's limits give anyway.
            env.update(CUDA_LIMITER_MPS="required", CUDA_MPS_PIPE_DIRECTORY=str(daemon.pipe),
                       CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(gpu.get("sm_percent") or 100),
                       CUDA_MPS_CLIENT_PRIORITY="1")
        return env

    def run(self, spec: Spec, budget_left: float) -> dict:
        """One run (see `run_once`); a failure is reported in it ("error")
        and the others go on. Its wall time: "wall_s"."""
        self.serial += 1
        tag = f"packing-{os.getpid()}-{self.serial}"
        t0 = time.monotonic()
        try:
            result = self.run_once(spec, tag, budget_left)
        except Exception as error:  # noqa: BLE001 - every failure is reported
            result = {"error": f"{type(error).__name__}: {error}"[:600]}
        result["tag"], result["wall_s"] = tag, time.monotonic() - t0
        return result

    def run_once(self, spec: Spec, tag: str, budget_left: float) -> dict:
        """Starts the daemon (if the mode has one) and the N workers, waits
        for all of them to be ready and registered, gives them one start
        time, samples the daemon as the window starts and ends, and reads
        every worker's result."""
        seconds = self.args.seconds
        pods = [f"{tag}-{i}" for i in range(spec.n)]
        daemon, procs, clocks = None, [], None
        ready_s = max(10.0, min(READY_S, budget_left))
        result = {"pods": []}
        try:
            placed = {}
            if spec.mode.daemon:
                # Short: MPS's sockets go under it (the daemon refuses a pipe folder past 87 bytes).
                work = self.work / str(self.serial)
                work.mkdir()
                daemon = PackingDaemon(self.bundle, self.logs, work, tag, spec.mode, pods, self.control)
                daemon.start()
                placed = daemon.placed()
            for i, pod in enumerate(pods):
                env = self.pod_env(daemon, pod, placed[pod]) if daemon else self.base_env()
                procs.append(proc.Proc(self.settings, spec.mode.name, pod if daemon else "-",
                                       self.logs / f"{tag}-{spec.workload}-{i}.log",
                                       ready_s + REGISTER_S + START_S + seconds + DRAIN_S,
                                       self.argv(spec.workload), env=env, stdin=True).start())
            t0 = time.monotonic()
            if not proc.wait_ready(procs, ready_s):
                late = [i for i, p in enumerate(procs) if not re.search(r"^ready=1", p.text(), re.MULTILINE)]
                first = procs[late[0] if late else 0]
                state = "still starting" if first.alive() else f"exit {first.p.poll() if first.p else '?'}"
                raise RuntimeError(f"{len(late)} of {spec.n} workers not ready after {time.monotonic() - t0:.1f} s;"
                                   f" worker {late[0] if late else 0} ({state}): {tail(first)}")
            result["ready_s"] = time.monotonic() - t0
            if daemon:
                seen = daemon.wait_workers(time.time() + REGISTER_S, pods, f"{tag}-registered")
                result["registered"] = seen.get("ok") == "1"
            start = time.monotonic() + START_S
            clocks = clock_sampler()
            for p in procs:
                if not p.tell(f"{start!r}\n"):
                    raise RuntimeError(f"a worker is gone before the start: {tail(p)}")
            end = start + seconds
            sleep_until(start)
            before = daemon.sample(scrape_first=True) if daemon else None
            sleep_until(end)
            if daemon:
                after = daemon.sample(scrape_first=False)
                result["daemon"] = {**daemon_figures(before, after), "pods": daemon.pod_figures()}
            failed = []
            for i, p in enumerate(procs):
                p.wait()
                lines = [l for l in p.text().splitlines() if l.startswith("result=")]
                if p.rc != 0 or not lines:
                    failed.append(f"worker {i} ({p.rc}{p.note}): {tail(p)}")
                    result["pods"].append(None)
                    continue
                result["pods"].append({k: float(v) for k, v in fields(lines[-1]).items()})
            clocks.stop()
            gpu = gpu_window(clocks, start, end)
            if gpu:
                result["gpu"] = {k: gpu[k] for k in ("sm_mhz", "power_w", "samples")}
            if failed:
                result["error"] = f"{len(failed)} of {spec.n} workers failed; {failed[0]}"[:600]
        finally:
            if clocks is not None:
                clocks.stop()
            for p in procs:
                p.stop()
            if daemon is not None:
                daemon.stop()
                if daemon.mps_log is not None and daemon.mps_log.exists():
                    shutil.copy(daemon.mps_log, self.logs / f"{tag}-mps-control.log")
            common.remove_pod_regions(*pods)
            shutil.rmtree(self.work / str(self.serial), ignore_errors=True)
        return result


def daemon_figures(before: dict, after: dict) -> dict:
    """The daemon's CPU (% of one core), admissions and each pod's charged
    GPU time over a window, its RSS at its end."""
    out = {"rss_mib": after["rss_mib"], "cpu_pct": None, "admission": None}
    if before["cpu_s"] is not None and after["cpu_s"] is not None and after["t"] > before["t"]:
        out["cpu_pct"] = (after["cpu_s"] - before["cpu_s"]) / (after["t"] - before["t"]) * 100
    if before["admission"] and after["admission"]:
        out["admission"] = admission_summary(admission_delta(before["admission"], after["admission"]))
    # What each pod was charged over the window, % of its wall time: beside
    # its share of the GPU's time, how far the limiter's prices are off.
    span_ns = (after["t"] - before["t"]) * 1e9
    out["charged_pct"] = {pod: (ns - before["charged_ns"][pod]) / span_ns * 100
                          for pod, ns in after["charged_ns"].items()
                          if ns is not None and before["charged_ns"].get(pod) is not None and span_ns > 0}
    return out


def sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def tail(p, size=300) -> str:
    """The end of a process's log, on one line."""
    return " ".join(p.text()[-size:].split())


# ---------------------------------------------------------------- the report


def ok(run) -> bool:
    """Whether a run ran and every one of its pods gave a result."""
    res = run.get("result") or {}
    return not run.get("skipped") and "error" not in res and bool(res.get("pods")) and all(res["pods"])


def solo_rates(runs, workload) -> list[float]:
    """The workload's lone runs that succeeded: their throughput, in order."""
    return [r["result"]["pods"][0]["per_s"] for r in runs
            if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]


def evaluate(runs, calibration) -> None:
    """Adds each run's shares against its targets, and its verdicts, as
    "figures": against the mean of its workload's lone runs, and the GPU
    time they keep busy (all of it where a unit's time is unknown)."""
    for workload in {r["spec"].workload for r in runs}:
        rates = solo_rates(runs, workload)
        if not rates:
            continue
        solo = sum(rates) / len(rates)
        unit = unit_gpu_s(runs, workload, calibration)
        busy = min(1.0, solo * unit) if unit else 1.0
        for run in runs:
            spec = run["spec"]
            if spec.workload != workload or not ok(run):
                continue
            want = targets(spec.mode, spec.n, busy)
            summary = shares([pod["per_s"] for pod in run["result"]["pods"]], solo, busy, want)
            charged = ((run["result"].get("daemon") or {}).get("charged_pct") or {})
            summary["charged"] = [charged.get(f"{run['result']['tag']}-{i}") for i in range(spec.n)]
            run["figures"] = {**summary, "targets": want,
                              "verdicts": verdicts(spec, summary, want, run["result"].get("daemon"))}


def fmt(x, spec="{:.1f}", none="–") -> str:
    if x is None:
        return none
    return "inf" if isinstance(x, float) and math.isinf(x) else spec.format(x)


def span(values) -> str:
    """"min–max" of the figures there are, "" with none."""
    got = [x for x in values or [] if x is not None]
    return f"{min(got):.2f}–{max(got):.2f}" if got else ""


def mark(verdicts, key) -> str:
    return "" if key not in verdicts else ("PASS" if verdicts[key] else "FAIL")


COLUMNS = ("workload", "run", "target a pod", "throughput (sum)", "aggregate %", "pod shares % (min–max)",
           "charged % (min–max)", "max dev pp", "spread pp", "admissions (timeouts)", "adm p50 ms", "adm p99 ms", "daemon CPU %",
           "daemon RSS MiB", f"agg >= {AGGREGATE_PCT:g}% (corun N={AGGREGATE_N})", f"shares +-{SHARE_PP:g} pp",
           f"CPU <= {DAEMON_CPU_PCT:g}% (N={DAEMON_N})", f"p99 <= {ADMISSION_P99_MS:g} ms (N={DAEMON_N})")


def row(run) -> list[str]:
    """A run's cells, one for each of COLUMNS."""
    spec, res = run["spec"], run.get("result") or {}
    cells = [spec.workload, spec.label]
    if run.get("skipped") or "figures" not in run:
        why = (f"skipped: {run['skipped']}" if run.get("skipped")
               else "failed: " + (res.get("error") or "no lone run to compare with"))
        return cells + [why.replace("|", "/")[:240]] + [""] * (len(COLUMNS) - 3)
    fig, v = run["figures"], run["figures"]["verdicts"]
    want = fig["targets"][0]
    total = sum(pod["per_s"] for pod in res["pods"])
    daemon = res.get("daemon") or {}
    adm = daemon.get("admission") or {}
    if spec.mode is SOLO:
        return cells + [f"the baseline (GPU {fig['busy'] * 100:.1f}% busy)", f"{total:,.1f} {WORKLOADS[spec.workload]}",
                        f"{fig['aggregate']:.1f}"] + \
            [""] * (len(COLUMNS) - 5)
    target = {"fixed": f"cap {want:.2f}%", "none": f"none (even: {want:.2f}%)"}.get(spec.mode.policy,
                                                                                  f"fair {want:.2f}%")
    return cells + [
        target, f"{total:,.1f} {WORKLOADS[spec.workload]}", f"{fig['aggregate']:.1f}",
        f"{min(fig['shares']):.2f}–{max(fig['shares']):.2f}", span(fig.get("charged")),
        f"{fig['max_dev_pp']:+.2f}", f"{fig['spread_pp']:.2f}",
        f"{adm['requests']} ({adm['timeouts']})" if adm else "",
        fmt(adm.get("p50_ms"), "{:.3f}", ""), fmt(adm.get("p99_ms"), "{:.3f}", ""),
        fmt(daemon.get("cpu_pct"), "{:.2f}", ""), fmt(daemon.get("rss_mib"), "{:.1f}", ""),
        mark(v, "aggregate"), mark(v, "shares"), mark(v, "cpu"), mark(v, "p99")]


def notes(runs, workloads) -> list[str]:
    """Per workload: the lone runs and their drift, and the SM clock and
    power of every run; the runs whose workers were not all registered."""
    out = []
    for workload in workloads:
        rates = solo_rates(runs, workload)
        if rates:
            drift = f", drift {(rates[-1] / rates[0] - 1) * 100:+.2f}%" if len(rates) > 1 else ""
            first = next(r for r in runs if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r))
            step = first["result"]["pods"][0].get("step_ms")
            out.append(f"{workload} alone: {', '.join(f'{x:,.1f}' for x in rates)} {WORKLOADS[workload]}{drift}"
                       + (f", a step {step:.3f} ms on the GPU" if step else ""))
        clocks = [f"{r['spec'].label} {fmt(r['result']['gpu']['sm_mhz'], '{:.0f}')}/"
                  f"{fmt(r['result']['gpu']['power_w'], '{:.0f}')}"
                  for r in runs if r["spec"].workload == workload and (r.get("result") or {}).get("gpu")]
        if clocks:
            out.append(f"{workload}, SM MHz/board W through the window: {'; '.join(clocks)}")
    for run in runs:
        if (run.get("result") or {}).get("registered") is False:
            out.append(f"{run['spec'].workload} {run['spec'].label}: not every worker was registered with the"
                       " daemon at the start")
    return out


def report(args, runs, order, took, calibration, checks) -> None:
    """The table (in `order`), the verdicts and the notes: on stdout, in
    OUT/packing-bench.md; every run's raw figures in OUT/packing-bench.json."""
    evaluate(runs, calibration)
    ordered = [runs[i] for i in order if i < len(runs)]
    table = ("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|\n"
             + "".join("| " + " | ".join(row(r)) + " |\n" for r in ordered))
    failed = sorted({k for r in runs for k, v in (r.get("figures") or {}).get("verdicts", {}).items() if not v})
    checked = any((r.get("figures") or {}).get("verdicts") for r in runs)
    if "iters" in calibration:
        cal = (f"kernels: {calibration['iters']} iterations x {calibration['grid']} blocks of 256 threads"
               f" ({calibration['blocks_per_sm']} an SM), {calibration['kernel_us']} us alone")
    else:
        cal = f"kernels: not calibrated {calibration.get('error', '')}".strip()
    verdict = ("FAILED: " + ", ".join(failed)) if failed else ("all met" if checked else "none applied")
    text = (f"Packing bench, N pods on GPU 0, {args.seconds:g} s windows ({took:.0f} s in all, budget"
            f" {args.budget_s:g} s)\n\n{table}\nTargets: {verdict}\n\n"
            + "".join(f"- {line}\n" for line in [cal] + notes(runs, args.workloads)
                      + [f"{k}: {v}" for k, v in checks.items()]))
    data = {"calibration": calibration, "checks": checks,
            "runs": [{"workload": r["spec"].workload, "mode": r["spec"].mode.name, "policy": r["spec"].mode.policy,
                      "n": r["spec"].n, "label": r["spec"].label, "ran": runs.index(r), "skipped": r.get("skipped"),
                      "result": r.get("result"), "figures": r.get("figures")} for r in ordered]}
    corun.publish(args, "packing-bench", text, data)


def progress(run) -> str:
    """A run's one line as it ends."""
    if run.get("skipped"):
        return f"skipped: {run['skipped']}"
    res = run.get("result") or {}
    if "error" in res:
        return f"FAILED: {res['error']}"
    rates = [pod["per_s"] for pod in res["pods"]]
    text = (f"{sum(rates):,.1f} in all, a pod {min(rates):,.1f} to {max(rates):,.1f}"
            f" (ready in {res['ready_s']:.1f} s, {res['wall_s']:.0f} s in all)")
    daemon = res.get("daemon")
    if daemon:
        adm = daemon.get("admission") or {}
        text += (f"; daemon {fmt(daemon.get('cpu_pct'), '{:.2f}')}% CPU, {fmt(daemon.get('rss_mib'))} MiB,"
                 f" {adm.get('requests')} admissions, p99 {fmt(adm.get('p99_ms'), '{:.3f}')} ms")
    return text


# ---------------------------------------------------------------- options and main


def comma_list(choices=None, kind=str):
    """An option's parser of comma-separated values (of `choices`, when given)."""
    def parse(text):
        items = [kind(x) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            raise ValueError(f"{text!r}: comma-separated{', of ' + ', '.join(choices) if choices else ''}")
        return items

    parse.__name__ = "list"  # argparse's "invalid list value"
    return parse


def add_arguments(p):
    p.add_argument("--bundle", required=True, help="the bundle folder: libcuda_limiter.so, hypervisor")
    p.add_argument("--out", default=os.environ.get("OUT") or "packing-bench-out")
    p.add_argument("--counts", type=comma_list(kind=int), default=[1, 4, 8, 16, 32],
                   help=f"pods a run, comma-separated (1 to {MAX_PODS})")
    p.add_argument("--seconds", type=float, default=5.0, help="every run's measured window")
    p.add_argument("--modes", type=comma_list(MODES), default=["timeslice", "corun"],
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--workloads", type=comma_list(WORKLOADS), default=list(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's wall time, at most")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")


def main(p, args):
    t_begin = time.monotonic()
    if any(not 1 <= n <= MAX_PODS for n in args.counts):
        p.error(f"--counts: 1 to {MAX_PODS} pods a run")
    bundle, control = corun.prepare(args)  # sets args.lib; refuses beside a running MPS daemon
    for path in (Path(args.lib), bundle / "hypervisor"):
        if not path.is_file():
            p.error(f"no {path}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modes = [MODES[m] for m in args.modes]
    specs = plan(args.workloads, args.counts, modes)
    estimate = sum(estimate_s(s, args.seconds) for s in specs)
    print(f"packing bench: {len(specs)} runs, {args.seconds:g} s windows, ~{estimate:.0f} s estimated, budget"
          f" {args.budget_s:g} s; pods {args.counts}, modes {args.modes}, workloads {args.workloads}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="packing-"))  # short: MPS's pipes are named under it
    runs, calibration, checks = [], {}, {}
    try:
        runner = Runner(args, bundle, control, build_kernels(work) if "kernels" in args.workloads else None, work)
        if runner.kernels is not None:
            try:
                calibration = runner.calibrate()
                print(f"  kernels calibrated: {calibration}", flush=True)
            except RuntimeError as error:
                calibration = {"error": str(error)[:400]}
        for spec in specs:
            run = {"spec": spec}
            runs.append(run)
            left = args.budget_s - (time.monotonic() - t_begin)
            need = estimate_s(spec, args.seconds)
            if spec.workload == "kernels" and runner.kernel is None:
                run["result"] = {"error": f"no calibration: {calibration.get('error')}"}
            elif need > left:
                run["skipped"] = f"budget ({need:.0f} s needed, {max(left, 0):.0f} s left)"
            else:
                run["result"] = runner.run(spec, left)
            print(f"  {spec.workload} {spec.label}: {progress(run)}", flush=True)
    finally:
        proc.stop_all()
        checks["MPS processes at the end"] = corun.mps_processes() or "none"
        shutil.rmtree(work, ignore_errors=True)
    report(args, runs, table_order(specs, args.workloads, modes), time.monotonic() - t_begin, calibration, checks)
