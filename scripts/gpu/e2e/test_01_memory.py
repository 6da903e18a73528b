"""Checks 1-10 and 27: the per-pod memory quota (CUDA_DEVICE_MEMORY_LIMIT=4g)."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from harness.checks import (
    QUOTA,
    QUOTA_MIB,
    SLACK,
    Above,
    AddedAtMost,
    AddedBelow,
    AtLeast,
    AtMost,
    Below,
    Between,
    Equal,
    GiB,
    MiB,
    Why,
    gib,
    mibs,
    q,
)
from harness.parse import api_field, median, smi_fields, smi_line
from harness.proc import SMI_MEM, Proc, clean_shm, footprints, run, wait_holding

NOT_BUILT = ("not built", "not built")


@pytest.mark.parametrize("num,label,binary,pod", [
    pytest.param("1", "static cudart", "mem_runtime", "e2e-rt-static", marks=pytest.mark.check("1"), id="1-static"),
    pytest.param("2", "shared cudart", "mem_runtime_shared", "e2e-rt-shared", marks=pytest.mark.check("2"),
                 id="2-shared"),
])
def test_runtime_oom(check, num, label, binary, pod):
    """1 / 2: cudaMalloc 256 MiB chunks until OOM, static or shared cudart."""
    row = check.row(f"{num}. cudaMalloc until OOM ({label})",
                    "with: total=4096MiB, 2GiB<=got<=4GiB, err=2, free<256MiB, footprint<=4096MiB; "
                    "without: total>16GiB, got>8GiB")
    if not check.s.built(binary):
        return row.done(*NOT_BUILT, "build failed")
    b = run(check.s, "base", "-", check.log / f"{num}-{binary}-base.log", 180, [check.s.bin(binary)])
    clean_shm()
    lm = run(check.s, "lim", pod, check.log / f"{num}-{binary}-lim.log", 180, [check.s.bin(binary)])
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(b.kv("done") == "1", "base-did-not-finish")
    why.need(Above(16 * GiB).holds(b.kv("total0")), "base-total<=16GiB")
    why.need(Above(8 * GiB).holds(b.kv("obtained")), "base-got<=8GiB")
    why.need(lm.kv("done") == "1", "lim-did-not-finish")
    why.need(Equal(QUOTA).holds(lm.kv("total0")), "total!=quota")
    why.need(AtMost(QUOTA).holds(lm.kv("obtained")), "got>quota")
    why.need(AtLeast(2 * GiB).holds(lm.kv("obtained")), "got<2GiB")
    why.need(Equal(2).holds(lm.kv("fail_code")), "err!=2")
    why.need(Below(256 * MiB).holds(lm.kv("free1")), "free-after>=256MiB")
    why.need(Between(0, QUOTA_MIB).holds(lm.kv("footprint_mib")), "footprint")
    row.done(f"total={mibs(b.kv('total0'))} got={gib(b.kv('obtained'))} err={q(b.kv('fail_code'))} "
             f"fp={q(b.kv('footprint_mib'))}MiB",
             f"total={mibs(lm.kv('total0'))} got={gib(lm.kv('obtained'))} err={q(lm.kv('fail_code'))} "
             f"free={mibs(lm.kv('free1'))} fp={q(lm.kv('footprint_mib'))}MiB", why)


@pytest.mark.check("3")
@pytest.mark.parametrize("mode", ["default", "deepbind"])
def test_ctypes(check, mode):
    """3: the driver API through ctypes (plain dlopen and RTLD_DEEPBIND)."""
    exp = "with: totalmem=info.total=4096MiB, 3GiB=0, +2GiB=2, free back; without: 0, 0"
    paths = {"direct": "exported symbols", "pa": "cuGetProcAddress_v2 pointers"}
    rows = {p: check.row(f"3. ctypes {mode}: {what}", exp) for p, what in paths.items()}
    cmd = check.s.script("mem_ctypes.py") + [mode]
    b = run(check.s, "base", "-", check.log / f"3-ctypes-{mode}-base.log", 120, cmd)
    clean_shm()
    lm = run(check.s, "lim", f"e2e-ctypes-{mode}", check.log / f"3-ctypes-{mode}-lim.log", 120, cmd)
    for p, row in rows.items():
        bv = {k: b.kv(f"{p}_{k}") for k in ("total_mem", "info_total", "alloc3g_rc", "alloc2g_rc")}
        lv = {k: lm.kv(f"{p}_{k}") for k in ("total_mem", "info_total", "alloc3g_rc", "alloc2g_rc",
                                               "free_back_diff")}
        why = Why()
        why.add(b.exit_why("base"), lm.exit_why("lim"))
        why.need(Equal(0).holds(bv["alloc3g_rc"]), "base-3GiB!=0")
        why.need(Equal(0).holds(bv["alloc2g_rc"]), "base-2GiB!=0")
        why.need(Equal(QUOTA).holds(lv["total_mem"]), "totalmem!=quota")
        why.need(Equal(QUOTA).holds(lv["info_total"]), "info.total!=quota")
        why.need(Equal(0).holds(lv["alloc3g_rc"]), "3GiB!=0")
        why.need(Equal(2).holds(lv["alloc2g_rc"]), "2GiB!=2")
        why.need(Between(-SLACK, SLACK).holds(lv["free_back_diff"]), f"free-not-back({q(lv['free_back_diff'])})")
        row.done(f"totalmem={mibs(bv['total_mem'])} info={mibs(bv['info_total'])} 3G={q(bv['alloc3g_rc'])} "
                 f"2G={q(bv['alloc2g_rc'])}",
                 f"totalmem={mibs(lv['total_mem'])} info={mibs(lv['info_total'])} 3G={q(lv['alloc3g_rc'])} "
                 f"2G={q(lv['alloc2g_rc'])} back={mibs(lv['free_back_diff'])}", why)


APIS = ["cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuMemCreate", "cuArrayCreate_v2",
        "cuArray3DCreate_v2", "cuMipmappedArrayCreate"]


@pytest.mark.check("4")
def test_alloc_apis(check):
    """4: every allocation API counts against the quota and gives back."""
    exp = "with: alloc=0 drop>=1GiB-2MiB over=2 back=ok; without: alloc=0 over=0 (managed: n/a)"
    rows = {a: check.row(f"4. {a}", exp) for a in APIS}
    if not check.s.built("mem_apis"):
        for r in rows.values():
            r.done(*NOT_BUILT, "build failed")
        return
    b = run(check.s, "base", "-", check.log / "4-apis-base.log", 180, [check.s.bin("mem_apis")])
    clean_shm()
    lm = run(check.s, "lim", "e2e-apis", check.log / "4-apis-lim.log", 180, [check.s.bin("mem_apis"), "limited"])
    check.say(f"   mem_apis: limited cuMemGetInfo total={q(lm.kv('total'))} "
              f"cuDeviceTotalMem={q(lm.kv('device_total'))} ptsz={q(lm.kv('ptsz_symbols'))}")
    bt, lt = b.text(), lm.text()
    for a, row in rows.items():
        bf = {k: api_field(bt, a, k) for k in ("alloc", "drop", "over", "back")}
        lf = {k: api_field(lt, a, k) for k in ("alloc", "drop", "over", "back")}
        why = Why()
        why.add(b.exit_why("base"), lm.exit_why("lim"))
        if lf["alloc"] is None:
            why.add("no-output-line")
        else:
            why.need(Equal(0).holds(bf["alloc"]), "base-alloc!=0")
            if a == "cuMemAllocManaged":
                why.need(bf["over"] == "n/a", "base-over-attempted")
            else:
                why.need(Equal(0).holds(bf["over"]), "base-over!=0")
            why.need(Equal(0).holds(lf["alloc"]), "alloc!=0")
            why.need(AtLeast(GiB - SLACK).holds(lf["drop"]), "drop<1GiB")
            why.need(Equal(2).holds(lf["over"]), "over!=2")
            why.need(lf["back"] == "ok", "not-given-back")
        row.done(f"alloc={q(bf['alloc'])} drop={mibs(bf['drop'])} over={q(bf['over'])} back={q(bf['back'])}",
                 f"alloc={q(lf['alloc'])} drop={mibs(lf['drop'])} over={q(lf['over'])} back={q(lf['back'])}", why)
    if not Equal(QUOTA).holds(lm.kv("total")):
        check.say(f"   note: mem_apis saw total={q(lm.kv('total'))} under the limiter (expected {QUOTA})")


@pytest.mark.check("5")
def test_torch_oom(check):
    """5: PyTorch mem_get_info and OOM."""
    row = check.row("5. PyTorch mem_get_info / OOM",
                    "with: total=4294967296, 2GiB ok, 5GiB -> torch.OutOfMemoryError; without: 5GiB ok")
    cmd = check.s.script("mem_torch.py")
    b = run(check.s, "base", "-", check.log / "5-torch-base.log", 240, cmd)
    clean_shm()
    lm = run(check.s, "lim", "e2e-torch", check.log / "5-torch-lim.log", 240, cmd)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(b.kv("alloc2g") == "ok", "base-2GiB-failed")
    why.need(b.kv("over") == "ok", "base-5GiB-failed")
    why.need(Equal(QUOTA).holds(lm.kv("total")), "total!=quota")
    why.need(AtMost(QUOTA).holds(lm.kv("free")), "free>quota")
    why.need(lm.kv("alloc2g") == "ok", "2GiB-failed")
    why.need(lm.kv("over") == "oom", "5GiB-not-OOM")
    row.done(f"total={q(b.kv('total'))} 2G={q(b.kv('alloc2g'))} 5G={q(b.kv('over'))}",
             f"total={q(lm.kv('total'))} free={mibs(lm.kv('free'))} 2G={q(lm.kv('alloc2g'))} 5G={q(lm.kv('over'))}",
             why)


@pytest.mark.check("6")
def test_smi(check):
    """6: nvidia-smi under the preload (NVML nvmlDeviceGetMemoryInfo)."""
    row = check.row("6. nvidia-smi memory.total/used/free (MiB)", "with: total=4096, used,free<=4096; without: total>8192")
    b = run(check.s, "base", "-", check.log / "6-smi-base.log", 60, SMI_MEM)
    clean_shm()
    lm = run(check.s, "lim", "e2e-smi", check.log / "6-smi-lim.log", 60, SMI_MEM)
    bl, ll = smi_line(b.text()), smi_line(lm.text())
    bt = smi_fields(bl)[0]
    lt, lu, lf = smi_fields(ll)
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(Above(8192).holds(bt), "base-total<=8192")
    why.need(Equal(QUOTA_MIB).holds(lt), "total!=4096")
    why.need(AtMost(QUOTA_MIB).holds(lu), "used>4096")
    why.need(AtMost(QUOTA_MIB).holds(lf), "free>4096")
    row.done(q(bl), q(ll), why)


def pod_sequence(check, mode: str, tag: str):
    """7: A holds 2.5 GiB in pod e2e-shared; B of the same pod, B of another
    pod; A killed (SIGKILL); C of the same pod. Returns (A, Bsame, Bother, C, runs)."""
    s, sz = check.s, str(5 * GiB // 2)
    flag = s.work / f"release-{tag}"
    flag.unlink(missing_ok=True)
    clean_shm()
    a = Proc(s, mode, "e2e-shared", check.log / f"7-{tag}-A.log", 150, [s.bin("mem_hold"), sz, str(flag), "120"],
             header=f" (A, holds until {flag})").start()
    wait_holding(a)
    seq_a = a.kv("alloc_rc") or "none"
    bs = run(s, mode, "e2e-shared", check.log / f"7-{tag}-B-same.log", 60, [s.bin("mem_hold"), sz])
    bo = run(s, mode, "e2e-other", check.log / f"7-{tag}-B-other.log", 60, [s.bin("mem_hold"), sz])
    alive = a.alive()
    a.kill()
    a.wait()
    time.sleep(1)
    c = run(s, mode, "e2e-shared", check.log / f"7-{tag}-C.log", 60, [s.bin("mem_hold"), sz])
    if not alive:
        seq_a += "(died-early)"
    flag.touch()
    return seq_a, bs.kv("alloc_rc"), bo.kv("alloc_rc"), c.kv("alloc_rc"), {"B-same": bs, "B-other": bo, "C": c}


@pytest.mark.check("7")
def test_pod_shares_quota(check):
    """7: two processes of one pod share one quota; a killed process gives back."""
    row = check.row("7. one pod, two processes (2.5GiB each); SIGKILL gives back",
                    "with: A=0 B-same-pod=2 B-other-pod=0 C-after-kill=0; without: all 0")
    if not check.s.built("mem_hold"):
        return row.done(*NOT_BUILT, "build failed")
    bA, bBs, bBo, bC, brun = pod_sequence(check, "base", "base")
    lA, lBs, lBo, lC, lrun = pod_sequence(check, "lim", "lim")
    why = Why()
    for tag, runs in (("base", brun), ("lim", lrun)):
        for k, p in runs.items():
            why.add(p.exit_why(f"{tag}-{k}"))
    why.need((bA, bBs, bBo, bC) == ("0", "0", "0", "0"), "baseline-not-all-0")
    why.need(lA == "0", "A!=0")
    why.need(lBs == "2", "B-same!=2")
    why.need(lBo == "0", "B-other!=0")
    why.need(lC == "0", "C-after-kill!=0")
    row.done(f"A={bA} Bsame={q(bBs)} Bother={q(bBo)} C={q(bC)}", f"A={lA} Bsame={q(lBs)} Bother={q(lBo)} C={q(lC)}",
             why)


@pytest.mark.check("8")
def test_pairs(check):
    """8: 10,000 alloc/free pairs from 4 threads leave usage at zero."""
    row = check.row("8. 10k cudaMalloc/cudaFree pairs, 4 threads",
                    "with: 10000 pairs, 0 errors, free back +-2MiB, alloc(free-64MiB)=0")
    if not check.s.built("mem_pairs"):
        return row.done(*NOT_BUILT, "build failed")
    b = run(check.s, "base", "-", check.log / "8-pairs-base.log", 180, [check.s.bin("mem_pairs")])
    clean_shm()
    lm = run(check.s, "lim", "e2e-pairs", check.log / "8-pairs-lim.log", 180, [check.s.bin("mem_pairs")])
    why = Why()
    why.add(b.exit_why("base"), lm.exit_why("lim"))
    why.need(Equal(10000).holds(b.kv("pairs")), "base-pairs!=10000")
    why.need(Equal(QUOTA).holds(lm.kv("total0")), "total!=quota")
    why.need(Equal(10000).holds(lm.kv("pairs")), "pairs!=10000")
    why.need(Equal(0).holds(lm.kv("alloc_errors")), "alloc-errors")
    why.need(Equal(0).holds(lm.kv("free_errors")), "free-errors")
    why.need(Between(-SLACK, SLACK).holds(lm.kv("free_diff")), "free-not-back")
    why.need(Equal(0).holds(lm.kv("big_rc")), "big-alloc!=0")
    row.done(f"pairs={q(b.kv('pairs'))} errs={q(b.kv('alloc_errors'))} diff={q(b.kv('free_diff'))}B "
             f"big={q(b.kv('big_rc'))}",
             f"pairs={q(lm.kv('pairs'))} errs={q(lm.kv('alloc_errors'))}/{q(lm.kv('free_errors'))} "
             f"diff={q(lm.kv('free_diff'))}B big={q(lm.kv('big_rc'))} big_bytes={mibs(lm.kv('big_bytes'))}", why)


BENCH_ROUNDS = 11
BENCH = AddedAtMost(5)


@pytest.mark.check("9")
def test_alloc_cost(check):
    """9: added cost of cuMemAlloc_v2 + cuMemFree_v2; the driver's own cost
    varies +-20% between processes, so many short runs alternating which goes
    first, and the medians."""
    row = check.row(f"9. cuMemAlloc_v2+cuMemFree_v2 (1MiB) ns/pair, median of {BENCH_ROUNDS}", str(BENCH))
    if not check.s.built("mem_bench"):
        return row.done(*NOT_BUILT, "build failed")
    runs = {"base": [], "lim": []}

    def one(mode, i):
        pod = "-" if mode == "base" else "e2e-bench"
        p = run(check.s, mode, pod, check.log / f"9-bench-{mode}-{i}.log", 120,
                [check.s.bin("mem_bench"), "10000", "2000"], limiter_log="warn")
        runs[mode].append(p.kv("ns_per_pair") or "x")

    for i in range(1, BENCH_ROUNDS + 1):
        for mode in (("base", "lim") if i % 2 else ("lim", "base")):
            one(mode, i)
    check.say(f"   bench ns/pair without: {' '.join(runs['base'])}  with: {' '.join(runs['lim'])}")
    bm, lm = median(runs["base"]), median(runs["lim"])
    why = Why()
    pct = BENCH.added(bm, lm)
    if bm is not None and lm is not None:
        why.need(BENCH.holds(bm, lm), "added>5%")
    else:
        why.add("no-numbers")
    if "x" in runs["base"] + runs["lim"]:
        why.add("some-runs-failed")
    row.done(f"{q(bm)} ns", f"{q(lm)} ns ({'?' if pct is None else f'{pct:.2f}'}%)", why)


SPAWN = AddedBelow(1000)


@pytest.mark.check("10")
def test_spawn_cost(check):
    """10: start-up cost of a non-CUDA program under the preload."""
    labels = {"preload": "LD_PRELOAD only", "limit": "LD_PRELOAD + CUDA_DEVICE_MEMORY_LIMIT=4g"}
    rows = {k: check.row(f"10. spawn /bin/true x1000 ({v})", "added < 1000 us") for k, v in labels.items()}
    if not check.s.built("spawn_bench"):
        for r in rows.values():
            r.done(*NOT_BUILT, "build failed")
        return
    extra = {"base": [], "preload": [f"LD_PRELOAD={check.s.lib}", "CUDA_LIMITER_LOG=warn"],
             "limit": [f"LD_PRELOAD={check.s.lib}", "CUDA_DEVICE_MEMORY_LIMIT=4g", "CUDA_LIMITER_POD=e2e-spawn",
                       "CUDA_LIMITER_LOG=warn"]}
    res = {k: [] for k in extra}
    for i in range(1, 4):
        for k, e in extra.items():
            p = run(check.s, "base", "-", check.log / f"10-spawn-{k}-{i}.log", 120,
                    [check.s.bin("spawn_bench"), "1000", "/bin/true"] + e)
            res[k].append(p.kv("mean_us") or "x")
    check.say(f"   spawn mean us: none={' '.join(res['base'])} preload={' '.join(res['preload'])} "
              f"preload+limit={' '.join(res['limit'])}")
    m0 = median(res["base"])
    for k, row in rows.items():
        m = median(res[k])
        why = Why()
        if m0 is not None and m is not None:
            d = f"{m - m0:+.1f}"
            why.need(SPAWN.holds(m0, m), "added>=1000us")
        else:
            d = "?"
            why.add("no-numbers")
        if "x" in res["base"] + res[k]:
            why.add("some-runs-failed")
        row.done(f"{q(m0)} us", f"{q(m)} us ({d} us)", why)


@pytest.mark.check("10")
def test_no_libcuda_in_plain_programs(check):
    """10: a program that is not a CUDA one (cat) under the preload maps no libcuda.so."""
    row = check.row("10. cat /proc/self/maps under preload: libcuda.so mappings", "libcuda.so=0, limiter>=1")
    maps = {}
    for k, mode in (("base", "base"), ("lim", "lim")):
        env = {x: v for x, v in os.environ.items() if x != "LD_PRELOAD"}
        if mode == "lim":
            env.update(LD_PRELOAD=check.s.lib, CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_LIMITER_POD="e2e-spawn",
                       CUDA_LIMITER_LOG="warn")
        # stderr apart: ld.so's "cannot be preloaded" message names the library too
        r = subprocess.run(["cat", "/proc/self/maps"], env=env, capture_output=True, text=True, timeout=30)
        (check.log / f"10-maps-{k}.log").write_text(r.stdout)
        (check.log / f"10-maps-{k}-stderr.log").write_text(r.stderr)
        maps[k] = r.stdout
    bc = sum(1 for ln in maps["base"].splitlines() if "libcuda.so" in ln)
    lc = sum(1 for ln in maps["lim"].splitlines() if "libcuda.so" in ln)
    lcl = sum(1 for ln in maps["lim"].splitlines() if "libcuda_limiter" in ln)
    why = Why()
    why.need(lc == 0, "libcuda-mapped")
    why.need(lcl >= 1, "limiter-not-mapped")
    row.done(f"libcuda.so={bc}", f"libcuda.so={lc} limiter={lcl}", why)


#: Check 27: processes of one pod started at once, what each allocates, and
#: how far past the quota their footprint read from outside may be (MiB).
RACERS, RACER_BYTES, FOOTPRINT_SLACK_MIB = 8, 256 * MiB, 64


def context_race(check, mode: str, tag: str):
    """Starts RACERS mem_hold processes of pod e2e-ctxrace at once; while the
    survivors hold, reads their footprints. Returns (held, MiB held in all,
    the alloc_rc of those that did not hold, the runs)."""
    s = check.s
    flag = s.work / f"release-27-{tag}"
    flag.unlink(missing_ok=True)
    clean_shm()
    procs = [Proc(s, mode, "e2e-ctxrace", check.log / f"27-{tag}-{i}.log", 150,
                  [s.bin("mem_hold"), str(RACER_BYTES), str(flag), "120"]).start() for i in range(RACERS)]
    for p in procs:
        wait_holding(p)
    time.sleep(1)
    seen = footprints(s)
    holding = [p for p in procs if re.search(r"^holding=1", p.text(), re.MULTILINE)]
    total = sum(seen.get(p.pid, 0) for p in holding)
    flag.touch()
    for p in procs:
        p.wait()
    refused = [p.kv("alloc_rc") or "none" for p in procs if p not in holding]
    return len(holding), total, refused, procs


@pytest.mark.check("27")
def test_context_race(check):
    """27: eight processes of one pod start at once under the 4 GiB quota and
    each allocates 256 MiB: their contexts are reserved in the quota before
    the driver creates them, so what they hold together, read from outside,
    stays within the quota, and those that do not fit are refused with
    cudaErrorMemoryAllocation (2). Without the limiter all eight hold."""
    row = check.row("27. 8 processes of one pod start at once, 256 MiB each: held, pod footprint (MiB, nvidia-smi)",
                    f"with: footprint<={QUOTA_MIB}+{FOOTPRINT_SLACK_MIB}, the others rc=2; without: 8 hold")
    if not check.s.built("mem_hold"):
        return row.done(*NOT_BUILT, "build failed")
    b_held, b_total, b_refused, b_runs = context_race(check, "base", "base")
    l_held, l_total, l_refused, l_runs = context_race(check, "lim", "lim")
    why = Why()
    for tag, runs in (("base", b_runs), ("lim", l_runs)):
        for i, p in enumerate(runs):
            why.add(p.exit_why(f"{tag}-{i}"))
    why.need(b_held == RACERS, "baseline-not-all-held")
    why.need(l_held >= 1, "none-held")
    why.need(AtMost(QUOTA_MIB + FOOTPRINT_SLACK_MIB).holds(l_total), "footprint-over-quota")
    why.need(all(rc == "2" for rc in l_refused), "refused-not-oom")
    row.done(f"held={b_held} footprint={b_total}",
             f"held={l_held} footprint={l_total} refused={','.join(l_refused) or '-'}", why)
