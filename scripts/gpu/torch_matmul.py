#!/usr/bin/env python3
"""Check 13: PyTorch bf16 matmul throughput.  Prints key=value lines.

Usage: torch_matmul.py [SECONDS=6] [WARMUP_S=2] [N=8192]

Multiplies two N x N bf16 matrices into a preallocated output, back to back,
for WARMUP_S seconds (wall clock; lets cuBLAS pick its kernels and a compute
limiter settle), synchronises, then for SECONDS more. At most 32 matmuls are
queued ahead of the GPU (an event every 16, waiting on the one before the
last), so the run ends soon after SECONDS and the GPU never idles for want of
work. matmuls_per_s = matmuls / (wall time from the first timed launch to the
final synchronize).
"""
import sys
import time


def out(key, value):
    print(f"{key}={value}", flush=True)


def loop(torch, a, b, c, seconds):
    """Launches matmuls for `seconds` of wall time; returns (count, elapsed)."""
    pending = []
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b, out=c)
        n += 1
        if n % 16 == 0:
            ev = torch.cuda.Event()
            ev.record()
            pending.append(ev)
            if len(pending) > 2:
                pending.pop(0).synchronize()
    torch.cuda.synchronize()
    return n, time.perf_counter() - t0


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    warmup = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    import torch

    out("torch_version", torch.__version__)
    out("device", torch.cuda.get_device_name(0).replace(" ", "_"))
    out("size", size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda", generator=gen)
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda", generator=gen)
    c = torch.empty(size, size, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()

    wn, wt = loop(torch, a, b, c, warmup)
    out("warmup_matmuls", wn)
    out("warmup_s", f"{wt:.3f}")
    n, t = loop(torch, a, b, c, seconds)
    rate = n / t
    out("matmuls", n)
    out("elapsed_s", f"{t:.3f}")
    out("matmuls_per_s", f"{rate:.3f}")
    out("tflops", f"{2.0 * size**3 * rate / 1e12:.1f}")
    out("finite", int(bool(torch.isfinite(c).all().item())))
    out("ok", 1)


if __name__ == "__main__":
    main()
