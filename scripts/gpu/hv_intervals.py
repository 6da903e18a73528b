#!/usr/bin/env python3
"""Checks 16-19: per-process busy shares from spin interval files.

spin (scripts/gpu/spin.cu) dumps one "start_ns end_ns" line per kernel, in
%globaltimer nanoseconds: one clock for the whole GPU, so the files of several
processes can be compared. This prints, as key=value lines, each file's own
busy fraction (union of its intervals) in windows of time given relative to
an origin, the 100 ms series of each file, the time a file took to settle
near a target, and the largest idle gap of a file.

Usage:
  hv_intervals.py [--origin first|common|fN] [--win NAME:LO:HI]...
                  [--series NAME:LO:HI]... [--settle NAME:N:LO:HI:TARGET:TOL]...
                  [--gap NAME:N:LO:HI]... [--ref-epoch SECONDS] FILE...

Origin (time 0): first = earliest first kernel start of all files (default),
common = latest first kernel start, fN = first kernel start of file N.
LO and HI are seconds after the origin: a number, or sN (first start of file
N), eN (last end of file N), start (latest first start), end (earliest last
end), each optionally followed by +X or -X (seconds), e.g. s1+1 or end-0.2.

Output keys (N = file index, in argument order):
  fN_kernels fN_first_s fN_last_s     per file
  start_s end_s                        latest first start, earliest last end
  win_NAME_lo_s win_NAME_hi_s          the window, resolved
  win_NAME_fN_pct                      file N's busy percent of the window
  win_NAME_union_pct                   all files merged
  win_NAME_overlap_pct                 time two or more files were busy at once
  series_NAME_lo_s series_NAME_fN_pm   busy per-mille of each full 100 ms window
  settle_NAME_ms                       first 100 ms window (from LO) after which
                                       every window of file N is within
                                       TARGET +- TOL percent; -1: never
  settle_NAME_sliding_ms               the same for 500 ms sliding averages
  gap_NAME_start_s gap_NAME_end_s gap_NAME_ms  file N's longest idle time in [LO, HI]
  origin_ns, and origin_minus_ref_ms with --ref-epoch (meaningful only when
  %globaltimer follows the host's clock, as it usually does)
  ok=1 last; on a bad file or argument: error=... and exit status 1.

The GPU harness (scripts/gpu/e2e) imports analyse(), which returns the same
keys as a dict and raises AnalysisError where the command prints error=.
"""

import bisect
import re
import sys

NS = 1_000_000_000
WIN = 100_000_000  # 100 ms


class Busy:
    """Union of one file's intervals, for covered-time queries."""

    def __init__(self, intervals):
        merged = []
        for s, e in sorted(intervals):
            if e <= s:
                continue
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.m = merged
        self.ends = [e for _, e in merged]
        self.prefix = [0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + (e - s))

    def covered(self, a, b):
        """Busy nanoseconds within [a, b)."""
        if b <= a or not self.m:
            return 0
        i = bisect.bisect_right(self.ends, a)  # first interval ending after a
        total = 0
        while i < len(self.m) and self.m[i][0] < b:
            s, e = self.m[i]
            total += min(e, b) - max(s, a)
            i += 1
        return total

    def longest_gap(self, a, b):
        """(start, end) of the longest idle stretch within [a, b)."""
        best = (a, a)
        cursor = a
        i = bisect.bisect_right(self.ends, a)
        while i < len(self.m) and self.m[i][0] < b:
            s, e = self.m[i]
            if s > cursor and s - cursor > best[1] - best[0]:
                best = (cursor, s)
            cursor = max(cursor, e)
            i += 1
        if b > cursor and b - cursor > best[1] - best[0]:
            best = (cursor, b)
        return best


class AnalysisError(ValueError):
    """A bad file or argument."""


def fail(message):
    raise AnalysisError(message)


def read_file(path):
    intervals = []
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) != 2:
                    continue
                try:
                    intervals.append((int(parts[0]), int(parts[1])))
                except ValueError:
                    continue
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if not intervals:
        fail(f"no intervals in {path}")
    return intervals


TERM = re.compile(r"^(?:(s|e)(\d+)|(start|end)|(-?\d+(?:\.\d+)?))(?:([+-])(\d+(?:\.\d+)?))?$")


def parse_args(argv):
    """(files, options) from the command line (see the usage)."""
    opts = {"origin": "first", "wins": [], "series": [], "settles": [], "gaps": [], "ref_epoch": None}
    files = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--origin", "--win", "--series", "--settle", "--gap", "--ref-epoch"):
            if i + 1 >= len(argv):
                fail(f"{a} needs a value")
            v = argv[i + 1]
            i += 2
            if a == "--origin":
                opts["origin"] = v
            elif a == "--ref-epoch":
                try:
                    opts["ref_epoch"] = float(v)
                except ValueError:
                    fail(f"--ref-epoch {v!r} is not a number")
            else:
                opts[{"--win": "wins", "--series": "series", "--settle": "settles", "--gap": "gaps"}[a]].append(v)
            continue
        files.append(a)
        i += 1
    return files, opts


