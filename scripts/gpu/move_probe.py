"""What a process sees after the driver restores it onto another GPU.

Run on a machine with two GPUs:

    python3 scripts/gpu/move_probe.py [--limiter gpu-bundle/libcuda_limiter.so]

A child holding a pattern on CUDA device 0 (PyTorch) is checkpointed by
this process through the driver's checkpoint API, then restored with every
GPU paired to the other, and asked again: the UUID and PCI bus id of its
device 0 as the driver and NVML report them, whether its pattern is intact,
and whether it can still allocate. `nvidia-smi` says which GPU holds it.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import ctypes, json, sys, torch
cuda = ctypes.CDLL("libcuda.so.1")
nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlInit_v2()

def driver_uuid():
    raw = (ctypes.c_ubyte * 16)()
    rc = cuda.cuDeviceGetUuid_v2(raw, 0)
    h = bytes(raw).hex()
    return rc, "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])

def driver_bus():
    buf = ctypes.create_string_buffer(64)
    rc = cuda.cuDeviceGetPCIBusId(buf, 64, 0)
    return rc, buf.value.decode()

def nvml_uuid_of_bus(bus):
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) != 0:
        return None
    buf = ctypes.create_string_buffer(96)
    nvml.nvmlDeviceGetUUID(handle, buf, 96)
    return buf.value.decode()

def look():
    free, total = torch.cuda.mem_get_info(0)
    urc, uuid = driver_uuid()
    brc, bus = driver_bus()
    return {"uuid": uuid, "uuid_rc": urc, "bus": bus, "bus_rc": brc,
            "nvml_uuid_of_bus": nvml_uuid_of_bus(bus),
            "torch_uuid": str(torch.cuda.get_device_properties(0).uuid),
            "free_mib": free >> 20}

x = torch.arange(1 << 28, device="cuda:0", dtype=torch.int32)
want = int(x.sum(dtype=torch.int64).item())
print(json.dumps({"ready": True, **look()}), flush=True)
for line in sys.stdin:
    out = {"sum_ok": int(x.sum(dtype=torch.int64).item()) == want}
    try:
        y = torch.ones(1 << 28, device="cuda:0")
        torch.cuda.synchronize()
        out["alloc_ok"] = bool(y.sum().item() == (1 << 28))
        del y
    except Exception as error:
        out["alloc_ok"] = False
        out["alloc_error"] = str(error)[:200]
    out.update(look())
    print(json.dumps(out), flush=True)
"""


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class GpuPair(ctypes.Structure):
    _fields_ = [("old", Uuid), ("new", Uuid)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("pairs", ctypes.POINTER(GpuPair)),
        ("count", ctypes.c_uint),
        ("reserved", ctypes.c_char * 44),
        ("reserved1", ctypes.c_uint64),
    ]


def uuids(cuda):
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    found = []
    for ordinal in range(count.value):
        raw = Uuid()
        cuda.cuDeviceGetUuid_v2(ctypes.byref(raw), ordinal)
        found.append(raw)
    return found


def text(raw):
    h = bytes(raw.bytes).hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


def smi(pid):
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.split(",")[0].strip() == str(pid)]


def step(name, rc):
    print(f"  {name}: {rc}", flush=True)
    if rc != 0:
        raise RuntimeError(f"{name} failed with CUresult {rc}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--limiter")
    p.add_argument("--pairs", choices=["both", "one", "identity"], default="both",
                   help="both GPUs exchanged, only the GPU it runs on onto the other, or each onto itself")
    p.add_argument("--visible", help="CUDA_VISIBLE_DEVICES of the child")
    args = p.parse_args()
    env = dict(os.environ)
    if args.visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.visible
    if args.limiter:
        env["LD_PRELOAD"] = os.path.abspath(args.limiter)
        env["CUDA_DEVICE_MEMORY_LIMIT"] = "4g"
        env["CUDA_LIMITER_POD"] = "move-probe"
    cuda = ctypes.CDLL("libcuda.so.1")
    step("cuInit", cuda.cuInit(0))
    gpus = uuids(cuda)
    if len(gpus) < 2:
        raise SystemExit("needs two GPUs")
    print("GPUs:", [text(g) for g in gpus], flush=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        before = json.loads(child.stdout.readline())
        print("before:", before, smi(child.pid), flush=True)
        if args.pairs == "both":
            pairs = (GpuPair * 2)(GpuPair(gpus[0], gpus[1]), GpuPair(gpus[1], gpus[0]))
        elif args.pairs == "identity":
            pairs = (GpuPair * 2)(GpuPair(gpus[0], gpus[0]), GpuPair(gpus[1], gpus[1]))
        else:
            pairs = (GpuPair * 1)(GpuPair(gpus[0], gpus[1]))
        restore = RestoreArgs(ctypes.cast(pairs, ctypes.POINTER(GpuPair)), len(pairs))
        for moved in (True, False):
            t = time.monotonic()
            step("lock", cuda.cuCheckpointProcessLock(child.pid, None))
            step("checkpoint", cuda.cuCheckpointProcessCheckpoint(child.pid, None))
            out_s = time.monotonic() - t
            print("  checkpointed:", smi(child.pid), flush=True)
            t = time.monotonic()
            step("restore", cuda.cuCheckpointProcessRestore(
                child.pid, ctypes.byref(restore) if moved else None))
            step("unlock", cuda.cuCheckpointProcessUnlock(child.pid, None))
            in_s = time.monotonic() - t
            child.stdin.write("check\n")
            child.stdin.flush()
            after = json.loads(child.stdout.readline())
            label = f"after a restore with pairs '{args.pairs}'" if moved else "after a plain swap"
            print(f"{label} (out {out_s:.2f} s, in {in_s:.2f} s):", after, smi(child.pid), flush=True)
    except RuntimeError as error:
        print("FAILED:", error, flush=True)
        # Whatever state the child is in, bring it back before it goes.
        cuda.cuCheckpointProcessRestore(child.pid, None)
        cuda.cuCheckpointProcessUnlock(child.pid, None)
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
