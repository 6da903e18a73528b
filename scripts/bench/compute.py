"""Compute-limiter benchmarks on a real GPU, without and with the limiter in
one run. Every figure is a median of alternated rounds; every row
prints its raw rounds. Results: a Markdown table on stdout and in
OUT/compute-bench.md, everything in OUT/compute-bench.json.

  python3 -m scripts.bench compute --bundle DIR [--out DIR] [--only NAME ...] [--quick]
          [--cpus LIST] [--fixed-us US ...] [--rounds NAME=N ...] [--pace-iterations N] [--bin PATH]

compute_bench.cu is built with nvcc (NVCC overrides it) unless --bin names a
built one. OUT: --out, else $OUT, else a new temporary folder.

Every run, without and with the limiter alike, is pinned to the same CPUs
(--cpus, a taskset list; by default four of the GPU's local CPUs, CPU 0
left out): unpinned, the same unlimited decode loop ran at 188 and 286
tokens/s in two consecutive processes, a spread far larger than the bars.

Rows (the limit is CUDA_DEVICE_SM_LIMIT, a fresh pod per run):
  shapes-N      N distinct grid sizes, 20 us host work between launches, L=50
                (does not bind: the GPU is mostly idle): launches/s within 3%
  shapes-20s    the same with 20,000 shapes over 20 s
  saturated     3,000 shapes, no host work, L=25: share = launches/s ratio, 25 +- 2 pp
                (its own bench: --only saturated)
  fixed-US-L    fixed-work kernels of ~50 us and ~2 ms at L=10/25/50/75:
                share = kernels/s ratio, L +- 1.5 pp
  decode-L      PyTorch decode loop (torch_workloads.py decode): tokens/s at
                L=90 and 50 within 3%; at L=10 the GPU time share (nvidia-smi
                utilization.gpu) is reported
  triton-L, graph-L  saturating, memory-bound Triton softmax loop / CUDA-graph
                replay at L=20/50: GPU time share (iterations/s ratio x the
                unlimited run's busy share) L +- 2 pp
  tight, pace   200k empty launches back to back with L=50 / 6,000 x (20 us
                host work + 1 empty launch) at L=50, 240 rounds of one short
                process each (pace-no-limit 120): added cost (pace <= 1%, by
                the medians; the mean difference with its 95% interval beside
                it); pace-no-limit: the same with the limiter loaded, no
                limit. `cost` runs all three
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.gpu.e2e.harness.parse import difference_interval, fields
from scripts.gpu.e2e.harness.parse import median as med
from scripts.gpu.e2e.harness.smi import Sampler

from . import common


@dataclass
class Row:
    name: str
    what: str
    without: str
    with_: str
    expected: str
    passed: bool | None  # None: reported only
    raw: dict = field(default_factory=dict)


class Runner:
    def __init__(self, lib, binary, log, cpus):
        self.lib, self.binary, self.log, self.cpus = lib, binary, log, cpus
        self.pod = 0

    def env(self, limit):
        env = common.clean_env()
        if limit is not None:
            self.pod += 1
            env.update(
                LD_PRELOAD=self.lib,
                CUDA_LIMITER_POD=f"bench-{os.getpid()}-{self.pod}",
                CUDA_LIMITER_LOG="info",  # its exit summary goes to the log
            )
            if limit != NO_LIMIT:
                env["CUDA_DEVICE_SM_LIMIT"] = str(limit)
        return env

    def run(self, argv, limit, timeout=300):
        env = self.env(limit)
        argv = ["taskset", "-c", self.cpus, *argv]
        before = cpu_times()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        steal = steal_share(before, cpu_times())
        self.log.write(f"$ L={limit} {' '.join(argv)}\n{proc.stdout}{proc.stderr}\n")
        self.log.flush()
        pod = env.get("CUDA_LIMITER_POD")
        if pod:
            common.remove_pod_regions(pod)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("mode=")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{argv} L={limit} failed ({proc.returncode}): {proc.stderr[-400:]}")
        return {**fields(lines[-1]), "steal_pct": f"{steal:.2f}"}

    def cuda(self, args, limit, timeout=300):
        return self.run([self.binary, *map(str, args)], limit, timeout)

    def torch(self, args, limit, timeout=300):
        return self.run([sys.executable, str(common.TORCH_WORKLOADS), *map(str, args)], limit, timeout)


def cpu_times():
    """The machine's CPU time so far, and the part of it stolen by the
    hypervisor of a virtual machine (/proc/stat, in ticks)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(ticks[:8]), ticks[7] if len(ticks) > 7 else 0


