"""Priority classes on a real GPU: a latency pod's inference step next to a
batch pod that fills the GPU, without and with the limiter's classes, in one
run. Results: a Markdown table on stdout and in OUT/priority-bench.md, raw
numbers in OUT/priority-bench.json, the workers' logs beside them.

  python3 -m scripts.bench priority --bundle DIR [--out DIR] [--seconds S] [--period-us P]
          [--sizes N N] [--quick]

About 4 minutes (12 runs of 8 s plus start-up); OUT: --out, else $OUT, else
./priority-bench-out.

The pods are workers.py's: the latency pod's step (64x2048 bf16 through four
2048x2048 bf16 matmuls, then a synchronize) every P us (default 2000) on a
fixed arrival schedule (a request that finds the previous one still running
starts at once), so it leaves the GPU mostly idle, as an inference server at
moderate load does; each step is timed on the host from its first launch to
the end of its synchronize. Its busy fraction alone is the sum of its steps'
GPU time (CUDA events around each step) over the wall time ("gpu"), and the
sum of its step times over the wall time ("wall"). The batch pod:
back-to-back bf16 NxN matmuls (N=4096: ~0.2 ms per kernel on an H100,
N=8192: ~2 ms), throughput in matmuls/s.

Runs (both processes started together, warm-up before a common start time,
the latency pod running 1 s past the batch pod's window so the batch pod never
runs alone in it):
  latency alone (no limiter; and under the limiter, class latency: its cost)
  batch alone, per size (no limiter)
  latency + unlimited batch, per size (no limiter on either)
  latency (class latency) + batch (class batch), both under the limiter, per
  size; and with ~0.2 ms kernels also with an in-flight window of 2 launches
  (CUDA_LIMITER_PRIORITY_WINDOW=2) to show what the window costs, and with
  arrival prediction off (CUDA_LIMITER_PRIORITY_PREDICT=0) to show what it
  adds;
  Poisson arrivals (exponential gaps of the same mean period): the latency pod
  alone and with classes next to ~0.2 ms batch kernels, where prediction
  withholds itself (the requests are not periodic): what classes alone give.
Criteria (the issue's): with ~0.2 ms batch kernels the latency pod's p50 is
within 1.2x and its p99 within 2x of alone, and the batch pod keeps at least
0.8 x (1 - busy) of its alone throughput (busy: the latency pod's gpu busy
fraction alone; the bar with the wall busy fraction is printed too). With
~2 ms kernels the same figures are reported.
"""
import json
import os
import struct
import sys
import time
from pathlib import Path

from scripts.gpu.e2e.harness import proc
from scripts.gpu.e2e.harness.parse import median
from scripts.gpu.e2e.harness.parse import percentile as pct
from scripts.gpu.e2e.harness.smi import Sampler

from . import common

READY_S = 180  # a worker's start-up and warm-up
START_S = 0.3  # from the last worker ready to the common start

# ---------------------------------------------------------------- the table


def pod_key(pod):
    h = 0xCBF29CE484222325
    for byte in pod.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return max(h, 1)


def priority_counters(region, pod):
    """The pod's counters in the priority table (utils/src/priority.rs)."""
    path = Path("/dev/shm") / region
    if not path.exists():
        return None
    data = path.read_bytes()
    # After the table's 64-byte header, the 16 devices' lines, then the slots.
    header, devices, pods_per_device, line = 64, 16, 64, 64
    key = pod_key(pod)
    out = None
    for slot in range(devices * pods_per_device):
        offset = header + devices * line + slot * line
        fields = struct.unpack_from("<QIIQQQQQQ", data, offset)
        if fields[0] != key:
            continue
        out = out or {"held_ns": 0, "held_launches": 0, "queue_ns": 0, "queue_samples": 0,
                      "queue_max_ns": 0}
        out["held_ns"] += fields[4]
        out["held_launches"] += fields[5]
        out["queue_ns"] += fields[6]
        out["queue_samples"] += fields[7]
        out["queue_max_ns"] = max(out["queue_max_ns"], fields[8])
    return out


# ---------------------------------------------------------------- driver


