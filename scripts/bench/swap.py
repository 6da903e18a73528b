"""Swapping pods to host memory and back on a real GPU, in one run: the
daemon (`hypervisor serve`, [swap] overcommit on) manages the pods; each
pod is a program of swap_pod.py under the limiter, on GPU 0. Results: a
Markdown table on stdout and in OUT/swap-bench.md, raw numbers in
OUT/swap-bench.json, the daemon's logs and the pods' in OUT (default: a
temporary folder, printed at the end).

  python3 -m scripts.bench swap --bundle DIR [--sizes 1,8,32] [--rounds 3] [--quick] [--path fast|both]
          [--overcommit PODSxGIB] [--out DIR] [--parts bandwidth,swap,infer,overcommit,move] [--budget-s 450]

Parts (a part that fails prints FAILED and why, and the run goes on):
1. bandwidth: pinned host memory <-> the GPU with torch, without the
   limiter (the physical limit): 4 GiB (less when host memory is short),
   GiB/s, median of 5 each way.
2. swap: per size S, a pod (quota S+4 GiB) holds S GiB of seeded random
   tensors; ROUNDS times: swap-out and swap-in through the admin API (the
   HTTP call's time and the daemon's last_swap_out_s/last_swap_in_s; GiB/s
   of what moved, the process's device memory as the daemon counts it),
   nvidia-smi's MiB of the process before, while swapped (expect none) and
   after; then the digests and a matmul recomputed on the GPU (bit-exact
   against those before any swap), and the quota (quota - S - 1 GiB more is
   granted, 2 GiB beyond that refused).
3. infer: an inference pod (quota 16 GiB, ~8 GiB of fp16 layers): a request
   after 3 s idle (T0) and a request right after a swap-out (T1: the
   limiter holds its first CUDA call and the daemon swaps the pod in),
   timed by the pod and by the bench; outputs bit-exact.
4. overcommit: three pods of quota 0.5xM each (M: GPU 0's memory), each
   holding ~0.45xM once it works (less where two of them would not fit
   the host memory), or the pods --overcommit says (5x30: five of 30 GiB,
   quota 32), served in turn twice (1,2,3,1,2,3) with pauses longer than
   idle_after_ms, the host copies of two pods prepared ahead of their
   swap-out ([swap] prepare_ahead): no out-of-memory anywhere, digests
   identical across a pod's turns; each request's time and the swaps the
   daemon made.
5. move (two GPUs or more): a pod on GPU 0 (quota 8+4 GiB, seen by the
   pod as its only GPU) holding 8 GiB is moved to GPU 1 and back through
   the admin API (POST …/pods/POD/move), then GPU 0 is drained (POST
   …/gpus/0/drain); each time: the seconds, nvidia-smi's GPU for the
   process, the UUID its CUDA device 0 reports, the digests and the quota.
   One GPU: not run.
6. limit (only when --parts names it): the largest pod this host takes
   (host_limit raised to the host's memory, so that the host itself is
   the limit): a pod holding what the host's available memory less 8 GiB
   allows (and the GPU has) is swapped out and back, contents checked; a
   pod holding more than the host has available less the daemon's 4 GiB
   reserve is refused up front, with the daemon's reason, and runs on.
7. frameworks (only when --parts names it): per workload of swap_fw_pod.py
   (PyTorch with a CUDA graph, with expandable segments, with
   cudaMallocAsync; JAX; CuPy; Triton), a pod holding about 1 GiB swapped
   out and back: the path each swap took (where the fast path is asked
   for and a process holds memory its limiter does not back, the daemon
   falls back to the checkpoint and says why), nvidia-smi while swapped,
   and the results recomputed after, bit-identical.
8. cost (only when --parts names it): what CUDA_LIMITER_FAST_SWAP=1 costs
   a pod that never swaps (swap_cost.py): allocations and a PyTorch
   training step, processes without and with it alternated, the paired
   differences' mean with a 95% confidence interval. The launch path's
   cost for pods never swapped: `python3 -m scripts.bench launch-ab`.

Paths (--path): checkpoint (the default), the pods as they are; fast, the
pods run with CUDA_LIMITER_FAST_SWAP=1; both: the bandwidth part once, the
swap part on the checkpoint path then on the fast path (each with a daemon
and pods of its own, their logs in OUT/checkpoint and OUT/fast), the other
parts on the fast path. The report of both adds a table of the swap part's
two paths side by side, a row per size; in swap-bench.json the swap part's
results are then {"checkpoint": RESULTS, "fast": RESULTS}, each as the
swap part of one path gives them ({SIZE: figures, "totals", "metrics"}, or
{"failed": why}), and args.path is "both".

Targets: swap-in of 8 GiB <= 2 s; a swapped pod's first request <= 3 s;
stretch: swap bandwidth >= 50% of pinned. With the defaults the run should
take 4 to 6 minutes, mostly checkpoints (1.4 to 2.3 GiB/s on an H100 and an
H200, driver 580) and restores; --quick: sizes 1,8 and 2 rounds. A swap, or
a request waiting for one, that does not answer within a minute and 4 s a
GiB fails (the daemon's swaps are then not tried again until the next
part's daemon), and --budget-s bounds the whole run.
"""
import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

