"""Typed tolerances, number parsing and the reasons a check failed.

Every assertion of the GPU checks is one of these objects, so the limits are
written once, are printed the same way everywhere, and are unit-tested
(scripts/gpu/selftest). A value that is not a number never satisfies one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

MiB = 1 << 20
GiB = 1 << 30
QUOTA = 4 * GiB  # the memory quota of every memory check
QUOTA_MIB = 4096
SLACK = 2 * MiB  # "free came back" slack

Value = Union[str, int, float, None]
_NUM = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")


def num(v: Value) -> float | None:
    """The number in v (an int, a float, or a decimal string), else None."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    s = str(v).strip()
    if not _NUM.match(s):
        return None
    return int(s) if "." not in s else float(s)


@dataclass(frozen=True)
class Tolerance:
    """Percentage points either side of a target: Tolerance(pp=3)."""

    pp: float

    def around(self, target: float) -> Near:
        return Near(target, self)


@dataclass(frozen=True)
class Near:
    """|value - target| <= tol.pp"""

    target: float
    tol: Tolerance

    def holds(self, v: Value) -> bool:
        x, t = num(v), num(self.target)
        return x is not None and t is not None and abs(x - t) <= self.tol.pp

    def __str__(self) -> str:
        return f"{fmt(self.target)}+-{fmt(self.tol.pp)}"


@dataclass(frozen=True)
class AtLeast:
    bound: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and x >= self.bound

    def __str__(self) -> str:
        return f">={fmt(self.bound)}"


@dataclass(frozen=True)
class AtMost:
    bound: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and x <= self.bound

    def __str__(self) -> str:
        return f"<={fmt(self.bound)}"


@dataclass(frozen=True)
class Above:
    bound: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and x > self.bound

    def __str__(self) -> str:
        return f">{fmt(self.bound)}"


@dataclass(frozen=True)
class Below:
    bound: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and x < self.bound

    def __str__(self) -> str:
        return f"<{fmt(self.bound)}"


@dataclass(frozen=True)
class Equal:
    value: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and x == self.value

    def __str__(self) -> str:
        return f"={fmt(self.value)}"


@dataclass(frozen=True)
class Between:
    lo: float
    hi: float

    def holds(self, v: Value) -> bool:
        x = num(v)
        return x is not None and self.lo <= x <= self.hi

    def __str__(self) -> str:
        return f"{fmt(self.lo)}..{fmt(self.hi)}"


@dataclass(frozen=True)
class AddedAtMost:
    """A cost with the limiter at most pct percent above the cost without."""

    pct: float

    def added(self, without: Value, with_: Value) -> float | None:
        a, b = num(without), num(with_)
        if a is None or b is None or a <= 0:
            return None
        return (b - a) * 100.0 / a

    def holds(self, without: Value, with_: Value) -> bool:
        p = self.added(without, with_)
        return p is not None and round(p, 2) <= self.pct

    def __str__(self) -> str:
        return f"added <= {fmt(self.pct)}%"


@dataclass(frozen=True)
class AddedBelow:
    """An absolute cost added by the limiter, strictly below `limit`."""

    limit: float

    def holds(self, without: Value, with_: Value) -> bool:
        a, b = num(without), num(with_)
        return a is not None and b is not None and round(b - a, 1) < self.limit


def fmt(x: Value) -> str:
    """A number without a useless ".0"."""
    n = num(x)
    if n is None:
        return "?" if x is None else str(x)
    if isinstance(n, float) and n.is_integer():
        return str(int(n))
    return str(n)


class Why:
    """The reasons a row fails, in the order they were found (empty: PASS)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def need(self, ok: bool, reason: str) -> bool:
        if not ok:
            self.reasons.append(reason)
        return ok

    def add(self, *reasons: str) -> None:
        self.reasons.extend(r for r in reasons if r)

    def extend(self, other: Why) -> None:
        self.reasons.extend(other.reasons)

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def __str__(self) -> str:
        return " ".join(self.reasons)


def mibs(b: Value) -> str:
    n = num(b)
    return "?" if n is None else f"{int(n / MiB)}MiB"


def gib(b: Value) -> str:
    n = num(b)
    return "?" if n is None else f"{n / GiB:.2f}GiB"


def pct_from_ppm(v: Value) -> str:
    n = num(v)
    return "?" if n is None else f"{n / 10000:.1f}"


def q(v: Value) -> str:
    """A value for a table cell: "?" when missing."""
    return "?" if v is None or v == "" else str(v)
