"""The rows of the result table, the Markdown table and the JSON results."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from .checks import Why

PASS, FAIL, INFO = "PASS", "FAIL", "INFO"
HEADER = "| check | without limiter | with limiter | expected | result |\n| --- | --- | --- | --- | --- |"


@dataclass
class Row:
    check: str
    without: str
    with_limiter: str
    expected: str
    result: str  # PASS, FAIL or INFO
    reasons: list = field(default_factory=list)
    test: str = ""

    def cell_result(self) -> str:
        return f"FAIL:{' '.join(self.reasons)}" if self.result == FAIL else self.result

    def markdown(self) -> str:
        cells = [self.check, self.without or "(none)", self.with_limiter or "(none)",
                 self.expected or "(none)", self.cell_result()]
        return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


class Progress:
    """Progress lines: printed at once and kept for e2e.log."""

    def __init__(self, echo=print):
        self.lines: list[str] = []
        self.echo = echo

    def say(self, text: str) -> None:
        self.lines.append(text)
        if self.echo:
            self.echo(text)


class Planned:
    """A row a test announced; done() fills it in. A row never done (the test
    crashed first) is recorded as FAIL with the crash as its reason."""

    def __init__(self, rec: Recorder, check: str, expected: str, test: str):
        self.rec, self.check, self.expected, self.test = rec, check, expected, test
        self.row: Row | None = None

    def done(self, without: str, with_limiter: str, why, info: bool = False) -> Row:
        reasons = why.reasons if isinstance(why, Why) else [r for r in (why or "").split() if r]
        if info:
            result = INFO
        else:
            result = FAIL if reasons else PASS
        self.row = Row(self.check, without, with_limiter, self.expected, result, list(reasons), self.test)
        self.rec.add(self.row)
        return self.row

    def fail(self, reason: str, without: str = "-", with_limiter: str = "-") -> Row:
        return self.done(without, with_limiter, Why_of(reason))


def Why_of(reason: str) -> Why:
    w = Why()
    w.add(reason)
    return w


class Recorder:
    """Every row of the run, in the order they were recorded."""

    def __init__(self, progress: Progress):
        self.rows: list[Row] = []
        self.progress = progress
        self.pending: list[Planned] = []
        self.started = time.time()

    def plan(self, check: str, expected: str, test: str = "") -> Planned:
        p = Planned(self, check, expected, test)
        self.pending.append(p)
        return p

    def add(self, row: Row) -> None:
        self.rows.append(row)
        why = f" | why: {' '.join(row.reasons)}" if row.reasons else ""
        self.progress.say(f"[{row.result}] {row.check} | without: {row.without or '(none)'} | "
                          f"with: {row.with_limiter or '(none)'} | expected: {row.expected}{why}")

    def close_test(self, test: str, crash: str | None) -> list[Row]:
        """Rows of `test` that were planned and never done: FAIL with the crash
        (or "no result recorded"); a test that planned nothing and crashed gets
        one row named after it. Returns the rows of the test."""
        left = [p for p in self.pending if p.test == test and p.row is None]
        reason = crash or "no result recorded"
        for p in left:
            p.done("-", "-", Why_of(f"crashed: {reason}" if crash else reason))
        self.pending = [p for p in self.pending if p.test != test]
        mine = [r for r in self.rows if r.test == test]
        if crash and not mine:
            self.add(Row(test, "-", "-", "-", FAIL, [f"crashed: {reason}"], test))
            mine = [r for r in self.rows if r.test == test]
        return mine

    def counts(self):
        passed = sum(1 for r in self.rows if r.result == PASS)
        failed = sum(1 for r in self.rows if r.result == FAIL)
        return passed, failed

    def table(self) -> str:
        passed, failed = self.counts()
        body = "\n".join(r.markdown() for r in self.rows)
        return f"{HEADER}\n{body}\n\n{passed} passed, {failed} failed\n"

    def json(self, meta: dict) -> str:
        passed, failed = self.counts()
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["with"] = d.pop("with_limiter")
            rows.append(d)
        return json.dumps({"meta": meta, "passed": passed, "failed": failed,
                           "seconds": round(time.time() - self.started, 1), "rows": rows}, indent=1)
