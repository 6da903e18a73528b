"""The GPU benchmarks: one package, one entry point (__main__.py), run from
the repository root on the GPU machine:

  python3 -m scripts.bench SUBCOMMAND --help

They share the GPU check's harness (scripts/gpu/e2e/harness): its process
runs and readiness waits, its daemon, its nvidia-smi sampler and its
statistics. workers.py and torch_workloads.py are the programs they measure,
each run as a process of its own.
"""