def analyse(files, origin="first", wins=(), series=(), settles=(), gaps=(), ref_epoch=None):
    """The output keys (see the usage) as an ordered dict of strings, ok=1 last.

    wins/series/settles/gaps are the option values, e.g. "after1s:start+1:end".
    Raises AnalysisError on a bad file or argument."""
    out = {}
    if not files:
        fail("no interval files")
    per = [read_file(p) for p in files]
    busy = [Busy(iv) for iv in per]
    first = [min(s for s, _ in iv) for iv in per]
    last = [max(e for _, e in iv) for iv in per]
    origin_mode = origin
    if origin_mode == "first":
        origin = min(first)
    elif origin_mode == "common":
        origin = max(first)
    elif re.fullmatch(r"f\d+", origin_mode) and int(origin_mode[1:]) < len(files):
        origin = first[int(origin_mode[1:])]
    else:
        fail(f"bad --origin {origin_mode!r}")

    def rel(ns):
        return (ns - origin) / NS

    def at(expr):
        """Nanoseconds of an expression (see the usage)."""
        m = TERM.match(expr.strip())
        if not m:
            fail(f"bad time {expr!r}")
        which, n, name, number, sign, off = m.groups()
        if which:
            k = int(n)
            if k >= len(files):
                fail(f"no file {k} in {expr!r}")
            t = first[k] if which == "s" else last[k]
        elif name:
            t = max(first) if name == "start" else min(last)
        else:
            t = origin + int(round(float(number) * NS))
        if sign:
            d = int(round(float(off) * NS))
            t = t + d if sign == "+" else t - d
        return t

    def file_index(text):
        if not text.isdigit() or int(text) >= len(files):
            fail(f"bad file index {text!r}")
        return int(text)

    out["origin"] = origin_mode
    out["origin_ns"] = str(origin)
    if ref_epoch is not None:
        out["origin_minus_ref_ms"] = f"{(origin - ref_epoch * NS) / 1e6:.1f}"
    for k, p in enumerate(files):
        out[f"f{k}"] = p
        out[f"f{k}_kernels"] = str(len(per[k]))
        out[f"f{k}_first_s"] = f"{rel(first[k]):.3f}"
        out[f"f{k}_last_s"] = f"{rel(last[k]):.3f}"
    out["start_s"] = f"{rel(max(first)):.3f}"
    out["end_s"] = f"{rel(min(last)):.3f}"

    for spec in wins:
        w = spec.split(":")
        if len(w) != 3:
            fail(f"bad --win {spec!r}")
        name, lo, hi = w[0], at(w[1]), at(w[2])
        out[f"win_{name}_lo_s"] = f"{rel(lo):.3f}"
        out[f"win_{name}_hi_s"] = f"{rel(hi):.3f}"
        if hi <= lo:
            for k in range(len(files)):
                out[f"win_{name}_f{k}_pct"] = "-1"
            out[f"win_{name}_union_pct"] = "-1"
            continue
        span = hi - lo
        own = [b.covered(lo, hi) for b in busy]
        union = Busy([tuple(x) for b in busy for x in b.m]).covered(lo, hi)
        for k in range(len(files)):
            out[f"win_{name}_f{k}_pct"] = f"{100.0 * own[k] / span:.2f}"
        out[f"win_{name}_union_pct"] = f"{100.0 * union / span:.2f}"
        out[f"win_{name}_overlap_pct"] = f"{100.0 * (sum(own) - union) / span:.2f}"

    for spec in series:
        s = spec.split(":")
        if len(s) != 3:
            fail(f"bad --series {spec!r}")
        name, lo, hi = s[0], at(s[1]), at(s[2])
        out[f"series_{name}_lo_s"] = f"{rel(lo):.3f}"
        n = max(0, (hi - lo) // WIN)
        for k in range(len(files)):
            vals = [round(1000 * busy[k].covered(lo + j * WIN, lo + (j + 1) * WIN) / WIN) for j in range(n)]
            out[f"series_{name}_f{k}_pm"] = ",".join(str(v) for v in vals)

    for spec in settles:
        s = spec.split(":")
        if len(s) != 6:
            fail(f"bad --settle {spec!r}")
        name, k, lo, hi = s[0], file_index(s[1]), at(s[2]), at(s[3])
        try:
            target, tol = float(s[4]), float(s[5])
        except ValueError:
            fail(f"bad --settle target/tolerance {s[4]!r} {s[5]!r}")
        n = max(0, (hi - lo) // WIN)
        w = [100.0 * busy[k].covered(lo + j * WIN, lo + (j + 1) * WIN) / WIN for j in range(n)]

        def settle(values):
            last_bad = -1
            for j, v in enumerate(values):
                if abs(v - target) > tol:
                    last_bad = j
            return -1 if last_bad + 1 >= len(values) else (last_bad + 1) * 100

        sliding = [sum(w[j:j + 5]) / 5 for j in range(len(w) - 4)] if len(w) >= 5 else []
        out[f"settle_{name}_windows"] = str(len(w))
        out[f"settle_{name}_ms"] = str(settle(w))
        out[f"settle_{name}_sliding_ms"] = str(settle(sliding))

    for spec in gaps:
        g = spec.split(":")
        if len(g) != 4:
            fail(f"bad --gap {spec!r}")
        name, k, lo, hi = g[0], file_index(g[1]), at(g[2]), at(g[3])
        gs, ge = busy[k].longest_gap(lo, hi) if hi > lo else (lo, lo)
        out[f"gap_{name}_start_s"] = f"{rel(gs):.3f}"
        out[f"gap_{name}_end_s"] = f"{rel(ge):.3f}"
        out[f"gap_{name}_ms"] = f"{(ge - gs) / 1e6:.1f}"

    out["ok"] = "1"
    return out


def main(argv):
    try:
        files, opts = parse_args(argv)
        result = analyse(files, **opts)
    except AnalysisError as e:
        print(f"error={e}")
        return 1
    for key, value in result.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
