"""Dense packing on a real GPU: N pods on GPU 0, each one process under the
limiter and registered with the daemon, time-sliced (also taking turns) and
co-run (MPS), beside the same N processes without the limiter and one
process alone, in one run. Results: Markdown tables (by mode, and of every
run) on stdout and in OUT/packing-bench.md, every pod's throughput of every
run in OUT/packing-bench.json, the workers' and the daemons' logs in
OUT/logs.

  python3 -m scripts.bench packing --bundle DIR [--out DIR] [--counts 1,4,8,16,32] [--seconds 5]
          [--modes timeslice,auto,corun] [--turn-ms 10] [--workloads kernels,infer] [--budget-s 560]
          [--mps-control PATH] [--limiter-log LEVEL]

About 9 minutes with the defaults on an H100: 42 runs, each a 5 s window
and its start (3 to 20 s: the most for 32 PyTorch processes under MPS); the
estimate (about 590 s) is printed at the start and each run's wall time in
the JSON.
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
  timeslice    N pods under the daemon (`hypervisor serve --no-auto-turns`,
               a [[pods]] section and token for each in its config), GPU 0
               time-sliced; each pod a fixed cap of floor(90/N)% (the
               config takes whole percents: caps that sum to at most 90%)
  auto         as timeslice, the daemon as by default (`--turn-ms Q`
               alone; Q: --turn-ms, default 10): GPU 0 takes turns by
               itself while two or more of its capped pods launch, one pod
               launching at a time, for a turn of Q ms
  turns (with --modes): as timeslice, and the daemon with `--turns-gpu 0
               --turn-ms Q`: GPU 0's pods take turns always
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
spread (a pod's share of the GPU's time: for the inference step, the
fraction of the window in which its kernels ran, plus the GPU's moves
between two of its kernels it had queued back to back (gaps of up to 3 us),
as CUPTI recorded each kernel's start and end in the pod's process
(kernel_time.c, built with nvcc against the CUPTI beside PyTorch or the
toolkit's, loaded before CUDA starts): a time-sliced GPU runs no other
context in those moves, and the limiter charges them, so that a pod of tiny
kernels pays for the GPU it holds; where every pod of the run has it and
they launch one at a time
(one pod, or pods taking turns: elsewhere a time-sliced kernel's span takes
in the slices of the pods that preempted it, and co-run kernels share the
SMs by design); with several pods, each pod's spans (its kernels and those
moves) laid over the others' on CUPTI's clock, one clock in every process,
and an instant two pods' spans cover split between them (packing_spans.py:
a pod starting its turn while the last holder's queued kernels still run
time-slices with them, and each pod's own spans would count that time);
else its throughput over the lone process's, times the
fraction of the time the lone process keeps the GPU busy, so that a
workload that leaves the GPU idle between steps is not counted as holding
it. That fraction, which also caps a pod's target, is the lone runs'
GPU time by CUPTI, so counted, where they have it; else NVML's utilisation over the
lone runs' windows, a second in, their mean, which counts a sample period
in which any kernel ran, blind to the microseconds between a host-bound
step's kernels; else the warm-up's reading, the lone process's rate times a
unit's GPU time alone (the calibrated kernel, or the step's CUDA-event time
in its warm-up). The notes give every reading; each run's pods' GPU time
by CUPTI, their sum and their kernels alone beside the shares by
throughput, and where their spans were laid over each other, the GPU busy
by any of them, the time they counted twice and each pod's time alone;
the lone runs' gaps between kernels (up to 3 us: the GPU moving to the
next kernel it had queued); the budget each pod forfeited at its
bucket's depth (the daemon's forfeited_ns over the window); and the
GPU time the lone process's steps took in its window, each bracketed by
events (the gaps inside a step count). The warm-up times a unit at its
boost clock, and the inference step is power-bound, its clock falling to
1,550-1,750 MHz in a window, where a step takes longer: on an H100 its
warm-up read the lone process 85.9% busy, NVML 95.0%. A pod's throughput is
at its own clock); the GPU time the
limiter charged each pod over the window, % of the window, from the daemon's
status (charged_ns at its start and end): against the pod's share, how far
its prices are from what its work took; what the elastic pods of a co-run
GPU split at the window's end (in the notes where it is more than the GPU's
time: the GPU idled while they used all they were given); and of the daemon
over the window, from its /metrics scraped as the window starts and as it
ends: the admission latency histogram's p50 and p99 (interpolated in its
buckets as Prometheus does; bounds 50 us to 1 s), requests and timeouts; its
CPU (utime + stime of /proc/PID/stat, % of one core) and its RSS at the end
(VmRSS, MiB). An admission is a launch of a pod the daemon does not count as
wanting the GPU yet that found its bucket empty: the daemon counts it in and
answers with the budget its bucket holds, waiting at most 1 ms for some to
refill; a pod whose bucket refills later is answered at once with none
(counted in timeouts) and waits on its bucket. A pod that runs through the
window stays counted and never asks, so the runs with the most pods end with
returns: each pod, idle past the daemon's 200 ms of counting it, comes back
for a 0.1 s burst, 4 times 0.4 s apart, the pods staggered over the period;
the daemon's admissions and CPU over the returns are reported apart, and the
p99 target is judged on the window's admissions and the returns' together.
Where the pods take turns, the notes give a turn's length as the daemon's
status says it and the turns handed over from pod to pod in the window.
The daemons log at warn, their default. Also the SM clock and board power
through the window, and two readings of GPU time that no clock moves, from
NVML (nvidia-smi, every sample a second into the window and later): the
GPU's utilisation (the share of the time a kernel ran) and each pod's SM %
(`pmon`, its process's share). They are reported beside the throughput
shares, not judged (but for the lone runs' utilisation, the shares'
baseline): a throughput share is a GPU-time share only where the clock is
the lone process's, and where it is (the kernels hold 1,980 MHz) the two
can be compared.
Targets (PASS/FAIL columns): corun at N=16, aggregate >= 97% of one
process; where the targets sum to at most 90% (the fixed caps: timeslice
and turns), every pod within 1 pp of its cap; under the daemon at N=32, its
CPU <= 5% of a core over the window and admission p99 <= 2 ms.
Refuses to start beside a running MPS daemon. After every run each
worker's process group is killed, the daemon stopped (it quits its MPS
control daemon; one still up then gets a quit through its pipe, and the
daemon's process group is killed), and the pods' /dev/shm regions and the
run's node tables removed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.gpu.e2e.harness import proc
from scripts.gpu.e2e.harness.parse import fields
from scripts.gpu.e2e.harness.smi import ProcessSampler, Sampler

from . import common, corun, packing_spans, priority
from .packing_daemon import PackingDaemon, daemon_figures, returns_figures
from .packing_plan import (MAX_PODS, MODES, RETURN_BURST_S, RETURN_PERIOD_S, RETURNS, START_S, TURN_MS,
                           WORKLOADS, Spec, estimate_s, plan, returns_phase, returns_s, table_order, with_turn_ms)
from .packing_report import progress, report

KERNEL_US = 450.0  # the kernels workload's kernel, alone
READY_S = 120.0  # the longest a run waits for its workers' ready=1
REGISTER_S = 20.0  # ... and for their registration with the daemon
DRAIN_S = 60.0  # the longest a worker may take past its window
SAMPLE_MS = 100  # nvidia-smi's period through a window
NVML_FROM_S = 1.0  # NVML's utilisation counts from this far into a window


KERNELS_CU = common.HERE / "packing_kernels.cu"
KERNEL_TIME_C = common.HERE / "kernel_time.c"
INFER = common.HERE / "packing_infer.py"


def build_kernels(folder: Path) -> Path:
    """packing_kernels.cu built with nvcc (NVCC overrides it) into folder."""
    binary = Path(folder) / "packing_kernels"
    error = nvcc(["-O2", "-arch=native", "-o", str(binary), str(KERNELS_CU)])
    if error:
        raise SystemExit(error)
    return binary


def nvcc(args) -> str | None:
    """Runs nvcc (NVCC overrides it) with args: None, else what failed."""
    cmd = [os.environ.get("NVCC") or "nvcc", *args]
    try:
        rc = subprocess.run(cmd, timeout=300).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]}: {e}"
    return f"{' '.join(cmd)}: exit {rc}" if rc != 0 else None


def cupti_roots() -> list[Path]:
    """Where CUPTI may be (its include/ and lib/ or lib64/): $CUPTI_HOME,
    else PyTorch's (the nvidia wheels beside it: the copy the process has
    loaded, where it has) and the CUDA toolkit's."""
    if os.environ.get("CUPTI_HOME"):
        return [Path(os.environ["CUPTI_HOME"])]
    roots = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        roots += sorted(Path(base).glob("cu[0-9]*")) + [Path(base) / "cuda_cupti"]
    found = shutil.which(os.environ.get("NVCC") or "nvcc")
    toolkit = Path(found).resolve().parent.parent if found else Path("/usr/local/cuda")
    return roots + [toolkit / "extras" / "CUPTI", toolkit]


