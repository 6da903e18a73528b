"""Checks 23-26: oversubscription (CUDA_OVERSUBSCRIBE=true) past a 4 GiB quota.

Every check runs scripts/gpu/oversub_torch.py without the limiter and with it
(quota 4 GiB; mode over:CAP adds the switch and the host-memory cap).
`bash scripts/gpu/run.sh gpu-bundle -k oversub` runs exactly these.
"""

from __future__ import annotations

import subprocess

import pytest

from harness.checks import QUOTA, QUOTA_MIB, AtLeast, AtMost, Equal, Why, mibs, num, q
from harness.proc import Proc, env_for, run

HOLD_S = 120
#: Relative difference allowed between the checksums with and without the limiter.
CHECKSUM_RTOL = 1e-6
CHECKSUMS = ("dev_sum", "dev_abs", "spill_sum", "spill_abs")


def footprint_mib(s, pid: int | None) -> int | None:
    """The process's device memory as NVML sees it from outside (nvidia-smi), MiB."""
    if pid is None:
        return None
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, env=env_for(s, "base")).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1])
    return None


def hold_and_measure(check, mode: str, pod: str, tag: str):
    """Runs the matmul program, reads its footprint while it holds its blocks, releases it."""
    flag = check.s.work / f"release-oversub-{tag}"
    flag.unlink(missing_ok=True)
    p = Proc(check.s, mode, pod, check.log / f"23-oversub-{tag}.log", 600,
             check.s.script("oversub_torch.py") + ["matmul", str(flag), str(HOLD_S)]).start()
    fp = footprint_mib(check.s, p.pid) if p.wait_for_line("ready=", "done=", limit_s=420) else None
    flag.touch()
    p.wait()
    return p, fp


def close(a, b) -> bool:
    x, y = num(a), num(b)
    return x is not None and y is not None and abs(x - y) <= CHECKSUM_RTOL * max(abs(x), abs(y), 1.0)


@pytest.mark.check("23")
def test_oversub_matmul(check):
    """23: PyTorch allocates 6 GiB under a 4 GiB quota; matmul as without the limiter; footprint <= quota."""
    row = check.row("23. oversubscription: PyTorch 6 GiB, matmul on spilled blocks",
                    "with: alloc ok, blocks 5,6 spilled (type 1), total=4096MiB, checksums = without's "
                    f"(rtol {CHECKSUM_RTOL:g}), footprint<=4096MiB (nvidia-smi, by pid); without: alloc ok")
    b, bfp = hold_and_measure(check, "base", "-", "base")
    lm, lfp = hold_and_measure(check, "over:8g", "e2e-oversub", "lim")
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(b.kv("alloc") == "ok", "base-alloc-failed")
    why.need(lm.kv("alloc") == "ok", "alloc-failed")
    types = (lm.kv("types") or "").split(",")
    why.need(len(types) == 6 and types[4:] == ["1", "1"], "blocks-5,6-not-spilled")
    why.need(all(t in ("1", "2") for t in types), "pointer-type-wrong")
    why.need(Equal(QUOTA).holds(lm.kv("total")), "total!=quota")
    why.need(AtMost(QUOTA).holds(lm.kv("free")), "free>quota")
    for key in CHECKSUMS:
        why.need(close(b.kv(key), lm.kv(key)), f"{key}-differs")
    why.need(lfp is not None, "no-footprint")
    why.need(AtMost(QUOTA_MIB).holds(lfp), "footprint>quota")
    exact = all(b.kv(k) == lm.kv(k) for k in CHECKSUMS)
    row.done(f"alloc={q(b.kv('alloc'))} types={q(b.kv('types'))} fp={q(bfp)}MiB spill_sum={q(b.kv('spill_sum'))}",
             f"alloc={q(lm.kv('alloc'))} types={q(lm.kv('types'))} total={mibs(lm.kv('total'))} fp={q(lfp)}MiB "
             f"spill_sum={q(lm.kv('spill_sum'))} bitwise={int(exact)} ranges={q(lm.kv('ranges'))}", why)