class Bench:
    """Runs the workers as the harness's processes (a log each in OUT), waits
    for their ready=1, gives them a common start time and reads their results."""

    def __init__(self, args):
        self.args = args
        self.lib = str(Path(args.lib).resolve())
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.settings = common.settings(self.lib, self.out)
        self.log = open(self.out / "priority-bench.log", "w")
        self.serial = 0

    def env(self, cls, region, extra):
        env = common.clean_env()
        pod = None
        if cls is not None:
            self.serial += 1
            pod = f"prio-{os.getpid()}-{self.serial}"
            env.update(LD_PRELOAD=self.lib, CUDA_LIMITER_CLASS=cls, CUDA_LIMITER_POD=pod,
                       CUDA_LIMITER_LOG="warn", GPUSHARE_PRIORITY_REGION=region,
                       GPUSHARE_NODE_REGION=region + "-node")
            env.update(extra)
        return env, pod

    def run(self, name, **kwargs):
        """One run (see `run_once`); a run that fails is reported and
        left out, and the others go on."""
        try:
            return self.run_once(name, **kwargs)
        except Exception as error:  # noqa: BLE001 - every failure is reported
            print(f"  {name}: FAILED: {error}", flush=True)
            self.log.write(f"== {name} FAILED: {error}\n")
            return {"error": str(error)}

    def run_once(self, name, latency=None, batch=None, size=None, extra=None, arrivals="fixed",
                 between=None, phase_ms=0):
        """One run: latency and/or batch workers; None = absent, "" = no
        limiter, else the class. With `between` (a callable), the batch
        worker starts first; once it is ready (CUDA up), `between()` runs,
        then the latency worker starts. With `phase_ms`, the batch worker
        works and idles in turns of that long (workers.batch_phases)."""
        self.serial += 1
        region = f"gpushare-priority-bench-{os.getpid()}-{self.serial}"
        seconds = self.args.seconds
        procs = {}
        pods = {}
        roles = (("latency", latency), ("batch", batch))
        if between is not None:
            roles = roles[::-1]
        results = {}
        clocks = None
        try:
            ready_roles = set()
            for role, cls in roles:
                if cls is None:
                    continue
                if role == "latency" and between is not None and "batch" in procs:
                    self.wait_ready(name, "batch", procs["batch"])
                    ready_roles.add("batch")
                    between()
                env, pod = self.env(cls or None, region, extra or {})
                argv = [sys.executable, str(common.WORKERS), role,
                        "--seconds", str(seconds + (1.0 if role == "latency" and batch is not None else 0)),
                        "--period-us", str(self.args.period_us), "--arrivals", arrivals]
                if role == "batch":
                    argv += ["--size", str(size), "--phase-ms", str(phase_ms)]
                procs[role] = proc.Proc(self.settings, cls or "base", pod or "-",
                                        self.out / f"worker-{self.serial}-{role}.log",
                                        READY_S + seconds + 120, argv, env=env, stdin=True).start()
                pods[role] = pod
            for role, p in procs.items():
                if role not in ready_roles:
                    self.wait_ready(name, role, p)
            start = time.monotonic() + START_S
            clocks = clock_sampler()
            for p in procs.values():
                p.tell(f"{start}\n")
            for role, p in procs.items():
                p.wait()
                self.log.write(f"== {name} {role}\n{tail(p, 20000)}\n")
                lines = [l for l in p.text().splitlines() if l.startswith("{")]
                if p.rc != 0 or not lines:
                    raise RuntimeError(f"{name}: {role} failed ({p.rc}{p.note}): {tail(p)}")
                results[role] = json.loads(lines[-1])
            clocks.stop()
            # The window the bars count (the batch pod's run, when there is one).
            results["gpu"] = gpu_window(clocks, start, start + seconds)
            for role, pod in pods.items():
                if pod:
                    results[role]["counters"] = self.counters(region, pod)
        finally:
            if clocks is not None:
                clocks.stop()
            for p in procs.values():
                p.stop()
            for suffix in ("", "-node"):
                Path(f"/dev/shm/{region}{suffix}").unlink(missing_ok=True)
            for pod in pods.values():
                if pod:
                    self.forget(pod)
            self.log.flush()
        lat = results.get("latency")
        if lat is not None and batch is not None:
            # Only the steps inside the batch pod's window.
            keep = [i for i, s in enumerate(lat["starts"]) if s < seconds]
            for key in ("starts", "steps_us", "gpu_us"):
                lat[key] = [lat[key][i] for i in keep]
        print(f"  {name}: {summary(results)}", flush=True)
        return results

    def counters(self, region, pod):
        """A run's priority counters of `pod` (table `region`)."""
        return priority_counters(region, pod)

    def forget(self, pod):
        """Removes what a run's pod left in /dev/shm."""
        common.remove_pod_regions(pod)

    @staticmethod
    def wait_ready(name, role, p):
        """Waits for a worker's ready=1 (its CUDA is up)."""
        if not proc.wait_ready([p], READY_S):
            raise RuntimeError(f"{name}: {role} not ready: {tail(p)}")


def clock_sampler():
    """The GPU's SM clock and power draw while a run lasts, as nvidia-smi
    reads them every 100 ms, each sample stamped as it arrives (a card held
    at its power limit lowers its clock, and every kernel on it runs
    slower)."""
    return Sampler(["clocks.sm", "power.draw"], 100, gpu=0)


