"""The swap bench's part `cost`: what `CUDA_LIMITER_FAST_SWAP=1` costs a pod
that never swaps. Processes under the limiter (local mode, a 16 GiB quota,
no daemon), without and with the setting, in alternated order round after
round (the setting is read when the limiter loads, so an arm is a
process); each measures
  - alloc: 200 cuMemAlloc_v2 / cuMemFree_v2 pairs of 8 MiB, µs per pair
    (median), the path the setting changes (four VMM calls instead of one);
  - step: a training step of a 3-layer MLP (4096 wide, batch 512, fp32,
    SGD), ms (median of 40 after 10 warm-up), where PyTorch's caching
    allocator keeps its blocks.
Per figure: the medians of each arm and the mean of the rounds' paired
differences with its 95% confidence interval (Student's t).

The arms' child, from the repository's root: python3 -m scripts.bench.swap_cost child
"""
import json
import statistics
import subprocess
import sys
import time

from scripts.gpu.e2e.harness.parse import median

from . import common
from .swap_bench import POD_ENV, BenchError

ROUNDS = 8
# Student's t, two-sided 95%, by degrees of freedom.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
       12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def child():
    import ctypes

    import torch

    torch.zeros(1, device="cuda")
    cuda = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64()
    pairs = []
    for i in range(210):
        start = time.perf_counter()
        if cuda.cuMemAlloc_v2(ctypes.byref(pointer), 8 << 20) or cuda.cuMemFree_v2(pointer):
            raise RuntimeError("cuMemAlloc_v2 or cuMemFree_v2 failed")
        if i >= 10:
            pairs.append((time.perf_counter() - start) * 1e6)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 4096, device="cuda"), torch.randn(512, 4096, device="cuda")
    steps = []
    for i in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        torch.cuda.synchronize()
        if i >= 10:
            steps.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"alloc_us": median(pairs), "step_ms": median(steps)}), flush=True)


def arm(b, fast):
    env = {**common.clean_env("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LIMITER_"), **POD_ENV, "LD_PRELOAD": b.lib,
           "CUDA_DEVICE_MEMORY_LIMIT": "16g"}
    if fast:
        env["CUDA_LIMITER_FAST_SWAP"] = "1"
    out = subprocess.run([sys.executable, "-m", "scripts.bench.swap_cost", "child"], capture_output=True, text=True,
                         env=env, cwd=common.HERE.parent.parent, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise BenchError(f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}")
    return json.loads(lines[-1])


def interval(differences):
    """(mean, half-width of its 95% confidence interval)."""
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return mean, None
    half = T95.get(len(differences) - 1, 2.0) * statistics.stdev(differences) / len(differences) ** 0.5
    return mean, half


def part_cost(b):
    b.begin("cost")
    rounds = []
    for n in range(ROUNDS):
        order = (False, True) if n % 2 == 0 else (True, False)
        r = {("on" if fast else "off"): arm(b, fast) for fast in order}
        rounds.append(r)
    result = {"rounds": rounds}
    for key in ("alloc_us", "step_ms"):
        off = [r["off"][key] for r in rounds]
        on = [r["on"][key] for r in rounds]
        mean, half = interval([b_ - a for a, b_ in zip(off, on)])
        result[key] = {"off": median(off), "on": median(on), "diff": mean, "ci": half,
                       "raw_off": off, "raw_on": on}
        print(f"cost {key}: off median {median(off):.3f}, on median {median(on):.3f};"
              f" on - off {mean:+.3f} ± {half if half is None else round(half, 3)} (95% CI, {len(rounds)} rounds);"
              f" raw off {[round(x, 3) for x in off]}, on {[round(x, 3) for x in on]}", flush=True)
    return result


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    child()
