"""What a batch neighbour costs a co-run latency pod, measured inside one
latency process: the batch pod works and idles in turns, and the latency
pod's steps while it works are compared with its steps while it idles.
Results: a Markdown table on stdout and in OUT/corun-ab.md, raw numbers in
OUT/corun-ab.json.

  python3 -m scripts.bench corun-ab --bundle DIR [--out DIR] [--reserve R] [--seconds S]
          [--phase-ms P] [--settle-ms W] [--sizes N N] [--period-us P]
          [--arms A,B] [--l2-percent L] [--mps-control PATH]

Why: the latency step (four eager PyTorch matmuls) is host-bound, and on
these machines its p50 moves by up to 2x from one process to the next and
within one (corun-frontier). A ratio between two processes cannot be
read to the 20% of the co-run bar; alternated phases of one process can.

Runs, each for S seconds (20) with the co-run bench's daemon (both pods
configured, R% of the SMs kept, 20): the batch pod alone (no MPS, no
limiter), in the same turns, per batch size (its throughput while it works);
the latency pod alone (no MPS, no limiter), a whole run; then per batch size
and arm the latency pod as an MPS client beside the batch pod in turns of
P ms (1,000). The arms (--arms, client,whole):
  client  under the limiter, on the reserve, as the daemon gives it beside a
          batch pod;
  whole   on every SM, without the limiter;
  window  as client, its weights in one block under an access policy window
          that marks them persisting in L2, as much of them as the L2
          set-aside its MPS server gives a client holds (the worker reports
          the set-aside and the hit ratio);
  l2      as window, the MPS server started asking for L% (60) of the L2 set
          aside for persisting lines
          (CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT in the
          control daemon's environment: under MPS a client cannot change the
          set-aside, only the server's start sets it), its own daemon.
Steps that start in the first W ms (100) of a turn are left out: the batch
pod's last kernels drain and the clock settles then. Per cycle (a working turn and
the idle turn after it) the ratio of the two turns' p50; the figure is the
median of those ratios with a bootstrap 95% interval over the cycles. Beside
it the same ratio of the step's GPU time (CUDA events around its kernels),
the SM clock in working and in idle turns, and the ratio the clock alone
would give (per cycle, the idle turn's step with its GPU time stretched by
the idle clock over the working clock): what of the cost is the GPU's, and
how much of that the board's clock explains.
"""
import time

from scripts.gpu.e2e.harness.parse import median as med
from scripts.gpu.e2e.harness.parse import median_interval
from scripts.gpu.e2e.harness.parse import percentile as pct

from . import corun as cb
from . import priority as pb


# The latency pod's arms: (its worker's class, the L2 set-aside its MPS
# server starts with, its worker's variables, what the table calls it).
def arms(args):
    persist = {"BENCH_L2_PERSIST": "1"}
    return {
        "client": ("corun-latency", 0, {}, f"MPS client, limiter, on the {args.reserve}% reserve"),
        "whole": ("corun-latency-at-100", 0, {}, "MPS client on every SM, no limiter"),
        "window": ("corun-latency", 0, persist,
                   "as the first, weights in one block under a persisting L2 window (the server's set-aside)"),
        "l2": ("corun-latency", args.l2_percent, persist,
               f"as the window arm, the server started asking for {args.l2_percent}% of the L2 set aside"),
    }


