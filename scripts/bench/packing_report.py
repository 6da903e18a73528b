"""The packing bench's figures and report: each pod's share against its
target, the verdicts, the table, the notes and the JSON (see packing.py)."""
from __future__ import annotations

import math

from . import corun
from .packing_plan import (ADMISSION_P99_MS, AGGREGATE_N, AGGREGATE_PCT, DAEMON_CPU_PCT, DAEMON_N, FILL_PCT,
                           SHARE_PP, SOLO, UNLIMITED, WORKLOADS, Spec, targets)


def shares(per_s: list[float], solo: float, busy: float, want: list[float], ran=None) -> dict:
    """Each pod's share of the GPU's time, percent: its GPU time by CUPTI
    over the window (`ran`, where every pod has it: see `gpu_time`), else
    its throughput over the lone process's `solo`, times the fraction
    `busy` of the time the lone process keeps the GPU busy
    ("by_throughput", whichever is judged); how far they are from their
    targets `want` ("by": "cupti" or "throughput"), and the aggregate: the
    pods' throughput over the lone process's, percent."""
    measured = ran is not None and all(x is not None for x in ran)
    by_rate = [x / solo * busy * 100 for x in per_s]
    got = [x * 100 for x in ran] if measured else by_rate
    dev = [g - w for g, w in zip(got, want)]
    return {"shares": got, "aggregate": sum(per_s) / solo * 100, "busy": busy,
            "by": "cupti" if measured else "throughput", "by_throughput": by_rate,
            "max_dev_pp": max(dev, key=abs), "spread_pp": max(got) - min(got)}


def lone_runs(runs, workload) -> list[dict]:
    """The workload's lone runs that succeeded, in order."""
    return [r for r in runs if r["spec"].workload == workload and r["spec"].mode is SOLO and ok(r)]


def unit_gpu_s(runs, workload, calibration) -> float | None:
    """The GPU time of one unit of `workload` alone, seconds: the calibrated
    kernel, or the least warm-up step time of its lone runs (a warm-up at a
    low clock reads long, and would count the lone process busier than it
    is: one read 0.368 ms where the others read 0.21)."""
    if workload == "kernels":
        us = calibration.get("kernel_us")
        return float(us) / 1e6 if us else None
    steps = [r["result"]["pods"][0].get("step_ms") for r in lone_runs(runs, workload)]
    steps = [x for x in steps if x]
    return min(steps) / 1e3 if steps else None


def window_busy(runs, workload) -> float | None:
    """The fraction of its window the lone process's units took on the GPU,
    as it measured them (the infer worker brackets each step with events,
    at the window's clock, gaps inside a step included), the mean over the
    lone runs; None where the worker does not say. A reading in the notes,
    not the baseline: see `baseline`."""
    got = [r["result"]["pods"][0].get("gpu_busy") for r in lone_runs(runs, workload)]
    got = [x for x in got if x]
    return min(1.0, sum(got) / len(got)) if got else None


def lone_mean(runs, workload, read) -> float | None:
    """The mean of `read(result)` over the workload's lone runs where it is
    not None; None where it is for all of them."""
    got = [x for r in lone_runs(runs, workload) if (x := read(r["result"])) is not None]
    return sum(got) / len(got) if got else None


def nvml_busy(runs, workload) -> float | None:
    """NVML's utilisation of the GPU over the lone runs' windows (the share
    of the time a kernel ran), the mean of the runs that have it, as a
    fraction, at most 1; None where none has it."""
    got = lone_mean(runs, workload, lambda res: (res.get("gpu") or {}).get("busy_pct"))
    return None if got is None else min(1.0, got / 100)


def gpu_time(pod: dict) -> float | None:
    """A pod's GPU time by CUPTI, as a fraction of its window: the time its
    kernels ran plus the GPU's moves between two of its kernels it had
    queued back to back (the gaps of up to 3 us between them; 1.5 to 3 us
    on an H100). A time-sliced GPU runs no other context in those moves,
    and the limiter charges a queued kernel its back-to-back period, move
    included, so that a pod of many tiny kernels pays for the GPU it holds
    (compute.md). Where the run's pods' spans were laid over each other,
    the instants that several pods' spans cover split between them
    ("gpu_split": packing_spans.py). None where CUPTI did not time the
    pod."""
    if pod.get("gpu_split") is not None:
        return pod["gpu_split"]
    return own_gpu_time(pod)