def steal_share(before, after):
    """Percent of the CPU time between two cpu_times() readings that other
    guests took: a run slowed by its host's neighbours shows it."""
    total = after[0] - before[0]
    return 100.0 * (after[1] - before[1]) / total if total > 0 else 0.0


def alternate(rounds, without, with_):
    """Alternated rounds: returns (without values, with values)."""
    a, b = [], []
    for r in range(rounds):
        first, second = (without, with_) if r % 2 == 0 else (with_, without)
        x, y = first(), second()
        (a, b)[r % 2].append(x)
        (b, a)[r % 2].append(y)
    return a, b



def column(runs, key):
    """One figure of every run (the parsed key=value lines of Runner.run)."""
    return [float(run[key]) for run in runs]


ROUNDS = {}  # alternated rounds per bench, from --rounds NAME=N
NO_LIMIT = "none"  # a run's limit: the limiter loaded, no compute limit set
SAMPLE_MS = 200  # nvidia-smi's period while a run lasts


SHAPES_ITERS = 16  # FMAs per thread: ~3 us kernels, 1-10 waves


def bench_shapes(rn, quick):
    rows = []
    secs = 2 if quick else 5

    def paced(n, seconds, limit):
        # The GPU's busy share is measured after the unlimited runs only.
        return rn.cuda(["shapes", n, seconds, 20, SHAPES_ITERS, int(limit is None)], limit)

    rounds_5s = ROUNDS.get("shapes", 5)
    long_rounds = ROUNDS.get("shapes-long", 1 if quick else 3)
    for n, seconds, rounds in ((1, secs, rounds_5s), (100, secs, rounds_5s), (3000, secs, rounds_5s),
                               (20000, secs, rounds_5s), (20000, 5 if quick else 20, long_rounds)):
        free_runs, lim_runs = alternate(rounds, lambda: paced(n, seconds, None), lambda: paced(n, seconds, 50))
        free, lim = column(free_runs, "launches_per_s"), column(lim_runs, "launches_per_s")
        busy = med(column(free_runs, "gpu_busy")) * 100
        change = (med(lim) / med(free) - 1) * 100
        rows.append(Row(f"shapes-{n}-{seconds}s",
                        f"{n} distinct grid sizes, 20 us host work, {seconds} s, L=50 (GPU busy {busy:.1f}% without): launches/s",
                        f"{med(free):,.0f}", f"{med(lim):,.0f} ({change:+.2f}%)", "within 3%",
                        abs(change) <= 3, {"without": free, "with": lim, "gpu_busy_without": busy}))
    return rows


def bench_saturated(rn, quick):
    rows = []
    args = ["shapes", 3000, 2 if quick else 4, 0, 4000, 0]
    free, lim = alternate(3, lambda: float(rn.cuda(args, None)["launches_per_s"]),
                          lambda: float(rn.cuda(args, 25)["launches_per_s"]))
    share = med(lim) / med(free) * 100
    rows.append(Row("saturated-shapes", "3,000 distinct grid sizes, no host work, L=25: share = launches/s ratio",
                    f"{med(free):,.0f}/s", f"{med(lim):,.0f}/s share={share:.2f}%", "25 +- 2 pp",
                    abs(share - 25) <= 2, {"without": free, "with": lim}))
    return rows


FIXED_TARGETS = (50, 2000)  # kernel lengths in us (--fixed-us)