def turn_of(t, seconds, phase, settle):
    """The turn that time `t` (s from the run's start) falls in: (cycle,
    0 working or 1 idle); None in the first `settle` s of a turn or past
    the run's `seconds`."""
    k = int(t // phase)
    if t >= seconds or t - k * phase < settle:
        return None
    return k // 2, k % 2


def turns(run, seconds, phase, settle, key="steps_us"):
    """The latency steps of `run` by cycle: [(working, idle)], each a list
    of one of the steps' figures (`key`: the step's time, or its GPU time)."""
    lat = run["latency"]
    cycles = {}
    for start, value in zip(lat["starts"], lat[key]):
        turn = turn_of(start, seconds, phase, settle)
        if turn is not None:
            cycles.setdefault(turn[0], ([], []))[turn[1]].append(value)
    return [c for _, c in sorted(cycles.items()) if c[0] and c[1]]


def turn_clocks(run, seconds, phase, settle):
    """The median SM clock (MHz) in the working turns and in the idle turns
    (the samples nvidia-smi took in them)."""
    series = ((run.get("gpu") or {}).get("series")) or []
    split = ([], [])
    for t, mhz, _ in series:
        turn = turn_of(t, seconds, phase, settle)
        if turn is not None:
            split[turn[1]].append(mhz)
    return tuple(med(s) if s else float("nan") for s in split)


def add_arguments(p):
    cb.common_args(p, "corun-ab", 20.0)
    p.add_argument("--reserve", type=int, default=20)
    p.add_argument("--phase-ms", type=float, default=1000)
    p.add_argument("--settle-ms", type=float, default=100)
    p.add_argument("--arms", default="client,whole",
                   help="the latency pod's arms, of client, whole, window, l2 (see arms())")
    p.add_argument("--l2-percent", type=int, default=60,
                   help="the l2 arm's set-aside: CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT")


def main(p, args):
    args.arms = args.arms.split(",")
    known = arms(args)
    if not args.arms or any(a not in known for a in args.arms):
        p.error(f"--arms: of {', '.join(known)}")
    bundle, control = cb.prepare(args)
    bench = cb.CorunBench(args)
    t_begin = time.monotonic()
    print(f"co-run A/B: {args.seconds:.0f} s per run, turns of {args.phase_ms:.0f} ms, {args.reserve}% kept,"
          f" batch matmuls {args.sizes[0]}^2 and {args.sizes[1]}^2, arms {', '.join(args.arms)}", flush=True)
    runs = {f"batch alone {size}": bench.run(f"batch alone {size}, in turns", batch="", size=size,
                                             phase_ms=args.phase_ms) for size in args.sizes}
    runs["latency alone"] = bench.run("latency alone", latency="")
    # One daemon per set-aside: the MPS server takes it when it starts.
    for set_aside in sorted({known[a][1] for a in args.arms}):
        env = {"CUDA_DEVICE_DEFAULT_PERSISTING_L2_CACHE_PERCENTAGE_LIMIT": str(set_aside)} if set_aside else {}
        with cb.daemon_for(args, bundle, control, args.reserve, f"l2-{set_aside}", env) as daemon:
            bench.daemon = daemon
            for size in args.sizes:
                for arm in args.arms:
                    cls, want, extra, _ = known[arm]
                    if want == set_aside:
                        runs[f"{arm} {size}"] = bench.run(f"latency ({arm}) + batch {size} in turns",
                                                          latency=cls, batch="corun-batch", size=size,
                                                          phase_ms=args.phase_ms, extra=extra)
    cb.say_mps_left()
    report(args, runs, time.monotonic() - t_begin)


def report(args, runs, took):
    phase, settle = args.phase_ms / 1e3, args.settle_ms / 1e3
    alone = runs.get("latency alone", {}).get("latency")
    a50 = pct(alone["steps_us"], .5) if alone else float("nan")
    known = arms(args)
    rows, raw = [], []
    for size in args.sizes:
        solo = runs[f"batch alone {size}"].get("batch")
        for arm in args.arms:
            label = known[arm][3]
            run = runs.get(f"{arm} {size}", {})
            if "latency" not in run or "batch" not in run or not solo:
                rows.append((f"{size}^2", label, "failed") + ("",) * 8)
                continue
            cycles = turns(run, args.seconds, phase, settle)
            if not cycles:
                rows.append((f"{size}^2", label, "no cycles") + ("",) * 8)
                continue
            ratios = [pct(w, .5) / pct(i, .5) for w, i in cycles]
            lo, hi = median_interval(ratios)
            gpu_cycles = turns(run, args.seconds, phase, settle, "gpu_us")
            gpu = [pct(w, .5) / pct(i, .5) for w, i in gpu_cycles]
            working = [s for w, _ in cycles for s in w]
            idle = [s for _, i in cycles for s in i]
            ratio = run["batch"]["per_s"] / solo["per_s"]
            busy_mhz, idle_mhz = turn_clocks(run, args.seconds, phase, settle)
            # The clock alone: the idle turn's step with its GPU time
            # stretched by the idle turn's clock over the working turn's.
            stretch = idle_mhz / busy_mhz - 1
            model = [1 + pct(gi, .5) * stretch / pct(i, .5) for (_, i), (_, gi) in zip(cycles, gpu_cycles)]
            rows.append((f"{size}^2 ({solo['kernel_ms']:.2f} ms)", label, str(len(cycles)),
                         f"{pct(idle, .1):.0f} / {pct(idle, .5):.0f} / {pct(idle, .99):.0f}",
                         f"{pct(working, .1):.0f} / {pct(working, .5):.0f} / {pct(working, .99):.0f}",
                         f"{med(ratios):.3f} [{lo:.3f}, {hi:.3f}]", f"{med(gpu):.3f}",
                         f"{busy_mhz:.0f} / {idle_mhz:.0f}", f"{med(model):.3f}",
                         f"{pct(idle, .5) / a50:.2f}x", f"{ratio:.3f}"))
            l2 = run["latency"].get("l2")
            raw.append(f"{size}^2, {label}: p50 working/idle us by cycle "
                       f"{[f'{pct(w, .5):.0f}/{pct(i, .5):.0f}' for w, i in cycles]};"
                       f" batch {run['batch']['per_s']:.1f}/s against {solo['per_s']:.1f}/s alone in the same turns;"
                       f" {pb.clocks(run)}" + (f"; L2 window {l2}" if l2 else ""))
    if alone:
        raw.append(f"latency alone (no MPS, no limiter, another process): p10/p50/p99"
                   f" {pct(alone['steps_us'], .1):.0f}/{a50:.0f}/{pct(alone['steps_us'], .99):.0f} us,"
                   f" GPU time p50 {pct(alone['gpu_us'], .5):.0f} us, {pb.clocks(runs['latency alone'])}")
    head = ("| batch | latency pod | cycles | idle turns p10 / p50 / p99 us | working turns p10 / p50 / p99 us |"
            " p50 working / idle, median [95%] | GPU time p50 working / idle, median | SM MHz working / idle |"
            " the clock alone would give | idle p50 / alone p50 (two processes) | batch / solo |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Co-run A/B, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run, turns of"
            f" {args.phase_ms:.0f} ms ({args.settle_ms:.0f} ms left out each), {args.reserve}% kept"
            f" ({took:.0f} s in all)\n\n{table}\n" + "".join(f"- {v}\n" for v in raw))
    cb.publish(args, "corun-ab", text, {"runs": runs})