def own_gpu_time(pod: dict) -> float | None:
    """A pod's GPU time by its own CUPTI records alone (its kernels and
    the moves between them), whatever other pods ran meanwhile; None where
    CUPTI did not time the pod."""
    kernels, moves = pod.get("kernel_busy"), pod.get("gaps_3us")
    return None if kernels is None or moves is None else kernels + moves


def lone_gpu_time(runs, workload) -> float | None:
    """The lone process's `gpu_time`, the mean of the lone runs that have
    it; None where none has."""
    return lone_mean(runs, workload, lambda res: gpu_time(res["pods"][0]))


def baseline(runs, workload, calibration) -> dict | None:
    """The workload's lone process: its throughput ("per_s", the mean of
    its lone runs) and the fraction of the GPU's time it keeps busy, which
    caps its pods' targets and against which throughput shares are judged
    ("busy"): its GPU time by CUPTI (`gpu_time`), else NVML's
    utilisation over its windows, else its warm-up's (its rate times a
    unit's GPU time alone), else all of it. Every reading is kept
    ("cupti", "nvml", "warmup") and which was used ("by"). CUPTI's first:
    it has each kernel's start and end, where NVML counts a
    sample period in which any kernel ran, blind to the host's gaps
    between a step's kernels; NVML before the warm-up, which times a unit
    at its boost clock where a power-bound step takes longer in the window
    (on an H100 the inference step read 85.9% busy by its warm-up, 95.0%
    by NVML). None without a lone run."""
    rates = solo_rates(runs, workload)
    if not rates:
        return None
    per_s = sum(rates) / len(rates)
    unit = unit_gpu_s(runs, workload, calibration)
    warmup = min(1.0, per_s * unit) if unit else None
    cupti = lone_gpu_time(runs, workload)
    nvml = nvml_busy(runs, workload)
    by, busy = next(((name, x) for name, x in (("cupti", cupti), ("nvml", nvml), ("warm-up", warmup))
                     if x is not None), ("none", 1.0))
    return {"per_s": per_s, "busy": busy, "by": by, "cupti": cupti, "nvml": nvml, "warmup": warmup,
            "unit_ms": unit * 1e3 if unit else None}


def verdicts(spec: Spec, summary: dict, want: list[float], daemon: dict | None, returns: dict | None = None) -> dict:
    """The targets that apply to a run: {name: True/False}; a figure the
    run lacks fails. The shares' where the pods' shares as configured
    (before what the workload keeps busy caps them in `want`) sum to at
    most FILL_PCT. Admissions: the window's and, where the run had
    returns, theirs too."""
    out = {}
    if spec.mode.corun and spec.mode.policy == "elastic" and spec.n == AGGREGATE_N:
        out["aggregate"] = summary["aggregate"] >= AGGREGATE_PCT
    if spec.mode.daemon and sum(targets(spec.mode, spec.n)) <= FILL_PCT:
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
    return [r["result"]["pods"][0]["per_s"] for r in lone_runs(runs, workload)]


def evaluate(runs, calibration) -> dict:
    """Adds each run's shares against its targets, and its verdicts, as
    "figures", against its workload's `baseline`; returns the baselines
    by workload. For a power-bound step no reading is its GPU time to a
    point, and a pod's clock is not the lone process's: the notes give the
    others beside the one judged on."""
    bases = {}
    for workload in {r["spec"].workload for r in runs}:
        base = baseline(runs, workload, calibration)
        if base is None:
            continue
        bases[workload] = base
        for run in runs:
            if run["spec"].workload == workload and ok(run):
                run["figures"] = run_figures(run, base)
    return bases


def one_at_a_time(spec: Spec) -> bool:
    """Whether a run's pods launch one at a time (one pod, or pods taking
    turns), so that a kernel's span in CUPTI's records, and a gap between
    two of a pod's kernels, is its pod's GPU time: where several launch at
    once, a time-sliced kernel's span takes in the slices of the pods that
    preempted it, and co-run kernels share the SMs by design."""
    return spec.n == 1 or spec.mode.turn_ms is not None


