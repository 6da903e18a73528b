#!/usr/bin/env python3
"""What a batch neighbour costs a co-run latency pod, measured inside one
latency process: the batch pod works and idles in turns, and the latency
pod's steps while it works are compared with its steps while it idles.
Results: a Markdown table on stdout and in OUT/corun-ab.md, raw numbers in
OUT/corun-ab.json.

Usage: corun_ab.py --bundle DIR [--out DIR] [--reserve R] [--seconds S]
                   [--phase-ms P] [--settle-ms W] [--sizes N N] [--period-us P]
                   [--mps-control PATH]

Why: the latency step (four eager PyTorch matmuls) is host-bound, and on
these machines its p50 moves by up to 2x from one process to the next and
within one (corun_frontier.py). A ratio between two processes cannot be
read to the 20% of the co-run bar; alternated phases of one process can.

Runs, each for S seconds (20) with the daemon of corun_bench.py (both pods
configured, R% of the SMs kept, 20): the batch pod alone (no MPS, no
limiter), in the same turns, per batch size (its throughput while it works);
the latency pod alone (no MPS, no limiter), a whole run; then per batch size
the latency pod as its MPS client under the limiter (on the reserve, as the
daemon gives it beside a batch pod) beside the batch pod in turns of P ms
(1,000), and again as an MPS client on every SM (without the limiter).
Steps that start in the first W ms (100) of a turn are left out: the batch
pod's last kernels drain and the clock settles then. Per cycle (a working turn and
the idle turn after it) the ratio of the two turns' p50; the figure is the
median of those ratios with a bootstrap 95% interval over the cycles.
"""
import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corun_bench as cb  # noqa: E402
import priority_bench as pb  # noqa: E402

med = statistics.median


def turns(run, seconds, phase, settle):
    """The latency steps of `run` by cycle: [(working, idle)], each a list
    of step times in us, leaving out the first `settle` s of each turn."""
    lat = run["latency"]
    cycles = {}
    for start, step in zip(lat["starts"], lat["steps_us"]):
        k = int(start // phase)
        if start >= seconds or start - k * phase < settle:
            continue
        cycles.setdefault(k // 2, ([], []))[k % 2].append(step)
    return [c for _, c in sorted(cycles.items()) if c[0] and c[1]]


def interval(ratios, draws=10000, seed=1):
    """The bootstrap 95% interval of the median of `ratios`."""
    rng = random.Random(seed)
    meds = sorted(med(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main():
    p = argparse.ArgumentParser()
    cb.common_args(p, "corun-ab", 20.0)
    p.add_argument("--reserve", type=int, default=20)
    p.add_argument("--phase-ms", type=float, default=1000)
    p.add_argument("--settle-ms", type=float, default=100)
    args = p.parse_args()
    bundle, control = cb.prepare(args)
    bench = cb.CorunBench(args)
    t_begin = time.monotonic()
    print(f"co-run A/B: {args.seconds:.0f} s per run, turns of {args.phase_ms:.0f} ms, {args.reserve}% kept,"
          f" batch matmuls {args.sizes[0]}^2 and {args.sizes[1]}^2", flush=True)
    runs = {f"batch alone {size}": bench.run(f"batch alone {size}, in turns", batch="", size=size,
                                             phase_ms=args.phase_ms) for size in args.sizes}
    work = Path(tempfile.mkdtemp(prefix="corun-ab-"))
    daemon = cb.Daemon(bundle, work, args.reserve, control)
    bench.daemon = daemon
    try:
        daemon.set_pods(["batch", "latency"])
        runs["latency alone"] = bench.run("latency alone", latency="")
        for size in args.sizes:
            for kind, cls in (("client", "corun-latency"), ("whole", "corun-latency-at-100")):
                runs[f"{kind} {size}"] = bench.run(f"latency ({kind}) + batch {size} in turns", latency=cls,
                                                   batch="corun-batch", size=size, phase_ms=args.phase_ms)
    finally:
        daemon.stop()
        shutil.copy(work / "hypervisor.log", Path(args.out) / "hypervisor.log")
        shutil.rmtree(work, ignore_errors=True)
    if cb.mps_processes():
        print(f"MPS processes left: {cb.mps_processes()}", flush=True)
    report(args, runs, time.monotonic() - t_begin)


def report(args, runs, took):
    phase, settle = args.phase_ms / 1e3, args.settle_ms / 1e3
    alone = runs.get("latency alone", {}).get("latency")
    a50 = pb.pct(alone["steps_us"], .5) if alone else float("nan")
    rows, raw = [], []
    for size in args.sizes:
        solo = runs[f"batch alone {size}"].get("batch")
        for kind, label in (("client", f"MPS client, limiter, on the {args.reserve}% reserve"),
                            ("whole", "MPS client on every SM, no limiter")):
            run = runs.get(f"{kind} {size}", {})
            if "latency" not in run or "batch" not in run or not solo:
                rows.append((f"{size}^2", label, "failed", "", "", "", "", "", ""))
                continue
            cycles = turns(run, args.seconds, phase, settle)
            if not cycles:
                rows.append((f"{size}^2", label, "no cycles", "", "", "", "", "", ""))
                continue
            ratios = [pb.pct(w, .5) / pb.pct(i, .5) for w, i in cycles]
            lo, hi = interval(ratios)
            working = [s for w, _ in cycles for s in w]
            idle = [s for _, i in cycles for s in i]
            ratio = run["batch"]["per_s"] / solo["per_s"]
            rows.append((f"{size}^2 ({solo['kernel_ms']:.2f} ms)", label, str(len(cycles)),
                         f"{pb.pct(idle, .1):.0f} / {pb.pct(idle, .5):.0f} / {pb.pct(idle, .99):.0f}",
                         f"{pb.pct(working, .1):.0f} / {pb.pct(working, .5):.0f} / {pb.pct(working, .99):.0f}",
                         f"{med(ratios):.3f} [{lo:.3f}, {hi:.3f}]",
                         f"{pb.pct(idle, .5) / a50:.2f}x", f"{ratio:.3f}", pb.clocks(run)))
            raw.append(f"{size}^2, {label}: p50 working/idle us by cycle "
                       f"{[f'{pb.pct(w, .5):.0f}/{pb.pct(i, .5):.0f}' for w, i in cycles]};"
                       f" batch {run['batch']['per_s']:.1f}/s against {solo['per_s']:.1f}/s alone in the same turns")
    if alone:
        raw.append(f"latency alone (no MPS, no limiter, another process): p10/p50/p99"
                   f" {pb.pct(alone['steps_us'], .1):.0f}/{a50:.0f}/{pb.pct(alone['steps_us'], .99):.0f} us,"
                   f" {pb.clocks(runs['latency alone'])}")
    head = ("| batch | latency pod | cycles | idle turns p10 / p50 / p99 us | working turns p10 / p50 / p99 us |"
            " p50 working / idle, median [95%] | idle p50 / alone p50 (two processes) | batch / solo |"
            " SM clock, power |\n|---|---|---|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Co-run A/B, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run, turns of"
            f" {args.phase_ms:.0f} ms ({args.settle_ms:.0f} ms left out each), {args.reserve}% kept"
            f" ({took:.0f} s in all)\n\n{table}\n" + "".join(f"- {v}\n" for v in raw))
    cb.publish(args, "corun-ab", text, {"runs": runs})


if __name__ == "__main__":
    main()
