"""The GPU benchmarks' entry point, from the repository root on the GPU
machine (Python 3, PyTorch, nvcc, nvidia-smi; the bundle of
scripts/make-gpu-bundle.sh):

  python3 -m scripts.bench SUBCOMMAND [options]   (SUBCOMMAND --help: its options)
"""
import argparse
import ast
import os
import sys

from . import (checkpoint_limit, common, compute, corun, corun_ab, corun_frontier, launch, packing, priority, serve,
               swap)

TORCH_MODES = ("decode", "decode-ab", "triton", "graph")


def add_torch_arguments(p):
    p.add_argument("mode", choices=TORCH_MODES)
    p.add_argument("seconds", metavar="SECONDS", help="seconds (decode-ab: generations)")


def main_torch(p, args):
    # The program itself in this process's place: what the benches run.
    script = str(common.TORCH_WORKLOADS)
    os.execv(sys.executable, [sys.executable, script, args.mode, args.seconds])


def torch_doc():
    """torch_workloads.py's docstring, read without importing it (it imports torch)."""
    return ast.get_docstring(ast.parse(common.TORCH_WORKLOADS.read_text()))


# name: (what it measures, its help, options, run)
SUBCOMMANDS = {
    "checkpoint-limit": ("how large a process the driver's checkpoint takes on this host, and the host memory it needs",
                         checkpoint_limit.__doc__, checkpoint_limit.add_arguments, checkpoint_limit.main_cli),
    "compute": ("the compute limit's rows, without and with the limiter", compute.__doc__,
                compute.add_arguments, compute.main),
    "priority": ("priority classes: a latency pod beside a batch pod", priority.__doc__,
                 priority.add_arguments, priority.main),
    "corun": ("co-run mode (MPS) against time slicing and classes", corun.__doc__,
              corun.add_arguments, corun.main),
    "corun-ab": ("what a batch neighbour costs a co-run latency pod, inside one process", corun_ab.__doc__,
                 corun_ab.add_arguments, corun_ab.main),
    "corun-frontier": ("co-run mode's trade-off for each share of SMs kept", corun_frontier.__doc__,
                       corun_frontier.add_arguments, corun_frontier.main),
    "launch-ab": ("the launch path's cost inside one process, admission off and on", launch.__doc__,
                  launch.add_ab_arguments, launch.main_ab),
    "launch-cost": ("where the launch path's cost goes, per window and per limiter build", launch.__doc__,
                    launch.add_cost_arguments, launch.main_cost),
    "packing": ("N pods packed on one GPU, time-sliced and co-run: throughput, shares, the daemon's cost",
                packing.__doc__, packing.add_arguments, packing.main),
    "serve": ("many models on one GPU served from a Zipf/Poisson trace: time to the first result, swaps, memory",
              serve.__doc__, serve.add_arguments, serve.main),
    "swap": ("pods swapped to host memory and back: time, content, first request, overcommit", swap.__doc__,
             swap.add_arguments, swap.main),
    "torch": ("one PyTorch or Triton workload, as the compute bench runs it (one key=value line)", torch_doc(),
              add_torch_arguments, main_torch),
}


def parser():
    """The entry point's parser and each subcommand's, by name."""
    top = argparse.ArgumentParser(prog="python3 -m scripts.bench", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    subs = {}
    for name, (what, doc, add, _) in SUBCOMMANDS.items():
        subs[name] = sub.add_parser(name, help=what, description=doc,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add(subs[name])
    return top, subs


def main(argv=None):
    top, subs = parser()
    args = top.parse_args(argv)
    return SUBCOMMANDS[args.command][3](subs[args.command], args) or 0


if __name__ == "__main__":
    # As the shell wrappers had it: progress lines at once, through a pipe
    # too, in the benches and in the programs they run.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