def run_figures(run, base: dict) -> dict:
    """A run's shares against its targets, the GPU time charged to each of
    its pods and NVML's SM % of each, and its verdicts."""
    spec, res = run["spec"], run["result"]
    want = targets(spec.mode, spec.n, base["busy"])
    summary = shares([pod["per_s"] for pod in res["pods"]], base["per_s"], base["busy"], want,
                     [gpu_time(pod) for pod in res["pods"]] if one_at_a_time(spec) else None)
    charged = (res.get("daemon") or {}).get("charged_pct") or {}
    summary["charged"] = [charged.get(f"{res['tag']}-{i}") for i in range(spec.n)]
    summary["nvml"] = [pod.get("nvml_sm_pct") for pod in res["pods"]]
    return {**summary, "targets": want, "baseline": base["by"],
            "verdicts": verdicts(spec, summary, want, res.get("daemon"), res.get("returns"))}


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


# How the notes and the tables name a baseline's reading, and a policy.
JUDGED_ON = {"cupti": "CUPTI", "nvml": "NVML", "warm-up": "the warm-up",
             "none": "all of the GPU's time"}
POLICIES = {"fixed": f"caps floor({FILL_PCT}/N)%", "elastic": "equal weights", "none": "unmetered"}
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
        return cells + [f"the baseline (GPU {fig['busy'] * 100:.1f}% busy, by {JUDGED_ON[fig['baseline']]})",
                        f"{total:,.1f} {WORKLOADS[spec.workload]}", f"{fig['aggregate']:.1f}", "", "",
                        span(fig.get("nvml")), busy] + [""] * (len(COLUMNS) - 9)
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


def notes(runs, workloads, bases) -> list[str]:
    """Per workload: the lone runs, their drift and the readings of how
    busy they keep the GPU (`bases`), and the SM clock and power of every
    run; the runs whose pods did not all get through their returns, and
    those whose workers were not all registered."""
    out = []
    for workload in workloads:
        rates = solo_rates(runs, workload)
        if rates:
            drift = f", drift {(rates[-1] / rates[0] - 1) * 100:+.2f}%" if len(rates) > 1 else ""
            line = (f"{workload} alone: {', '.join(f'{x:,.1f}' for x in rates)} {WORKLOADS[workload]}{drift};"
                    f" {baseline_note(workload, bases[workload])}")
            busy = window_busy(runs, workload)
            if busy:
                line += f"; busy by its steps' events in the window: {busy * 100:.1f}%"
            out.append(line)
        clocks = [f"{r['spec'].label} {fmt(r['result']['gpu']['sm_mhz'], '{:.0f}')}/"
                  f"{fmt(r['result']['gpu']['power_w'], '{:.0f}')}"
                  for r in runs if r["spec"].workload == workload and (r.get("result") or {}).get("gpu")]
        if clocks:
            out.append(f"{workload}, SM MHz/board W through the window: {'; '.join(clocks)}")
        out += [x for x in (cupti_note(runs, workload), gaps_note(runs, workload),
                            forfeited_note(runs, workload), host_note(runs, workload)) if x]
        turns = turns_note(runs, workload)
        if turns:
            out.append(turns)
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


def cupti_note(runs, workload) -> str:
    """Per run whose pods CUPTI timed: each pod's GPU time by its own
    records (`own_gpu_time`), % of the window, their sum (past 100%, one
    pod's kernel went on while another's time slice preempted it), its
    kernels alone; where the pods' spans were laid over each other, the
    GPU busy by any of them, what the pods' own times counted twice, each
    pod's time alone and its time split (`gpu_time`); and its share by
    throughput; "" without any."""
    got = []
    for r in runs:
        pods = r["result"]["pods"] if r["spec"].workload == workload and ok(r) else []
        ran = [own_gpu_time(pod) for pod in pods]
        if not pods or None in ran:
            continue
        kernels = [pod["kernel_busy"] * 100 for pod in pods]
        text = (f"{r['spec'].label} {figure_range([x * 100 for x in ran])} (sum {sum(ran) * 100:.1f};"
                f" kernels {figure_range(kernels)})")
        laid = r["result"].get("spans")
        if laid:
            text += (f", laid over each other: busy {laid['union'] * 100:.2f}, counted twice"
                     f" {laid['overlap'] * 100:.2f}, alone {figure_range([p['gpu_alone'] * 100 for p in pods])},"
                     f" split {figure_range([p['gpu_split'] * 100 for p in pods])}")
        if "figures" in r and r["spec"].mode is not SOLO:
            text += f", by throughput {figure_range(r['figures']['by_throughput'])}"
        got.append(text)
    return (f"{workload}, each pod's GPU time by CUPTI (kernels and the moves between its queued kernels), % of the"
            f" window (their sum; kernels alone; laid over each other: the GPU busy by any, the time counted twice,"
            f" each pod's time alone and split where they overlap), and its share by throughput:"
            f" {'; '.join(got)}") if got else ""


