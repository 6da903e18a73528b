"""Many models on one GPU, served from a request trace: N inference pods,
each a PyTorch model of W GiB of fp16 weights made up from a seed (no
download; swap_pod.py `serve`: a stack of 8192x8192 linear layers), under
the limiter on GPU 0, the daemon (`hypervisor serve`, [swap] overcommit,
the serving policy's settings) deciding which stay resident. Results: a
Markdown table on stdout and in OUT/serve-bench.md, one row per (pods,
path, load); every request's row, the daemon's swap counts and metrics,
and the samples in OUT/serve-bench.json; the daemons' and pods' logs in
OUT (default: a temporary folder, printed at the end).

  python3 -m scripts.bench serve --bundle DIR [--sizes 4,8,12,16] [--weights 12]
          [--loads 2,4,8] [--duration 12] [--zipf 1.0] [--seed 1] [--path fast]
          [--baseline largest] [--headroom GIB] [--min-resident-ms MS]
          [--swap-key KEY=VALUE ...] [--budget-s 540] [--out DIR] [--dry-run]

Each run (one per count of pods, the most first): a daemon with
`[swap] overcommit` on GPU 0, idle_after_ms (default 200: a pod that
answered is idle), host_limit, `headroom` (GPU memory kept free ahead of
need, default one pod's weights and context: a request to a swapped pod
then waits for its swap-in, not for a swap-out) and `min_resident_ms`
(a pod brought back stays that long unless nothing else can go; default
250, so that a pod brought back for one request, keeping its host
copies, can be the one that goes again, by a copy only); the pods
started one by one, each once the one before answered
(--start-together: all at once) (path fast: with
CUDA_LIMITER_FAST_SWAP=1; checkpoint: the driver's checkpoint), each
answering its 8 inputs once loaded (resident, before any swap: the
reference). Then, per load (requests a second over all pods), a trace of
Poisson arrivals for --duration seconds, each request to a pod drawn by
Zipf(s) popularity (ranks dealt to the pods from the seed) with one of
the inputs; requests are sent as they arrive whatever is in flight, a
pod answers its own in order; a request to a swapped pod waits for its
swap-in (the limiter holds its first CUDA call). Per load: p50/p95/p99
of the time from a request's arrival to its answer, answers a second,
the daemon's swaps in and out a second (its status), GPU 0's memory in
use (nvidia-smi, most), the host memory of swapped pods and of the
copies resident pods keep (the daemon's status, most), out-of-memory
errors, and whether every answer is identical to its model's reference
(also the same model's in every run). The baseline: the same pods, the
same traces, overcommit off, for the most pods whose models all fit the
GPU (--baseline all: every such count). The last line names the most
pods served with p99 <= 1.5 s and p50 <= 0.5 s at every load, no
out-of-memory error, every request answered, every answer identical.

Host memory: the daemon's host_limit is what /proc/meminfo gives as
available, less 1.5 GiB for each pod's process and 8 GiB for the system;
a run whose swapped pods need more is not run, and says so. A daemon
that refuses a [swap] key (a build without the serving policy) stops the
bench at once with the key's name. Everything started is stopped at the
end, on failure too; --budget-s bounds the whole (runs and loads that no
longer fit are not run). --dry-run starts nothing and needs no GPU: the
plan, each load's trace, the daemons' configs (checked by the bundle's
`hypervisor check-config` when --bundle is given).
"""
import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from . import serve_plan
from .serve_report import report
from .serve_run import INPUTS, Reference, model_seed, pod_name, serve_run
from .serve_trace import popularity, trace, trace_seed
from .swap_bench import GIB, Bench, BenchError, config_text, gib, gpu_memory, host_available

# An H200's memory as nvidia-smi reports it (143771 MiB): the dry run's GPU.
H200_MIB = 143771
# --headroom's default, filled in once the weights are known: one pod's.
ONE_POD = object()


def numbers(kind, minimum):
    """An argparse type: numbers of `kind` separated by commas, each above `minimum`."""
    def parse(text):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"numbers separated by commas, not {text!r}")
        if not values or min(values) <= minimum:
            raise argparse.ArgumentTypeError(f"at least one number, each above {minimum}, not {text!r}")
        return values
    return parse


def optional(kind):
    """An argparse type: a number of `kind`, or "none" (the key left out)."""
    def parse(text):
        if text.strip().lower() == "none":
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number or none, not {text!r}")
        if value < 0:
            raise argparse.ArgumentTypeError(f"a number from 0, or none, not {text!r}")
        return value
    return parse


