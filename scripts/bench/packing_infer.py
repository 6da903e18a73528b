#!/usr/bin/env python3
"""The infer workload of the packing bench (scripts/bench/packing.py), one
process a pod (only PyTorch besides the standard library):

  packing_infer.py SECONDS

A step: 1,024 tokens through a 4-layer MLP (4096 wide, bf16, GELU), about
0.25 ms on an H100. Warms up, prints ready=1, reads the common start time
(CLOCK_MONOTONIC seconds) from stdin, runs steps back to back from then until
start + SECONDS, and prints
  result=1 count=N per_s=R launched=L drain_s=D step_ms=S gpu_busy=B host_wait=W launch_us=U
N: the steps that completed by start + SECONDS, R = N / SECONDS, L: those
launched, D: how long after the window the last one ended, S: a step's GPU
time in the warm-up (CUDA events), B: the GPU time of the steps counted,
each from an event before it to the one after, over SECONDS (a process
alone: the fraction of the window its steps kept the GPU busy, at the
window's clock), W: the fraction of the window the thread slept waiting for
a step (near 0: the host, not the GPU, sets the pace), U: the host's time
to launch a step, its mean over the window (a limiter's waits for budget
included). With PACKING_KERNEL_TIME naming kernel_time.c built (a
library), CUPTI records its kernels from before CUDA starts, and the line
also has
  kernel_busy=K kernels=C kernels_lost=X gaps_3us=A gaps_3us_n=M gaps_10us=B gaps_longer=L
K: the fraction of the window in which its kernels ran, C: the kernels
that ran in it, X: records CUPTI lost, A, B, L: the fractions of the window
in the gaps between its kernels of up to 3 us (M of them: the GPU moving
from one kernel to the next it had queued), of 3 to 10 us and longer (or
kernel_error=CODE, CUPTI's). With PACKING_KERNEL_SPANS naming a file too,
it writes its kernels' spans in the window there (kernel_time.c's
kt_write_spans), and the line ends spans=1 (spans=0: none written). Then
it reads one more line: "done", or
"returns AT COUNT PERIOD BURST": COUNT times, from AT on and PERIOD apart,
it runs steps for BURST seconds and waits for them, idle in between; then
it prints returns=COUNT. At most two steps are queued behind the
host; it waits for the oldest on its event, which sleeps the thread (many
processes, few CPUs), so a process alone keeps the GPU busy. When a step
completed is read off its event's GPU timestamp, against an event whose
completion the host saw at a known time before the window.
"""
import ctypes
import os
import sys
import time

import torch

DIM, TOKENS, LAYERS = 4096, 1024, 4
DEPTH = 2  # steps queued at most


def wait_until(t):
    """Sleeps, then spins, until time.monotonic() >= t."""
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        if left > 0.001:
            time.sleep(left - 0.0005)


class KernelClock:
    """CUPTI's record of this process's kernels, by kernel_time.c built at
    `path`, recording from its construction, before CUDA starts (`error`:
    0, else CUPTI's code)."""

    GAPS_US = (3, 10)  # the gaps the line gives, by length: up to 3 us, 3 to 10, longer

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for name in ("kt_now", "kt_kernels", "kt_kernel_ns", "kt_dropped"):
            getattr(self.lib, name).restype = ctypes.c_uint64
        self.lib.kt_window.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        self.lib.kt_write_spans.argtypes = [ctypes.c_char_p]
        self.error = self.lib.kt_start()

    def open_window(self, seconds: float) -> None:
        """The window that `fields` counts in: from now, `seconds` long."""
        t0 = self.lib.kt_now()
        self.lib.kt_window(t0, t0 + int(seconds * 1e9))

    def fields(self, seconds: float, spans: str | None) -> str:
        """Once the window's kernels ended: the result line's fields, and
        the spans written to the file `spans` (where not None)."""
        rc = self.error or self.lib.kt_stop()
        if rc != 0:
            return f" kernel_error={rc}"
        counts, ns, bounds = ((ctypes.c_uint64 * 16)() for _ in range(3))
        n = self.lib.kt_gaps(counts, ns, bounds)
        gaps = [0.0] * (len(self.GAPS_US) + 1)
        short = 0
        for bound, count, took in zip(bounds[:n], counts[:n], ns[:n]):
            i = sum(bound > us * 1000 for us in self.GAPS_US)
            gaps[i] += took / 1e9 / seconds
            short += count if i == 0 else 0
        written = "" if spans is None else f" spans={int(self.lib.kt_write_spans(spans.encode()) == 0)}"
        return (f" kernel_busy={self.lib.kt_kernel_ns() / 1e9 / seconds:.5f} kernels={self.lib.kt_kernels()}"
                f" kernels_lost={self.lib.kt_dropped()} gaps_3us={gaps[0]:.5f} gaps_3us_n={short}"
                f" gaps_10us={gaps[1]:.5f} gaps_longer={gaps[2]:.5f}{written}")


