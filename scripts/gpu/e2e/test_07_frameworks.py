"""Check 37: JAX and CuPy run unchanged under the 4 GiB quota: work that
fits is never refused, and each sees the quota as the device's size."""

from __future__ import annotations

import pytest
from harness.checks import QUOTA_MIB, Equal, Why, q
from harness.proc import clean_shm, run

#: Each framework's work and the checksum it must give with and without the limiter.
SUMS = {"jax": "8192", "cupy": str((256 << 20) + 4096)}


@pytest.mark.check("37")
@pytest.mark.parametrize("fw", ["jax", "cupy"])
def test_frameworks(check, fw):
    """37: the same program without and with the limiter: both succeed with
    the same checksum; with it, JAX preallocates 75% of the quota and CuPy
    sees the quota as the device's total."""
    seen = "limit_mib" if fw == "jax" else "total_mib"
    want = QUOTA_MIB * 3 // 4 if fw == "jax" else QUOTA_MIB
    row = check.row(f"37. {fw} work that fits the 4 GiB quota (no false refusal)",
                    f"with: {fw}=ok, same checksum, {seen}={want}; without: {fw}=ok")
    cmd = check.s.script("mem_frameworks.py") + [fw]
    b = run(check.s, "base", "-", check.log / f"37-{fw}-base.log", 240, cmd)
    clean_shm()
    lm = run(check.s, "lim", f"e2e-{fw}", check.log / f"37-{fw}-lim.log", 240, cmd)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(b.kv(fw) == "ok", "base-failed")
    why.need(lm.kv(fw) == "ok", "refused")
    why.need(b.kv("sum") == SUMS[fw] and lm.kv("sum") == SUMS[fw], "checksum")
    why.need(Equal(want).holds(lm.kv(seen)), f"{seen}!={want}")
    row.done(f"{fw}={q(b.kv(fw))} sum={q(b.kv('sum'))} {seen}={q(b.kv(seen))}",
             f"{fw}={q(lm.kv(fw))} sum={q(lm.kv('sum'))} {seen}={q(lm.kv(seen))}", why)
