"""The launch path's cost, taken apart on the GPU machine; both run
compute_bench.cu (built with nvcc; NVCC overrides it), every process pinned
like the compute bench's runs.

  python3 -m scripts.bench launch-ab LIMITER_AB.so [PACE_S] [DECODE_S] [--out DIR]
    The paced loop and the decode loop with the limiter's admission switched
    off and on between launches inside one process (pace: every other pair
    of launches; decode: every other pair of steps), so that the host's
    drift, which moves whole runs by more than the limiter costs, and the
    process's memory layout are the same for both arms. Needs a limiter built
    with the `launch-ab` feature (scripts/make-gpu-bundle.sh with AB=1:
    gpu-bundle/libcuda_limiter_ab.so), never a shipped one. Runs processes of
    each for PACE_S (default 90) and DECODE_S (default 150) seconds, at L=50
    (does not bind) unless LAUNCH_AB_LIMITS says otherwise, and prints the
    medians of the per-process differences with the 95% interval of their
    mean. Raw lines go to OUT (--out, else $OUT, else a temporary folder) as
    pace-ab.txt and decode-ab.txt. LAUNCH_AB_LIMITS (default
    CUDA_DEVICE_SM_LIMIT=50) sets the limits the processes run under (e.g.
    CUDA_DEVICE_MEMORY_LIMIT=40g: the launch path of a pod with a memory
    quota alone); GPUSHARE_LAUNCH_AB_PART=first-launch makes the switch take
    out only the check of a library's first use at a launch, not the whole
    admission.

  python3 -m scripts.bench launch-cost [--seconds S] LIMITER.so... [--out DIR]
    The 20 us cadence row, taken apart: the paced loop (20 us of host work,
    one empty launch) in 4 consecutive windows of 6,000 iterations per
    process (`compute_bench pace 20 6000 4`), one process without a limiter
    and one per LIMITER.so (CUDA_DEVICE_SM_LIMIT=50, which does not bind) in
    rotating order until S seconds (default 300) passed; prints each arm's
    per-window medians and change against no limiter. Pass limiters built
    with a part of the launch path cut out to see what that part costs; the
    windows show whether a process speeds up as it runs (without a limiter
    it does, by ~2% of the launch call).
  python3 -m scripts.bench launch-cost --mimic [--seconds S] [--out DIR]
    The limiter's sample mimicked in an unlimited process (`compute_bench
    mimic 6000 2`): each mode's iteration and launch call against the plain
    windows of the same process, in its first round and in its second.
    Raw lines go to OUT/launch-cost.txt when --out (or $OUT) is given.
"""
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.gpu.e2e.harness.parse import fields, mean_halfwidth
from scripts.gpu.e2e.harness.parse import median as med

from . import common

# ---------------------------------------------------------------- launch-ab


def add_ab_arguments(p):
    p.add_argument("lib", metavar="LIMITER_AB.so", help="a limiter built with --features launch-ab")
    p.add_argument("pace_s", metavar="PACE_S", nargs="?", type=float, default=90)
    p.add_argument("decode_s", metavar="DECODE_S", nargs="?", type=float, default=150)
    p.add_argument("--out", default=os.environ.get("OUT"), help="raw lines (default: $OUT, else a temporary folder)")


def ab_limits(p):
    """LAUNCH_AB_LIMITS's VAR=VALUE words (default CUDA_DEVICE_SM_LIMIT=50)."""
    words = (os.environ.get("LAUNCH_AB_LIMITS") or "CUDA_DEVICE_SM_LIMIT=50").split()
    if not all("=" in w for w in words):
        p.error(f"LAUNCH_AB_LIMITS: VAR=VALUE words, not {words}")
    return dict(w.split("=", 1) for w in words)


def repeat(seconds, argv, out, env_of):
    """Runs argv (pinned), one fresh pod per process, until `seconds`
    passed; their stdout in the file `out`. A process that fails is only
    one line fewer."""
    n = 0
    end = time.monotonic() + seconds
    with open(out, "w") as f:
        while time.monotonic() < end:
            n += 1
            pod = f"launch-ab-{os.getpid()}-{n}"
            subprocess.run(argv, stdout=f, env=env_of(pod))
            common.remove_pod_regions(pod)