def bench_fixed(rn, quick):
    rows = []
    secs = 2 if quick else 3
    for target in FIXED_TARGETS:
        iters = int(rn.cuda(["calibrate", target], None)["iters"])
        for limit in (10, 25, 50, 75):
            args = ["fixed", iters, secs]
            free, lim = alternate(2, lambda: float(rn.cuda(args, None)["kernels_per_s"]),
                                  lambda: float(rn.cuda(args, limit)["kernels_per_s"]))
            share = med(lim) / med(free) * 100
            kernel_us = 1e6 / med(free)
            rows.append(Row(f"fixed-{target}us-L{limit}",
                            f"fixed-work kernels ~{kernel_us:.0f} us (iters={iters}), L={limit}: kernels/s ratio",
                            f"{med(free):,.1f}/s", f"{med(lim):,.1f}/s share={share:.2f}%", f"{limit} +- 1.5 pp",
                            abs(share - limit) <= 1.5, {"without": free, "with": lim}))
    return rows


def bench_decode(rn, quick):
    """Tokens/s of one process differ from the next far more than the bars:
    six-second runs on the H100, 209.6 to 264.4 tokens/s without a limiter in
    one call; three-second runs, 161.6 to 304.5. Each run warms up
    for 3 s (torch_workloads.py) and is measured for 5; its median SM clock
    (the GPU idles at 345 MHz; 1,980 MHz in every run measured), the share
    of CPU time the virtual machine's host stole (~0) and how long its
    thread took for a fixed Python loop (37 to 101 ms, which tokens/s
    followed) are kept beside it."""
    rows = []
    secs = 2 if quick else 5
    rounds = ROUNDS.get("decode", 2 if quick else 11)
    runs = {None: [], 90: [], 50: []}
    for r in range(rounds):
        order = [None, 90, 50] if r % 2 == 0 else [50, 90, None]
        for limit in order:
            with Sampler(["clocks.sm"], SAMPLE_MS) as sm_clock:
                result = rn.torch(["decode", secs], limit)
            runs[limit].append({**result, "sm_mhz": sm_clock.median()})
    base = column(runs[None], "tokens_per_s")
    for limit in (90, 50):
        tokens = column(runs[limit], "tokens_per_s")
        change = (med(tokens) / med(base) - 1) * 100
        raw = {"without": base, "with": tokens}
        for key in ("steal_pct", "sm_mhz", "cpu_probe_ms"):
            raw[f"{key}_without"], raw[f"{key}_with"] = column(runs[None], key), column(runs[limit], key)
        rows.append(Row(f"decode-L{limit}", f"PyTorch decode, batch 1, KV cache growing 256 steps, L={limit}, "
                                            f"{rounds} rounds of {secs} s: tokens/s",
                        f"{med(base):,.1f}", f"{med(tokens):,.1f} ({change:+.2f}%)", "within 3%",
                        abs(change) <= 3, raw))
    busy_secs = 3 if quick else 6  # 30 utilization samples
    with Sampler(["utilization.gpu"], SAMPLE_MS) as free_util:
        free = float(rn.torch(["decode", busy_secs], None)["tokens_per_s"])
    with Sampler(["utilization.gpu"], SAMPLE_MS) as lim_util:
        lim = float(rn.torch(["decode", busy_secs], 10)["tokens_per_s"])
    rows.append(Row("decode-L10", "PyTorch decode at L=10 (binds): GPU time share (nvidia-smi utilization.gpu)",
                    f"{free_util.busy_mean():.1f}% busy, {free:,.1f} tokens/s",
                    f"{lim_util.busy_mean():.1f}% busy, {lim:,.1f} tokens/s", "reported", None,
                    {"without_util": free_util.values(), "with_util": lim_util.values(),
                     "without_tokens_per_s": free, "with_tokens_per_s": lim}))
    return rows


def bench_saturating(rn, quick):
    """GPU time share of memory-bound loops: iterations/s ratio x unlimited busy share."""
    rows = []
    secs = 3 if quick else 5
    for mode in ("triton", "graph"):
        free = rn.torch([mode, secs], None)
        busy = float(free["busy_share"])
        for limit in (20, 50):
            lim = rn.torch([mode, secs], limit)
            ratio = float(lim["iterations_per_s"]) / float(free["iterations_per_s"])
            share = ratio * busy * 100
            rows.append(Row(f"{mode}-L{limit}",
                            f"{mode} loop (memory-bound), L={limit}: GPU time share = iterations/s ratio x unlimited busy share",
                            f"{free['iterations_per_s']}/s busy={busy * 100:.2f}%",
                            f"{lim['iterations_per_s']}/s share={share:.2f}%",
                            f"{limit} +- 2 pp", abs(share - limit) <= 2, {"without": free, "with": lim}))
    return rows


