"""The pure parts of the harness: parsing, statistics, tolerances, the table."""

import json

import pytest

import hv_intervals
import hvctl
from harness.checks import (GiB, AddedAtMost, AddedBelow, Above, AtLeast, AtMost, Below, Between, Equal, Tolerance,
                            Why, fmt, gib, mibs, num, pct_from_ppm)
from harness.parse import api_field, compute_apps, kv, median, series_summary, smi_fields, smi_line, smi_mean
from harness.report import Progress, Recorder


def test_num():
    assert num("42") == 42 and num("-3.5") == -3.5 and num(7) == 7
    for bad in (None, "", "?", "1e3", "12abc", "n/a", True):
        assert num(bad) is None


def test_tolerance_near():
    near = Tolerance(pp=3).around(25)
    assert near.holds("22") and near.holds("28") and near.holds(25.0)
    assert not near.holds("21.99") and not near.holds("28.01") and not near.holds(None) and not near.holds("?")
    assert str(near) == "25+-3"
    assert Tolerance(pp=5).around(47.5).holds("52.5")


def test_bounds():
    assert AtLeast(85).holds("85") and not AtLeast(85).holds("84.99")
    assert AtMost(3).holds("3") and not AtMost(3).holds("3.01")
    assert Above(16 * GiB).holds(str(16 * GiB + 1)) and not Above(16 * GiB).holds(str(16 * GiB))
    assert Below(256).holds(255) and not Below(256).holds(256)
    assert Equal(2).holds("2") and not Equal(2).holds("02x")
    assert Between(0, 1000).holds("1000") and not Between(0, 1000).holds("-1")
    for t in (AtLeast(0), AtMost(0), Equal(0), Between(0, 1)):
        assert not t.holds(None)


def test_added():
    a = AddedAtMost(5)
    assert a.added("100", "105") == pytest.approx(5.0)
    assert a.holds("100", "105") and not a.holds("100", "105.01")
    assert a.holds("1000", "1050.04")  # 5.004% -> "5.00"%, as the bash script rounded
    assert not a.holds(None, "1") and not a.holds("0", "1")
    assert AddedBelow(1000).holds("500", "1499.9") and not AddedBelow(1000).holds("500", "1500")


