"""Whose GPU time it was where pods' kernels overlap: the inference
workers write their kernels' spans in the window by CUPTI (packing_infer.py,
kernel_time.c), on one clock for every process, and a time-sliced GPU runs
one context at a time. So where two pods' spans overlap, one pod's kernel
went on while the other's slice preempted it (as when a pod taking turns
starts its turn while the last holder's queued kernels still run), and
each pod's own spans count that time twice over between them. Here each
instant goes to the pods whose spans cover it, split evenly."""
from __future__ import annotations

import struct
from pathlib import Path


def read(path: Path) -> list[tuple[int, int]]:
    """A worker's spans: (start, end) pairs, ns, in order."""
    data = Path(path).read_bytes()
    if len(data) % 16:
        raise ValueError(f"{path}: {len(data)} bytes, not whole (start, end) pairs")
    return list(struct.iter_unpack("<QQ", data))


def split(pods: list[list[tuple[int, int]]], window_ns: float) -> dict:
    """Each pod's spans laid over the others', as fractions of the window:
    "own" (its spans' time: what a pod reads alone), "alone" (no other
    pod's span over it), "split" (every instant split evenly between the
    pods whose spans cover it: their share of the GPU), and over all pods
    "union" (some pod's span: the GPU busy) and "overlap" (the sum of the
    pods' own time past the union: time counted more than once)."""
    events = sorted((t, edge, i) for i, spans in enumerate(pods)
                    for start, end in spans if end > start for t, edge in ((start, 1), (end, -1)))
    own, alone, share = ([0.0] * len(pods) for _ in range(3))
    union = 0.0
    active: dict[int, int] = {}
    last = 0
    for t, edge, i in events:
        if active and t > last:  # `last`: the event before, once a span is open
            length = t - last
            union += length
            for p in active:
                own[p] += length
                share[p] += length / len(active)
                if len(active) == 1:
                    alone[p] += length
        last = t
        active[i] = active.get(i, 0) + edge
        if not active[i]:
            del active[i]
    frac = [x / window_ns for x in own]
    return {"own": frac, "alone": [x / window_ns for x in alone], "split": [x / window_ns for x in share],
            "union": union / window_ns, "overlap": sum(frac) - union / window_ns}
