"""The serve bench's plan, without a GPU: each run's pods, quotas and host
memory from the GPU's and the host's memory, the daemon's [swap] keys of
the serving policy, and the time each run takes, so that the whole fits
the run's budget."""
from __future__ import annotations

import dataclasses
import re
import tomllib

from .swap_bench import GIB, MIB, gib
from .swap_parts import CONTEXT

# The model's layers are 8192 x 8192 fp16 (swap_pod.py's SERVE_DIM): the
# weights come in steps of 128 MiB.
LAYER = 8192 * 8192 * 2
# A pod's quota beyond its weights: its context, cuBLAS's workspace, the
# inputs and activations, with room to spare.
POD_MARGIN = 2 * GIB
# Host memory each pod's process takes besides its swapped copy (PyTorch
# and the CUDA runtime), and what the system keeps: neither is given to
# the daemon's host_limit.
POD_HOST = 3 * GIB // 2
HOST_RESERVE = 8 * GIB
# The seconds a run takes besides its loads (a generous guess: the lead's
# measurements replace it): the daemon and N PyTorch processes started at
# once, each start's swap-out where the GPU is full (the driver's
# checkpoint takes seconds a pod), the pods stopped.
START_S, START_PER_POD_S, STOP_S = 20.0, 1.0, 10.0
SWAP_AT_START_S = {"fast": 1.0, "checkpoint": 8.0}
# Seconds after a load's last arrival for its answers.
DRAIN_S = 3.0

BASELINES = ("largest", "all", "none")
# The serving policy's [swap] keys the bench sets by its own options.
HEADROOM_KEY, MIN_RESIDENT_KEY = "headroom", "min_resident_ms"


@dataclasses.dataclass
class Run:
    """One daemon and its pods: `kind` "overcommit" (the path's swaps) or
    "baseline" (overcommit off, every model resident); `skip`: why it is
    not run, None when it is; `warning`: what the plan expects to go wrong."""
    pods: int
    kind: str
    quota: int
    host_limit: int
    swapped_at_start: int
    estimate_s: float
    skip: str | None = None
    warning: str | None = None


def weight_bytes(weights_gib: float) -> int:
    """GiB of weights as bytes, rounded down to whole layers (one at least)."""
    return max(LAYER, int(weights_gib * GIB) // LAYER * LAYER)


def footprint(weights: int) -> int:
    """What a pod holds on the GPU once loaded: its weights and its context."""
    return weights + CONTEXT


def moved(weights: int, path: str) -> int:
    """What a swap moves of a loaded pod: the fast path its allocations (the
    context stays on the GPU), the driver's checkpoint all of it."""
    return weights if path == "fast" else footprint(weights)


def resident_room(pods: int, weights: int, gpu_free: int, headroom: int, path: str) -> int:
    """How many of `pods` loaded pods GPU memory holds at once, `headroom`
    kept free (on the fast path every pod's context stays)."""
    if path == "fast":
        return max(0, (gpu_free - headroom - pods * CONTEXT) // weights)
    return max(0, (gpu_free - headroom) // footprint(weights))


def estimate_s(pods: int, swapped: int, loads: int, seconds: float, path: str) -> float:
    """The seconds a run of `pods` pods takes, `swapped` of them swapped
    out to make room as they start, with `loads` loads of `seconds` each."""
    return (START_S + START_PER_POD_S * pods + SWAP_AT_START_S[path] * swapped + loads * (seconds + DRAIN_S)
            + STOP_S)


def runs(sizes, weights: int, gpu_free: int, host_available: int, headroom: int, baseline: str,
         loads: int, seconds: float, path: str) -> list[Run]:
    """The runs of a call, in the order they go: the overcommit runs from
    the most pods down (the headline first, should the budget run out),
    then the baselines (`baseline`: of the largest count of pods whose
    models all fit the GPU, of every such count, or none). Host memory:
    what is available less each pod's process and the system's reserve
    goes to the daemon's host_limit (a run whose swapped pods would need
    more is run, with a warning: the daemon refuses swaps past it); a run
    where one pod cannot be resident is skipped with the reason."""
    planned = []
    for n in sorted(set(sizes), reverse=True):
        room = min(n, resident_room(n, weights, gpu_free, headroom, path))
        host_limit = max(0, host_available - n * POD_HOST - HOST_RESERVE)
        run = Run(n, "overcommit", weights + POD_MARGIN, host_limit, n - room,
                  estimate_s(n, n - room, loads, seconds, path))
        need = (n - room) * moved(weights, path)
        if room < 1:
            run.skip = (f"one pod's {gib(footprint(weights))} GiB and a headroom of {gib(headroom)} GiB do not fit"
                        f" the GPU's {gib(gpu_free)} GiB free")
        elif need > host_limit:
            run.warning = (f"{n - room} pods swapped need about {gib(need)} GiB of host memory, more than the"
                           f" {gib(host_limit)} GiB of host_limit ({gib(host_available)} GiB available less"
                           f" {gib(POD_HOST)} GiB for each pod's process and {gib(HOST_RESERVE)} GiB for the"
                           " system): expect swaps refused")
        planned.append(run)
    fit = sorted((n for n in set(sizes) if n * footprint(weights) <= gpu_free), reverse=True)
    chosen = {"largest": fit[:1], "all": fit, "none": []}[baseline]
    for n in chosen:
        planned.append(Run(n, "baseline", weights + POD_MARGIN, 0, 0, estimate_s(n, 0, loads, seconds, path)))
    return planned


def size_text(nbytes: int) -> str:
    """Bytes as the daemon's config writes a size: "14g", "1536m"."""
    return f"{nbytes // GIB}g" if nbytes % GIB == 0 else f"{nbytes // MIB}m"


_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def extra_key(text: str) -> tuple[str, str]:
    """A --swap-key KEY=VALUE: (key, VALUE as TOML text); ValueError unless
    KEY is a bare key and VALUE a TOML value."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not _KEY.match(key):
        raise ValueError(f"KEY=VALUE with a bare TOML key, not {text!r}")
    try:
        tomllib.loads(f"k = {value}")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{key}: {value!r} is not a TOML value ({e})")
    return key, value


def swap_keys(headroom: int | None, min_resident_ms: int | None, extra=()) -> dict:
    """The serving policy's [swap] keys of an overcommit run, as TOML text:
    headroom and min_resident_ms where given, then each (key, value) of
    `extra` over them."""
    keys = {}
    if headroom is not None:
        keys[HEADROOM_KEY] = f'"{size_text(headroom)}"'
    if min_resident_ms is not None:
        keys[MIN_RESIDENT_KEY] = str(min_resident_ms)
    keys.update(extra)
    return keys
