"""The serve bench's report: one Markdown row per (pods, run, load), a row
for each run not run or stopped early, and the line naming the most pods
served within the bounds."""
from __future__ import annotations

import math

from .serve_trace import P50_BOUND_S, P99_BOUND_S, highest_served, highest_turning_over, shortfalls
from .swap_bench import GIB

HEAD = ("| pods | run | load, req/s | requests (answered) | first result p50 / p95 / p99, s | throughput, req/s"
        " | swaps in / out a second | resident pods | GPU used, GiB | swapped pods' host memory, GiB (kept copies)"
        " | OOM | answers identical | verdict |\n" + "|---" * 13 + "|\n")


def seconds(x) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return "never" if math.isinf(x) else f"{x:.3f}"


def gib_cell(nbytes, none="n/a") -> str:
    return none if nbytes is None else f"{nbytes / GIB:.1f}"


def label(run: dict) -> str:
    return "all resident (baseline)" if run["kind"] == "baseline" else f"{run['path']} path"


def load_row(run: dict, load: dict) -> str:
    f = load["figures"]
    why = shortfalls(f)
    resident = "n/a" if f.get("resident_mean") is None else f"{f['resident_mean']:.1f}"
    host = f"{gib_cell(f.get('host_swapped_max'))} ({gib_cell(f.get('host_kept_max'))})"
    # Turned over: the load swapped in at least as many pods as were resident.
    swaps = f"{f['swap_ins_per_s']:.2f} / {f['swap_outs_per_s']:.2f}"
    swaps += ", turned over" if f.get("turned_over") else ""
    cells = [str(run["pods"]), label(run), f"{load['rate']:g}", f"{f['requests']} ({f['answered']})",
             " / ".join(seconds(f[k]) for k in ("p50_s", "p95_s", "p99_s")), f"{f['throughput']:.2f}",
             swaps, resident, f"{gib_cell(f.get('gpu_used_max'))}", host, str(f["oom"]),
             "yes" if not f["different"] and f["answered"] else "no",
             "PASS" if not why else "FAIL: " + ", ".join(why)]
    return "| " + " | ".join(cells) + " |\n"


def note_row(pods, what: str, why: str) -> str:
    """A run's row without figures: why it was not run or stopped."""
    return "| " + " | ".join([str(pods), what] + [""] * 10 + [why[:160]]) + " |\n"


def report(runs: list[dict], conflicts: list[str]) -> str:
    """The table of the runs (in the order of pods, then the path's runs
    before the baseline's) and the verdict's lines."""
    rows = []
    for run in sorted(runs, key=lambda r: (r["pods"], r["kind"] == "baseline")):
        if "skipped" in run:
            rows.append(note_row(run["pods"], label(run), f"not run: {run['skipped']}"))
            continue
        rows += [load_row(run, load) for load in run["loads"]]
        if "failed" in run:
            rows.append(note_row(run["pods"], label(run), f"FAILED: {run['failed']}"))
    text = HEAD + "".join(rows)
    measured = [r for r in runs if r["kind"] == "overcommit" and "skipped" not in r]
    best = highest_served(measured)
    bounds = (f"p99 <= {P99_BOUND_S:g} s and p50 <= {P50_BOUND_S:g} s at every load, no out-of-memory error, every"
              " request answered, answers identical")
    counts = ", ".join(str(n) for n in sorted({r["pods"] for r in measured})) or "none"
    text += (f"\nHighest number of pods served ({bounds}): {best if best is not None else 'none'}"
             f" (of {counts} run).\n")
    over = highest_turning_over(measured)
    at = ("none" if over is None else
          f"{over[0]} (at {', '.join(f'{rate:g}' for rate in over[1])} req/s)")
    text += (f"Highest number of pods served at a load where the resident set turned over (the same bounds at that"
             f" load): {at}.\n")
    if conflicts:
        text += f"Models' answers computed resident differ between runs: {'; '.join(conflicts[:5])}\n"
    return text
