#!/usr/bin/env python3
"""Compute-limiter benchmarks: the PyTorch and Triton side, a program of its
own (only PyTorch and Triton besides the standard library), run by the
compute and launch-ab benches; by hand:

  python3 -m scripts.bench torch MODE SECONDS   (or python3 scripts/bench/torch_workloads.py MODE SECONDS)
  decode   a small transformer (random weights, no download), batch 1, a KV
           cache that grows by one position every step, 256 steps per
           generation, generations repeated for SECONDS after 3 s of
           warm-up -> tokens_per_s
           (attention's shapes change with every step, like a server's)
  decode-ab  the decode loop, GENERATIONS (in place of SECONDS) generations
           with the limiter's admission switched off on every other pair
           of steps (a limiter built with the `launch-ab` feature) ->
           step_cost_pct: the full steps' time over the bypassed ones'
  triton   a Triton softmax over a 4096 x 8192 fp32 matrix, eight per
           iteration, back to back
  graph    a CUDA graph of sixteen kernels (elementwise updates of a 64 Mi-
           element fp32 tensor and a 1024^2 matmul), replayed back to back
Both are bound by memory bandwidth, so a kernel takes the same time at any
clock the power cap allows: GPU time per iteration is the same without and
with a limit, and the limited run's GPU time share is its iterations/s over
the unlimited run's, times the unlimited run's busy share. They report
iterations_per_s and busy_share: the sum of each iteration's event bracket
over the wall time (valid without a limit, when an iteration's bracket
starts as the previous one ends; with one, a bracket also holds the wait in
the launch). At most 4 iterations are queued ahead, so the GPU never waits
on the host and the run ends soon after SECONDS.
Prints one line of key=value pairs.
"""
import ctypes
import os
import statistics
import sys
import threading
import time

import torch


WARM_UP_S = 3.0  # untimed generations before decode's measured ones
DECODE_STEPS = 256  # tokens a generation: the KV cache grows this long


def decoder():
    """A small transformer with random weights (no download), batch 1: returns
    `step(state)`, one token with the KV cache grown by one, and `start()`,
    a fresh state."""
    torch.manual_seed(0)
    layers, dim, heads, vocab = 12, 768, 12, 32000
    head = dim // heads
    dev, dt = "cuda", torch.float16
    w = [
        {
            "qkv": torch.randn(dim, 3 * dim, device=dev, dtype=dt) * 0.02,
            "out": torch.randn(dim, dim, device=dev, dtype=dt) * 0.02,
            "up": torch.randn(dim, 4 * dim, device=dev, dtype=dt) * 0.02,
            "down": torch.randn(4 * dim, dim, device=dev, dtype=dt) * 0.02,
        }
        for _ in range(layers)
    ]
    emb = torch.randn(vocab, dim, device=dev, dtype=dt) * 0.02

    def start():
        return {"caches": [(None, None) for _ in range(layers)],
                "token": torch.zeros(1, dtype=torch.long, device=dev)}

    def step(state):
        caches = state["caches"]
        x = emb[state["token"]].view(1, 1, dim)
        for i, p in enumerate(w):
            h = torch.nn.functional.layer_norm(x, (dim,))
            q, k, v = (h @ p["qkv"]).split(dim, dim=-1)
            q, k, v = (t.view(1, 1, heads, head).transpose(1, 2) for t in (q, k, v))
            ck, cv = caches[i]
            ck = k if ck is None else torch.cat([ck, k], dim=2)
            cv = v if cv is None else torch.cat([cv, v], dim=2)
            caches[i] = (ck, cv)
            att = torch.softmax((q @ ck.transpose(-1, -2)) / head**0.5, dim=-1)
            y = (att @ cv).transpose(1, 2).reshape(1, 1, dim)
            x = x + y @ p["out"]
            h = torch.nn.functional.layer_norm(x, (dim,))
            x = x + torch.nn.functional.gelu(h @ p["up"]) @ p["down"]
        logits = x.view(1, dim) @ emb.t()
        state["token"] = logits.argmax(dim=-1)

    return step, start


def warm_decoder():
    """The decoder, warmed up: kernels chosen, the allocator's caches filled,
    the GPU's clock raised from idle by the loop's load; then the thread
    pinned. Returns `generate()` (DECODE_STEPS steps from a fresh cache),
    `step` and `start`, as `decoder` makes them."""
    step, start = decoder()

    def generate():
        state = start()
        for _ in range(DECODE_STEPS):
            step(state)
        return state["token"].item()

    warm_until = time.perf_counter() + WARM_UP_S
    generate()
    while time.perf_counter() < warm_until:
        generate()
    torch.cuda.synchronize()
    pin_main_thread()
    return generate, step, start