def gpu_window(clocks, start, end):
    """The medians of the samples taken in [start, end] and the samples
    themselves, their times from `start`: {"sm_mhz", "power_w", "samples",
    "series"}, or None without any. The clock and the power are a sample's
    first two fields; a sampler may read more after them."""
    series = clocks.between(start, end)
    if not series:
        return None
    return {"sm_mhz": median(s[1] for s in series), "power_w": median(s[2] for s in series),
            "samples": len(series), "series": series}


def tail(p, size=2000):
    """The end of a worker's log, its result line left out."""
    return "\n".join(l for l in p.text().splitlines() if not l.startswith("{"))[-size:]



def clocks(run):
    """A run's SM clock and board power (clock_sampler's medians) as text;
    "" without samples."""
    gpu = (run or {}).get("gpu")
    return f"SM {gpu['sm_mhz']:.0f} MHz, {gpu['power_w']:.0f} W" if gpu else ""


def summary(results):
    parts = []
    lat = results.get("latency")
    if lat:
        parts.append(f"latency p50 {pct(lat['steps_us'], .5):.0f} us p99 {pct(lat['steps_us'], .99):.0f} us"
                     f" ({len(lat['steps_us'])} steps)")
    bat = results.get("batch")
    if bat:
        parts.append(f"batch {bat['per_s']:.1f} matmuls/s (kernel {bat['kernel_ms']:.3f} ms)")
    if results.get("gpu"):
        parts.append(clocks(results))
    return "; ".join(parts)


def add_arguments(p):
    common.limiter_arguments(p)
    p.add_argument("--out", default=os.environ.get("OUT") or "priority-bench-out")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--period-us", type=float, default=2000)
    p.add_argument("--sizes", type=int, nargs=2, default=[4096, 8192], metavar=("SHORT", "LONG"))
    p.add_argument("--quick", action="store_true")


def main(p, args):
    args.lib = common.limiter(p, args)
    if args.quick:
        args.seconds = 3.0
    bench = Bench(args)
    t_begin = time.monotonic()
    short, long_ = args.sizes
    print(f"priority bench: {args.seconds:.0f} s per run, a request every {args.period_us:.0f} us,"
          f" batch matmuls {short}^2 and {long_}^2", flush=True)
    runs = {}
    runs["latency alone"] = bench.run("latency alone", latency="")
    runs["latency alone, limiter"] = bench.run("latency alone, limiter", latency="latency")
    for size in (short, long_):
        runs[f"batch alone {size}"] = bench.run(f"batch alone {size}", batch="", size=size)
        runs[f"unlimited {size}"] = bench.run(f"latency + unlimited batch {size}", latency="", batch="", size=size)
        runs[f"priority {size}"] = bench.run(f"latency + batch {size}, classes", latency="latency",
                                             batch="batch", size=size)
    runs[f"priority {short} window 2"] = bench.run(
        f"latency + batch {short}, classes, window 2", latency="latency", batch="batch", size=short,
        extra={"CUDA_LIMITER_PRIORITY_WINDOW": "2"})
    runs[f"priority {short} no prediction"] = bench.run(
        f"latency + batch {short}, classes, prediction off", latency="latency", batch="batch",
        size=short, extra={"CUDA_LIMITER_PRIORITY_PREDICT": "0"})
    runs["latency alone poisson"] = bench.run("latency alone, Poisson arrivals", latency="",
                                              arrivals="poisson")
    runs[f"priority {short} poisson"] = bench.run(
        f"latency + batch {short}, classes, Poisson arrivals", latency="latency", batch="batch",
        size=short, arrivals="poisson")
    report(args, runs, time.monotonic() - t_begin)


