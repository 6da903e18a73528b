"""Co-run mode's trade-off on a real GPU: for each share of the SMs kept for
latency pods (the daemon's `--corun-latency-reserve`), the latency pod's step
beside a batch pod's kernels and the batch pod's throughput, in one run.
Results: a Markdown table on stdout and in OUT/corun-frontier.md, raw numbers
in OUT/corun-frontier.json.

  python3 -m scripts.bench corun-frontier --bundle DIR [--out DIR] [--reserves R ...] [--seconds S]
          [--rounds N] [--sizes N N] [--period-us P] [--mps-control PATH]
          [--pin-cpu CPU] [--whole-gpu]

The workers, pods and daemon are the co-run bench's (corun.py). First each
batch size alone (no MPS, no limiter: the solo throughput). Then per reserve,
the daemon (`hypervisor serve --corun-gpu 0 --corun-latency-reserve R`) runs
the MPS control daemon with both pods configured, and in ROUNDS rounds (2)
runs, alternated: the latency pod alone (no MPS, no limiter: the baseline),
the latency pod alone as its MPS client under the limiter (what the mode costs
a step with no neighbour; first round only), and the latency pod beside the
batch pod for each batch size. Each run reports the SM clock and the board's
power (nvidia-smi) and the step's GPU time.

With --pin-cpu, every latency worker runs on that one CPU (as a latency pod
with an exclusive core does), and each round also runs the latency pod alone
unpinned: how much of the baseline's spread is the host's. The latency pod's
client keeps to the reserve beside a batch pod; with --whole-gpu each round
also runs the latency worker as an MPS client on every SM (no limiter, the
batch pod as before): what keeping it to the reserve spares it.

What it shows: MPS keeps the reserved SMs free for the latency pod, but a
card at its power limit runs every SM at a lower clock; a larger reserve
lowers the batch pod's power, and its throughput, together. Where the bars
of the co-run bench (latency p50 <= 1.2x and p99 <= 1.5x alone, batch >= 0.85
of solo) can both hold, and with what margin, is read off this table.
"""
import time

from scripts.gpu.e2e.harness.parse import median as med
from scripts.gpu.e2e.harness.parse import percentile as pct

from . import corun as cb  # the daemon, the pods and the runner
from . import priority as pb


class FrontierBench(cb.CorunBench):
    """The co-run bench's runner with one more worker kind, `unpinned` (no MPS,
    no limiter, never pinned); with a CPU to pin, every other latency
    worker runs on it."""

    def env(self, cls, region, extra):
        if cls == "unpinned":
            return super().env(None, region, extra)
        env, pod = super().env(cls, region, extra)
        if self.args.pin_cpu is not None:
            env["BENCH_LATENCY_CPU"] = str(self.args.pin_cpu)
        return env, pod


def add_arguments(p):
    cb.common_args(p, "corun-frontier", 4.0)
    p.add_argument("--reserves", type=int, nargs="+", default=[10, 20, 25, 30, 40])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pin-cpu", type=int, help="the CPU every latency worker runs on")
    p.add_argument("--whole-gpu", action="store_true",
                   help="also run the latency client on every SM")


def main(p, args):
    args.reserve = args.reserves[0]
    bundle, control = cb.prepare(args)
    bench = FrontierBench(args)
    t_begin = time.monotonic()
    print(f"co-run frontier: reserves {args.reserves}%, {args.seconds:.0f} s per run, {args.rounds} rounds,"
          f" batch matmuls {args.sizes[0]}^2 and {args.sizes[1]}^2", flush=True)
    runs = {f"batch alone {size}": bench.run(f"batch alone {size}", batch="", size=size)
            for size in args.sizes}
    for reserve in args.reserves:
        with cb.daemon_for(args, bundle, control, reserve, f"reserve-{reserve}") as daemon:
            bench.daemon, bench.reserve, bench.seen = daemon, reserve, {}
            for r in range(args.rounds):
                runs[f"{reserve} alone #{r}"] = bench.run(f"reserve {reserve}%: latency alone, round {r + 1}",
                                                          latency="")
                if args.pin_cpu is not None:
                    runs[f"{reserve} unpinned #{r}"] = bench.run(
                        f"reserve {reserve}%: latency alone, unpinned, round {r + 1}", latency="unpinned")
                if r == 0:
                    runs[f"{reserve} client alone"] = bench.run(
                        f"reserve {reserve}%: latency alone, MPS client under the limiter",
                        latency="corun-latency")
                for size in args.sizes:
                    runs[f"{reserve} corun {size} #{r}"] = bench.run(
                        f"reserve {reserve}%: latency + batch {size}, co-run, round {r + 1}",
                        latency="corun-latency", batch="corun-batch", size=size)
                    if args.whole_gpu:
                        runs[f"{reserve} whole {size} #{r}"] = bench.run(
                            f"reserve {reserve}%: latency client on every SM + batch {size}, round {r + 1}",
                            latency="corun-latency-at-100", batch="corun-batch", size=size)
    cb.say_mps_left()
    report(args, runs, time.monotonic() - t_begin)


