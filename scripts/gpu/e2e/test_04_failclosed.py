"""Checks 21-22: fail closed, and reports right at once."""

from __future__ import annotations

import re

import pytest
from harness.checks import QUOTA, QUOTA_MIB, Above, AtLeast, AtMost, Equal, GiB, Why, gib, mibs, num, q
from harness.hv import free_port
from harness.parse import smi_fields, smi_line
from harness.proc import SMI_MEM, Proc, clean_shm, run, wait_holding

NOT_BUILT = ("not built", "not built")


def stale_sequence(check, mode: str, tag: str, how: str) -> dict:
    """A of pod P holds 3 GiB, then exits without freeing (exit) or is killed
    (kill); at once the next process of P and nvidia-smi in P report."""
    s, pod = check.s, f"e2e-stale-{how}"
    flag = s.work / f"release-21-{tag}-{how}"
    flag.unlink(missing_ok=True)
    clean_shm()
    a = Proc(s, mode, pod, check.log / f"21-{tag}-{how}-A.log", 150,
             [s.bin("mem_hold"), str(3 * GiB), str(flag), "120", "keep"], header=f" (A holds 3 GiB, then {how})").start()
    wait_holding(a)
    out = {"A": a.kv("alloc_rc"), "A0": a.kv("free0")}
    if how == "kill":
        a.kill()
    else:
        flag.touch()
    a.wait()
    # at once: the next process of the pod, then nvidia-smi in the pod
    nxt = run(s, mode, pod, check.log / f"21-{tag}-{how}-B.log", 60, [s.bin("mem_hold"), "0"])
    smi = run(s, mode, pod, check.log / f"21-{tag}-{how}-smi.log", 60, SMI_MEM)
    out.update(T=nxt.kv("total0"), F=nxt.kv("free0"), SMI=smi_line(smi.text()), next=nxt)
    return out


@pytest.mark.check("21")
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_report_after_holder_ends(check, how):
    """21: reports right after a process of the pod holding 3 GiB ended: with the
    limiter total=4096MiB, free >= 3072MiB, nvidia-smi used <= 512MiB; without,
    free is back within 1 GiB of what the holder saw before allocating."""
    label = "SIGKILL" if how == "kill" else how
    row = check.row(f"21. report right after a 3GiB holder ends ({label})",
                    "with: A=0, next: total=4096MiB free>=3072MiB, nvidia-smi total=4096 used<=512; "
                    "without: free back within 1GiB")
    if not check.s.built("mem_hold"):
        return row.done(*NOT_BUILT, "build failed")
    b = stale_sequence(check, "base", "base", how)
    lm = stale_sequence(check, "lim", "lim", how)
    lst, lsu, _ = smi_fields(lm["SMI"])
    why = Why()
    why.add(b["next"].exit_why("base-next"), lm["next"].exit_why("lim-next"))
    why.need(b["A"] == "0", "base-A!=0")
    bF, bA0 = num(b["F"]), num(b["A0"])
    why.need(bF is not None and bA0 is not None and bF + GiB >= bA0, "base-free-not-back")
    why.need(lm["A"] == "0", "A!=0")
    why.need(Equal(QUOTA).holds(lm["T"]), "total!=quota")
    why.need(AtLeast(3 * GiB).holds(lm["F"]), "free<3072MiB")
    why.need(Equal(QUOTA_MIB).holds(lst), "smi-total!=4096")
    why.need(AtMost(512).holds(lsu), "smi-used>512")
    row.done(f"A={q(b['A'])} before={mibs(b['A0'])} next-free={mibs(b['F'])} smi={q(b['SMI'])}",
             f"A={q(lm['A'])} next: total={mibs(lm['T'])} free={mibs(lm['F'])} smi={q(lm['SMI'])}", why)
    clean_shm()


def limiter_lines(text: str):
    return [ln for ln in text.splitlines() if ln.startswith("cuda-limiter:")]


@pytest.fixture
def down_url(check):
    """A URL nothing listens on: the hypervisor is down and never granted limits."""
    check.s.hv_down_url = f"http://127.0.0.1:{free_port()}"
    check.say(f"   hypervisor-down URL: {check.s.hv_down_url}")
    return check.s.hv_down_url


@pytest.mark.check("22")
def test_down_local_limit(check, down_url):
    """22a: with CUDA_DEVICE_MEMORY_LIMIT=4g, cudaMalloc until OOM as in check 1,
    and one stderr line saying the local limits apply."""
    row = check.row("22a. hypervisor down + local 4g: cudaMalloc until OOM",
                    "with: total=4096MiB, 2GiB<=got<=4GiB, err=2, 1 stderr line 'local limits apply'; without: got>8GiB")
    if not check.s.built("mem_runtime"):
        return row.done(*NOT_BUILT, "build failed")
    b = run(check.s, "base", "-", check.log / "22a-base.log", 180, [check.s.bin("mem_runtime")])
    clean_shm()
    lm = run(check.s, "down:4g", "e2e-down-local", check.log / "22a-down.log", 180, [check.s.bin("mem_runtime")])
    lines = limiter_lines(lm.text())
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("down"))
    why.need(Above(8 * GiB).holds(b.kv("obtained")), "base-got<=8GiB")
    why.need(Equal(QUOTA).holds(lm.kv("total0")), "total!=quota")
    why.need(AtMost(QUOTA).holds(lm.kv("obtained")), "got>quota")
    why.need(AtLeast(2 * GiB).holds(lm.kv("obtained")), "got<2GiB")
    why.need(Equal(2).holds(lm.kv("fail_code")), "err!=2")
    why.need(len(lines) == 1 and any(re.search("the local limits apply", ln) for ln in lines),
             f"stderr-lines={len(lines)}")
    row.done(f"got={gib(b.kv('obtained'))}", f"total={mibs(lm.kv('total0'))} got={gib(lm.kv('obtained'))} "
                                             f"err={q(lm.kv('fail_code'))} lines={len(lines)}", why)


@pytest.mark.check("22")
def test_down_no_limit(check, down_url):
    """22b: with no local limit, CUDA refuses to initialise (cudaMalloc fails,
    mem_hold exits 0) with exactly one "cuda-limiter:" line."""
    row = check.row("22b. hypervisor down, no local limit: CUDA refused",
                    "with: cudaMalloc(1GiB)!=0, exactly 1 stderr line 'CUDA refuses to initialise'; without: cudaMalloc=0")
    if not check.s.built("mem_hold"):
        return row.done(*NOT_BUILT, "build failed")
    b = run(check.s, "base", "-", check.log / "22b-base.log", 60, [check.s.bin("mem_hold"), str(GiB)])
    clean_shm()
    lm = run(check.s, "down:", "e2e-down-none", check.log / "22b-down.log", 60, [check.s.bin("mem_hold"), str(GiB)])
    lines = limiter_lines(lm.text())
    la = lm.kv("alloc_rc")
    why = Why()
    why.add(b.exit_why("base"))
    why.need(b.kv("alloc_rc") == "0", "base-alloc!=0")
    why.need(num(la) is not None and num(la) != 0, "alloc-not-refused")
    why.need(len(lines) == 1 and any("CUDA refuses to initialise" in ln for ln in lines), f"stderr-lines={len(lines)}")
    row.done(f"alloc={q(b.kv('alloc_rc'))}", f"alloc={q(la)} ({q(lm.kv('alloc_name'))}) lines={len(lines)}", why)
    clean_shm()
