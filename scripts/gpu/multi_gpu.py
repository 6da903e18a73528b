#!/usr/bin/env python3
"""Checks on every GPU of the machine at once (written for two-GPU machines;
on one GPU they run on the one there is).

Usage: python3 scripts/gpu/multi_gpu.py --bundle gpu-bundle [--out DIR] [--seconds S]

Rows (each WITHOUT the limiter and WITH it, in this call):
  per-device compute shares: ONE process spins on every GPU at once (CuPy,
    a kernel busy-waiting on %globaltimer for 2 ms, filling the SMs) with
    CUDA_DEVICE_SM_LIMIT_<i> = 30 on device 0 and 60 on device 1; each
    device's busy share from 1 s to the end (one CUDA event after each
    kernel: kernels between two events times 2 ms over their elapsed time)
    within 1.5 pp of its limit.
  NCCL all-reduce: one process per GPU (PyTorch, torch.multiprocessing),
    NVLink multicast off (NCCL_NVLS_ENABLE=0), 256 MiB of float32 per rank
    summed 20 times; with a 4 GiB quota and L=50 on every device: the sums
    are right, the bus bandwidth is reported against the unlimited run.
  per-device footprint: ONE process allocates 256 MiB blocks on every GPU
    until refused, under CUDA_DEVICE_MEMORY_LIMIT_<i> = 4g on device 0 and
    6g on device 1; what nvidia-smi --query-compute-apps shows the process
    holding on each GPU is at most its quota + 64 MiB.
On one GPU the rows of device 0 run, and NCCL with one rank. Not here:
a DRA claim and a device-plugin request for two GPUs (MODE=two-gpu and
MODE=two-gpu-dp of scripts/gpu/k8s_e2e.sh) and two pods with weights on
GPU 1 (check 16 of the GPU check runs on the machine's last GPU).
Prints a Markdown table; exit status 0 when every row passed.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SM_LIMITS = (30, 60)
QUOTAS_GIB = (4, 6)
SHARE_PP = 1.5
SPIN_NS = 2_000_000

SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


def worker_shares(seconds):
    """One process, one thread per visible GPU: each spins for `seconds` and
    reports its busy share from 1 s on."""
    import threading
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    results = [None] * count

    def run(device):
        with cupy.cuda.Device(device):
            kernel = cupy.RawKernel(SPIN_SRC, "spin")
            sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
            stream = cupy.cuda.Stream(non_blocking=True)
            events = []
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                kernel((sms * 2,), (512,), (cupy.uint64(SPIN_NS),), stream=stream)
                event = cupy.cuda.Event()
                event.record(stream)
                events.append((time.monotonic() - start, event))
                # At most 10 kernels queued ahead of the GPU.
                if len(events) > 10:
                    events[-11][1].synchronize()
            stream.synchronize()
            # From the first event recorded at 1 s or later, to the last.
            first = next(i for i, (t, _) in enumerate(events) if t >= 1.0)
            elapsed_ms = cupy.cuda.get_elapsed_time(events[first][1], events[-1][1])
            kernels = len(events) - 1 - first
            results[device] = {"device": device, "kernels": kernels,
                               "share_pct": 100.0 * kernels * SPIN_NS / 1e6 / elapsed_ms}

    threads = [threading.Thread(target=run, args=(d,)) for d in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(results), flush=True)


def worker_footprint():
    """One process: 256 MiB blocks on every GPU until refused; then what
    nvidia-smi shows it holding on each."""
    import cupy

    held, obtained = [], []
    for device in range(cupy.cuda.runtime.getDeviceCount()):
        with cupy.cuda.Device(device):
            got = 0
            while got < (80 << 30):
                try:
                    held.append(cupy.cuda.runtime.malloc(256 << 20))
                    got += 256 << 20
                except cupy.cuda.runtime.CUDARuntimeError:
                    break
            obtained.append({"device": device,
                             "uuid": cupy.cuda.runtime.getDeviceProperties(device)["uuid"].hex(),
                             "obtained_mib": got >> 20})
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    mine = [line.split(", ") for line in smi.splitlines() if line.split(", ")[0] == str(os.getpid())]
    print(json.dumps({"obtained": obtained, "smi": mine}), flush=True)


def nccl_rank(rank, world, port, out):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.full((64 << 20,), float(rank + 1), device="cuda")
    for _ in range(3):
        y = x.clone()
        dist.all_reduce(y)
    torch.cuda.synchronize()
    start = time.monotonic()
    for _ in range(20):
        y = x.clone()
        dist.all_reduce(y)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    want = world * (world + 1) / 2
    right = bool((y == want).all().item())
    size = x.numel() * 4
    # NCCL's bus bandwidth of an all-reduce: 2 (n - 1) / n of the data.
    busbw = size * 20 / took * (2 * (world - 1) / world if world > 1 else 1) / 1e9
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "right": right, "busbw_gbs": busbw}))
    dist.destroy_process_group()


def worker_nccl(out):
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    port = 29500 + os.getpid() % 1000
    mp.spawn(nccl_rank, args=(world, port, out), nprocs=world, join=True)


def run_worker(args, role, env, *extra):
    """This script as a worker with `env` added; its last stdout line, parsed."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_LIMITER_")
            and not k.startswith("CUDA_DEVICE_") and k != "LD_PRELOAD"}
    full.update(env)
    out = subprocess.run([sys.executable, __file__, "worker", role, str(args.seconds), *extra],
                         env=full, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("[", "{"))]
    if out.returncode != 0 or not lines:
        return {"error": f"rc={out.returncode} {out.stderr[-400:]}"}
    return json.loads(lines[-1])


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        role, seconds = sys.argv[2], float(sys.argv[3])
        if role == "shares":
            worker_shares(seconds)
        elif role == "footprint":
            worker_footprint()
        elif role == "nccl":
            worker_nccl(sys.argv[4])
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", default=os.environ.get("OUT", "multi-gpu-out"))
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    lib = str((Path(args.bundle) / "libcuda_limiter.so").resolve())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = [line for line in subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                            text=True).stdout.splitlines() if line.startswith("GPU ")]
    n = len(gpus)
    pod = f"multi-gpu-{os.getpid()}"
    # The node tables a local-mode limiter makes: this run's own.
    limited = {"LD_PRELOAD": lib, "CUDA_LIMITER_POD": pod, "NCCL_NVLS_ENABLE": "0",
               "GPUSHARE_NODE_REGION": f"gpushare-node-{pod}", "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{pod}"}
    rows, failed = [], 0

    def row(name, without, with_, bar, ok):
        nonlocal failed
        verdict = "PASS" if ok is True else ("FAIL" if ok is False else ok)
        failed += ok is False
        rows.append(f"| {name} | {without} | {with_} | {bar} | {verdict} |")

    # Per-device compute shares, one process.
    shares_env = {**limited, **{f"CUDA_DEVICE_SM_LIMIT_{d}": str(SM_LIMITS[d]) for d in range(min(n, 2))}}
    base = run_worker(args, "shares", {})
    got = run_worker(args, "shares", shares_env)
    for d in range(min(n, 2)):
        b = base[d]["share_pct"] if isinstance(base, list) else None
        g = got[d]["share_pct"] if isinstance(got, list) else None
        ok = g is not None and abs(g - SM_LIMITS[d]) <= SHARE_PP
        row(f"per-device compute share, device {d}, L={SM_LIMITS[d]} (one process on {min(n, 2)} GPUs)",
            f"{b:.2f}%" if b is not None else base, f"{g:.2f}%" if g is not None else got,
            f"{SM_LIMITS[d]} ± {SHARE_PP} pp", ok)

    # NCCL all-reduce, one process per GPU.
    results = {}
    for mode, env in (("without", {"NCCL_NVLS_ENABLE": "0"}),
                      ("with", {**limited, "CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_SM_LIMIT": "50"})):
        path = out / f"nccl-{mode}.json"
        path.unlink(missing_ok=True)
        r = run_worker(args, "nccl", env, str(path))
        results[mode] = json.loads(path.read_text()) if path.exists() else r
    w, l = results["without"], results["with"]
    ok = bool(w.get("right")) and bool(l.get("right"))
    ratio = l.get("busbw_gbs", 0) / w["busbw_gbs"] if w.get("busbw_gbs") else float("nan")
    row(f"NCCL all-reduce, {n} rank(s), 256 MiB x 20, 4 GiB quota, L=50: sums right; bus GB/s",
        f"right={w.get('right')} {w.get('busbw_gbs', 0):.1f}" if "error" not in w else w["error"],
        f"right={l.get('right')} {l.get('busbw_gbs', 0):.1f} ({ratio:.3f})" if "error" not in l else l["error"],
        "sums right (bandwidth reported)", ok)

    # Per-device footprint under per-device quotas, one process.
    quota_env = {**limited, **{f"CUDA_DEVICE_MEMORY_LIMIT_{d}": f"{QUOTAS_GIB[d]}g" for d in range(min(n, 2))}}
    fp = run_worker(args, "footprint", quota_env)
    for d in range(min(n, 2)):
        if "error" in fp:
            row(f"footprint, device {d}, quota {QUOTAS_GIB[d]} GiB", "-", fp["error"], "", False)
            continue
        uuid = fp["obtained"][d]["uuid"]
        held = [int(m[2]) for m in fp["smi"] if m[1].lower().replace("-", "")[3:] == uuid]
        smi = held[0] if held else None
        limit = QUOTAS_GIB[d] * 1024
        ok = smi is not None and smi <= limit + 64
        row(f"footprint, device {d}, quota {QUOTAS_GIB[d]} GiB (one process on {min(n, 2)} GPUs)", "-",
            f"obtained {fp['obtained'][d]['obtained_mib']} MiB, nvidia-smi {smi} MiB",
            f"nvidia-smi <= {limit + 64} MiB", ok)

    for name in os.listdir("/dev/shm"):
        if pod in name:
            os.unlink(f"/dev/shm/{name}")
    table = ("| check | without | with | bar | result |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    text = f"Multi-GPU checks on {n} GPU(s)\n\n{table}\n{failed} failed\n"
    (out / "multi-gpu.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