def forfeited_note(runs, workload) -> str:
    """Per run with a daemon whose pods forfeited budget: what each earned
    beyond its bucket's depth in the window, % of the window (a pod below
    its cap while its demand dipped, or one waiting longer than its bucket
    holds); "" where none forfeited 0.05% or more."""
    got = []
    for r in runs:
        lost = list((((r.get("result") or {}).get("daemon") or {}).get("forfeited_pct") or {}).values())
        if r["spec"].workload == workload and lost and max(lost) >= 0.05:
            got.append(f"{r['spec'].label} {figure_range(lost)}")
    return (f"{workload}, budget forfeited at the bucket's depth, % of the window: {'; '.join(got)}"
            if got else "")


def host_note(runs, workload) -> str:
    """Per run whose workers timed their host loop: the fraction of the
    window each pod's thread slept waiting for a step (near 0: the host,
    not the GPU or the limiter, set its pace) and its time to launch a step,
    µs (the limiter's waits for budget in it); "" without any."""
    got = []
    for r in runs:
        pods = r["result"]["pods"] if r["spec"].workload == workload and ok(r) else []
        if not pods or any(pod.get("host_wait") is None or pod.get("launch_us") is None for pod in pods):
            continue
        got.append(f"{r['spec'].label} {figure_range([pod['host_wait'] * 100 for pod in pods], '%')},"
                   f" {figure_range([pod['launch_us'] for pod in pods])} us")
    return (f"{workload}, each pod's thread waiting for its steps, % of the window, and launching a step:"
            f" {'; '.join(got)}") if got else ""


def gaps_note(runs, workload) -> str:
    """The lone runs' gaps between kernels by CUPTI, % of the window: up
    to 3 us (the GPU moving to a kernel it had queued), 3 to 10 us and
    longer; "" without them."""
    got = [f"{r['spec'].label} {pod['gaps_3us'] * 100:.1f}% ({pod['gaps_3us_n']:,.0f}) / {pod['gaps_10us'] * 100:.1f}%"
           f" / {pod['gaps_longer'] * 100:.1f}%"
           for r in lone_runs(runs, workload) if (pod := r["result"]["pods"][0]).get("gaps_3us") is not None]
    return (f"{workload} alone, the GPU idle between its kernels by CUPTI, % of the window, in gaps up to 3 us"
            f" (how many) / 3 to 10 us / longer: {'; '.join(got)}") if got else ""


def turns_note(runs, workload) -> str:
    """The runs that ran whose pods took turns: a turn's length, as the
    daemon's status says it, and the turns handed over in the window; ""
    without any."""
    got = [f"{r['spec'].label} {turns_cell(((r.get('result') or {}).get('daemon') or {}).get('turns'))}"
           for r in runs if r["spec"].workload == workload and r["spec"].mode.turn_ms and r.get("result")]
    return f"{workload}, turns (the status's turn, handovers in the window): {'; '.join(got)}" if got else ""


def turns_cell(turns: dict | None) -> str:
    """A run's turns (`turns_figures`) in a few words; "–" without them."""
    if not turns:
        return "–"
    return f"{turns['turn_ms']:g} ms, {turns['handovers']:,} ({fmt(turns['handovers_per_s'], '{:,.0f}')}/s)"


def baseline_note(workload, base: dict) -> str:
    """The lone process's busy readings and which the shares are judged on."""
    unit = WORKLOADS[workload].split("/")[0].removesuffix("s")
    warmup = ("unknown" if base["warmup"] is None
              else f"{base['warmup'] * 100:.1f}% (a {unit} {base['unit_ms']:.3f} ms on the GPU alone)")
    nvml = "none" if base["nvml"] is None else f"{base['nvml'] * 100:.1f}%"
    cupti = "" if base.get("cupti") is None else f"CUPTI baseline {base['cupti'] * 100:.1f}%, "
    return f"{cupti}warm-up baseline {warmup}, NVML baseline {nvml}: baseline used: {JUDGED_ON[base['by']]}"