PACE_HOST_US = 20
PACE_ITERATIONS = 6000  # per round (--pace-iterations)
PACE_ROUNDS = {"pace": 240, "pace-no-limit": 120}  # processes per arm (--rounds)


def bench_tight(rn, quick):
    free, lim = alternate(5, lambda: float(rn.cuda(["tight", 200000], None)["ns_per_launch"]),
                          lambda: float(rn.cuda(["tight", 200000], 50)["ns_per_launch"]))
    change = (med(lim) / med(free) - 1) * 100
    return [Row("tight", "200k empty launches back to back, L=50 (binds: the launch cost itself is reported)",
                f"{med(free):.1f} ns", f"{med(lim):.1f} ns ({change:+.2f}%)", "reported", None,
                {"without": free, "with": lim})]


def pace_row(rn, quick, name, what, limit):
    """The paced loop without and with the limiter: added cost per iteration.

    The launch call's time differs from process to process far more than the
    limiter adds (3.1 to 7.8 us, the same binary, no limiter, on the H100;
    the spread narrowed without address-space randomisation, so it follows
    where things land in memory): the rounds are many short processes, and
    the verdict is the median's, with the mean difference's 95% interval
    beside it. With 40 processes an arm, the same limiter's median came out
    +0.76% and +0.35% over the unlimited one's in two calls:
    pace takes 240 an arm."""
    rounds = ROUNDS.get(name, 15 if quick else PACE_ROUNDS[name])
    args = ["pace", PACE_HOST_US, PACE_ITERATIONS]
    free_runs, lim_runs = alternate(rounds, lambda: rn.cuda(args, None), lambda: rn.cuda(args, limit))
    free, lim = column(free_runs, "ns_per_iter"), column(lim_runs, "ns_per_iter")
    free_call, lim_call = column(free_runs, "call_ns"), column(lim_runs, "call_ns")
    change = (med(lim) / med(free) - 1) * 100
    low, high = difference_interval(free, lim)
    mean_free = statistics.mean(free)
    mean_change = (statistics.mean(lim) / mean_free - 1) * 100
    # Processes whose launch call ran in the slow mode (1.5x the unlimited
    # median or more): how many there were in each arm moves the medians.
    slow_bar = 1.5 * med(free_call)
    slow_free = sum(call >= slow_bar for call in free_call)
    slow_lim = sum(call >= slow_bar for call in lim_call)
    return Row(name, f"{PACE_HOST_US} us host work + 1 empty launch x{PACE_ITERATIONS:,}, {rounds} rounds, "
                     f"{what}: ns per iteration",
               f"{med(free):.1f} ns (in the launch call {med(free_call):.0f} ns; "
               f"{slow_free} slow processes)",
               f"{med(lim):.1f} ns ({change:+.2f}%; mean {mean_change:+.2f}%, 95% interval "
               f"{low / mean_free * 100:+.2f}% to {high / mean_free * 100:+.2f}%; "
               f"in the launch call {med(lim_call):.0f} ns; {slow_lim} slow processes)",
               "added <= 1%", change <= 1,
               {"without": free, "with": lim, "call_without": free_call, "call_with": lim_call,
                "steal_pct_without": column(free_runs, "steal_pct"),
                "steal_pct_with": column(lim_runs, "steal_pct")})


def bench_pace(rn, quick):
    return [pace_row(rn, quick, "pace", "L=50 (does not bind)", 50)]


def bench_pace_no_limit(rn, quick):
    # The limiter loaded, no compute limit: its launch detours are not even
    # installed then (only the memory and driver ones), so this is what the
    # limiter's presence costs a launch, not its launch path.
    return [pace_row(rn, quick, "pace-no-limit", "limiter loaded without a compute limit", NO_LIMIT)]


