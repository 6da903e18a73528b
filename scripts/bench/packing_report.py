"""The packing bench's figures and report: each pod's share against its
target, the verdicts, the table, the notes and the JSON (see packing.py)."""
from __future__ import annotations

import math

from . import corun
from .packing_plan import (ADMISSION_P99_MS, AGGREGATE_N, AGGREGATE_PCT, DAEMON_CPU_PCT, DAEMON_N, FILL_PCT,
                           SHARE_PP, SOLO, WORKLOADS, Spec, targets)


def shares(per_s: list[float], solo: float, busy: float, want: list[float]) -> dict:
    """Each pod's share of the GPU's time, percent (its throughput over the
    lone process's `solo`, times the fraction `busy` of the time the lone
    process keeps the GPU busy), how far they are from their targets
    `want`, and the aggregate: the pods' throughput over the lone
    process's, percent."""
    got = [x / solo * busy * 100 for x in per_s]
    dev = [g - w for g, w in zip(got, want)]
    return {"shares": got, "aggregate": sum(per_s) / solo * 100, "busy": busy,
            "max_dev_pp": max(dev, key=abs), "spread_pp": max(got) - min(got)}


def unit_gpu_s(runs, workload, calibration) -> float | None:
    """The GPU time of one unit of `workload` alone, seconds: the calibrated
    kernel, or the least warm-up step time of its lone runs (a warm-up at a
    low clock reads long, and would count the lone process busier than it
    is: one read 0.368 ms where the others read 0.21)."""
    if workload == "kernels":
        us = calibration.get("kernel_us")
        return float(us) / 1e6 if us else None
    steps = [r["result"]["pods"][0].get("step_ms") for r in runs
             if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]
    steps = [x for x in steps if x]
    return min(steps) / 1e3 if steps else None


def window_busy(runs, workload) -> float | None:
    """The fraction of its window the lone process's units took on the GPU,
    as it measured them (the infer worker brackets each step with events,
    at the window's clock, gaps inside a step included), the mean over the
    lone runs; None where the worker does not say. A second reading beside
    the baseline's, not the baseline: see `evaluate`."""
    got = [r["result"]["pods"][0].get("gpu_busy") for r in runs
           if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]
    got = [x for x in got if x]
    return min(1.0, sum(got) / len(got)) if got else None


def verdicts(spec: Spec, summary: dict, want: list[float], daemon: dict | None, returns: dict | None = None) -> dict:
    """The targets that apply to a run: {name: True/False}; a figure the
    run lacks fails. Admissions: the window's and, where the run had
    returns, theirs too."""
    out = {}
    if spec.mode.corun and spec.mode.policy == "elastic" and spec.n == AGGREGATE_N:
        out["aggregate"] = summary["aggregate"] >= AGGREGATE_PCT
    if spec.mode.daemon and sum(want) <= FILL_PCT:
        out["shares"] = abs(summary["max_dev_pp"]) <= SHARE_PP
    if spec.mode.daemon and spec.n == DAEMON_N:
        cpu = (daemon or {}).get("cpu_pct")
        out["cpu"] = cpu is not None and cpu <= DAEMON_CPU_PCT
        adm = ((returns or {}).get("admission_with_window") if returns else (daemon or {}).get("admission")) or {}
        # No admission at all: nothing waited for the daemon.
        out["p99"] = adm.get("requests") == 0 or (adm.get("p99_ms") is not None
                                                  and adm["p99_ms"] <= ADMISSION_P99_MS)
    return out


def ok(run) -> bool:
    """Whether a run ran and every one of its pods gave a result."""
    res = run.get("result") or {}
    return not run.get("skipped") and "error" not in res and bool(res.get("pods")) and all(res["pods"])


def solo_rates(runs, workload) -> list[float]:
    """The workload's lone runs that succeeded: their throughput, in order."""
    return [r["result"]["pods"][0]["per_s"] for r in runs
            if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]


def evaluate(runs, calibration) -> None:
    """Adds each run's shares against its targets, and its verdicts, as
    "figures": against the mean of its workload's lone runs, and the GPU
    time they keep busy: their rate times a unit's time (all of it where
    that is unknown). For a power-bound step neither that (the unit timed
    at the warm-up's boost clock reads it short) nor the window's brackets
    (`window_busy`: the gaps inside a step read as busy) is its time to a
    point, and a pod's clock is not the lone process's: the notes give
    both."""
    for workload in {r["spec"].workload for r in runs}:
        rates = solo_rates(runs, workload)
        if not rates:
            continue
        solo = sum(rates) / len(rates)
        unit = unit_gpu_s(runs, workload, calibration)
        busy = min(1.0, solo * unit) if unit else 1.0
        for run in runs:
            spec = run["spec"]
            if spec.workload != workload or not ok(run):
                continue
            want = targets(spec.mode, spec.n, busy)
            summary = shares([pod["per_s"] for pod in run["result"]["pods"]], solo, busy, want)
            charged = ((run["result"].get("daemon") or {}).get("charged_pct") or {})
            summary["charged"] = [charged.get(f"{run['result']['tag']}-{i}") for i in range(spec.n)]
            summary["nvml"] = [pod.get("nvml_sm_pct") for pod in run["result"]["pods"]]
            run["figures"] = {**summary, "targets": want,
                              "verdicts": verdicts(spec, summary, want, run["result"].get("daemon"),
                                                   run["result"].get("returns"))}