def main():
    seconds = float(sys.argv[1])
    lib = os.environ.get("PACKING_KERNEL_TIME")
    clock = KernelClock(lib) if lib else None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ws = [torch.randn(DIM, DIM, dtype=torch.bfloat16, device=dev) / DIM ** 0.5 for _ in range(LAYERS)]
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, device=dev)

    def step():
        y = x
        for w in ws:
            y = torch.nn.functional.gelu(y @ w)
        return y

    # Warm-up: cuBLAS's kernels, the allocator's blocks, the limiter's first measurements.
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        step()
    e1.record()
    e1.synchronize()
    step_ms = e0.elapsed_time(e1) / 20
    done = [torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(DEPTH)]
    begun = [torch.cuda.Event(enable_timing=True) for _ in range(DEPTH)]
    # The host's clock when `zero` completed: polled, so within microseconds.
    zero = torch.cuda.Event(enable_timing=True)
    zero.record()
    while not zero.query():
        pass
    zero_at = time.monotonic()
    print("ready=1", flush=True)
    start = float(sys.stdin.readline())
    end = start + seconds
    wait_until(start)
    if clock is not None and clock.error == 0:
        clock.open_window(seconds)
    launched = completed = waited = 0
    last, busy_ms = start, 0.0
    slept = launching = 0.0  # host seconds waiting for steps, launching them

    def settle(k):
        """Waits for step k; True when it ended inside the window."""
        nonlocal last, busy_ms, slept
        ev = done[k % DEPTH]
        t = time.monotonic()
        ev.synchronize()
        slept += time.monotonic() - t
        at = zero_at + zero.elapsed_time(ev) / 1e3
        last = max(last, at)
        if at <= end:
            busy_ms += begun[k % DEPTH].elapsed_time(ev)
        return at <= end

    while time.monotonic() < end:
        if launched >= DEPTH:
            completed += settle(waited)
            waited += 1
        t = time.monotonic()
        begun[launched % DEPTH].record()
        step()
        done[launched % DEPTH].record()
        launching += time.monotonic() - t
        launched += 1
    host_wait = slept / seconds  # the drain after the window is not counted
    while waited < launched:
        completed += settle(waited)
        waited += 1
    timed = clock.fields(seconds, os.environ.get("PACKING_KERNEL_SPANS")) if clock is not None else ""
    print(f"result=1 count={completed} per_s={completed / seconds:.3f} launched={launched}"
          f" drain_s={max(0.0, last - end):.6f} step_ms={step_ms:.4f} gpu_busy={busy_ms / 1e3 / seconds:.4f}"
          f" host_wait={host_wait:.4f} launch_us={launching / max(launched, 1) * 1e6:.1f}{timed}",
          flush=True)
    words = sys.stdin.readline().split()
    if words[:1] != ["returns"]:
        return
    at, count, period, burst = float(words[1]), int(words[2]), float(words[3]), float(words[4])
    for c in range(count):
        wait_until(at + c * period)
        k = 0
        while time.monotonic() < at + c * period + burst:
            if k >= DEPTH:
                done[k % DEPTH].synchronize()
            step()
            done[k % DEPTH].record()
            k += 1
        torch.cuda.synchronize()
    print(f"returns={count}", flush=True)


if __name__ == "__main__":
    main()
