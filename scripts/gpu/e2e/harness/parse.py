"""Reading the programs' key=value output, and the statistics of the checks
and of the benchmarks (scripts/bench)."""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence

from .checks import num


def kv(text: str, key: str) -> str | None:
    """The value of the first "KEY=value" line (whitespace removed), else None."""
    prefix = key + "="
    for line in text.splitlines():
        if line.startswith(prefix):
            return "".join(line[len(prefix):].split())
    return None


def fields(line: str) -> dict:
    """Every "key=value" word of one line, by key (a later key wins)."""
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


def api_field(text: str, api: str, key: str) -> str | None:
    """FIELD=value on the line "API <api> ..." (mem_apis' output)."""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "API" and words[1] == api:
            for w in words[2:]:
                k, eq, v = w.partition("=")
                if eq and k == key:
                    return v
            return None
    return None


_SMI = re.compile(r"^\s*[0-9]+\s*,")


def smi_line(text: str) -> str | None:
    """The first "total, used, free" line of nvidia-smi's csv, spaces removed."""
    for line in text.splitlines():
        if _SMI.match(line):
            return line.replace(" ", "").replace("\t", "")
    return None


def smi_fields(line: str | None) -> list[str | None]:
    parts = (line or "").split(",")
    return (parts + [None, None, None])[:3]


def compute_apps(text: str) -> dict:
    """MiB by pid from nvidia-smi's "pid, used_memory" csv (no header, no
    units); lines that are not two numbers are skipped."""
    out = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            out[int(fields[0])] = int(fields[1])
    return out


def median(values: Iterable) -> float | None:
    """Median of the numbers among values (others ignored); None when none."""
    xs = sorted(x for x in (num(v) for v in values) if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between the two nearest; nan when none."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean_halfwidth(values: Sequence[float]) -> float:
    """Half the width of the 95% interval of the mean (normal); nan below 2 values."""
    return 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else math.nan


def difference_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """The 95% interval of mean(b) - mean(a), two independent samples (Welch,
    normal approximation: the samples are many)."""
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    d = statistics.mean(b) - statistics.mean(a)
    return d - 1.96 * se, d + 1.96 * se


def median_interval(values: Sequence[float], draws: int = 10000, seed: int = 1) -> tuple[float, float]:
    """The bootstrap 95% interval of the median of values."""
    rng = random.Random(seed)
    meds = sorted(median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def series_summary(series: str | None, lo: float, hi: float):
    """(first, min, max, n_later, n_outside) of a comma list of per-mille
    windows; min/max/outside over the windows after the first, outside [lo, hi]."""
    if not series or not re.fullmatch(r"[0-9]+(,[0-9]+)*", series):
        return None, None, None, 0, 0
    w = [int(x) for x in series.split(",")]
    later = w[1:]
    bad = sum(1 for v in later if v < lo or v > hi)
    return w[0], (min(later) if later else None), (max(later) if later else None), len(later), bad


def smi_mean(text: str, field: int) -> float | None:
    """Mean of a numeric column (1-based) of nvidia-smi's csv samples taken
    while the GPU was busy (utilization, column 6, > 0), first busy one skipped."""
    n = c = 0
    s = 0.0
    for i, line in enumerate(text.splitlines()):
        if i == 0:
            continue
        cols = line.split(", ")
        if len(cols) < 6 or _lead_num(cols[5]) <= 0:
            continue
        n += 1
        if n > 1 and len(cols) >= field:
            s += _lead_num(cols[field - 1])
            c += 1
    return round(s / c, 1) if c else None


def _lead_num(s: str) -> float:
    """awk's "$f + 0": the leading number of s, 0 when none."""
    m = re.match(r"\s*[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)", s)
    return float(m.group(0)) if m else 0.0


def pm2pct(v) -> str:
    n = num(v)
    return "?" if n is None else f"{n / 10:.1f}"