def mode_heading(mode) -> str:
    """A mode's column in the table by mode."""
    turns = f" of {mode.turn_ms} ms" if mode.turn_ms else ""
    split = ", split" if mode.corun else ""
    return f"{mode.name}{turns}, {POLICIES[mode.policy]}: aggregate, pods' shares (charged){split}"


def figure_range(values, unit="") -> str:
    """"min–max" of the figures there are, one where they read the same;
    "" with none."""
    got = [x for x in values or [] if x is not None]
    if not got:
        return ""
    low, high = f"{min(got):.2f}", f"{max(got):.2f}"
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def mode_cell(run) -> str:
    """A run's cell in the table by mode: its aggregate, its pods' shares,
    the GPU time charged to them and, co-run, what its elastic pods split
    at the window's end; a figure whose target was missed in bold."""
    if run is None:
        return ""
    if run.get("skipped") or "figures" not in run:
        return "skipped" if run.get("skipped") else "failed"
    fig, verdict = run["figures"], run["figures"]["verdicts"]
    agg, got = f"{fig['aggregate']:.1f}%", figure_range(fig["shares"], "%")
    cell = (f"**{agg}**" if verdict.get("aggregate") is False else agg) + ", " + (
        f"**{got}**" if verdict.get("shares") is False else got)
    if figure_range(fig.get("charged")):
        cell += f" ({figure_range(fig['charged'])})"
    split = (run["result"].get("daemon") or {}).get("capacity_pct")
    return cell + (f", {split:.0f}%" if run["spec"].mode.corun and split is not None else "")


def mode_table(runs, workloads, bases) -> str:
    """The runs by workload and N (rows) and mode (columns): first the
    processes without the limiter (at N = 1, the lone process), then each
    mode under the daemon."""
    modes = list(dict.fromkeys(r["spec"].mode for r in runs if r["spec"].mode.daemon))
    counts = sorted({r["spec"].n for r in runs if r["spec"].mode is not SOLO})
    found = {(r["spec"].workload, r["spec"].mode.name, r["spec"].n): r for r in runs}
    head = ["workload, N", "no limiter: aggregate, pods' shares"] + [mode_heading(m) for m in modes]
    lines = [head, ["---"] * len(head)]
    for workload in workloads:
        base = bases.get(workload)
        for n in counts:
            if n == 1:
                alone = f"100% ({base['per_s']:,.1f} {WORKLOADS[workload]})" if base else "–"
            else:
                alone = mode_cell(found.get((workload, UNLIMITED.name, n)))
            lines.append([f"{workload}, {n}", alone] + [mode_cell(found.get((workload, m.name, n))) for m in modes])
    return "".join("| " + " | ".join(line) + " |\n" for line in lines)


def report(args, runs, order, took, calibration, checks) -> None:
    """The table by mode, the table of every run (in `order`), the
    verdicts and the notes: on stdout, in OUT/packing-bench.md; every
    run's raw figures, and the baselines, in OUT/packing-bench.json."""
    bases = evaluate(runs, calibration)
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
            f" {args.budget_s:g} s)\n\nBy mode (shares of the GPU's time, charged by the limiter; in bold, a"
            f" target missed):\n\n{mode_table(runs, args.workloads, bases)}\nEvery run:\n\n{table}\n"
            f"Targets: {verdict}\n\n"
            + "".join(f"- {line}\n" for line in [cal] + notes(runs, args.workloads, bases)
                      + [f"{k}: {v}" for k, v in checks.items()]))
    data = {"calibration": calibration, "checks": checks, "baselines": bases,
            "runs": [{"workload": r["spec"].workload, "mode": r["spec"].mode.name, "policy": r["spec"].mode.policy,
                      "turn_ms": r["spec"].mode.turn_ms, "n": r["spec"].n, "label": r["spec"].label,
                      "ran": runs.index(r), "skipped": r.get("skipped"), "result": r.get("result"),
                      "figures": r.get("figures")} for r in ordered]}
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
        if daemon.get("turns"):
            text += f"; turns: {turns_cell(daemon['turns'])}"
    if res.get("returns"):
        text += f"; returns: {returns_cell(res['returns'])}"
    return text