def decode(seconds):
    generate, _, _ = warm_decoder()
    probe_ms = cpu_probe_ms()
    tokens, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        generate()
        tokens += DECODE_STEPS
    wall = time.perf_counter() - begin
    return {"tokens": tokens, "wall_s": f"{wall:.3f}", "tokens_per_s": f"{tokens / wall:.1f}",
            "cpu_probe_ms": f"{probe_ms:.1f}"}


def decode_ab(generations):
    """The decode loop inside one process, the limiter's admission switched
    off on every other pair of steps (ABBA) through gpushare_launch_ab_bypass
    (a limiter built with the `launch-ab` feature): the host's speed, which
    drifts second by second, is the same for both within a few steps. Per
    generation, the full steps' time over the bypassed steps' time."""
    bypass = getattr(ctypes.CDLL(None), "gpushare_launch_ab_bypass", None)
    if bypass is None:
        sys.exit("decode-ab: no gpushare_launch_ab_bypass (preload a limiter built with --features launch-ab)")
    _, step, start = warm_decoder()
    costs = []
    for _ in range(generations):
        state, spent = start(), [0.0, 0.0]
        for i in range(DECODE_STEPS):
            off = int(i % 4 in (1, 2))
            bypass(off)
            begin = time.perf_counter()
            step(state)
            spent[off] += time.perf_counter() - begin
        bypass(0)
        state["token"].item()
        costs.append((spent[0] / spent[1] - 1) * 100)
    return {"generations": generations, "step_cost_pct_median": f"{statistics.median(costs):+.3f}",
            "step_cost_pct": ",".join(f"{cost:+.2f}" for cost in costs)}


def cpu_probe_ms():
    """How long this thread takes for a fixed Python loop (no GPU): the
    decode loop is bound by its host thread, so a process whose CPU runs
    slower shows it here too."""
    start = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i & 7
    return (time.perf_counter() - start) * 1e3


def pin_main_thread():
    """The decode loop is bound by this thread's launches: it gets one of
    the process's CPUs to itself and every other thread (the driver's, the
    limiter's monitor; all started by the warm-up) the rest, so that where
    the scheduler puts them does not move tokens/s between processes (it did
    by up to 40%, unlimited, on four shared CPUs). Linux applies
    sched_setaffinity to the one thread named; 0 is the calling thread."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    main = threading.get_native_id()
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        try:
            os.sched_setaffinity(tid, cpus[:1] if tid == main else cpus[1:])
        except OSError:
            pass  # a thread that has just exited


def saturate(step, seconds):
    """Runs `step` back to back for `seconds`, bracketing each with events."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    brackets, queued = [], []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        queued.append((begin, end))
        if len(queued) > 4:
            begin, end = queued.pop(0)
            end.synchronize()
            brackets.append(begin.elapsed_time(end))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    brackets += [begin.elapsed_time(end) for begin, end in queued]
    busy = sum(brackets) / 1e3
    n = len(brackets)
    return {
        "iterations": n,
        "wall_s": f"{wall:.3f}",
        "iterations_per_s": f"{n / wall:.2f}",
        "busy_share": f"{busy / wall:.4f}",
    }


def triton_step():
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_kernel(out_ptr, in_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(in_ptr + row * cols + offs, mask=mask, other=-float("inf"))
        x = x - tl.max(x, axis=0)
        e = tl.exp(x)
        tl.store(out_ptr + row * cols + offs, e / tl.sum(e, axis=0), mask=mask)

    rows, cols = 4096, 8192
    x = torch.randn(rows, cols, device="cuda")
    y = torch.empty_like(x)

    def step():
        for _ in range(8):
            softmax_kernel[(rows,)](y, x, cols, BLOCK=cols)

    return step


def graph_step():
    x = torch.randn(64 * 1024 * 1024, device="cuda")
    a = torch.randn(1024, 1024, device="cuda")
    c = torch.empty_like(a)

    def body():
        for _ in range(15):
            x.mul_(0.999).add_(0.001)
        torch.matmul(a, a, out=c)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    if mode == "decode":
        result = decode(seconds)
    elif mode == "decode-ab":
        result = decode_ab(int(seconds))
    elif mode == "triton":
        result = saturate(triton_step(), seconds)
    elif mode == "graph":
        result = saturate(graph_step(), seconds)
    else:
        sys.exit(f"unknown mode {mode}")
    print(" ".join(f"{k}={v}" for k, v in {"mode": mode, **result}.items()), flush=True)


if __name__ == "__main__":
    main()