def main_ab(p, args):
    lib = os.path.realpath(args.lib)
    if not os.path.isfile(lib):
        p.error(f"no {lib}")
    limits = ab_limits(p)
    with common.build_folder("launch-ab") as build:
        out = Path(args.out or build)
        out.mkdir(parents=True, exist_ok=True)
        binary = common.build_compute_bench(build)
        pin = ["taskset", "-c", common.gpu_local_cpus()]

        # A pod named in LAUNCH_AB_LIMITS (one a daemon serves) is kept;
        # otherwise every process is a fresh pod of its own.
        fixed_pod = limits.get("CUDA_LIMITER_POD")

        def env_of(pod):
            return {**os.environ, "LD_PRELOAD": lib, **limits, "CUDA_LIMITER_POD": fixed_pod or pod}

        repeat(args.pace_s, [*pin, binary, "pace-ab", "20", "40000"], out / "pace-ab.txt", env_of)
        repeat(args.decode_s, [*pin, sys.executable, str(common.TORCH_WORKLOADS), "decode-ab", "8"],
               out / "decode-ab.txt", env_of)
        lines = ab_report((out / "pace-ab.txt").read_text(), (out / "decode-ab.txt").read_text())
    if not lines:
        sys.exit("no results: is the limiter built with --features launch-ab?")
    print("\n".join(lines))
    return 0


def rows(text, mode):
    return [f for f in map(fields, text.splitlines()) if f.get("mode") == mode]


def summary(values, digits=1):
    return (f"median {med(values):+.{digits}f}, mean {statistics.mean(values):+.{digits}f}"
            f" +- {mean_halfwidth(values):.{digits}f}")


def ab_report(pace_text, decode_text):
    """The lines launch-ab prints; none without results."""
    lines = []
    pace = rows(pace_text, "pace-ab")
    if pace:
        call = [float(r["call_full"]) - float(r["call_bypass"]) for r in pace]
        iters = [(float(r["iter_full"]) / float(r["iter_bypass"]) - 1) * 100 for r in pace]
        bypass = med(float(r["call_bypass"]) for r in pace)
        lines.append(f"pace-ab, {len(pace)} processes: launch call, full - bypass, ns: {summary(call)} "
                     f"(bypass {bypass:.0f} ns); iteration, %: {summary(iters, 2)}")
        for name in ("mean", "p99", "p999"):
            diff = [float(r[f"{name}_full"]) - float(r[f"{name}_bypass"]) for r in pace]
            lines.append(f"  launch call's {name}, full - bypass, ns: {summary(diff)}")
    decode = rows(decode_text, "decode-ab")
    costs = [float(x) for r in decode for x in r["step_cost_pct"].split(",")]
    if costs:
        lines.append(f"decode-ab, {len(decode)} processes, {len(costs)} generations: step time, full over bypass, %: "
                     f"{summary(costs, 2)}")
    return lines


# ---------------------------------------------------------------- launch-cost


def add_cost_arguments(p):
    p.add_argument("limiters", metavar="LIMITER.so", nargs="*")
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--mimic", action="store_true", help="the limiter's sample mimicked, no limiter")
    p.add_argument("--out", default=os.environ.get("OUT"), help="raw lines to OUT/launch-cost.txt")


