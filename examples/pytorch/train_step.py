#!/usr/bin/env python3
"""A few training steps of a small model: what a training job does, in a
few seconds. Nothing here knows of the limiter. Run by run.sh as the pod
"train" of the node daemon, the GPU it sees is the pod's 8 GiB quota and its
kernels get at most the pod's 60% cap of the GPU's time.

Usage: python3 train_step.py [STEPS]   (default 50)
Prints one line: train: steps=N loss_first=X loss_last=Y gpu_total_mib=M steps_per_s=S
"""

import sys
import time

import torch


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    torch.manual_seed(0)
    device = torch.device("cuda")
    _, total = torch.cuda.mem_get_info()
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # One batch learnt again and again: the loss must fall.
    inputs = torch.randn(512, 1024, device=device)
    labels = torch.randint(0, 10, (512,), device=device)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(
        f"train: steps={steps} loss_first={losses[0].item():.3f} loss_last={losses[-1].item():.3f} "
        f"gpu_total_mib={total >> 20} steps_per_s={steps / elapsed:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