def build_kernel_time(folder: Path) -> tuple[Path | None, str]:
    """kernel_time.c built with nvcc against the first CUPTI of
    `cupti_roots` with its header and library, into folder: (the library,
    where it was found), else (None, why not)."""
    roots = cupti_roots()
    for root in roots:
        libs = sorted(p for d in ("lib64", "lib") for p in (root / d).glob("libcupti.so*"))
        if not (root / "include" / "cupti_activity.h").is_file() or not libs:
            continue
        lib = Path(folder) / "kernel_time.so"
        error = nvcc(["-O2", "-shared", "-Xcompiler", "-fPIC", "-I", str(root / "include"), "-o", str(lib),
                      str(KERNEL_TIME_C), "-L", str(libs[0].parent), f"-l:{libs[0].name}",
                      f"-Xlinker=-rpath={libs[0].parent}", "-lpthread"])
        return (None, error) if error else (lib, str(libs[0]))
    return None, "no CUPTI (its header and library) in " + ", ".join(map(str, roots))



class Runner:
    """Runs the plan's runs: each one's workers (and daemon), their common
    window, their results."""

    def __init__(self, args, bundle: Path, control: str, kernels: Path | None, work: Path,
                 kernel_time: Path | None = None):
        self.args, self.bundle, self.control, self.kernels, self.work = args, bundle, control, kernels, work
        self.kernel_time = kernel_time  # kernel_time.so: the inference workers time their windows' kernels
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
                   CUDA_LIMITER_HYPERVISOR=daemon.url, CUDA_LIMITER_LOG=self.args.limiter_log, **daemon.tables)
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

    @staticmethod
    def returns(daemon: PackingDaemon, procs, before: dict, after: dict) -> dict:
        """The pods' returns after the window (see the module's doc), told
        to the workers as it ends (each reads them once its result is out);
        the daemon sampled at the window's end (`after`) and once every
        worker has said it is through them, or after twice their time."""
        at = time.monotonic() + START_S
        for i, p in enumerate(procs):
            p.tell(f"returns {at + i * RETURN_PERIOD_S / len(procs)!r} {RETURNS} {RETURN_PERIOD_S!r}"
                   f" {RETURN_BURST_S!r}\n")
        def through(p) -> bool:
            return re.search(r"^returns=", p.text(), re.MULTILINE) is not None

        deadline = at + 2 * returns_s() + 1.0
        sleep_until(at + returns_s())
        while time.monotonic() < deadline and not all(through(p) or not p.alive() for p in procs):
            time.sleep(0.05)
        return {"returns": RETURNS, "pods_through": sum(map(through, procs)),
                **returns_figures(before, after, daemon.sample(False))}

    def spans_path(self, tag: str, i: int) -> Path:
        """Where pod `i` of run `tag` writes its kernels' spans."""
        return self.work / f"{tag}-{i}.spans"

    def lay_spans(self, tag: str, result: dict) -> None:
        """Where every pod wrote its spans: each pod's GPU time split where
        they overlap ("gpu_split", "gpu_alone"), and the run's GPU busy and
        time counted twice ("spans": "union", "overlap"); see
        packing_spans.py. A file that cannot be read leaves each pod its
        own records' time, and says why ("spans_error")."""
        pods = result["pods"]
        if not all(pod.get("spans") == 1 for pod in pods):
            return
        try:
            spans = [packing_spans.read(self.spans_path(tag, i)) for i in range(len(pods))]
        except (OSError, ValueError) as error:
            result["spans_error"] = str(error)[:300]
            return
        laid = packing_spans.split(spans, self.args.seconds * 1e9)
        for pod, share, alone in zip(pods, laid["split"], laid["alone"]):
            pod["gpu_split"], pod["gpu_alone"] = share, alone
        result["spans"] = {"union": laid["union"], "overlap": laid["overlap"]}

    def run_once(self, spec: Spec, tag: str, budget_left: float) -> dict:
        """Starts the daemon (if the mode has one) and the N workers, waits
        for all of them to be ready and registered, gives them one start
        time, samples the daemon as the window starts and ends, and reads
        every worker's result."""
        seconds = self.args.seconds
        pods = [f"{tag}-{i}" for i in range(spec.n)]
        daemon, procs, clocks, pmon = None, [], None, None
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
                if spec.workload == "infer" and self.kernel_time is not None:
                    env["PACKING_KERNEL_TIME"] = str(self.kernel_time)  # its window's kernels, by CUPTI
                    env["PACKING_KERNEL_SPANS"] = str(self.spans_path(tag, i))
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
            clocks = Sampler(["clocks.sm", "power.draw", "utilization.gpu"], SAMPLE_MS, gpu=0)
            pmon = ProcessSampler(gpu=0)
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
            if returns_phase(spec, self.args.counts):
                result["returns"] = self.returns(daemon, procs, before, after)
            else:
                for p in procs:
                    p.tell("done\n")
            failed = []
            for i, p in enumerate(procs):
                p.wait()
                lines = [l for l in p.text().splitlines() if l.startswith("result=")]
                if p.rc != 0 or not lines:
                    failed.append(f"worker {i} ({p.rc}{p.note}): {tail(p)}")
                    result["pods"].append(None)
                    continue
                result["pods"].append({k: float(v) for k, v in fields(lines[-1]).items()})
            if spec.n > 1 and not failed:
                self.lay_spans(tag, result)
            clocks.stop()
            pmon.stop()
            result["gpu"] = gpu_window(clocks, start, end)
            held = pmon.shares([p.pid for p in procs], start, end)
            for p, pod in zip(procs, result["pods"]):
                if pod is not None:
                    pod["nvml_sm_pct"] = held[p.pid]["sm_pct"]
            if failed:
                result["error"] = f"{len(failed)} of {spec.n} workers failed; {failed[0]}"[:600]
        finally:
            for sampler in (clocks, pmon):
                if sampler is not None:
                    sampler.stop()
            for p in procs:
                p.stop()
            if daemon is not None:
                daemon.stop()
                if daemon.mps_log is not None and daemon.mps_log.exists():
                    shutil.copy(daemon.mps_log, self.logs / f"{tag}-mps-control.log")
            common.remove_pod_regions(*pods)
            for i in range(spec.n):
                self.spans_path(tag, i).unlink(missing_ok=True)
            shutil.rmtree(self.work / str(self.serial), ignore_errors=True)
        return result


