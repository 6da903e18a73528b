"""The serve bench's runs on the GPU: per run, one daemon (the swap bench's
harness) and its pods, swap_pod.py programs in `serve` mode started all at
once; per load, the trace's requests sent as they arrive (an open loop: a
request never waits for another to be answered, a pod answers its own in
order), each answer timed from its request's arrival and checked against
its model's answer computed resident; the daemon's swaps, GPU 0's memory
and the host memory of swapped pods sampled meanwhile."""
from __future__ import annotations

import concurrent.futures
import contextlib
import re
import threading
import time

from .serve_trace import figures, popularity, trace, trace_seed
from .swap_bench import BenchError, gib, gpu_memory, host_available

INPUTS = 8
SAMPLE_S = 1.0
# Seconds kept, of the run's budget, to stop the pods and the daemon.
STOP_RESERVE_S = 20.0
# Request numbers of load k start at k times this (one number space per run).
LOAD_IDS = 1_000_000
_METRIC = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def pod_name(run, index: int) -> str:
    """Pod `index` of a run (serve_plan.Run): a name of its own in each run,
    so that each run's pod logs stay."""
    return f"{'base' if run.kind == 'baseline' else 'serve'}{run.pods}-{index:02d}"


def model_seed(index: int) -> int:
    """Pod `index`'s model seed: the same model for that pod in every run."""
    return 1000 + index


class Reference:
    """Each model's answer to each input as computed resident (a pod's
    ready reply, before any swap): the first seen is the reference, every
    later one (other runs' pods, the baseline's) is compared with it."""

    def __init__(self):
        self.digests = {}
        self.conflicts = []

    def learn(self, seed: int, answers: list, where: str) -> None:
        for i, digest in enumerate(answers):
            known = self.digests.setdefault((seed, i), digest)
            if known != digest:
                self.conflicts.append(f"{where}: model {seed} input {i}: {digest} where {known} was")

    def same(self, seed: int, i: int, digest) -> bool:
        return digest is not None and self.digests.get((seed, i)) == digest


class Answers:
    """The answers to requests in flight, by request number, with the time
    each was read (the pods' route)."""

    def __init__(self):
        self.got = {}
        self.changed = threading.Condition()

    def route(self, answer: dict, at: float) -> bool:
        if "req" not in answer:
            return False
        with self.changed:
            self.got[answer["req"]] = (answer, at)
            self.changed.notify_all()
        return True

    def wait(self, ids, until: float) -> None:
        """Until every request of `ids` is answered or `until` (monotonic)."""
        with self.changed:
            while any(i not in self.got for i in ids):
                left = until - time.monotonic()
                if left <= 0:
                    return
                self.changed.wait(left)


def metric_values(lines) -> dict:
    """{name with its labels: value} of /metrics lines."""
    values = {}
    for line in lines:
        m = _METRIC.match(line.strip())
        if m:
            with contextlib.suppress(ValueError):
                values[m.group(1)] = float(m.group(2))
    return values


def delta(before: dict, after: dict) -> dict:
    """What each number of `after` gained over `before`."""
    return {k: v - before[k] for k, v in after.items()
            if isinstance(v, (int, float)) and isinstance(before.get(k), (int, float))}


class Sampler:
    """GPU 0's used memory (nvidia-smi), the daemon's swapped pods and
    their host memory, and the host's available memory: every SAMPLE_S,
    and when a load starts and ends."""

    def __init__(self, b):
        self.b, self.samples, self.done = b, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(SAMPLE_S):
            self.take()

    def take(self):
        try:
            used = gpu_memory()[1]
        except BenchError:
            used = None
        totals = self.b.totals()
        self.samples.append({"t": time.monotonic(), "gpu_used": used, "available": host_available(),
                             **{k: totals.get(k) for k in ("swapped_pods", "bytes_on_host", "host_kept_bytes")}})

    def stop(self):
        self.done.set()
        self.thread.join(timeout=30)

    def window(self, start: float, end: float, pods: int) -> dict:
        """The samples' figures between start and end: GPU used (max and
        mean), host memory of swapped pods and their kept copies (max),
        pods resident (mean), the host's available memory (min)."""
        inside = [s for s in self.samples if start <= s["t"] <= end]

        def values(key):
            return [s[key] for s in inside if s[key] is not None]

        def top(key):
            return max(values(key), default=None)

        used, swapped = values("gpu_used"), values("swapped_pods")
        return {"samples": len(inside), "gpu_used_max": top("gpu_used"),
                "gpu_used_mean": sum(used) / len(used) if used else None,
                "host_swapped_max": top("bytes_on_host"), "host_kept_max": top("host_kept_bytes"),
                "resident_mean": pods - sum(swapped) / len(swapped) if swapped else None,
                "available_min": min(values("available"), default=None)}