def swap_key(text):
    try:
        return serve_plan.extra_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def add_arguments(p):
    p.add_argument("--bundle", help="the bundle folder: libcuda_limiter.so, hypervisor (a dry run: optional)")
    p.add_argument("--out", help="folder of the results and logs (default: a new temporary folder)")
    p.add_argument("--sizes", type=numbers(int, 0), default=[4, 8, 12, 16],
                   help="counts of pods, one run each (default 4,8,12,16)")
    p.add_argument("--weights", type=float, default=12.0, help="GiB of fp16 weights a pod's model holds (default 12)")
    p.add_argument("--loads", type=numbers(float, 0), default=[2.0, 4.0, 8.0],
                   help="requests a second over all pods, one load each, in this order (default 2,4,8)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals a load (default 12)")
    p.add_argument("--zipf", type=float, default=1.0, help="the popularity's Zipf exponent s (default 1.0)")
    p.add_argument("--seed", type=int, default=1, help="the traces' seed (default 1)")
    p.add_argument("--path", choices=("fast", "checkpoint"), default="fast",
                   help="fast: pods with CUDA_LIMITER_FAST_SWAP=1; checkpoint: the driver's checkpoint (default fast)")
    p.add_argument("--baseline", choices=serve_plan.BASELINES, default="largest",
                   help="all-resident runs: of the most pods that fit the GPU, of every count that fits, or none"
                        " (default largest)")
    p.add_argument("--headroom", type=optional(float), default=ONE_POD, metavar="GIB",
                   help="[swap] headroom, GiB (none: left out; default one pod's weights and context)")
    p.add_argument("--min-resident-ms", type=optional(int), default=250, metavar="MS",
                   help="[swap] min_resident_ms (none: left out; default 250)")
    p.add_argument("--swap-key", type=swap_key, action="append", default=[], metavar="KEY=VALUE",
                   help="one more [swap] key of the overcommit runs, VALUE as TOML (again for more)")
    p.add_argument("--idle-after-ms", type=int, default=200, help="[swap] idle_after_ms (default 200)")
    p.add_argument("--start-together", action="store_true",
                   help="start every pod at once (default: one by one, each once the one before answered)")
    p.add_argument("--drain-s", type=float, default=15.0,
                   help="seconds after a load's end for its answers; later: unanswered (default 15)")
    p.add_argument("--limiter-log", default="info",
                   help="the pods' CUDA_LIMITER_LOG (default info; debug says why an allocation was refused)")
    p.add_argument("--budget-s", type=float, default=540,
                   help="the whole run's time: runs and loads that no longer fit are not run (default 540)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the plan, the traces, the configs")
    p.add_argument("--gpu-gib", type=float, help="a dry run's GPU memory, GiB (default an H200's, 140.4)")
    p.add_argument("--host-gib", type=float, help="a dry run's available host memory, GiB (default this host's)")


def resolve(p, args):
    """Checks the bundle; fills the headroom's default and the folder."""
    if args.bundle:
        for name in ("libcuda_limiter.so", "hypervisor"):
            if not (Path(args.bundle) / name).is_file():
                p.error(f"no {Path(args.bundle) / name}")
    elif not args.dry_run:
        p.error("--bundle is required (but for --dry-run)")
    args.weight_bytes = serve_plan.weight_bytes(args.weights)
    if args.headroom is ONE_POD:
        args.headroom = serve_plan.footprint(args.weight_bytes) / GIB
    args.headroom_bytes = None if args.headroom is None else int(args.headroom * GIB) // (256 << 20) * (256 << 20)
    args.keys = serve_plan.swap_keys(args.headroom_bytes, args.min_resident_ms, args.swap_key)
    args.out = args.out or tempfile.mkdtemp(prefix="serve-bench-")
    Path(args.out).mkdir(parents=True, exist_ok=True)


