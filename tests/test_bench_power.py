"""The solo-window power tool (wsattn.bench.power): its window arithmetic on a made-up
clock log, on the CPU; the GPU run is a device tool (scripts/device.sh power)."""

import pytest

from wsattn.bench import power


def _log(t0, n, step, mhz, watts, reasons):
    return [{"t": t0 + i * step, "sm_mhz": mhz(i), "mem_mhz": 3201.0, "power_w": watts(i),
             "power_limit_w": 700.0, "temp_c": 50.0, "reasons": reasons(i)} for i in range(n)]


def test_window_drops_the_settling_and_reads_the_rest():
    # 3 s window at 20 ms: the first second idles at 1980 MHz and 100 W, the rest runs
    # capped at 1700 MHz and 690 W
    log = _log(100.0, 150, 0.02, lambda i: 1980.0 if i < 50 else 1700.0,
               lambda i: 100.0 if i < 50 else 690.0, lambda i: 0 if i < 50 else 0x4)
    samples = [(2.0 if t < 101.0 else 1.5, t) for t in (100.5, 100.9, 101.2, 101.8, 102.5)]
    s = power.window_stats(log, 100.0, 103.0, 1.0, samples)
    assert s["ms"] == 1.5 and s["samples"] == 3
    assert s["sm_mhz"] == 1700.0 and s["power_w"] == 690.0
    assert s["power_cap_share"] == 1.0
    assert s["energy_mj"] == pytest.approx(690.0 * 1.5)
    assert s["log_entries"] == 100


def test_power_cap_share_counts_only_the_cap_bit():
    log = _log(0.0, 11, 0.1, lambda i: 1800.0, lambda i: 500.0,
               lambda i: 0x4 if i % 2 else 0x1)  # 0x1: GPU idle, not the cap
    s = power.window_stats(log, 0.0, 1.05, 0.05, [(1.0, 0.5)])  # entries 1-10
    assert s["log_entries"] == 10
    assert s["power_cap_share"] == pytest.approx(0.5)


@pytest.mark.parametrize("start,end,settle,samples,match", [
    (0.0, 1.0, 1.0, [(1.0, 0.9)], "not longer than settle"),
    (0.0, 3.0, 1.0, [(1.0, 0.5)], "no sample"),
    (10.0, 13.0, 1.0, [(1.0, 12.0)], "no clock-log entry"),
])
def test_window_from_nothing_is_refused(start, end, settle, samples, match):
    log = _log(0.0, 100, 0.02, lambda i: 1800.0, lambda i: 600.0, lambda i: 0x4)
    with pytest.raises(ValueError, match=match):
        power.window_stats(log, start, end, settle, samples)


def test_summary_takes_medians_over_rounds_and_skips_failed_rows():
    rows = [{"case": "c", "impl": "a", "status": "ok", "ms": ms, "tflops": 600.0 / ms,
             "sm_mhz": mhz, "power_w": 650.0, "power_cap_share": 1.0, "energy_mj": 650.0 * ms}
            for ms, mhz in ((1.0, 1700.0), (1.2, 1690.0), (1.1, 1710.0))]
    rows.append({"case": "c", "impl": "b", "status": "failed", "reason": "relative error"})
    (s,) = power.summarize(rows)
    assert (s["impl"], s["rounds"], s["ms"], s["sm_mhz"]) == ("a", 3, 1.1, 1700.0)
    assert s["energy_mj"] == pytest.approx(715.0)
    assert "a" in power.format_summary([s])


@pytest.mark.parametrize("argv,match", [
    (["--impl", "nope"], "not a bench column"),
    (["--seconds", "1", "--settle", "1"], "must exceed --settle"),
    (["--rounds", "0"], "at least 1"),
])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        power.parse_args(argv)
    assert match in capsys.readouterr().err
