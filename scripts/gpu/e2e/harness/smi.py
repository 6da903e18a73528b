"""nvidia-smi sampled while a run lasts (the benchmarks' GPU clock, power and
utilisation beside their figures)."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

from .parse import median


class _Follower:
    """An nvidia-smi command that prints as it samples, run without the
    limiter, each line given to `take` by a reader thread as it arrives.
    Without nvidia-smi nothing is taken. A context manager, or stop() at the
    end."""

    def __init__(self, cmd: Sequence[str]):
        self.cmd = list(cmd)
        self.reader = None
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
        except OSError:
            self.proc = None
            return
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.take(line)

    def take(self, line: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Stops sampling (again: nothing)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.reader is not None:
            self.reader.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Sampler(_Follower):
    """`nvidia-smi --query-gpu=FIELDS` every period_ms, on GPU `gpu` (every
    GPU when None); each sample is (time.monotonic() when it arrived, one
    number per field). A line that is not that is skipped; without
    nvidia-smi there are no samples."""

    def __init__(self, fields: Sequence[str], period_ms: int, gpu: int | None = None):
        self.fields = list(fields)
        self.samples: list[tuple[float, tuple[float, ...]]] = []
        super().__init__(["nvidia-smi"] + ([] if gpu is None else ["-i", str(gpu)])
                         + [f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits",
                            "-lms", str(period_ms)])

    def take(self, line: str) -> None:
        try:
            values = tuple(float(v) for v in line.split(","))
        except ValueError:
            return
        if len(values) == len(self.fields):
            self.samples.append((time.monotonic(), values))

    def values(self, field: int = 0) -> list[float]:
        return [v[field] for _, v in self.samples]

    def between(self, start: float, end: float) -> list[tuple]:
        """The samples taken in [start, end], as (seconds from start, *values)."""
        return [(t - start, *v) for t, v in self.samples if start <= t <= end]

    def median(self, field: int = 0) -> float:
        """The median of a field's samples; nan without any."""
        m = median(self.values(field))
        return math.nan if m is None else m

    def busy_mean(self, field: int = 0) -> float:
        """The mean of a field's samples above 0 but the first and the last,
        which straddle the run's start and end; nan without any."""
        busy = [x for x in self.values(field) if x > 0][1:-1]
        return statistics.mean(busy) if busy else math.nan


def pmon_sample(line: str) -> tuple[int, float | None] | None:
    """One process's line of `nvidia-smi pmon -s u`: (pid, SM %, None where
    it prints "-"); None for a heading, a line of no process, or anything
    else. Its columns: gpu, pid, type, sm, mem, enc, dec, ... , command."""
    parts = line.split()
    if len(parts) < 4 or parts[0].startswith("#"):
        return None
    try:
        pid = int(parts[1])
    except ValueError:
        return None
    try:
        return pid, float(parts[3])
    except ValueError:
        return pid, None


class ProcessSampler(_Follower):
    """`nvidia-smi pmon -s u -d 1` on GPU `gpu`: each process's SM
    utilisation, NVML's share of the last second in which one of its kernels
    ran, whatever the clock (the GPU time it held, where a throughput is
    also a matter of clocks). Each sample is (time.monotonic() when it
    arrived, pid, SM % or None); without nvidia-smi there are none."""

    def __init__(self, gpu: int = 0):
        self.samples: list[tuple[float, int, float | None]] = []
        super().__init__(["nvidia-smi", "pmon", "-i", str(gpu), "-s", "u", "-d", "1"])

    def take(self, line: str) -> None:
        sample = pmon_sample(line)
        if sample is not None:
            self.samples.append((time.monotonic(), *sample))

    def shares(self, pids: Sequence[int], start: float, end: float) -> dict[int, dict]:
        """For each of `pids`: {"sm_pct": the mean of its SM % over the samples
        that arrived in [start + 1 s, end] (each covers the second before it,
        so the first whole one ends a second in), None without any; "samples":
        how many}."""
        out = {}
        for pid in pids:
            got = [sm for t, p, sm in self.samples if p == pid and start + 1.0 <= t <= end and sm is not None]
            out[pid] = {"sm_pct": statistics.mean(got) if got else None, "samples": len(got)}
        return out
