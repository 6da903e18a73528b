#!/usr/bin/env python3
"""The pods of the priority and co-run benchmarks, each run as a program of
its own (only PyTorch besides the standard library, so that it does not
depend on how the benchmark was started):

  workers.py latency --seconds S [--period-us P] [--arrivals fixed|poisson]
  workers.py batch --seconds S --size N [--phase-ms MS]

Each warms up, prints ready=1, reads the common start time (CLOCK_MONOTONIC
seconds) from stdin, works until start + S and prints one JSON line.

The latency pod: x (64x2048 bf16) through four 2048x2048 bf16 matmuls, then
torch.cuda.synchronize(): one request every P us on a fixed arrival schedule
(or exponential gaps of the same mean), each step timed on the host from its
first launch to the end of its synchronize, and on the GPU by CUDA events.
BENCH_LATENCY_CPU pins it to one CPU; BENCH_L2_PERSIST=1 puts its weights in
one block under a persisting L2 access policy window.

The batch pod: back-to-back bf16 NxN matmuls (N=4096: ~0.2 ms per kernel on
an H100, N=8192: ~2 ms; the kernel time is measured alone and printed);
throughput in matmuls/s, counted over the measured window and the drain of
its queue at the end; with --phase-ms it works and idles in turns.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time


def wait_until(t):
    """Sleeps, then spins, until time.monotonic() >= t."""
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        if left > 0.0005:
            time.sleep(left - 0.0004)


def handshake():
    """Prints ready=1, reads the common start time (CLOCK_MONOTONIC seconds)."""
    print("ready=1", flush=True)
    line = sys.stdin.readline()
    return float(line)


def worker_latency(args):
    # A fixed CPU where the runner gives one (BENCH_LATENCY_CPU), as a
    # latency pod with an exclusive core has.
    if os.environ.get("BENCH_LATENCY_CPU"):
        os.sched_setaffinity(0, {int(os.environ["BENCH_LATENCY_CPU"])})
    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device=dev)
    l2 = None
    if os.environ.get("BENCH_L2_PERSIST"):
        # The weights in one block that the step's stream marks persisting
        # in L2 (what the context's set-aside can hold of it).
        block = torch.randn(4, 2048, 2048, dtype=torch.bfloat16, device=dev) / 45
        ws = list(block.unbind(0))
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        l2 = persist_in_l2(stream.cuda_stream, block.data_ptr(), block.numel() * block.element_size())
    else:
        ws = [torch.randn(2048, 2048, dtype=torch.bfloat16, device=dev) / 45 for _ in range(4)]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def step(timed):
        if timed:
            e0.record()
        y = x
        for w in ws:
            y = y @ w
        if timed:
            e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) if timed else 0.0

    for _ in range(300):
        step(True)
    start = handshake()
    period = args.period_us / 1e6
    end = start + args.seconds
    starts, steps, gpu = [], [], []
    late = 0
    i = 0
    # Poisson arrivals: exponential gaps of the same mean, a fixed seed.
    gaps = random.Random(1)
    due = start
    while True:
        if i > 0:
            due += gaps.expovariate(1 / period) if args.arrivals == "poisson" else period
        if due >= end:
            break
        now = time.monotonic()
        if now < due:
            wait_until(due)
        else:
            late += now - due > period
        t0 = time.monotonic()
        g = step(True)
        t1 = time.monotonic()
        starts.append(t0 - start)
        steps.append((t1 - t0) * 1e6)
        gpu.append(g * 1e3)
        i += 1
    print(json.dumps({"role": "latency", "starts": starts, "steps_us": steps, "gpu_us": gpu,
                      "late": late, "seconds": args.seconds, "l2": l2}), flush=True)


def persist_in_l2(stream, base, size):
    """Sets an access policy window on `stream` over [base, base + size):
    hits persist, misses stream, with the hit ratio the context's L2
    set-aside can hold (under MPS the set-aside is the server's, fixed at its
    start). Returns {"set_aside", "window", "hit_ratio", "rc"}."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    class Window(ctypes.Structure):
        _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                    ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]

    class Value(ctypes.Union):  # CUstreamAttrValue: 64 bytes
        _fields_ = [("window", Window), ("pad", ctypes.c_char * 64)]

    set_aside, most = ctypes.c_size_t(), ctypes.c_int()
    cuda.cuCtxGetLimit(ctypes.byref(set_aside), 0x06)  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
    cuda.cuDeviceGetAttribute(ctypes.byref(most), 109, 0)  # MAX_ACCESS_POLICY_WINDOW_SIZE
    window = min(size, most.value)
    ratio = min(1.0, set_aside.value / window) if window else 0.0
    value = Value()
    value.window = Window(base, window, ratio, 2, 1)  # hits PERSISTING, misses STREAMING
    rc = cuda.cuStreamSetAttribute(ctypes.c_void_p(stream), 1, ctypes.byref(value))  # ACCESS_POLICY_WINDOW
    return {"set_aside": set_aside.value, "window": window, "hit_ratio": ratio, "rc": rc}


def worker_batch(args):
    import torch

    dev = torch.device("cuda")
    n = args.size
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev) / 64
    c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    for _ in range(10):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kernel_ms = []
    for _ in range(20):
        e0.record()
        torch.matmul(a, b, out=c)
        e1.record()
        e1.synchronize()
        kernel_ms.append(e0.elapsed_time(e1))
    start = handshake()
    wait_until(start)
    end = start + args.seconds
    if args.phase_ms:
        count, elapsed = batch_phases(torch, lambda: torch.matmul(a, b, out=c), start, end, args.phase_ms / 1e3)
    else:
        count = 0
        while time.monotonic() < end:
            for _ in range(8):
                torch.matmul(a, b, out=c)
            count += 8
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
    print(json.dumps({"role": "batch", "size": n, "matmuls": count, "elapsed": elapsed,
                      "per_s": count / elapsed, "kernel_ms": statistics.median(kernel_ms)}),
          flush=True)


def batch_phases(torch, matmul, start, end, phase):
    """Works in the even phases of `phase` seconds from `start` and idles
    in the odd ones, until `end`: at most two pairs of matmuls queued, so
    the GPU is idle soon after a phase ends. Returns (matmuls, seconds of
    work)."""
    events = [torch.cuda.Event() for _ in range(3)]
    count, busy, k = 0, 0.0, 0
    while start + 2 * k * phase < end:
        on, off = start + 2 * k * phase, min(start + (2 * k + 1) * phase, end)
        wait_until(on)
        pair = 0
        while time.monotonic() < off:
            if pair >= 2:
                events[(pair - 2) % 3].synchronize()
            matmul()
            matmul()
            events[pair % 3].record()
            pair += 1
        torch.cuda.synchronize()
        count += 2 * pair
        busy += time.monotonic() - on
        k += 1
    return count, busy


def main():
    w = argparse.ArgumentParser()
    w.add_argument("role", choices=["latency", "batch"])
    w.add_argument("--seconds", type=float, required=True)
    w.add_argument("--period-us", type=float, default=2000)
    w.add_argument("--size", type=int, default=4096)
    w.add_argument("--arrivals", choices=["fixed", "poisson"], default="fixed")
    w.add_argument("--phase-ms", type=float, default=0,
                   help="batch: work and idle in turns of this long (0: work throughout)")
    args = w.parse_args()
    return worker_latency(args) if args.role == "latency" else worker_batch(args)


if __name__ == "__main__":
    main()