def latency_of(run):
    """(p50, p99, step GPU time p50, p10) of a run's latency pod, or None."""
    lat = (run or {}).get("latency")
    if not lat:
        return None
    steps = lat["steps_us"]
    return pct(steps, .5), pct(steps, .99), pct(lat["gpu_us"], .5), pct(steps, .1)


def by_round(values):
    return [f"{x[3]:.0f}/{x[0]:.0f}/{x[1]:.0f}/{x[2]:.0f}" for x in values]


def report(args, runs, took):
    rows, raw = [], []
    rounds = range(args.rounds)

    def latency_row(reserve, label, values, base, extra=("", "", "")):
        """A row of the medians of `values` (latency_of tuples) against
        `base` (the same of the latency pod alone)."""
        v = [med(x[i] for x in values) for i in range(4)]
        rows.append((f"{reserve}%", label, f"{v[3]:.0f} ({v[3] / base[3]:.2f}x)",
                     f"{v[0]:.0f} ({v[0] / base[0]:.2f}x)", f"{v[1]:.0f} ({v[1] / base[1]:.2f}x)", f"{v[2]:.0f}",
                     *extra))
        return v

    for reserve in args.reserves:
        alone = [x for x in (latency_of(runs.get(f"{reserve} alone #{r}")) for r in rounds) if x]
        if not alone:
            rows.append((f"{reserve}%", "alone failed", "", "", "", "", "", "", ""))
            continue
        base = [med(x[i] for x in alone) for i in range(4)]
        pinned = " (pinned)" if args.pin_cpu is not None else ""
        latency_row(reserve, f"latency alone{pinned}, no MPS, no limiter", alone, base,
                    ("", " / ".join(pb.clocks(runs.get(f"{reserve} alone #{r}")) for r in rounds), "baseline"))
        raw.append(f"reserve {reserve}%, alone{pinned}, p10/p50/p99/GPU us by round: {by_round(alone)}")
        unpinned = [x for x in (latency_of(runs.get(f"{reserve} unpinned #{r}")) for r in rounds) if x]
        if unpinned:
            latency_row(reserve, "latency alone, unpinned", unpinned, base)
            raw.append(f"reserve {reserve}%, alone unpinned, p10/p50/p99/GPU us by round: {by_round(unpinned)}")
        client = latency_of(runs.get(f"{reserve} client alone"))
        if client:
            latency_row(reserve, "latency alone, MPS client, limiter", [client], base,
                        ("", pb.clocks(runs.get(f"{reserve} client alone")), ""))
        for kind, label in (("corun", "co-run"), ("whole", "co-run, latency client on every SM")):
            for size in args.sizes:
                solo = runs[f"batch alone {size}"].get("batch")
                keys = [f"{reserve} {kind} {size} #{r}" for r in rounds]
                pairs = [(latency_of(runs.get(k)), runs.get(k, {}).get("batch"), k) for k in keys if k in runs]
                pairs = [(lat, bat, k) for lat, bat, k in pairs if lat and bat]
                if not pairs:
                    if any(k in runs for k in keys):
                        rows.append((f"{reserve}%", f"{label}, {size}^2", "failed", "", "", "", "", "", ""))
                    continue
                if not solo:
                    continue
                ratio = med(bat["per_s"] for _, bat, _ in pairs) / solo["per_s"]
                c = [med(lat[i] for lat, _, _ in pairs) for i in range(4)]
                ok = c[0] <= 1.2 * base[0] and c[1] <= 1.5 * base[1] and ratio >= 0.85
                latency_row(reserve, f"{label}, {solo['kernel_ms']:.2f} ms kernels", [lat for lat, _, _ in pairs],
                            base, (f"{ratio:.3f}", " / ".join(pb.clocks(runs.get(k)) for _, _, k in pairs),
                                   "both bars" if ok else "misses"))
                raw.append(f"reserve {reserve}%, {label} {size}^2, p10/p50/p99/GPU us by round:"
                           f" {by_round([lat for lat, _, _ in pairs])};"
                           f" batch {[round(bat['per_s'] / solo['per_s'], 3) for _, bat, _ in pairs]}")
    for size in args.sizes:
        run = runs[f"batch alone {size}"]
        if "batch" in run:
            raw.append(f"batch alone {size}^2: {run['batch']['per_s']:.1f} matmuls/s,"
                       f" {run['batch']['kernel_ms']:.3f} ms kernels, {pb.clocks(run)}")
    head = ("| reserve | run | latency p10 us (vs alone) | p50 | p99 | step on the GPU p50 us |"
            " batch / solo | SM clock, power | bars |\n|---|---|---|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Co-run frontier, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run,"
            f" medians of {args.rounds} rounds ({took:.0f} s in all)\n\n{table}\n"
            + "".join(f"- {v}\n" for v in raw))
    cb.publish(args, "corun-frontier", text, {"runs": runs})

