"""Checks 40 and 41: memory that one process of a pod exports and another of
the same pod imports is charged once, to the exporter
(scripts/gpu/ipc_share.cu). NVML attributes imported memory to the exporter
alone (measured), so the importer's footprint read from outside holds only
its own memory and its context.

The exporter allocates 2 GiB and starts the importer (fork and exec of
itself: both inherit the pod's environment); the importer imports the 2 GiB,
checks the exporter's pattern in it, then cudaMallocs 256 MiB of its own and
then 1 GiB more. Under the 4 GiB quota, which the two processes share (each
context about 0.5 GiB), the 256 MiB fit only if the import is not charged a
second time (2 + 2 + 0.25 + 2 x 0.5 GiB would not fit) and the 1 GiB more
does not fit. Each runs three times: without the limiter, with the 4 GiB
quota and with 60 GiB (mode pre). While both hold, their footprints are read
from outside (nvidia-smi, by pid).
`bash scripts/gpu/run.sh gpu-bundle -k ipc` runs exactly these.
"""

from __future__ import annotations

import time

import pytest
from harness.checks import QUOTA_MIB, Below, AtMost, Equal, Why, q
from harness.proc import Proc, clean_shm, footprints

NOT_BUILT = ("not built", "not built")
#: What the exporter shares, what the importer takes of its own, then more (MiB).
SHARED_MIB, OWN_MIB, MORE_MIB = 2048, 256, 1024
#: How far past a bound a footprint read from outside may be (MiB), as in checks 27-39.
SLACK_MIB = 64
#: How long the programs hold (s), and how long they may take to get there.
HOLD_S, READY_S = 120, 90
#: The importer's steps: with the quota, and without it (all succeed).
LIMITED = {"import_rc": 0, "import_ok": 1, "own_rc": 0, "more_rc": 2}
WITHOUT = {"import_rc": 0, "import_ok": 1, "own_rc": 0, "more_rc": 0}

CHECKS = [
    ("40", "legacy", "imported memory is the exporter's: legacy IPC (cudaIpcGetMemHandle, cudaIpcOpenMemHandle)"),
    ("41", "vmm", "imported memory is the exporter's: VMM shareable handle (cuMemCreate with a POSIX fd handle, "
                  "cuMemExportToShareableHandle, cuMemImportFromShareableHandle)"),
]


def steps(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def expected() -> str:
    return (f"with: {steps(LIMITED)}, importer fp<{OWN_MIB}+ctx+{SLACK_MIB} (ctx: exporter fp-{SHARED_MIB}), "
            f"exporter+importer fp<={QUOTA_MIB}+{SLACK_MIB}; 60g quota: as without; without: {steps(WITHOUT)}")


def hold(check, num: str, kind: str, mode: str):
    """Runs the exporter (which starts the importer) in one mode; reads both
    footprints (MiB) while they hold, then releases them. Returns (the run,
    the exporter's footprint, the importer's; None where unknown)."""
    s = check.s
    flag = s.work / f"release-{num}-ipc-{kind}-{mode}"
    flag.unlink(missing_ok=True)
    clean_shm()
    pod = "-" if mode == "base" else f"e2e-ipc-{kind}"
    p = Proc(s, mode, pod, check.log / f"{num}-ipc-{kind}-{mode}.log", HOLD_S + READY_S,
             [s.bin("ipc_share"), kind, str(flag), str(HOLD_S)], header=f" (hold until {flag})").start()
    efp = ifp = None
    # holding= is the importer's: the exporter holds from before it started the importer.
    if p.wait_for_line("holding=", limit_s=READY_S):
        time.sleep(1)  # as check 27: NVML's per-process numbers settle
        fps = footprints(s)
        efp = fps.get(p.pid)
        importer = p.kv("importer_pid")
        ifp = fps.get(int(importer)) if importer and importer.isdigit() else None
    flag.touch()
    p.wait()
    return p, efp, ifp


def step_values(p) -> str:
    return " ".join(f"{k}={q(p.kv(k))}" for k in LIMITED)


@pytest.mark.parametrize("num,kind,label", [
    pytest.param(n, k, label, marks=pytest.mark.check(n), id=f"{n}-ipc-{k}") for n, k, label in CHECKS])
def test_ipc_import(check, num, kind, label):
    """40, 41: the import is the exporter's: under the 4 GiB quota the
    importer gets the shared memory with the exporter's pattern and 256 MiB
    of its own, 1 GiB more is refused (2), its footprint does not hold the
    import and the two footprints stay within the quota. Without the limiter
    every step succeeds; with 60 GiB, every step gets what it gets without."""
    row = check.row(f"{num}. {label}: importer's steps, footprints (MiB, nvidia-smi)", expected())
    if not check.s.built("ipc_share"):
        return row.done(*NOT_BUILT, "build failed")
    b, bes, bis = hold(check, num, kind, "base")
    lm, les, lis = hold(check, num, kind, "lim")
    pr, pes, pis = hold(check, num, kind, "pre")
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"), pr.exit_why("pre"))
    for tag, p in (("base", b), ("lim", lm), ("pre", pr)):
        why.need(p.kv("importer_pid") is not None, f"{tag}-no-importer(export_rc={q(p.kv('export_rc'))})")
        why.need(Equal(0).holds(p.kv("importer_exit")), f"{tag}-importer-exit={q(p.kv('importer_exit'))}")
    for k, v in WITHOUT.items():
        why.need(Equal(v).holds(b.kv(k)), f"base-{k}!={v}")
    for k, v in LIMITED.items():
        why.need(Equal(v).holds(lm.kv(k)), f"{k}!={v}")
    if why.need(les is not None and lis is not None, "no-footprint"):
        ctx = les - SHARED_MIB  # the exporter's context: its footprint less what it shares
        why.need(Below(OWN_MIB + ctx + SLACK_MIB).holds(lis), f"importer-fp>={OWN_MIB}+{ctx}+{SLACK_MIB}")
        why.need(AtMost(QUOTA_MIB + SLACK_MIB).holds(les + lis), "footprints-over-quota")
    for k in WITHOUT:
        why.need(pr.kv(k) is not None and pr.kv(k) == b.kv(k), f"pre-{k}!=without's")
    row.done(f"{step_values(b)} fp={q(bes)}+{q(bis)}MiB",
             f"{step_values(lm)} fp={q(les)}+{q(lis)}MiB (exporter+importer); "
             f"60g: {step_values(pr)} fp={q(pes)}+{q(pis)}MiB", why)