def fmt(x, spec="{:.1f}", none="–") -> str:
    if x is None:
        return none
    return "inf" if isinstance(x, float) and math.isinf(x) else spec.format(x)


def span(values) -> str:
    """"min–max" of the figures there are, "" with none."""
    got = [x for x in values or [] if x is not None]
    return f"{min(got):.2f}–{max(got):.2f}" if got else ""


def mark(verdicts, key) -> str:
    return "" if key not in verdicts else ("PASS" if verdicts[key] else "FAIL")


COLUMNS = ("workload", "run", "target a pod", "throughput (sum)", "aggregate %", "pod shares % (min–max)",
           "charged % (min–max)", "NVML SM % a pod (min–max)", "GPU busy % (NVML)", "max dev pp", "spread pp", "admissions (timeouts)", "adm p50 ms", "adm p99 ms",
           "returns: admissions (timeouts), p50/p99 ms, daemon CPU %", "daemon CPU %",
           "daemon RSS MiB", f"agg >= {AGGREGATE_PCT:g}% (corun N={AGGREGATE_N})", f"shares +-{SHARE_PP:g} pp",
           f"CPU <= {DAEMON_CPU_PCT:g}% (N={DAEMON_N})", f"p99 <= {ADMISSION_P99_MS:g} ms (N={DAEMON_N})")


def row(run) -> list[str]:
    """A run's cells, one for each of COLUMNS."""
    spec, res = run["spec"], run.get("result") or {}
    cells = [spec.workload, spec.label]
    if run.get("skipped") or "figures" not in run:
        why = (f"skipped: {run['skipped']}" if run.get("skipped")
               else "failed: " + (res.get("error") or "no lone run to compare with"))
        return cells + [why.replace("|", "/")[:240]] + [""] * (len(COLUMNS) - 3)
    fig, v = run["figures"], run["figures"]["verdicts"]
    want = fig["targets"][0]
    total = sum(pod["per_s"] for pod in res["pods"])
    daemon = res.get("daemon") or {}
    adm = daemon.get("admission") or {}
    busy = fmt((res.get("gpu") or {}).get("busy_pct"), "{:.1f}", "")
    if spec.mode is SOLO:
        return cells + [f"the baseline (GPU {fig['busy'] * 100:.1f}% busy)", f"{total:,.1f} {WORKLOADS[spec.workload]}",
                        f"{fig['aggregate']:.1f}", "", "", span(fig.get("nvml")), busy] + \
            [""] * (len(COLUMNS) - 9)
    target = {"fixed": f"cap {want:.2f}%", "none": f"none (even: {want:.2f}%)"}.get(spec.mode.policy,
                                                                                  f"fair {want:.2f}%")
    return cells + [
        target, f"{total:,.1f} {WORKLOADS[spec.workload]}", f"{fig['aggregate']:.1f}",
        f"{min(fig['shares']):.2f}–{max(fig['shares']):.2f}", span(fig.get("charged")),
        span(fig.get("nvml")), busy, f"{fig['max_dev_pp']:+.2f}", f"{fig['spread_pp']:.2f}",
        f"{adm['requests']} ({adm['timeouts']})" if adm else "",
        fmt(adm.get("p50_ms"), "{:.3f}", ""), fmt(adm.get("p99_ms"), "{:.3f}", ""), returns_cell(res.get("returns")),
        fmt(daemon.get("cpu_pct"), "{:.2f}", ""), fmt(daemon.get("rss_mib"), "{:.1f}", ""),
        mark(v, "aggregate"), mark(v, "shares"), mark(v, "cpu"), mark(v, "p99")]


def returns_cell(returns: dict | None) -> str:
    """The returns' admissions, their p50/p99 and the daemon's CPU over
    them; "" for a run without returns."""
    if not returns:
        return ""
    adm = returns.get("admission") or {}
    if not adm:
        return f"no histogram, {fmt(returns.get('cpu_pct'), '{:.2f}')}%"
    return (f"{adm['requests']} ({adm['timeouts']}), {fmt(adm.get('p50_ms'), '{:.3f}')}/"
            f"{fmt(adm.get('p99_ms'), '{:.3f}')}, {fmt(returns.get('cpu_pct'), '{:.2f}')}%")