def gpu_window(clocks: Sampler, start: float, end: float) -> dict | None:
    """The window's medians of the SM clock and board power (priority's
    window), and the mean of NVML's utilisation (the share of each sample
    period in which a kernel ran) over the samples NVML_FROM_S in and later
    (the first second's straddle the idle start); None without samples."""
    window = priority.gpu_window(clocks, start, end)
    if window is None:
        return None
    busy = [u for t, _, _, u in window["series"] if t >= NVML_FROM_S]
    return {"sm_mhz": window["sm_mhz"], "power_w": window["power_w"],
            "busy_pct": statistics.mean(busy) if busy else None, "samples": window["samples"]}


def sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def tail(p, size=300) -> str:
    """The end of a process's log, on one line."""
    return " ".join(p.text()[-size:].split())



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
    p.add_argument("--modes", type=comma_list(MODES), default=["timeslice", "auto", "corun"],
                   help=f"comma-separated, of {', '.join(MODES)} (auto: time-sliced, the daemon as by default,"
                        " taking turns while capped pods contend; turns: taking turns always)")
    p.add_argument("--turn-ms", type=int, default=TURN_MS, help="the auto and turns modes' turn, ms (1 to 100)")
    p.add_argument("--limiter-log", default="info",
                   help="the pods' CUDA_LIMITER_LOG (info: the exit summary; trace: every measurement too),"
                        " in OUT/logs")
    p.add_argument("--workloads", type=comma_list(WORKLOADS), default=list(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--budget-s", type=float, default=560.0, help="the whole run's wall time, at most")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")


def main(p, args):
    t_begin = time.monotonic()
    if any(not 1 <= n <= MAX_PODS for n in args.counts):
        p.error(f"--counts: 1 to {MAX_PODS} pods a run")
    if not 1 <= args.turn_ms <= 100:
        p.error("--turn-ms: 1 to 100")
    bundle, control = corun.prepare(args)  # sets args.lib; refuses beside a running MPS daemon
    for path in (Path(args.lib), bundle / "hypervisor"):
        if not path.is_file():
            p.error(f"no {path}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modes = with_turn_ms([MODES[m] for m in args.modes], args.turn_ms)
    specs = plan(args.workloads, args.counts, modes)
    estimate = sum(estimate_s(s, args.seconds, returns_phase(s, args.counts)) for s in specs)
    turns = f" (turns of {args.turn_ms} ms)" if any(m.turn_ms for m in modes) else ""
    print(f"packing bench: {len(specs)} runs, {args.seconds:g} s windows, ~{estimate:.0f} s estimated, budget"
          f" {args.budget_s:g} s; pods {args.counts}, modes {args.modes}{turns}, workloads {args.workloads}",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="packing-"))  # short: MPS's pipes are named under it
    runs, calibration, checks = [], {}, {}
    try:
        kernel_time = None
        if "infer" in args.workloads:
            kernel_time, where = build_kernel_time(work)
            checks["kernel timing (CUPTI)"] = where if kernel_time else f"none: {where}"[:400]
            print(f"  kernel timing: {checks['kernel timing (CUPTI)']}", flush=True)
        runner = Runner(args, bundle, control, build_kernels(work) if "kernels" in args.workloads else None, work,
                        kernel_time)
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
            need = estimate_s(spec, args.seconds, returns_phase(spec, args.counts))
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