@pytest.mark.check("24")
def test_oversub_off(check):
    """24: the same program with oversubscription off: torch.OutOfMemoryError."""
    row = check.row("24. oversubscription off: PyTorch 6 GiB", "with: torch.OutOfMemoryError after <=4 blocks; "
                    "without: alloc ok")
    flag = check.s.work / "release-oversub-off"
    flag.touch()
    cmd = check.s.script("oversub_torch.py") + ["matmul", str(flag), "0"]
    b = run(check.s, "base", "-", check.log / "24-oversub-off-base.log", 600, cmd)
    lm = run(check.s, "lim", "e2e-oversub-off", check.log / "24-oversub-off-lim.log", 600, cmd)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(b.kv("alloc") == "ok", "base-alloc-failed")
    why.need(lm.kv("alloc") == "oom", "not-OOM")
    why.need(AtMost(4).holds(lm.kv("blocks")), "blocks>4")
    why.need("2" in (lm.kv("types") or "2") and "1" not in (lm.kv("types") or ""), "spilled-while-off")
    row.done(f"alloc={q(b.kv('alloc'))} blocks={q(b.kv('blocks'))}",
             f"alloc={q(lm.kv('alloc'))} blocks={q(lm.kv('blocks'))} msg={q(lm.kv('oom_msg'))}", why)


@pytest.mark.check("25")
def test_oversub_host_cap(check):
    """25: a host-memory cap of 1.5 GiB: one 1 GiB block spills, the next is torch.OutOfMemoryError."""
    row = check.row("25. oversubscription host cap 1536MiB: 1 GiB blocks until OOM",
                    "with: spilled=1, oom=1; without: 8 blocks, oom=0")
    cmd = check.s.script("oversub_torch.py") + ["cap"]
    b = run(check.s, "base", "-", check.log / "25-oversub-cap-base.log", 600, cmd)
    lm = run(check.s, "over:1536m", "e2e-oversub-cap", check.log / "25-oversub-cap-lim.log", 600, cmd)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(Equal(8).holds(b.kv("blocks")), "base-blocks!=8")
    why.need(Equal(1).holds(lm.kv("spilled")), "spilled!=1")
    why.need(Equal(1).holds(lm.kv("oom")), "no-OOM-past-cap")
    row.done(f"blocks={q(b.kv('blocks'))} oom={q(b.kv('oom'))}",
             f"blocks={q(lm.kv('blocks'))} spilled={q(lm.kv('spilled'))} oom={q(lm.kv('oom'))}", why)


@pytest.mark.check("26")
def test_oversub_slowdown(check):
    """26: a read kernel (torch.sum over 1 GiB) on device memory vs spilled memory, GB/s."""
    row = check.row("26. oversubscription slowdown: torch.sum over 1 GiB (GB/s)",
                    "with: device and spilled both measured, the same sum (2^28 within 1e-3); the slowdown "
                    "is reported")
    cmd = check.s.script("oversub_torch.py") + ["bench"]
    b = run(check.s, "base", "-", check.log / "26-oversub-bench-base.log", 600, cmd)
    lm = run(check.s, "over:8g", "e2e-oversub-bench", check.log / "26-oversub-bench-lim.log", 600, cmd)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    ones = float(1 << 28)
    why.need(AtLeast(1).holds(b.kv("dev_gbps")), "base-not-measured")
    why.need(AtLeast(0.01).holds(lm.kv("spill_gbps")), "spilled-not-measured")
    sums = num(lm.kv("dev_sum")), num(lm.kv("spill_sum"))
    why.need(sums[0] is not None and sums[0] == sums[1], "sums-differ")
    why.need(sums[1] is not None and abs(sums[1] - ones) <= 1e-3 * ones, "sum-wrong")
    dev, spill = num(lm.kv("dev_gbps")), num(lm.kv("spill_gbps"))
    slowdown = f"{dev / spill:.1f}x" if dev and spill else "-"
    check.say(f"   | memory | read GB/s |\n   | device (without) | {q(b.kv('dev_gbps'))} |\n"
              f"   | device (with) | {q(lm.kv('dev_gbps'))} |\n   | spilled (with) | {q(lm.kv('spill_gbps'))} |\n"
              f"   slowdown of a kernel reading spilled memory: {slowdown}")
    row.done(f"device={q(b.kv('dev_gbps'))}GB/s",
             f"device={q(lm.kv('dev_gbps'))}GB/s spilled={q(lm.kv('spill_gbps'))}GB/s slowdown={slowdown}", why)