from .swap_bench import Bench, gib, guarded
from .swap_cost import part_cost
from .swap_frameworks import part_frameworks
from .swap_parts import part_bandwidth, part_infer, part_limit, part_move, part_overcommit, part_swap
from .swap_report import PATHS, report


def parse_sizes(text):
    """"1,8,32" -> [1.0, 8.0, 32.0]: GiB, each > 0."""
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers of GiB separated by commas, not {text!r}")
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"at least one size, each above 0, not {text!r}")
    return sizes


PARTS = ("bandwidth", "swap", "infer", "overcommit", "move", "limit", "frameworks", "cost")
# limit fills the host, frameworks needs JAX, CuPy and Triton, cost takes
# minutes of its own: only when asked.
DEFAULT_PARTS = PARTS[:5]


def parse_overcommit(text):
    """"5x30" -> (5, 30.0): pods (2 or more) and the GiB each holds (> 0)."""
    try:
        pods, size = text.lower().split("x")
        pods, size = int(pods), float(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not PODSxGIB: {text!r}") from None
    if pods < 2 or size <= 0:
        raise argparse.ArgumentTypeError(f"two pods or more, of more than 0 GiB: {text!r}")
    return pods, size


def add_arguments(p):
    p.add_argument("--bundle", required=True, help="the bundle folder: libcuda_limiter.so, hypervisor")
    p.add_argument("--out", help="folder of the results and logs (default: a new temporary folder)")
    p.add_argument("--sizes", type=parse_sizes, help="GiB a pod holds in the swap part (default 1,8,32)")
    p.add_argument("--rounds", type=int, help="swap cycles per size (default 3)")
    p.add_argument("--quick", action="store_true", help="sizes 1,8 and 2 rounds (unless given)")
    p.add_argument("--path", choices=(*PATHS, "both"), default="checkpoint",
                   help="checkpoint: the pods as they are, swapped by the driver's checkpoint; fast: the pods run"
                        " with CUDA_LIMITER_FAST_SWAP=1, their limiters moving their memory themselves; both: the"
                        " swap part on each path in turn (checkpoint, then fast), reported side by side, the"
                        " bandwidth part once, the other parts on the fast path; the run takes longer, give it"
                        " more --budget-s (default checkpoint)")
    p.add_argument("--infer-rounds", type=int, default=5, help="requests resident and swapped (default 5)")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle time before a resident request (default 3)")
    p.add_argument("--overcommit", type=parse_overcommit, metavar="PODSxGIB",
                   help="the overcommit part's pods: how many, and the GiB each holds (e.g. 5x30: five pods"
                        " of 30 GiB, each with a quota of 2 GiB more); default three pods of 0.45x the GPU's"
                        " memory")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"which parts to run of {','.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    p.add_argument("--limiter-log", default="info",
                   help="the pods' CUDA_LIMITER_LOG (default info; debug says why an allocation was refused)")
    p.add_argument("--budget-s", type=float, default=450,
                   help="the run's time: a swap that does not answer fails within it, and parts left then"
                        " are not run (default 450)")


