#!/usr/bin/env python3
"""A test double of what the benchmarks (scripts/bench) run, for their dry
runs here (no GPU, no nvcc, no PyTorch): linked under each program's name
(nvidia-smi, nvcc, compute_bench, workers.py, torch_workloads.py,
packing_kernels, packing_infer.py), it prints
the lines the real program prints, with the numbers a working limiter gives
when the limiter's variables are set. Only for scripts/gpu/selftest: it shows
that every benchmark's plumbing runs and parses; it says nothing about the
limiter.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # hvctl
import hvctl  # noqa: E402

E = os.environ
LIMIT = int(E["CUDA_DEVICE_SM_LIMIT"]) if "LD_PRELOAD" in E and "CUDA_DEVICE_SM_LIMIT" in E else 100
SMI = {"clocks.sm": "1980", "power.draw": "300.50", "utilization.gpu": "42"}


def out(**kv):
    print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True)


PMON = ["# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command",
        "# Idx           #    C/G      %      %      %      %      %      %    name",
        "    0       4242     C     30      4      -      -      -      -    fake",
        "    0       4243     C      -      -      -      -      -      -    fake",
        "    0          -      -      -      -      -      -      -      -    -"]


def nvidia_smi(args):
    if args[:1] == ["pmon"]:
        while True:  # every 50 ms, not every second: the tests stay short
            print("\n".join(PMON), flush=True)
            time.sleep(0.05)
    query = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--query-gpu=")), [])
    if "-lms" in args:
        period = int(args[args.index("-lms") + 1]) / 1000
        print("[N/A]", flush=True)  # a line that is not numbers: skipped
        while True:
            print(", ".join(SMI.get(q, "1") for q in query), flush=True)
            time.sleep(period)
    if query == ["pci.bus_id"]:
        print("00000000:00:00.0")


def nvcc(args):
    # The "build": the fake as the program of the binary's name (a script:
    # the bench runs the binary's resolved path).
    binary = args[args.index("-o") + 1]
    name = os.path.basename(binary)
    with open(binary, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.realpath(__file__)}" {name} "$@"\n')
    os.chmod(binary, 0o755)


def compute_bench(args):
    mode, share = args[0], LIMIT / 100
    if mode == "shapes":
        out(mode=mode, launches_per_s=40000 * (share if args[3] == "0" else 1), gpu_busy=0.05)
    elif mode == "calibrate":
        out(mode=mode, iters=1000)
    elif mode == "fixed":
        out(mode=mode, kernels_per_s=1000 * share, kernel_us=1000)
    elif mode == "tight":
        out(mode=mode, ns_per_launch=2000 if LIMIT == 100 else 2100)
    elif mode == "pace":
        windows = int(args[3]) if len(args) > 3 else 1
        out(mode=mode, ns_per_iter=21000, call_ns=4000,
            **{f"{k}{w}": v for w in range(windows) for k, v in (("iter", 21000 + w), ("call", 4000 + w))})
    elif mode == "mimic":
        out(mode=mode, **{f"r{r}m{m}": f"{21000 + m}.00/{4000 + m}.00" for r in range(2) for m in range(5)})
    elif mode == "pace-ab":
        out(mode=mode, **{f"{k}_{arm}": v + (10 if arm == "full" else 0) for arm in ("full", "bypass")
                          for k, v in (("call", 4000), ("iter", 21000), ("mean", 4100), ("p99", 9000),
                                       ("p999", 20000))})


def torch_workloads(args):
    mode = args[0]
    if mode == "decode":
        time.sleep(0.2)  # a few nvidia-smi samples
        out(mode=mode, tokens=2560, wall_s="10.000", tokens_per_s="256.0", cpu_probe_ms="50.0")
    elif mode == "decode-ab":
        out(mode=mode, generations=args[1], step_cost_pct_median="+0.100", step_cost_pct="+0.10,-0.20,+0.30")
    else:  # triton, graph: 90% busy without a limit, L% of the GPU's time with one
        per_s = 100 * LIMIT / 90 if LIMIT < 100 else 100
        out(mode=mode, iterations=100, wall_s="1.000", iterations_per_s=f"{per_s:.2f}", busy_share="0.9000")


def workers(args):
    role, opt = args[0], dict(zip(args[1::2], args[2::2]))
    seconds, period = float(opt["--seconds"]), float(opt.get("--period-us", 2000)) / 1e6
    print("ready=1", flush=True)
    start = float(sys.stdin.readline())
    while time.monotonic() < start + min(seconds, 0.1):
        time.sleep(0.01)
    if role == "latency":
        starts = [i * period for i in range(int(seconds / period))]
        steps = [300.0 + (i % 10) for i in range(len(starts))]
        print(json.dumps({"role": role, "starts": starts, "steps_us": steps, "gpu_us": [100.0] * len(starts),
                          "late": 0, "seconds": seconds, "l2": None}), flush=True)
    else:
        print(json.dumps({"role": role, "size": int(opt["--size"]), "matmuls": 400, "elapsed": seconds,
                          "per_s": 400 / seconds, "kernel_ms": 0.2}), flush=True)


def packing_kernels(args):
    if args[0] == "calibrate":
        out(result=1, iters=1000, grid=132, sms=132, blocks_per_sm=1, kernel_us="450.00")
    else:  # run ITERS GRID SECONDS
        packing_worker(float(args[3]), 2000)


def packing_infer(args):  # SECONDS
    # With PACKING_KERNEL_TIME, the window as CUPTI would time it: its kernels ran 40% of it.
    timed = {"kernel_busy": "0.40000", "kernels": 8000, "kernels_lost": 0, "gaps_3us": "0.05000",
             "gaps_3us_n": 7000, "gaps_10us": "0.02000", "gaps_longer": "0.01000"}
    packing_worker(float(args[0]), 4000, step_ms="0.2100", gpu_busy="0.9000",
                   **(timed if E.get("PACKING_KERNEL_TIME") else {}))


def packing_worker(seconds, rate, **extra):
    """A packing worker: registered with the daemon as the limiter does it,
    ready, its window from the start time on stdin, `rate` a second in it;
    then, told its returns, one admission request at the start of each, as
    a limiter's first launch after idle may make."""
    url, token, pod = (E.get(k) for k in ("CUDA_LIMITER_HYPERVISOR", "CUDA_LIMITER_TOKEN", "CUDA_LIMITER_POD"))
    registered = None
    if url and token and pod:
        body = json.dumps({"pod": pod, "pid": os.getpid()})
        code, text = hvctl.request(f"{url}/api/v1/workers", "POST", token, timeout=5.0, body=body)
        if code != 200:
            sys.exit(f"registration refused ({code}): {text}")
        registered = json.loads(text)
    print("ready=1", flush=True)
    start = float(sys.stdin.readline())
    while time.monotonic() < start + seconds:
        time.sleep(0.01)
    count = int(rate * seconds)
    out(result=1, count=count, per_s=f"{count / seconds:.3f}", launched=count, drain_s="0.000000", **extra)
    words = sys.stdin.readline().split()
    if words[:1] != ["returns"]:
        return
    at, times, period = float(words[1]), int(words[2]), float(words[3])
    for c in range(times):
        while time.monotonic() < at + c * period:
            time.sleep(0.005)
        if registered:
            body = json.dumps({"worker_id": registered["worker_id"], "uuid": registered["devices"][0]["uuid"],
                               "cost_ns": 100_000})
            code, text = hvctl.request(f"{url}/api/v1/admission", "POST", token, timeout=5.0, body=body)
            if code != 200:
                sys.exit(f"admission refused ({code}): {text}")
    out(returns=times)


def main():
    args = sys.argv
    if os.path.basename(args[0]) == "fakebench.py":  # fakebench.py NAME ARGS...
        args = args[1:]
    globals()[os.path.basename(args[0]).replace("-", "_").removesuffix(".py")](args[1:])


if __name__ == "__main__":
    main()
