"""The swap bench's part `frameworks`: for each framework workload of
swap_fw_pod.py, a pod (quota 6 GiB, about 1 GiB of data) is swapped out and
back by the admin API, and its results recomputed after (bit-identical to
before, a CUDA graph captured before replayed after). Each line says which
path each swap took (with the fast path asked for, the daemon falls back to
the driver's checkpoint where a process holds memory its limiter does not
back, and the status says why), what nvidia-smi shows of the process
while it is swapped, and the times. torch-ipc shares a tensor with a
second process of the pod by CUDA IPC: on the fast path the limiter shares
it, and the pod is not swapped (the driver's checkpoint takes such a
process but cannot restore it), the status saying why. cupy-managed holds
managed memory, which the limiter does not back; torch-nccl an NCCL
communicator, whose buffers NCCL maps itself: each line says which path
took them, or why none did."""
import time

from .swap_bench import GIB, POD_PROGRAM, BenchError, gib, guarded, smi_mib
from .swap_report import fmt, yes

FW_PROGRAM = POD_PROGRAM.with_name("swap_fw_pod.py")
QUOTA, DATA = 6 * GIB, 1 * GIB
# Each workload's environment besides the pods' own.
WORKLOADS = {
    "torch-graph": {},
    "torch-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "torch-async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "jax": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
    "cupy": {},
    "triton": {},
    "torch-ipc": {},
    "cupy-managed": {},
    "torch-nccl": {},
}


def workload_round(b, workload, r):
    pod = f"fw-{workload}"
    p = b.start_pod(pod, workload, DATA, program=FW_PROGRAM, env=WORKLOADS[workload])
    try:
        before = p.ready(600)
        r["smi_before_mib"], _ = smi_mib(p.p.pid)
        time.sleep(0.2)  # the daemon refuses a pod whose last CUDA call is this fresh
        out = b.swap(pod, "swap-out", QUOTA)
        record = b.pod_swap(pod)
        r.update(out_http=out["http"], out_s=out["seconds"], residency=out.get("residency"),
                 path_out=record.get("last_swap_out_path"), fast_declined=record.get("fast_declined"),
                 last_error=record.get("last_error") or out.get("error"))
        r["smi_swapped_mib"], _ = smi_mib(p.p.pid)
        if out.get("residency") == "swapped":
            back = b.swap(pod, "swap-in", QUOTA)
            r.update(in_s=back["seconds"], path_in=b.pod_swap(pod).get("last_swap_in_path"))
        check, _ = p.ask("check", 300)
        if not check.get("ok"):
            raise BenchError(f"{pod}: check failed: {check.get('error')}")
        r["identical"] = check.get("digest") == before.get("digest")
    finally:
        b.stop_pod(p)


def part_frameworks(b):
    b.begin("frameworks")
    results = {}
    quotas = {f"fw-{w}": QUOTA for w in WORKLOADS}
    with b.serving("frameworks", quotas):
        for workload in WORKLOADS:
            r = {}
            r.update(guarded(f"frameworks {workload}", workload_round, b, workload, r) or {})
            results[workload] = r
            if "failed" in r and b.stuck:
                break
            if "failed" in r:
                continue
            swapped = r.get("residency") == "swapped"
            print(f"frameworks {workload}: out {fmt(r.get('out_s'))} s by {r.get('path_out') or 'n/a'}"
                  + (f" (fast path declined: {r['fast_declined']})" if r.get("fast_declined") else "")
                  + (f", in {fmt(r.get('in_s'))} s by {r.get('path_in')}" if swapped
                     else f"; not swapped: HTTP {r.get('out_http')} {r.get('last_error')}")
                  + f"; nvidia-smi MiB {fmt(r.get('smi_before_mib'), 'd', 'absent')} /"
                  f" {fmt(r.get('smi_swapped_mib'), 'd', 'absent')}; identical {yes(r.get('identical'))}",
                  flush=True)
    return {"data_bytes": DATA, "quota": QUOTA, "workloads": results,
            "note": f"{gib(DATA)} GiB of data per pod"}