def run_load(b, procs, seeds, requests, seconds, base, answers, reference, sampler):
    """Sends a load's requests as they arrive and waits for their answers
    (--drain-s after its end at most); its rows (each request's arrival,
    pod, input, time to its answer, whether the answer is its model's) and
    figures, the daemon's swap totals and metrics gained meanwhile."""
    before, metrics_before = b.totals(), metric_values(b.metrics())
    began = time.monotonic()
    sampler.take()
    start = time.monotonic() + 0.1
    sent = {}
    for r in requests:
        delay = start + r.at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with contextlib.suppress(BenchError):  # a pod gone: its requests stay unanswered
            procs[r.pod].send(f"infer {base + r.id} {r.input}")
            sent[r.id] = time.monotonic()
    end = start + seconds
    time.sleep(max(0.0, end - time.monotonic()))
    answers.wait([base + r.id for r in requests], min(end + b.args.drain_s, b.deadline - STOP_RESERVE_S))
    after, metrics_after = b.totals(), metric_values(b.metrics())
    sampler.take()
    rows = []
    for r in requests:
        answer, at = answers.got.get(base + r.id, ({}, None))
        rows.append({"id": r.id, "at": r.at, "pod": procs[r.pod].pod, "input": r.input,
                     "sent_late_s": sent[r.id] - start - r.at if r.id in sent else None,
                     "latency_s": None if at is None else at - start - r.at, "ok": answer.get("ok"),
                     "oom": answer.get("oom", False), "pod_s": answer.get("s"), "error": answer.get("error"),
                     "identical": reference.same(seeds[r.pod], r.input, answer.get("digest"))})
    figures_ = figures(rows, seconds)
    swaps = delta(before, after)
    figures_.update(sampler.window(began, time.monotonic(), len(procs)),
                    swap_ins_per_s=swaps.get("swap_ins", 0) / seconds,
                    swap_outs_per_s=swaps.get("swap_outs", 0) / seconds)
    resident = figures_["resident_mean"]
    figures_["turned_over"] = resident is not None and swaps.get("swap_ins", 0) >= resident
    return {"rows": rows, "figures": figures_, "totals": swaps, "metrics": delta(metrics_before, metrics_after)}


def stop_all(b, procs):
    """Stops the pods at once (each as the swap bench stops one)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        list(pool.map(b.stop_pod, procs))


def serve_run(b, run, weights, reference, keys, result):
    """One run of the plan (serve_plan.Run) on the GPU: its daemon, its
    pods, its loads, their figures put into `result` as they come (a
    "failed" reason where it stopped early: the budget spent, requests
    unanswered)."""
    args = b.args
    n, overcommit = run.pods, run.kind == "overcommit"
    seeds = [model_seed(i) for i in range(n)]
    shares = popularity(n, args.zipf, f"serve-{args.seed}-{n}-popularity")
    result.update(shares=shares, loads=[])
    answers = Answers()
    tag = f"serve-{n}-{run.kind}"
    with b.serving(tag, {pod_name(run, i): run.quota for i in range(n)}, args.idle_after_ms,
                   host_limit=run.host_limit or None, overcommit=overcommit, extra=keys if overcommit else None):
        started = time.monotonic()
        procs = []

        def start(i):
            procs.append(b.start_pod(pod_name(run, i), "serve", weights, seeds[i], INPUTS, route=answers.route))

        def ready(i):
            answered = procs[i].ready(max(10.0, b.left() - STOP_RESERVE_S))
            reference.learn(seeds[i], answered["answers"], f"{tag} {procs[i].pod}")

        try:
            # One by one (each once the one before answered), as a node
            # brings models up; --start-together starts them all at once.
            if args.start_together:
                for i in range(n):
                    start(i)
                for i in range(n):
                    ready(i)
            else:
                for i in range(n):
                    start(i)
                    ready(i)
            result["start_s"] = time.monotonic() - started
            result["pod_rss"] = [rss(p.p.pid) for p in procs]
            print(f"{tag} ({args.path} path): {n} pods of {gib(weights)} GiB (quota {gib(run.quota)} GiB) ready in"
                  f" {result['start_s']:.1f} s; daemon swaps {b.totals()}", flush=True)
            sampler = Sampler(b)
            try:
                for k, rate in enumerate(args.loads):
                    if b.left() - STOP_RESERVE_S < args.duration + args.drain_s:
                        result["failed"] = f"the budget (--budget-s) spent before {rate:g} req/s"
                        break
                    requests = trace(shares, rate, args.duration, INPUTS, trace_seed(args.seed, n, k))
                    load = run_load(b, procs, seeds, requests, args.duration, k * LOAD_IDS, answers, reference,
                                    sampler)
                    load["rate"] = rate
                    result["loads"].append(load)
                    print_load(tag, rate, load["figures"])
                    if load["figures"]["unanswered"]:
                        result["failed"] = f"{load['figures']['unanswered']} requests unanswered at {rate:g} req/s"
                        break
            finally:
                sampler.stop()
                result["samples"] = sampler.samples
        finally:
            stop_all(b, procs)


def rss(pid: int):
    """The process's resident memory, bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def print_load(tag, rate, f):
    def s(x):
        return "n/a" if x is None else f"{x:.3f}"

    print(f"  {tag} at {rate:g} req/s: {f['answered']}/{f['requests']} answered; first result p50 {s(f['p50_s'])} s,"
          f" p95 {s(f['p95_s'])} s, p99 {s(f['p99_s'])} s; {f['throughput']:.2f} req/s; swaps in"
          f" {f['swap_ins_per_s']:.2f}/s, out {f['swap_outs_per_s']:.2f}/s (the resident set turned over:"
          f" {'yes' if f['turned_over'] else 'no'});"
          f" OOM {f['oom']}, different {f['different']}, failed {f['failed']}", flush=True)
