#!/usr/bin/env python3
"""Checks 23-26: PyTorch past a 4 GiB quota with oversubscription.  Prints key=value lines.

Usage: oversub_torch.py matmul FLAG HOLD_S | cap | bench

matmul: six 1 GiB float32 blocks (torch.randn after manual_seed, so the same
        values with and without the limiter); types=T,... the memory type of
        each block (cuPointerGetAttribute: 1 host = spilled, 2 device), ranges=
        cuMemGetAddressRange_v2 "rc:size" of each; a 4096x4096 matmul of two
        device-resident blocks (dev_*) and of the last two blocks (spill_*,
        spilled under the limiter) with float64 checksums; then ready=1 and it
        holds everything until FLAG exists (at most HOLD_S seconds).
        On torch.OutOfMemoryError: alloc=oom blocks=N.
cap:    1 GiB blocks until torch.OutOfMemoryError (at most 8): blocks=N
        spilled=M oom=0|1.
bench:  1 GiB blocks (filled with 1.0) until one is spilled (at most 8); the
        time of torch.sum over a device block and over the spilled one:
        dev_gbps, spill_gbps (GB/s read), slowdown, and both sums.
Kernels and cuBLAS are warmed up before the blocks, so that the driver memory
they take is counted before the quota fills.
"""
import ctypes
import os
import sys
import time

GiB = 1 << 30
BLOCK = GiB // 4  # float32 elements of one 1 GiB block
N = 4096
HOST, DEVICE = 1, 2


def out(key, value):
    print(f"{key}={value}", flush=True)


class Driver:
    """cuPointerGetAttribute / cuMemGetAddressRange_v2, straight from libcuda."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self.lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]

    def mem_type(self, tensor) -> int:
        kind = ctypes.c_uint(0)
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(kind), 2, tensor.data_ptr())  # MEMORY_TYPE
        return kind.value if rc == 0 else -rc

    def range(self, tensor) -> str:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr())
        return f"{rc}:{size.value}"


def warm_up(torch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    w = torch.randn(N * N, device="cuda").view(N, N)
    (w @ w).double().sum().item()
    torch.ones(N, device="cuda").sum().item()
    del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def blocks_until(torch, oom_type, count, make, stop=None):
    """Up to count blocks from make(); (blocks, oom)."""
    blocks = []
    for _ in range(count):
        try:
            blocks.append(make())
            torch.cuda.synchronize()
        except oom_type as e:
            out("oom_msg", str(e).splitlines()[0] if str(e) else "")
            return blocks, True
        if stop is not None and stop(blocks[-1]):
            break
    return blocks, False


def checksums(prefix, c):
    d = c.double()
    out(f"{prefix}_sum", repr(d.sum().item()))
    out(f"{prefix}_abs", repr(d.abs().sum().item()))
    out(f"{prefix}_c00", repr(c[0, 0].item()))


def matmul(torch, oom_type, drv, flag, hold_s):
    torch.manual_seed(1234)
    blocks, oom = blocks_until(torch, oom_type, 6, lambda: torch.randn(BLOCK, device="cuda"))
    out("blocks", len(blocks))
    out("types", ",".join(str(drv.mem_type(b)) for b in blocks))
    out("ranges", ",".join(drv.range(b) for b in blocks))
    if oom:
        out("alloc", "oom")
        out("done", 1)
        return
    out("alloc", "ok")
    free, total = torch.cuda.mem_get_info()
    out("free", free)
    out("total", total)
    view = lambda b: b[: N * N].view(N, N)  # noqa: E731
    checksums("dev", view(blocks[0]) @ view(blocks[1]))
    checksums("spill", view(blocks[5]) @ view(blocks[4]))
    torch.cuda.synchronize()
    out("ready", 1)
    end = time.time() + hold_s
    while time.time() < end and not os.path.exists(flag):
        time.sleep(0.1)
    out("released", int(os.path.exists(flag)))
    out("done", 1)


def cap(torch, oom_type, drv):
    blocks, oom = blocks_until(torch, oom_type, 8, lambda: torch.empty(BLOCK, device="cuda"))
    out("blocks", len(blocks))
    out("spilled", sum(1 for b in blocks if drv.mem_type(b) == HOST))
    out("oom", int(oom))
    out("done", 1)


def read_gbps(torch, t, reps):
    t.sum().item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        s = t.sum()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / reps
    return t.numel() * t.element_size() / (ms / 1e3) / 1e9, s.item()


def bench(torch, oom_type, drv):
    blocks, _ = blocks_until(torch, oom_type, 8, lambda: torch.ones(BLOCK, device="cuda"),
                             stop=lambda b: drv.mem_type(b) == HOST)
    device = [b for b in blocks if drv.mem_type(b) == DEVICE]
    spilled = [b for b in blocks if drv.mem_type(b) == HOST]
    if device:
        gbps, total = read_gbps(torch, device[0], 10)
        out("dev_gbps", f"{gbps:.1f}")
        out("dev_sum", repr(total))
    if spilled:
        gbps, total = read_gbps(torch, spilled[0], 3)
        out("spill_gbps", f"{gbps:.2f}")
        out("spill_sum", repr(total))
    else:
        out("spill_gbps", "none")
    out("done", 1)


def main():
    import torch

    out("torch_version", torch.__version__)
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    warm_up(torch)
    drv = Driver()
    mode = sys.argv[1] if len(sys.argv) > 1 else "matmul"
    if mode == "matmul":
        matmul(torch, oom_type, drv, sys.argv[2], float(sys.argv[3]))
    elif mode == "cap":
        cap(torch, oom_type, drv)
    elif mode == "bench":
        bench(torch, oom_type, drv)
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