def notes(runs, workloads) -> list[str]:
    """Per workload: the lone runs and their drift, and the SM clock and
    power of every run; the runs whose pods did not all get through their
    returns, and those whose workers were not all registered."""
    out = []
    for workload in workloads:
        rates = solo_rates(runs, workload)
        if rates:
            drift = f", drift {(rates[-1] / rates[0] - 1) * 100:+.2f}%" if len(rates) > 1 else ""
            first = next(r for r in runs if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r))
            step = first["result"]["pods"][0].get("step_ms")
            line = f"{workload} alone: {', '.join(f'{x:,.1f}' for x in rates)} {WORKLOADS[workload]}{drift}"
            if step:
                line += (f", a step {step:.3f} ms on the GPU in the warm-up (busy by it, the shares'"
                         f" baseline: {min(1.0, sum(rates) / len(rates) * step / 1e3) * 100:.1f}%)")
            busy = window_busy(runs, workload)
            if busy:
                line += f", busy by its steps' events in the window: {busy * 100:.1f}%"
            out.append(line)
        clocks = [f"{r['spec'].label} {fmt(r['result']['gpu']['sm_mhz'], '{:.0f}')}/"
                  f"{fmt(r['result']['gpu']['power_w'], '{:.0f}')}"
                  for r in runs if r["spec"].workload == workload and (r.get("result") or {}).get("gpu")]
        if clocks:
            out.append(f"{workload}, SM MHz/board W through the window: {'; '.join(clocks)}")
    split = [f"{r['spec'].workload} {r['spec'].label} {d['capacity_pct']:.1f}%" for r in runs
             if (d := (r.get("result") or {}).get("daemon") or {}).get("capacity_pct") not in (None, 100.0)]
    if split:
        out.append("elastic pods split more than the GPU's time at the window's end (a co-run GPU that idled"
                   f" while they used all they were given): {'; '.join(split)}")
    for run in runs:
        back = (run.get("result") or {}).get("returns")
        if back and back["pods_through"] < run["spec"].n:
            out.append(f"{run['spec'].workload} {run['spec'].label}: {back['pods_through']} of {run['spec'].n}"
                       " pods through their returns")
        if (run.get("result") or {}).get("registered") is False:
            out.append(f"{run['spec'].workload} {run['spec'].label}: not every worker was registered with the"
                       " daemon at the start")
    return out


def report(args, runs, order, took, calibration, checks) -> None:
    """The table (in `order`), the verdicts and the notes: on stdout, in
    OUT/packing-bench.md; every run's raw figures in OUT/packing-bench.json."""
    evaluate(runs, calibration)
    ordered = [runs[i] for i in order if i < len(runs)]
    table = ("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|\n"
             + "".join("| " + " | ".join(row(r)) + " |\n" for r in ordered))
    failed = sorted({k for r in runs for k, v in (r.get("figures") or {}).get("verdicts", {}).items() if not v})
    checked = any((r.get("figures") or {}).get("verdicts") for r in runs)
    if "iters" in calibration:
        cal = (f"kernels: {calibration['iters']} iterations x {calibration['grid']} blocks of 256 threads"
               f" ({calibration['blocks_per_sm']} an SM), {calibration['kernel_us']} us alone")
    else:
        cal = f"kernels: not calibrated {calibration.get('error', '')}".strip()
    verdict = ("FAILED: " + ", ".join(failed)) if failed else ("all met" if checked else "none applied")
    text = (f"Packing bench, N pods on GPU 0, {args.seconds:g} s windows ({took:.0f} s in all, budget"
            f" {args.budget_s:g} s)\n\n{table}\nTargets: {verdict}\n\n"
            + "".join(f"- {line}\n" for line in [cal] + notes(runs, args.workloads)
                      + [f"{k}: {v}" for k, v in checks.items()]))
    data = {"calibration": calibration, "checks": checks,
            "runs": [{"workload": r["spec"].workload, "mode": r["spec"].mode.name, "policy": r["spec"].mode.policy,
                      "n": r["spec"].n, "label": r["spec"].label, "ran": runs.index(r), "skipped": r.get("skipped"),
                      "result": r.get("result"), "figures": r.get("figures")} for r in ordered]}
    corun.publish(args, "packing-bench", text, data)


def progress(run) -> str:
    """A run's one line as it ends."""
    if run.get("skipped"):
        return f"skipped: {run['skipped']}"
    res = run.get("result") or {}
    if "error" in res:
        return f"FAILED: {res['error']}"
    rates = [pod["per_s"] for pod in res["pods"]]
    text = (f"{sum(rates):,.1f} in all, a pod {min(rates):,.1f} to {max(rates):,.1f}"
            f" (ready in {res['ready_s']:.1f} s, {res['wall_s']:.0f} s in all)")
    daemon = res.get("daemon")
    if daemon:
        adm = daemon.get("admission") or {}
        text += (f"; daemon {fmt(daemon.get('cpu_pct'), '{:.2f}')}% CPU, {fmt(daemon.get('rss_mib'))} MiB,"
                 f" {adm.get('requests')} admissions, p99 {fmt(adm.get('p99_ms'), '{:.3f}')} ms")
    if res.get("returns"):
        text += f"; returns: {returns_cell(res['returns'])}"
    return text
