"""The packing bench's kernel spans without a GPU: kernel_time.c's spans,
built with gcc against a stand-in for CUPTI's header that hands it
records, and how the bench lays the pods' spans over each other."""

import ctypes
import shutil
import struct
import subprocess
from types import SimpleNamespace

import pytest

from scripts.bench import packing, packing_plan, packing_report, packing_spans

# Just what kernel_time.c uses of CUPTI, and a buffer of records that the
# test fills and then hands over as CUPTI would: the completed buffer.
FAKE_CUPTI = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUptiResult;
typedef void *CUcontext;
#define CUPTI_SUCCESS 0
#define CUPTIAPI
#define ACTIVITY_RECORD_ALIGNMENT 8
typedef enum { CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL = 10 } CUpti_ActivityKind;
typedef enum { CUPTI_ACTIVITY_FLAG_FLUSH_FORCED = 1 } CUpti_ActivityFlag;
typedef struct { CUpti_ActivityKind kind; } CUpti_Activity;
typedef struct { CUpti_ActivityKind kind; uint64_t start, end; } CUpti_ActivityKernel10;
static void (*fake_requested)(uint8_t **, size_t *, size_t *);
static void (*fake_completed)(CUcontext, uint32_t, uint8_t *, size_t, size_t);
static CUpti_ActivityKernel10 fake_records[64];
static size_t fake_count, fake_next;
static CUptiResult cuptiActivityRegisterCallbacks(void (*r)(uint8_t **, size_t *, size_t *),
                                                  void (*c)(CUcontext, uint32_t, uint8_t *, size_t, size_t)) {
    fake_requested = r;
    fake_completed = c;
    return 0;
}
static CUptiResult cuptiActivityEnable(CUpti_ActivityKind k) { (void)k; return 0; }
static CUptiResult cuptiActivityDisable(CUpti_ActivityKind k) { (void)k; return 0; }
static CUptiResult cuptiGetTimestamp(uint64_t *t) { *t = 0; return 0; }
static CUptiResult cuptiActivityFlushAll(uint32_t f) { (void)f; return 0; }
static CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext c, uint32_t s, size_t *n) {
    (void)c; (void)s; *n = 0; return 0;
}
static CUptiResult cuptiActivityGetNextRecord(uint8_t *b, size_t v, CUpti_Activity **r) {
    (void)b; (void)v;
    if (fake_next >= fake_count)
        return 1;
    *r = (CUpti_Activity *)&fake_records[fake_next++];
    return 0;
}
"""

# The library's own file, with the records handed over by one call.
HARNESS = r"""
#include "kernel_time.c"
void fake_hand_over(const uint64_t *pairs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        fake_records[i].kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        fake_records[i].start = pairs[2 * i];
        fake_records[i].end = pairs[2 * i + 1];
    }
    fake_count = n;
    fake_next = 0;
    uint8_t *buffer;
    size_t size, most;
    fake_requested(&buffer, &size, &most);
    fake_completed(0, 0, buffer, size, 0);
}
"""


@pytest.fixture
def kernel_time(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "cupti.h").write_text(FAKE_CUPTI)
    (tmp_path / "harness.c").write_text(HARNESS)
    lib = tmp_path / "kernel_time.so"
    subprocess.run([cc, "-shared", "-fPIC", "-Wall", "-Werror", "-I", str(tmp_path), "-I",
                    str(packing.KERNEL_TIME_C.parent), "-o", str(lib), str(tmp_path / "harness.c"), "-lpthread"],
                   check=True)
    kt = ctypes.CDLL(str(lib))
    kt.kt_kernel_ns.restype = ctypes.c_uint64
    kt.kt_window.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    kt.kt_write_spans.argtypes = [ctypes.c_char_p]
    assert kt.kt_start() == 0
    return kt


def hand_over(kt, kernels):
    flat = [t for k in kernels for t in k]
    kt.fake_hand_over((ctypes.c_uint64 * len(flat))(*flat), ctypes.c_size_t(len(kernels)))


def test_kernel_time_writes_its_windows_spans_joined_across_the_moves(kernel_time, tmp_path):
    kernel_time.kt_window(80, 25_000)
    # Before the window (cut at its start), back to back (gaps of 1 and 3
    # ns), a gap of 3.7 us, one of 3.001 us, one of 0.5 us, and one past
    # the window's end (cut there).
    hand_over(kernel_time, [(50, 100), (101, 200), (203, 300), (4_000, 5_000), (8_001, 9_000),
                            (9_500, 12_000), (20_000, 30_000)])
    assert kernel_time.kt_kernel_ns() == 20 + 99 + 97 + 1_000 + 999 + 2_500 + 5_000
    path = tmp_path / "pod.spans"
    assert kernel_time.kt_write_spans(str(path).encode()) == 0
    spans = packing_spans.read(path)
    assert spans == [(80, 300), (4_000, 5_000), (8_001, 12_000), (20_000, 25_000)]
    # The spans' time: the kernels' and the gaps of up to 3 us between them.
    assert sum(b - a for a, b in spans) == kernel_time.kt_kernel_ns() + 1 + 3 + 500
    # A new window starts with none; a kernel wholly outside it adds none.
    kernel_time.kt_window(100_000, 200_000)
    hand_over(kernel_time, [(300_000, 301_000)])
    assert kernel_time.kt_write_spans(str(path).encode()) == 0 and packing_spans.read(path) == []
    assert kernel_time.kt_write_spans(str(tmp_path / "no" / "such").encode()) == -1


def test_spans_read_refuses_a_torn_file(tmp_path):
    (tmp_path / "torn").write_bytes(struct.pack("<QQ", 1, 2) + b"\0" * 8)
    with pytest.raises(ValueError, match="not whole"):
        packing_spans.read(tmp_path / "torn")


def test_spans_laid_over_each_other_split_what_they_share():
    # Pod 0 holds 0-100 and 300-400; pod 1 starts at 80 (pod 0's last 20
    # still run) and holds to 200; pod 2 overlaps both at 90-110 and runs
    # 300-310 beside pod 0.
    laid = packing_spans.split([[(0, 100), (300, 400)], [(80, 200)], [(90, 110), (300, 310)]], 1_000)
    assert laid["own"] == pytest.approx([0.2, 0.12, 0.03])
    assert laid["union"] == pytest.approx(0.3) and laid["overlap"] == pytest.approx(0.05)
    # Alone: pod 0 0-80 and 310-400; pod 1 110-200; pod 2 never.
    assert laid["alone"] == pytest.approx([0.17, 0.09, 0.0])
    # Split: 80-90 by two, 90-100 by three, 100-110 by two, 300-310 by two.
    assert laid["split"] == pytest.approx([(80 + 5 + 10 / 3 + 5 + 90) / 1_000, (5 + 10 / 3 + 5 + 90) / 1_000,
                                           (10 / 3 + 5 + 5) / 1_000])
    assert sum(laid["split"]) == pytest.approx(laid["union"])
    # Spans that only touch share nothing; an empty pod gets nothing.
    laid = packing_spans.split([[(0, 50)], [(50, 100)], []], 100)
    assert laid["split"] == laid["alone"] == laid["own"] == [0.5, 0.5, 0.0] and laid["overlap"] == 0


def test_a_pods_share_is_its_split_gpu_time_where_the_spans_were_laid():
    spec = packing_plan.Spec("infer", packing_plan.MODES["turns"], 2, "turns N=2")
    pods = [{"per_s": 1900.0, "kernel_busy": 0.46, "gaps_3us": 0.01, "gpu_split": 0.45, "gpu_alone": 0.44},
            {"per_s": 1800.0, "kernel_busy": 0.45, "gaps_3us": 0.01, "gpu_split": 0.44, "gpu_alone": 0.43}]
    assert packing_report.gpu_time(pods[0]) == 0.45 and packing_report.own_gpu_time(pods[0]) == pytest.approx(0.47)
    lone = {"spec": packing_plan.Spec("infer", packing_plan.SOLO, 1, "solo"),
            "result": {"tag": "s", "pods": [{"per_s": 4000.0, "kernel_busy": 0.9, "gaps_3us": 0.05, "gaps_3us_n": 9,
                                             "gaps_10us": 0.0, "gaps_longer": 0.0}]}}
    run = {"spec": spec, "result": {"tag": "t", "pods": pods, "spans": {"union": 0.89, "overlap": 0.04}}}
    runs = [lone, run]
    bases = packing_report.evaluate(runs, {})
    assert run["figures"]["shares"] == pytest.approx([45.0, 44.0])
    [line] = [x for x in packing_report.notes(runs, ["infer"], bases) if x.startswith("infer, each pod's GPU time")]
    assert ("turns N=2 46.00–47.00 (sum 93.0; kernels 45.00–46.00), laid over each other: busy 89.00, counted twice"
            " 4.00, alone 43.00–44.00, split 44.00–45.00, by throughput") in line


def test_the_runner_lays_its_pods_spans_where_every_pod_wrote_them(tmp_path):
    runner = SimpleNamespace(work=tmp_path, args=SimpleNamespace(seconds=1e-6))  # a window of 1,000 ns
    runner.spans_path = lambda tag, i: packing.Runner.spans_path(runner, tag, i)
    for i, spans in enumerate([[(0, 600)], [(500, 900)]]):
        runner.spans_path("t", i).write_bytes(b"".join(struct.pack("<QQ", *s) for s in spans))
    pods = [{"spans": 1.0}, {"spans": 1.0}]
    result = {"pods": pods}
    packing.Runner.lay_spans(runner, "t", result)
    assert [p["gpu_split"] for p in pods] == pytest.approx([0.55, 0.35])
    assert [p["gpu_alone"] for p in pods] == pytest.approx([0.5, 0.3])
    assert result["spans"] == pytest.approx({"union": 0.9, "overlap": 0.1})
    # One pod wrote none: the shares stay each pod's own.
    pods = [{"spans": 1.0}, {"spans": 0.0}]
    result = {"pods": pods}
    packing.Runner.lay_spans(runner, "t", result)
    assert "spans" not in result and "gpu_split" not in pods[0]
    # Every pod said it wrote them, one file is torn: each keeps its own.
    runner.spans_path("t", 1).write_bytes(b"\0" * 24)
    pods = [{"spans": 1.0}, {"spans": 1.0}]
    result = {"pods": pods}
    packing.Runner.lay_spans(runner, "t", result)
    assert "not whole" in result["spans_error"] and "gpu_split" not in pods[0] and "spans" not in result