def resolve(p, args):
    """Fills the defaults that depend on --quick; checks the bundle and --parts."""
    args.sizes = args.sizes or ([1.0, 8.0] if args.quick else [1.0, 8.0, 32.0])
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}; known: {','.join(PARTS)}")
    for name in ("libcuda_limiter.so", "hypervisor"):
        if not (Path(args.bundle) / name).is_file():
            p.error(f"no {Path(args.bundle) / name}")
    args.out = args.out or tempfile.mkdtemp(prefix="swap-bench-")
    Path(args.out).mkdir(parents=True, exist_ok=True)


def paths_line(path):
    """The path or paths a run measures, as its first line and its report say."""
    if path == "both":
        return "checkpoint and fast paths: the swap part on each, the other parts on the fast path"
    return f"{path} path"


@contextlib.contextmanager
def on_path(b, path, out=None):
    """Within it, the pods start on `path` (Bench.start_pod reads
    args.path for their environment) and, where `out` is given, the
    daemon's and the pods' files go to that folder; both restored after."""
    asked, folder = b.args.path, b.out
    b.args.path, b.out = path, Path(out or folder)
    b.out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        b.args.path, b.out = asked, folder


def run_swap(b, bandwidth):
    """The swap part on the run's path; for both, on each path in turn,
    each with its logs in OUT/PATH: {path: its results}."""
    if b.args.path != "both":
        return guarded("swap", part_swap, b, bandwidth)
    results = {}
    for path in PATHS:
        print(f"swap part, {path} path:", flush=True)
        with on_path(b, path, b.out / path):
            results[path] = guarded(f"swap ({path} path)", part_swap, b, bandwidth)
    return results


def main(p, args):
    resolve(p, args)
    started = time.monotonic()
    b = Bench(args)
    results = {}
    print(f"swap bench ({paths_line(args.path)}): sizes {[f'{s:g}' for s in args.sizes]} GiB, {args.rounds} rounds; host memory for"
          f" swapped pods {gib(b.host_limit)} GiB; out {args.out}", flush=True)
    try:
        bandwidth = {}
        if "bandwidth" in args.parts:
            bandwidth = results["bandwidth"] = guarded("bandwidth", part_bandwidth, b)
        if "swap" in args.parts:
            results["swap"] = run_swap(b, bandwidth)
        # A run of both paths runs the other parts once, on the fast path.
        others = (("infer", part_infer), ("overcommit", part_overcommit), ("move", part_move),
                  ("limit", part_limit), ("frameworks", part_frameworks), ("cost", part_cost))
        with on_path(b, "fast" if args.path == "both" else args.path):
            for name, part in others:
                if name in args.parts:
                    results[name] = guarded(name, part, b)
        print("no cost for pods never swapped: measured by `python3 -m scripts.bench launch-ab`", flush=True)
    finally:
        # Each part stops its pods and its daemon and removes the regions.
        b.remove_tables()
    took = time.monotonic() - started
    text = f"Swap bench, {paths_line(args.path)} ({took:.0f} s)\n\n{report(results, args.sizes)}"
    out = Path(args.out)
    (out / "swap-bench.md").write_text(text)
    (out / "swap-bench.json").write_text(json.dumps({"args": vars(args), "seconds": took, **results},
                                                    indent=1, default=str))
    print()
    print(text)
    print(f"raw numbers: {out / 'swap-bench.json'}; logs: {out}")
    return 0
