"""The packing bench's plan: its workloads, modes and runs, in the order
they run and in the table's, each pod's target share, and the targets
the runs are judged by (see packing.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

FILL_PCT = 90  # fixed caps sum to at most this
START_S = 0.5  # from the last worker ready and registered to the common start
MAX_PODS = 48  # MPS clients of one GPU (Volta and later)
# The targets.
AGGREGATE_N, AGGREGATE_PCT = 16, 97.0
SHARE_PP = 1.0
DAEMON_N, DAEMON_CPU_PCT, ADMISSION_P99_MS = 32, 5.0, 2.0
# Returns: after the window of the runs with the most pods, each pod comes
# back from idle RETURNS times, a period apart (the pods staggered over
# it): idle past the daemon's 200 ms of counting a pod as wanting the
# GPU, then launching for a burst. A pod's first launches after idle are
# where it asks the daemon for admission.
RETURNS, RETURN_PERIOD_S, RETURN_BURST_S = 4, 0.4, 0.1

WORKLOADS = {"kernels": "kernels/s", "infer": "steps/s"}
TURN_MS = 10  # a turn of the turns mode, unless --turn-ms says otherwise


@dataclass(frozen=True)
class Mode:
    """How a run's pods run: under the daemon or not, co-run or time-sliced,
    the policy of their shares (fixed: caps of floor(90/N)%; elastic:
    weight 1 each), and on a time-sliced GPU whether its pods take turns
    (`turn_ms`: the daemon's --turns-gpu 0 --turn-ms, or with `auto` its
    default, --turn-ms alone: turns while two or more capped pods contend;
    None: they do not, --no-auto-turns)."""

    name: str
    daemon: bool
    corun: bool
    policy: str | None
    turn_ms: int | None = None
    auto: bool = False


MODES = {
    "timeslice": Mode("timeslice", True, False, "fixed"),
    "turns": Mode("turns", True, False, "fixed", turn_ms=TURN_MS),
    "auto": Mode("auto", True, False, "fixed", turn_ms=TURN_MS, auto=True),
    "corun": Mode("corun", True, True, "elastic"),
    "timeslice-elastic": Mode("timeslice-elastic", True, False, "elastic"),
    "corun-fixed": Mode("corun-fixed", True, True, "fixed"),
    "corun-unmetered": Mode("corun-unmetered", True, True, "none"),
}
SOLO = Mode("solo", False, False, None)
UNLIMITED = Mode("no limiter", False, False, None)


@dataclass(frozen=True)
class Spec:
    """One run: `n` processes of `workload` in `mode`; `label` names it."""

    workload: str
    mode: Mode
    n: int
    label: str


def with_turn_ms(modes, turn_ms: int) -> list[Mode]:
    """`modes` with every mode that takes turns taking them of `turn_ms`."""
    return [replace(m, turn_ms=turn_ms) if m.turn_ms else m for m in modes]


def cap_percent(n: int) -> int:
    """A pod's fixed cap with n pods: whole percents summing to at most 90."""
    return max(1, FILL_PCT // n)


def targets(mode: Mode, n: int, busy: float = 1.0) -> list[float]:
    """Each pod's target share of the GPU's time, percent: its cap, else
    100/n; at most what the workload keeps busy alone (`busy`, a fraction)."""
    share = float(cap_percent(n)) if mode.policy == "fixed" else 100.0 / n
    return [min(share, busy * 100)] * n


def plan(workloads, counts, modes) -> list[Spec]:
    """The runs in the order they run: per workload the lone process, then
    for each N, the largest first, the unlimited processes (N > 1) and each
    mode; last, each workload's lone process again. A budget that runs
    short skips the end: the drift check and the fewest pods."""
    runs = []
    for workload in workloads:
        runs.append(Spec(workload, SOLO, 1, "solo"))
        for n in sorted(set(counts), reverse=True):
            if n > 1:
                runs.append(Spec(workload, UNLIMITED, n, f"no limiter N={n}"))
            for mode in modes:
                runs.append(Spec(workload, mode, n, f"{mode.name} N={n}"))
    runs += [Spec(workload, SOLO, 1, "solo again") for workload in workloads]
    return runs


def table_order(specs, workloads, modes) -> list[int]:
    """The indices of `specs` in the table's order: by workload, then N
    (the lone runs first and last), then the unlimited run and the modes."""
    rank = {UNLIMITED.name: 0, **{m.name: i + 1 for i, m in enumerate(modes)}}

    def key(i):
        s = specs[i]
        n = (-1 if s.label == "solo" else math.inf) if s.mode is SOLO else s.n
        return workloads.index(s.workload), n, rank.get(s.mode.name, 0)

    return sorted(range(len(specs)), key=key)


def returns_phase(spec: Spec, counts) -> bool:
    """Whether the run ends with the pods' returns: under the daemon, at the
    most pods of the bench."""
    return spec.mode.daemon and spec.n == max(counts)


def returns_s() -> float:
    """The returns' wall time, from their start to the last burst's end
    (the last pod's last burst starts less than RETURNS periods after the
    first pod's first)."""
    return RETURNS * RETURN_PERIOD_S + RETURN_BURST_S


def estimate_s(spec: Spec, seconds: float, returns: bool = False) -> float:
    """A run's expected wall time: its window, its workers' start (PyTorch's
    import and CUDA's start, N processes on 16 CPUs), its daemon's start and
    stop (co-run: the MPS control daemon's too), the workers' exits, and
    its returns if it has them."""
    start = {"kernels": 1.5 + 0.08 * spec.n, "infer": 5.0 + 0.3 * spec.n}[spec.workload]
    daemon = (3.0 if spec.mode.corun else 1.0) if spec.mode.daemon else 0.0
    after = START_S + returns_s() if returns else 0.0
    return seconds + START_S + start + daemon + 1.5 + after