def main_cost(p, args):
    if not args.mimic and not args.limiters:
        p.error("LIMITER.so... or --mimic")
    limiters = [os.path.realpath(lib) for lib in args.limiters]
    for lib in limiters:
        if not os.path.isfile(lib):
            p.error(f"no {lib}")
    pin = ["taskset", "-c", common.gpu_local_cpus()]
    with common.build_folder("launch-cost") as build:
        raw = Path(build) / "raw.txt"
        binary = common.build_compute_bench(build)
        end = time.monotonic() + args.seconds
        with open(raw, "w") as f:
            if args.mimic:
                while time.monotonic() < end:
                    rc = subprocess.run([*pin, binary, "mimic", "6000", "2"], stdout=f).returncode
                    if rc != 0:
                        sys.exit(f"compute_bench mimic: exit {rc}")
            else:
                arms = ["none", *limiters]
                round_ = 0
                while time.monotonic() < end:
                    for i in range(len(arms)):
                        arm = arms[(round_ + i) % len(arms)]
                        f.write(f"{cost_arm(pin, binary, arm)}\n")
                        f.flush()
                    round_ += 1
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, Path(args.out) / "launch-cost.txt")
        lines = raw.read_text().splitlines()
    text, ok = cost_report(lines, args.mimic)
    if not ok:
        sys.exit(text)
    print(text)
    return 0


def cost_arm(pin, binary, arm):
    """One process of an arm ("none": no limiter), its output after the arm's name."""
    argv = [*pin, binary, "pace", "20", "6000", "4"]
    if arm == "none":
        return "none " + subprocess.run(argv, stdout=subprocess.PIPE, text=True).stdout.rstrip("\n")
    pod = f"launch-cost-{os.getpid()}"
    env = {**os.environ, "LD_PRELOAD": arm, "CUDA_DEVICE_SM_LIMIT": "50", "CUDA_LIMITER_POD": pod}
    line = f"{os.path.basename(arm)} " + subprocess.run(argv, stdout=subprocess.PIPE, text=True,
                                                        env=env).stdout.rstrip("\n")
    common.remove_pod_regions(pod)
    return line


MIMIC_MODES = {1: "sample, read by a monitor thread", 2: "sample, read by the launching thread",
               3: "sample without the stream query", 4: "sample, events without timing"}


def cost_report(lines, mimic):
    """(the text launch-cost prints, True), or (why there is none, False)."""
    out = []
    if mimic:
        runs = []
        for line in lines:
            got = {(int(r), int(m)): (float(i), float(c))
                   for r, m, i, c in re.findall(r"r(\d)m(\d)=([\d.]+)/([\d.]+)", line)}
            if len(got) == 10:
                runs.append(got)
        if not runs:
            return "no mimic run completed", False
        out.append(f"{len(runs)} processes; each mode against the plain window of the same round")
        for r in range(2):
            for m in range(1, 5):
                it = med(x[(r, m)][0] / x[(r, 0)][0] - 1 for x in runs) * 100
                call = med(x[(r, m)][1] - x[(r, 0)][1] for x in runs)
                out.append(f"round {r} mode {m} ({MIMIC_MODES[m]}): iteration {it:+.2f}%, launch call {call:+.0f} ns")
        return "\n".join(out), True
    arms = collections.defaultdict(list)
    for line in lines:
        it = [float(x) for x in re.findall(r"iter\d=([\d.]+)", line)]
        call = [float(x) for x in re.findall(r"call\d=([\d.]+)", line)]
        if len(it) == 4 and len(call) == 4:
            arms[line.split()[0]].append((it, call))
    base = arms.pop("none", [])
    if not base:
        return "no run without a limiter completed", False

    def show(name, runs):
        its = [med(r[0][w] for r in runs) for w in range(4)]
        calls = [med(r[1][w] for r in runs) for w in range(4)]
        return its, calls, f"{name} ({len(runs)} processes): ns per iteration " + " / ".join(
            f"{x:.1f}" for x in its) + ", launch call " + " / ".join(f"{x:.1f}" for x in calls)

    b_its, b_calls, text = show("no limiter", base)
    out.append(text)
    for name, runs in arms.items():
        its, calls, text = show(name, runs)
        out.append(text)
        out.append("  against no limiter, by window: " + " / ".join(
            f"{(i / b - 1) * 100:+.2f}% ({c - bc:+.0f} ns)" for i, b, c, bc in zip(its, b_its, calls, b_calls)))
    return "\n".join(out), True
