"""The serve bench's requests and their figures, without a GPU: a trace of
Zipf popularity over the pods and Poisson arrivals from a fixed seed, the
time to the first result's percentiles, a load's figures from its
requests' rows, and whether they meet the bounds."""
from __future__ import annotations

import bisect
import dataclasses
import math
import random

from scripts.gpu.e2e.harness.parse import percentile

# The bounds a load must meet (seconds to the first result), as the issue
# sets them for many models on one GPU.
P50_BOUND_S, P99_BOUND_S = 0.5, 1.5


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace: its number, its arrival (seconds after the
    load's start), the pod it goes to (by index) and its input."""
    id: int
    at: float
    pod: int
    input: int


def zipf(n: int, s: float) -> list[float]:
    """Zipf(s) probabilities of ranks 1..n: 1/k^s, normalised."""
    weights = [1 / k ** s for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def popularity(n: int, s: float, seed: str) -> list[float]:
    """Each pod's share of the requests, by pod index: Zipf(s) ranks dealt
    to the pods in an order drawn from `seed` (the most popular pod is not
    always the first started)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    ranks = zipf(n, s)
    shares = [0.0] * n
    for rank, pod in enumerate(order):
        shares[pod] = ranks[rank]
    return shares


def trace(shares: list[float], rate: float, seconds: float, inputs: int, seed: str) -> list[Request]:
    """Requests arriving at `rate` a second (Poisson: exponential gaps)
    for `seconds`, each to a pod drawn by `shares` with one of `inputs`
    inputs drawn uniformly; the same for the same arguments."""
    rng = random.Random(seed)
    cumulative, total = [], 0.0
    for share in shares:
        total += share
        cumulative.append(total)
    requests, at = [], rng.expovariate(rate)
    while at < seconds:
        pod = min(bisect.bisect_right(cumulative, rng.random() * total), len(shares) - 1)
        requests.append(Request(len(requests), at, pod, rng.randrange(inputs)))
        at += rng.expovariate(rate)
    return requests


def trace_seed(seed: int, n: int, load: int) -> str:
    """The seed of the trace of load number `load` of the runs of n pods:
    the same for every path and for the baseline."""
    return f"serve-{seed}-{n}-{load}"


def quantile(latencies: list[float], q: float, unanswered: int = 0) -> float:
    """The q-quantile (0..1, linear between the two nearest) of the times
    to the first result, unanswered requests counting as longer than any:
    inf where the quantile reaches them; nan without requests."""
    xs = sorted(latencies) + [math.inf] * unanswered
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    if k == int(k):
        return xs[int(k)]
    # Between two values: inf when the upper one was never answered.
    return math.inf if xs[int(k) + 1] == math.inf else percentile(xs, q)


def figures(rows: list[dict], seconds: float) -> dict:
    """A load's figures from its requests' rows (`latency_s` None: not
    answered; `ok`, `oom`, `identical`): counts, the percentiles of the
    time to the first result, and the throughput (answers a second, from
    the load's start to its end or its last answer, whichever is later)."""
    answered = [r for r in rows if r.get("latency_s") is not None]
    latencies = [r["latency_s"] for r in answered]
    missing = len(rows) - len(answered)
    span = max([seconds] + [r["at"] + r["latency_s"] for r in answered])
    return {
        "requests": len(rows), "answered": len(answered), "unanswered": missing,
        "failed": sum(1 for r in answered if not r.get("ok")),
        "oom": sum(1 for r in answered if r.get("oom")),
        "different": sum(1 for r in answered if r.get("ok") and not r.get("identical")),
        "p50_s": quantile(latencies, 0.50, missing), "p95_s": quantile(latencies, 0.95, missing),
        "p99_s": quantile(latencies, 0.99, missing),
        "throughput": len(answered) / span if span > 0 else math.nan,
    }


def shortfalls(f: dict) -> list[str]:
    """What keeps a load's figures from the bounds (none: it meets them)."""
    why = []
    if not f["requests"]:
        why.append("no request")
    if f["unanswered"]:
        why.append(f"{f['unanswered']} unanswered")
    if f["oom"]:
        why.append(f"{f['oom']} out of memory")
    if f["failed"] > f["oom"]:
        why.append(f"{f['failed'] - f['oom']} failed")
    if f["different"]:
        why.append(f"{f['different']} answers differ")
    if not f["p50_s"] <= P50_BOUND_S:
        why.append(f"p50 > {P50_BOUND_S:g} s")
    if not f["p99_s"] <= P99_BOUND_S:
        why.append(f"p99 > {P99_BOUND_S:g} s")
    return why


def highest_served(runs: list[dict]) -> int | None:
    """The most pods of the runs (each {"pods": N, "loads": [{"figures"}],
    and "failed" when it did not run to its end}) whose every load met
    the bounds; None when none did."""
    served = [r["pods"] for r in runs
              if "failed" not in r and r["loads"] and not any(shortfalls(x["figures"]) for x in r["loads"])]
    return max(served, default=None)


def highest_turning_over(runs: list[dict]) -> tuple[int, list[float]] | None:
    """The most pods of the runs that met the bounds at a load where the
    resident set turned over (a load's figures say "turned_over": its
    swap-ins reached the pods resident), and those loads' rates; None
    when no run did. A run that did not reach its end counts for the
    loads it measured."""
    served = [(r["pods"], [x["rate"] for x in r["loads"]
                           if x["figures"].get("turned_over") and not shortfalls(x["figures"])])
              for r in runs]
    return max(((n, loads) for n, loads in served if loads), default=None)