def check_config(hypervisor, path, text):
    """`hypervisor check-config` of the config `text` (written to path);
    BenchError that names the key where the daemon refuses one."""
    path.write_text(text)
    out = subprocess.run([str(hypervisor), "check-config", "--config", str(path)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode == 0:
        return
    said = (out.stderr + out.stdout).strip()
    unknown = re.search(r"unknown field `([^`]+)`", said)
    if unknown:
        key = unknown.group(1)
        option = {serve_plan.HEADROOM_KEY: "--headroom none",
                  serve_plan.MIN_RESIDENT_KEY: "--min-resident-ms none"}.get(key, f"no --swap-key {key}=...")
        raise BenchError(f"the daemon {hypervisor} refuses [swap] {key}: it does not know the key (a build without"
                         f" the serving policy?); use a bundle that has it, or run with {option}. It said:"
                         f" {said[-300:]}")
    raise BenchError(f"the daemon {hypervisor} refuses the config {path}: {said[-300:]}")


def plan_of(args, gpu_free, available):
    return serve_plan.runs(args.sizes, args.weight_bytes, gpu_free, available, args.headroom_bytes or 0,
                           args.baseline, len(args.loads), args.duration, args.path)


def config_of(args, run):
    quotas = {pod_name(run, i): run.quota for i in range(run.pods)}
    overcommit = run.kind == "overcommit"
    return config_text(quotas, args.idle_after_ms, run.host_limit or GIB, overcommit,
                       args.keys if overcommit else None)


def describe(run):
    what = (f"{run.pods} pods, {run.kind}: quota {gib(run.quota)} GiB each; about {run.estimate_s:.0f} s")
    if run.kind == "overcommit":
        what += f"; host_limit {gib(run.host_limit)} GiB, {run.swapped_at_start} swapped once all are loaded"
    return what + (f"; not run: {run.skip}" if run.skip else "") + (f"; WARNING: {run.warning}" if run.warning else "")


def dry_run(args):
    """The plan, each load's trace and the configs, nothing started."""
    gpu_free = int((args.gpu_gib or H200_MIB / 1024) * GIB)
    available = int(args.host_gib * GIB) if args.host_gib else host_available()
    out = Path(args.out)
    print(f"serve bench, dry run ({args.path} path): GPU {gib(gpu_free)} GiB, host {gib(available)} GiB available;"
          f" [swap] keys {args.keys}; out {out}")
    plan = plan_of(args, gpu_free, available)
    for run in plan:
        print(f"  {describe(run)}")
        if run.skip:
            continue
        config = out / f"serve-{run.pods}-{run.kind}-hypervisor.toml"
        if args.bundle:
            check_config(Path(args.bundle) / "hypervisor", config, config_of(args, run))
        else:
            config.write_text(config_of(args, run))
        shares = popularity(run.pods, args.zipf, f"serve-{args.seed}-{run.pods}-popularity")
        for k, rate in enumerate(args.loads):
            requests = trace(shares, rate, args.duration, INPUTS, trace_seed(args.seed, run.pods, k))
            pods = {r.pod for r in requests}
            top = max((sum(1 for r in requests if r.pod == p) for p in pods), default=0)
            print(f"    {rate:g} req/s: {len(requests)} requests to {len(pods)} of {run.pods} pods (the most asked:"
                  f" {top})")
    total = sum(r.estimate_s for r in plan if not r.skip)
    print(f"  about {total:.0f} s of {args.budget_s:g} s; configs in {out}"
          + (f", checked by {Path(args.bundle) / 'hypervisor'}" if args.bundle else ""))
    return 0


def wait_gpu_idle(used_before, limit_s=30.0):
    """Until GPU 0 uses no more than before the bench plus 1 GiB (the last
    run's processes gone), limit_s at most."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and gpu_memory()[1] > used_before + GIB:
        time.sleep(0.5)


def main(p, args):
    resolve(p, args)
    if args.dry_run:
        try:
            return dry_run(args)
        except BenchError as e:
            print(f"serve bench: {e}")
            return 2
    started = time.monotonic()
    out = Path(args.out)
    try:
        total, used, free = gpu_memory()
        available = host_available()
        plan = plan_of(args, free, available)
        first = next((r for r in plan if r.kind == "overcommit" and not r.skip), None)
        if first:
            check_config(Path(args.bundle) / "hypervisor", out / "serve-check.toml", config_of(args, first))
    except BenchError as e:
        print(f"serve bench: {e}")
        return 2
    print(f"serve bench ({args.path} path): GPU 0 {gib(total)} GiB ({gib(free)} GiB free), host {gib(available)} GiB"
          f" available; {gib(args.weight_bytes)} GiB of weights a pod; loads {args.loads} req/s, {args.duration:g} s"
          f" each; Zipf({args.zipf:g}), seed {args.seed}; [swap] keys {args.keys}; out {out}", flush=True)
    b = Bench(args)
    reference, results = Reference(), []
    try:
        for run in plan:
            result = {"pods": run.pods, "kind": run.kind, "path": args.path, "quota": run.quota,
                      "host_limit": run.host_limit, "loads": []}
            results.append(result)
            print(describe(run), flush=True)
            if run.skip or b.left() < run.estimate_s:
                result["skipped"] = run.skip or f"about {run.estimate_s:.0f} s needed, {b.left():.0f} s left"
                continue
            try:
                wait_gpu_idle(used)
                serve_run(b, run, args.weight_bytes, reference, args.keys, result)
            except Exception as e:  # the run's row says why; the next run goes on
                result["failed"] = f"{type(e).__name__}: {e}"
                print(f"{run.pods} pods, {run.kind}: FAILED: {result['failed']}", flush=True)
    finally:
        b.remove_tables()
    took = time.monotonic() - started
    text = (f"Serve bench, {args.path} path: {gib(args.weight_bytes)} GiB of weights a pod, Zipf({args.zipf:g}),"
            f" {args.duration:g} s a load, seed {args.seed} ({took:.0f} s)\n\n{report(results, reference.conflicts)}")
    (out / "serve-bench.md").write_text(text)
    (out / "serve-bench.json").write_text(json.dumps(
        {"args": vars(args), "seconds": took, "gpu": {"total": total, "free": free}, "host_available": available,
         "model_seeds": [model_seed(i) for i in range(max(args.sizes))], "reference_conflicts":
         reference.conflicts, "runs": results}, indent=1, default=str))
    print()
    print(text)
    print(f"raw rows: {out / 'serve-bench.json'}; logs: {out}")
    return 0
