"""The packing bench's daemon: `hypervisor serve` for one run, and what the
bench reads of it over a window (its CPU, memory, admission latency
histogram and the GPU time charged to each pod)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from scripts.gpu.e2e.harness import hv

from . import common, corun
from .packing_plan import Mode, cap_percent

SIMULATE = ""  # the daemon's --simulate-gpus (dry runs without a GPU); "": the GPU


_BUCKET = re.compile(r'^gpushare_admission_latency_seconds_bucket\{le="([^"]+)"\}\s+(\S+)\s*$')
_SCALAR = re.compile(r"^(gpushare_admission_latency_seconds_(?:sum|count)|gpushare_admission_timeouts_total)"
                     r"\s+(\S+)\s*$")


def parse_admission(text: str) -> dict | None:
    """The admission histogram of a /metrics text: {"buckets": [(upper
    bound s, cumulative count)] by bound, "sum", "count", "timeouts"}; None
    without its buckets."""
    buckets, scalars = [], {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m:
            bound = math.inf if m.group(1) == "+Inf" else float(m.group(1))
            buckets.append((bound, int(float(m.group(2)))))
            continue
        m = _SCALAR.match(line)
        if m:
            scalars[m.group(1)] = float(m.group(2))
    if not buckets:
        return None
    return {"buckets": sorted(buckets), "sum": scalars.get("gpushare_admission_latency_seconds_sum", 0.0),
            "count": int(scalars.get("gpushare_admission_latency_seconds_count", buckets[-1][1])),
            "timeouts": int(scalars.get("gpushare_admission_timeouts_total", 0))}


def admission_delta(before: dict, after: dict) -> dict:
    """What the histogram gained between two scrapes of one daemon."""
    old = dict(before["buckets"])
    return {"buckets": [(bound, n - old.get(bound, 0)) for bound, n in after["buckets"]],
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"],
            "timeouts": after["timeouts"] - before["timeouts"]}


def quantile(buckets, q: float) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram [(bound, count)],
    linear inside its bucket from the bucket below's bound (0 for the first),
    as Prometheus's histogram_quantile; inf when it falls in +Inf; None
    when the histogram is empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    low, below = 0.0, 0
    for bound, cum in buckets:
        if cum >= rank and cum > below:
            if math.isinf(bound):
                return math.inf
            return low + (bound - low) * (rank - below) / (cum - below)
        low, below = bound, cum
    return math.inf


def admission_summary(delta: dict) -> dict:
    """Requests, timeouts, p50, p99 and mean of a window's admissions, in ms."""
    def ms(q):
        seconds = quantile(delta["buckets"], q)
        return None if seconds is None else seconds * 1e3

    return {"requests": delta["count"], "timeouts": delta["timeouts"], "p50_ms": ms(0.5), "p99_ms": ms(0.99),
            "mean_ms": delta["sum"] / delta["count"] * 1e3 if delta["count"] else None}


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time so far (/proc/PID/stat), seconds."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the command's name, which may hold spaces and parentheses:
    # field 3 (state) is index 0, utime (14) index 11, stime (15) index 12.
    rest = text[text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float | None:
    """The process's resident memory (VmRSS), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PackingDaemon(hv.Daemon):
    """`hypervisor serve` for one run: its config names the run's pods (all
    on GPU 0, each with the policy of `mode`), GPU 0 co-run where the mode
    says so (ready once its MPS control daemon answers: /readyz), or its
    pods taking turns of the mode's `turn_ms` (always, or by the daemon's
    default while they contend), or never; node tables of its own. Its
    config and log in `logs`; its MPS folders in `work`."""

    def __init__(self, bundle: Path, logs: Path, work: Path, tag: str, mode: Mode, pods, control: str):
        self.mode, self.work, self.pod_ids = mode, work, list(pods)
        self.tables = {"GPUSHARE_NODE_REGION": f"gpushare-node-{tag}",
                       "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{tag}"}
        settings = dataclasses.replace(common.settings("", logs, bundle / "hypervisor", SIMULATE), hv_log="warn")
        config = logs / f"{tag}.toml"
        n = len(self.pod_ids)
        lines = {"fixed": ('policy = "fixed"', f"cap = {cap_percent(n)}"),
                 "elastic": ('policy = "elastic"', "weight = 1"),
                 "none": ('policy = "none"',)}[mode.policy]
        hv.write_config(config, f"admin-{tag}", *(hv.pod_section(pod, *lines) for pod in self.pod_ids))
        serve_args, ready, stop_s = [], None, 5.0
        self.control = control
        if mode.corun:
            # The MPS control daemon quits its servers on the daemon's SIGTERM: 20 s for it.
            serve_args = ["--corun-gpu", "0", "--corun-dir", str(work / "mps"), "--mps-control", control]
            ready, stop_s = "/readyz", 20.0
        elif mode.turn_ms and mode.auto:
            serve_args = ["--turn-ms", str(mode.turn_ms)]
        elif mode.turn_ms:
            serve_args = ["--turns-gpu", "0", "--turn-ms", str(mode.turn_ms)]
        else:
            serve_args = ["--no-auto-turns"]
        super().__init__(settings, tag, config, serve_args=serve_args, env=self.tables, ready=ready, ready_s=60,
                         stop_s=stop_s)
        self.pipe = self.mps_log = None

    def start(self, port=None):
        super().start(port)
        if self.mode.corun:
            uuid = self.status_json()["corun"][0]["gpu"]
            self.pipe = self.work / "mps" / uuid / "pipe"
            self.mps_log = self.work / "mps" / uuid / "log" / "control.log"

    def placed(self, limit_s: float = 20.0) -> dict:
        """Waits until every pod is listed on a GPU (and, co-run, with the
        share of the SMs its next client takes); {pod: its GPU's status}."""
        deadline = time.monotonic() + limit_s
        listed = {}
        while time.monotonic() < deadline:
            listed = {p["id"]: (p.get("gpus") or [{}])[0] for p in self.status_json().get("pods", [])}
            if all(listed.get(pod, {}).get("uuid") and (not self.mode.corun or listed[pod].get("sm_percent"))
                   for pod in self.pod_ids):
                return listed
            time.sleep(0.05)
        missing = [pod for pod in self.pod_ids if not listed.get(pod, {}).get("uuid")]
        raise RuntimeError(f"pods not placed after {limit_s:g} s: {missing[:4]}"
                           f" ({len(missing)} of {len(self.pod_ids)})")

    def sample(self, scrape_first: bool) -> dict:
        """The daemon's CPU time, RSS, admission histogram and the GPU time
        charged to each pod so far. Its answers cost the daemon CPU: before
        the window they come first, after it last, so that neither is
        counted in the window's."""
        pid = self.p.pid if self.p else 0

        def scrape():
            code, text = hv.hvctl.request(self.url + "/metrics", timeout=5.0)
            return parse_admission(text) if code == 200 else None

        def from_status():
            """Each pod's GPU time charged, the co-run split (%) and GPU 0's turns."""
            status = self.status_or_none()
            figures = pod_figures(status)
            capacity = [f["elastic_capacity_ppm"] for f in figures.values() if f.get("elastic_capacity_ppm")]
            return {"charged_ns": {pod: f.get("charged_ns") for pod, f in figures.items()},
                    "forfeited_ns": {pod: f.get("forfeited_ns") for pod, f in figures.items()},
                    "capacity_pct": max(capacity) / 1e4 if capacity else None, "turns": gpu_turns(status)}

        first = (from_status(), scrape()) if scrape_first else None
        out = {"t": time.monotonic(), "cpu_s": cpu_seconds(pid), "rss_mib": rss_mib(pid)}
        figures, admission = first or (from_status(), scrape())
        return {**out, "admission": admission, **figures}

    def status_or_none(self) -> dict:
        """The daemon's status; {} when it does not answer."""
        try:
            return self.status_json()
        except hv.HvError:
            return {}

    def pod_figures(self) -> dict:
        """`pod_figures` of the daemon's status now."""
        return pod_figures(self.status_or_none())

    def stop(self):
        """Stops the daemon; an MPS control daemon still up then gets its
        quit through the pipe, and what is left of the daemon's process
        group is killed."""
        pid = self.p.pid if self.p else None
        super().stop()
        if self.mode.corun and corun.mps_processes() and self.pipe is not None:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe)
            try:
                subprocess.run([self.control], input="quit\n", env=env, capture_output=True, text=True, timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
            deadline = time.monotonic() + 10
            while corun.mps_processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in self.tables.values():
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def pod_figures(status: dict) -> dict:
    """Each pod's rate (the share granted), achieved share over the last
    second, share of the SMs (co-run) and workers, as `status` says them."""
    keys = ("rate_ppm", "achieved_ppm", "sm_percent", "charged_ns", "forfeited_ns", "elastic_capacity_ppm")
    return {p["id"]: {**{k: (p.get("gpus") or [{}])[0].get(k) for k in keys}, "workers": p.get("workers")}
            for p in status.get("pods", [])}


def gpu_turns(status: dict) -> dict | None:
    """GPU 0's turns as `status` says them: {"quantum_us", "handovers"};
    None where its pods take none (or the daemon does not say). A GPU that
    takes turns by itself is read whether it takes them now or not: at a
    window's start, its pods idle since their warm-up, it may not yet."""
    gpu = next((g for g in status.get("turns") or []
                if g.get("index") == 0 and (g.get("takes_turns") or g.get("automatic"))), None)
    return {"quantum_us": gpu.get("quantum_us"), "handovers": gpu.get("handovers")} if gpu else None


def turns_figures(before: dict | None, after: dict | None, seconds: float) -> dict | None:
    """A turn's length at a window's end (ms) and the turns handed over
    from one pod to another in it; None without both readings."""
    if not before or not after or before.get("handovers") is None or after.get("handovers") is None:
        return None
    handovers = after["handovers"] - before["handovers"]
    return {"turn_ms": (after.get("quantum_us") or 0) / 1e3, "handovers": handovers,
            "handovers_per_s": handovers / seconds if seconds > 0 else None}


def daemon_figures(before: dict, after: dict) -> dict:
    """The daemon's CPU (% of one core), admissions, each pod's charged
    GPU time and the turns handed over on GPU 0 over a window; its RSS,
    and what elastic pods split, at its end."""
    # What the GPU's elastic pods split at the window's end, % of its time.
    out = {"rss_mib": after["rss_mib"], "cpu_pct": None, "admission": None,
           "capacity_pct": after.get("capacity_pct")}
    if before["cpu_s"] is not None and after["cpu_s"] is not None and after["t"] > before["t"]:
        out["cpu_pct"] = (after["cpu_s"] - before["cpu_s"]) / (after["t"] - before["t"]) * 100
    if before["admission"] and after["admission"]:
        out["admission"] = admission_summary(admission_delta(before["admission"], after["admission"]))
    # What each pod was charged over the window, % of its wall time: beside
    # its share of the GPU's time, how far the limiter's prices are off.
    span_ns = (after["t"] - before["t"]) * 1e9

    def gained(key):
        """What each pod's counter `key` (ns) gained, % of the window."""
        was = before.get(key) or {}
        return {pod: (ns - was[pod]) / span_ns * 100 for pod, ns in (after.get(key) or {}).items()
                if ns is not None and was.get(pod) is not None and span_ns > 0}

    out["charged_pct"] = gained("charged_ns")
    # What each pod earned beyond its bucket's depth and lost, % of the window.
    out["forfeited_pct"] = gained("forfeited_ns")
    out["turns"] = turns_figures(before.get("turns"), after.get("turns"), span_ns / 1e9)
    return out


def returns_figures(before: dict, after: dict, back: dict) -> dict:
    """The daemon over the returns after a window (`before` and `after` its
    start and end, `back` the returns' end): its CPU (% of one core) and
    admissions over the returns, and its admissions over the window and
    the returns together, which the p99 target is judged on."""
    phase = daemon_figures(after, back)
    both = None
    if before["admission"] and back["admission"]:
        both = admission_summary(admission_delta(before["admission"], back["admission"]))
    return {"cpu_pct": phase["cpu_pct"], "admission": phase["admission"], "admission_with_window": both}