def test_why_and_formatting():
    w = Why()
    assert not w
    w.need(True, "never")
    w.need(False, "got<2GiB")
    w.add("", "lim-exit=139")
    assert str(w) == "got<2GiB lim-exit=139"
    assert mibs(4 * GiB) == "4096MiB" and mibs(None) == "?"
    assert gib(3 * GiB // 2) == "1.50GiB"
    assert pct_from_ppm("250000") == "25.0" and pct_from_ppm("None") == "?"
    assert fmt(50.0) == "50" and fmt(2.5) == "2.5"


def test_kv():
    text = "# mode=lim\nfree0 = 12\ntotal0=4294967296\ntotal0=1\nok=1\n"
    assert kv(text, "total0") == "4294967296"  # the first one
    assert kv(text, "ok") == "1" and kv(text, "missing") is None and kv(text, "free0 ") == "12"
    assert kv("windows_pm=250, 248\n", "windows_pm") == "250,248"


def test_api_field():
    text = "limited=1\nAPI cuMemAlloc_v2 alloc=0 drop=1073741824 over=2 back=ok free_rc=0\nAPI cuMemCreate alloc=1\n"
    assert api_field(text, "cuMemAlloc_v2", "drop") == "1073741824"
    assert api_field(text, "cuMemAlloc_v2", "back") == "ok"
    assert api_field(text, "cuMemCreate", "over") is None and api_field(text, "cuArrayCreate_v2", "alloc") is None


def test_smi_line():
    text = "# mode=lim\nsome warning\n 4096, 12, 4084\n"
    assert smi_line(text) == "4096,12,4084"
    assert smi_fields(smi_line(text)) == ["4096", "12", "4084"]
    assert smi_line("No devices were found\n") is None and smi_fields(None)[0] == ""


def test_compute_apps():
    text = "1234, 4096\n 77 ,512\nNo running processes found\n88, [N/A]\n"
    assert compute_apps(text) == {1234: 4096, 77: 512}
    assert compute_apps("") == {}


def test_median():
    assert median(["3", "x", "1", "2"]) == 2
    assert median([1, 2, 3, 4]) == 2.5
    assert median(["x", ""]) is None


def test_series_summary():
    assert series_summary("900,250,260,290", 220, 280) == (900, 250, 290, 3, 1)
    assert series_summary("250", 220, 280) == (250, None, None, 0, 0)
    assert series_summary("", 0, 1) == (None, None, None, 0, 0)
    assert series_summary("1,a", 0, 1) == (None, None, None, 0, 0)


def test_smi_mean():
    text = ("timestamp, clocks.sm [MHz], clocks.mem [MHz], power.draw [W], temperature.gpu, utilization.gpu [%]\n"
            "t, 1980 MHz, 2619 MHz, 100 W, 40, 0 %\n"  # idle: skipped
            "t, 1980 MHz, 2619 MHz, 300 W, 40, 100 %\n"  # the first busy one: skipped
            "t, 1700 MHz, 2619 MHz, 300 W, 41, 26 %\n"
            "t, 1800 MHz, 2619 MHz, 300 W, 41, 24 %\n")
    assert smi_mean(text, 6) == 25.0
    assert smi_mean(text, 2) == 1750.0
    assert smi_mean("header\n", 6) is None


def test_recorder_table_and_json():
    rec = Recorder(Progress(echo=None))
    p = rec.plan("1. a | b", "with: x", "t1")
    p.done("w/o", "w", Why())
    rec.plan("2. info", "reported", "t1").done("1/s", "2/s", Why(), info=True)
    w = Why()
    w.add("got<2GiB")
    rec.plan("3. c", "exp", "t2").done("", "w", w)
    crashed = rec.plan("4. d", "exp", "t3")
    rows = rec.close_test("t3", "ZeroDivisionError: division by zero at test_x.py:3")
    assert crashed.row is rows[0] and rows[0].result == "FAIL"
    assert rows[0].reasons == ["crashed: ZeroDivisionError: division by zero at test_x.py:3"]
    rec.close_test("t4", "KeyError: 'x'")  # crashed before planning a row
    table = rec.table()
    lines = table.splitlines()
    assert lines[0] == "| check | without limiter | with limiter | expected | result |"
    assert lines[2] == "| 1. a / b | w/o | w | with: x | PASS |"
    assert lines[3] == "| 2. info | 1/s | 2/s | reported | INFO |"
    assert lines[4] == "| 3. c | (none) | w | exp | FAIL:got<2GiB |"
    assert lines[6].startswith("| t4 | - | - | - | FAIL:crashed: KeyError")
    assert lines[-1] == "1 passed, 3 failed"
    data = json.loads(rec.json({"limiter": "x"}))
    assert data["passed"] == 1 and data["failed"] == 3 and data["rows"][2]["with"] == "w"
    assert data["rows"][2]["reasons"] == ["got<2GiB"]


def write(tmp_path, name, intervals):
    p = tmp_path / name
    p.write_text("".join(f"{s} {e}\n" for s, e in intervals))
    return str(p)


MS = 1_000_000


def test_intervals_windows_and_series(tmp_path):
    # A: busy 25% (2.5 ms of every 10 ms) for 3 s; B: 75%, starting 1 s later
    a = write(tmp_path, "a", [(i * 10 * MS, i * 10 * MS + 25 * MS // 10) for i in range(300)])
    b = write(tmp_path, "b", [(1000 * MS + i * 10 * MS, 1000 * MS + i * 10 * MS + 75 * MS // 10) for i in range(200)])
    r = hv_intervals.analyse([a, b], origin="common", wins=["w:0:1.9", "empty:end:start"], series=["s:start:end"])
    assert r["start_s"] == "0.000" and r["f0_first_s"] == "-1.000"
    assert r["win_w_f0_pct"] == "25.00" and r["win_w_f1_pct"] == "75.00"
    assert r["win_w_union_pct"] == "75.00" and r["win_w_overlap_pct"] == "25.00"
    assert r["win_empty_f0_pct"] == "-1"
    assert r["series_s_f0_pm"].split(",")[0] == "250" and len(r["series_s_f1_pm"].split(",")) == 19
    assert r["ok"] == "1"


def test_intervals_settle_and_gap(tmp_path):
    # 100% for 1 s, idle 0.5 s, then 50%
    iv = [(0, 1000 * MS)] + [(1500 * MS + i * 4 * MS, 1500 * MS + i * 4 * MS + 2 * MS) for i in range(500)]
    f = write(tmp_path, "f", iv)
    r = hv_intervals.analyse([f], origin="f0", settles=["x:0:0:end:50:3"], gaps=["g:0:0:e0"], ref_epoch=0.0)
    assert r["gap_g_start_s"] == "1.000" and r["gap_g_end_s"] == "1.500" and r["gap_g_ms"] == "500.0"
    assert r["settle_x_ms"] == "1500"
    assert r["origin_minus_ref_ms"] == "0.0"


def test_intervals_errors(tmp_path):
    with pytest.raises(hv_intervals.AnalysisError):
        hv_intervals.analyse([str(tmp_path / "missing")])
    f = write(tmp_path, "f", [(0, 10)])
    for bad in ({"origin": "f7"}, {"wins": ["w:0"]}, {"wins": ["w:zz:1"]}, {"settles": ["s:9:0:1:5:3"]}):
        with pytest.raises(hv_intervals.AnalysisError):
            hv_intervals.analyse([f], **bad)
    assert hv_intervals.main([f, "--win", "bad"]) == 1


def test_latency_parse(tmp_path):
    log = tmp_path / "lat.log"
    log.write_text("running 1 test\n"
                   "admission latency (100 workers): p50 85.3µs, p99 1.2ms, max 3ms (optimized build)\n"
                   "GET /healthz p50 40µs, p99 90µs\n"
                   "4 concurrent clients: p50 100µs, p99 900µs\n"
                   "server side p50 ≤ 50 µs, p99 ≤ 100 µs\n"
                   "test result: ok. 1 passed; 0 failed\n")
    r = hvctl.cmd_latency(str(log))
    assert r["p50_us"] == "85.3" and r["p99_us"] == "1200.0" and r["max_us"] == "3000.0"
    assert r["build"] == "optimized" and r["concurrent_p99_us"] == "900.0"
    assert r["server_p50_us"] == "50" and r["tests_failed"] == "0" and r["ok"] == "1"
    assert hvctl.cmd_latency(str(tmp_path / "none"))["ok"] == "0"
