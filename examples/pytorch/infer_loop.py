#!/usr/bin/env python3
"""A loop of inference requests, answered one at a time as a model server
answers them. Nothing here knows of the limiter. Run by run.sh as the pod
"infer" of the node daemon, a latency-class pod: the GPU it sees is the
pod's 4 GiB quota, and its requests go before the training pod's kernels.

Usage: python3 infer_loop.py [REQUESTS]   (default 200)
Prints one line: infer: requests=N p50_ms=X p99_ms=Y gpu_total_mib=M
"""

import sys
import time

import torch


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    torch.manual_seed(0)
    device = torch.device("cuda")
    _, total = torch.cuda.mem_get_info()
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    ).to(device).eval()
    latencies = []
    with torch.inference_mode():
        for _ in range(requests):
            request = torch.randn(8, 1024)
            start = time.perf_counter()
            # The answer back on the host: the request is done when it is there.
            answer = model(request.to(device)).argmax(dim=1).cpu()
            latencies.append(time.perf_counter() - start)
            assert answer.shape == (8,)
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1e3
    p99 = latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)] * 1e3
    print(
        f"infer: requests={requests} p50_ms={p50:.2f} p99_ms={p99:.2f} gpu_total_mib={total >> 20}",
        flush=True,
    )


if __name__ == "__main__":
    main()