def bench_cost(rn, quick):
    return bench_tight(rn, quick) + bench_pace(rn, quick) + bench_pace_no_limit(rn, quick)


BENCHES = {
    "shapes": bench_shapes,
    "saturated": bench_saturated,
    "fixed": bench_fixed,
    "decode": bench_decode,
    "saturating": bench_saturating,
    "cost": bench_cost,  # tight, pace and pace-no-limit
    "tight": bench_tight,
    "pace": bench_pace,
    "pace-no-limit": bench_pace_no_limit,
}


def table(rows):
    out = ["| row | what | without limiter | with limiter | expected | result |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        result = "INFO" if r.passed is None else ("PASS" if r.passed else "FAIL")
        out.append(f"| {r.name} | {r.what} | {r.without} | {r.with_} | {r.expected} | {result} |")
    return "\n".join(out)


def add_arguments(ap):
    common.limiter_arguments(ap)
    ap.add_argument("--bin", help="a built compute_bench (default: compute_bench.cu built with nvcc)")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="results folder (default: $OUT, else a new temporary one)")
    ap.add_argument("--only", nargs="*", choices=sorted(BENCHES))
    ap.add_argument("--quick", action="store_true", help="shorter runs, for a dry run")
    ap.add_argument("--cpus", help="taskset CPU list every run is pinned to (default: 4 GPU-local CPUs)")
    ap.add_argument("--fixed-us", nargs="+", type=int, help="fixed-work kernel lengths (default: 50 2000)")
    ap.add_argument("--rounds", nargs="+", default=[], metavar="NAME=N",
                    help="alternated rounds: shapes (5 s rows, default 5), shapes-long (20 s, 3), "
                         "decode (11), pace (240), pace-no-limit (120)")
    ap.add_argument("--pace-iterations", type=int, default=PACE_ITERATIONS,
                    help=f"iterations of the paced loop per round (default {PACE_ITERATIONS})")


def main(ap, args):
    global PACE_ITERATIONS, FIXED_TARGETS
    lib = common.limiter(ap, args)
    PACE_ITERATIONS = args.pace_iterations
    FIXED_TARGETS = tuple(args.fixed_us) if args.fixed_us else (50, 2000)
    ROUNDS.clear()
    for item in args.rounds:
        name, _, count = item.partition("=")
        ROUNDS[name] = int(count)
    cpus = args.cpus or common.gpu_local_cpus()
    print(f"[pinned to CPUs {cpus}]", file=sys.stderr, flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="compute-bench."))
    out.mkdir(parents=True, exist_ok=True)
    print(f"[results in {out}]", file=sys.stderr, flush=True)
    with (nullcontext(None) if args.bin else common.build_folder("compute-bench")) as build:
        binary = args.bin or common.build_compute_bench(build)
        return measure(args, lib, binary, cpus, out)


def measure(args, lib, binary, cpus, out):
    rows, errors = [], []
    started = time.time()
    with open(out / "compute-bench.log", "w") as log:
        rn = Runner(lib, str(Path(binary).resolve()), log, cpus)
        for name in args.only or BENCHES:
            t0 = time.time()
            try:
                rows += BENCHES[name](rn, args.quick)
            except Exception as error:  # one broken bench must not hide the others
                errors.append(f"{name}: {error}")
                rows.append(Row(name, "did not run", "-", "-", "-", False, {"error": str(error)}))
            print(f"[{name}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    md = table(rows)
    passed = sum(r.passed is True for r in rows)
    failed = sum(r.passed is False for r in rows)
    summary = f"{passed} passed, {failed} failed, {time.time() - started:.0f} s"
    (out / "compute-bench.md").write_text(md + "\n\n" + summary + "\n")
    (out / "compute-bench.json").write_text(json.dumps(
        {"rows": [asdict(r) for r in rows], "errors": errors, "summary": summary, "cpus": cpus}, indent=1))
    print(md)
    print(summary)
    for r in rows:
        print(f"raw {r.name}: {json.dumps(r.raw)}")
    return 1 if failed else 0