def report(args, runs, took):
    out = Path(args.out)
    failed = [name for name, run in runs.items() if "error" in run]
    (out / "priority-bench.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    if "latency alone" in failed:
        print(f"\nno baseline: the latency pod alone failed; failed runs: {failed}")
        return
    alone = runs["latency alone"]["latency"]
    p50_alone, p99_alone = pct(alone["steps_us"], .5), pct(alone["steps_us"], .99)
    busy_gpu = sum(alone["gpu_us"]) / (alone["seconds"] * 1e6)
    busy_wall = sum(alone["steps_us"]) / (alone["seconds"] * 1e6)
    bar_gpu, bar_wall = 0.8 * (1 - busy_gpu), 0.8 * (1 - busy_wall)
    short, long_ = args.sizes
    rows = []
    verdicts = []

    def latency_cells(lat):
        p50, p99 = pct(lat["steps_us"], .5), pct(lat["steps_us"], .99)
        return p50, p99, f"{p50:.0f} ({p50 / p50_alone:.2f}x)", f"{p99:.0f} ({p99 / p99_alone:.2f}x)"

    rows.append(("latency alone", f"{p50_alone:.0f}", f"{p99_alone:.0f}", "", "", "",
                 f"busy gpu {busy_gpu:.3f}, wall {busy_wall:.3f}"))
    if "error" not in runs["latency alone, limiter"]:
        _, _, c50, c99 = latency_cells(runs["latency alone, limiter"]["latency"])
        rows.append(("latency alone, limiter (class latency)", c50, c99, "", "", "", "the limiter's cost"))
    for key, label, size in [(f"unlimited {short}", "+ unlimited batch", short),
                             (f"priority {short}", "+ batch, classes", short),
                             (f"priority {short} window 2", "+ batch, classes, window 2", short),
                             (f"priority {short} no prediction", "+ batch, classes, prediction off", short),
                             (f"priority {short} poisson", "Poisson arrivals: + batch, classes", short),
                             (f"unlimited {long_}", "+ unlimited batch", long_),
                             (f"priority {long_}", "+ batch, classes", long_)]:
        run, alone_run = runs[key], runs[f"batch alone {size}"]
        if "error" in run or "error" in alone_run:
            rows.append((f"{label} ({size}^2 matmuls)", "failed", "", "", "", "", run.get("error", alone_run.get("error", ""))[-200:].replace("\n", " ").replace("|", "/")))
            continue
        lat, bat = run["latency"], run["batch"]
        batch_alone = alone_run["batch"]
        if key.endswith("poisson"):
            # Against the latency pod alone under the same arrivals.
            base = runs["latency alone poisson"]
            if "error" in base:
                rows.append((f"{label} ({size}^2 matmuls)", "no Poisson baseline", "", "", "", "", ""))
                continue
            p50_base, p99_base = pct(base["latency"]["steps_us"], .5), pct(base["latency"]["steps_us"], .99)
            p50, p99 = pct(lat["steps_us"], .5), pct(lat["steps_us"], .99)
            c50 = f"{p50:.0f} ({p50 / p50_base:.2f}x of {p50_base:.0f})"
            c99 = f"{p99:.0f} ({p99 / p99_base:.2f}x of {p99_base:.0f})"
        else:
            p50, p99, c50, c99 = latency_cells(lat)
        ratio = bat["per_s"] / batch_alone["per_s"]
        counters = bat.get("counters") or {}
        lat_counters = lat.get("counters") or {}
        note = []
        if counters:
            note.append(f"batch held {counters['held_ns'] / 1e9 / args.seconds:.1%} of the time"
                        f" ({counters['held_launches']} launches)")
        if lat_counters and lat_counters.get("queue_samples"):
            note.append(f"latency queueing delay mean {lat_counters['queue_ns'] / lat_counters['queue_samples'] / 1e3:.0f} us,"
                        f" max {lat_counters['queue_max_ns'] / 1e3:.0f} us")
        verdict = ""
        if key == f"priority {short}":
            ok50, ok99, okt = p50 <= 1.2 * p50_alone, p99 <= 2 * p99_alone, ratio >= bar_gpu
            verdict = ("PASS" if ok50 and ok99 and okt else "FAIL") + \
                f" (p50 {'ok' if ok50 else 'over'}, p99 {'ok' if ok99 else 'over'}, throughput {'ok' if okt else 'under'};" \
                f" throughput vs wall bar {'ok' if ratio >= bar_wall else 'under'})"
            verdicts.append(verdict)
        rows.append((f"{label} ({batch_alone['kernel_ms']:.2f} ms kernels)", c50, c99,
                     f"{bat['per_s']:.1f} / {batch_alone['per_s']:.1f}", f"{ratio:.3f}",
                     f"{bar_gpu:.3f} (wall {bar_wall:.3f})", "; ".join(note) + (" " + verdict if verdict else "")))
    head = ("| run | latency p50 us (vs alone) | p99 us (vs alone) | batch matmuls/s (with / alone) |"
            " ratio | bar 0.8x(1-busy) | notes |\n|---|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Priority classes, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run"
            f" ({took:.0f} s in all)\n\n{table}\nCriteria (~0.2 ms batch kernels): {verdicts[0] if verdicts else 'n/a'}\n"
            + (f"Failed runs: {', '.join(failed)}\n" if failed else ""))
    (out / "priority-bench.md").write_text(text)
    (out / "priority-bench.json").write_text(json.dumps(
        {"args": vars(args), "busy_gpu": busy_gpu, "busy_wall": busy_wall, "runs": runs}, indent=1))
    print()
    print(text)
