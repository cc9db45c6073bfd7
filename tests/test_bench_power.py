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


def test_run_windows_each_column_alone_on_fakes(monkeypatch, tmp_path):
    """run() on the CPU with the GPU parts faked: every checked column gets one window a
    round, in reversed order every other round; a column that fails its check gets a row
    saying so and no window; each window's figures come from the log entries inside it."""
    import datetime as dt
    import time

    from wsattn.bench import env, runners, suite, timing

    class FakeLogger:  # writes a 5 ms clock log over its lifetime when stopped
        def __init__(self, out):
            self.path, self.t0 = out.name, time.time()

        def terminate(self):
            lines = ["timestamp, index, ..."]
            t = self.t0
            while t < time.time():
                stamp = dt.datetime.fromtimestamp(t, dt.timezone.utc)
                lines.append(f"{stamp:%Y/%m/%d %H:%M:%S.%f}"[:-3] +
                             ", 0, 1700 MHz, 3201 MHz, 690.00 W, 700.00 W, 50, 0x0000000000000004")
                t += 0.005
            with open(self.path, "w") as fh:
                fh.write("\n".join(lines) + "\n")

        def wait(self):
            return 0

    class Fake(runners.Runner):
        ops = ("prefill",)

        def __init__(self, name):
            self.name = name

    def check_one(case, runner, inputs, stamp, device):
        if runner.name == "fa4":
            return {"status": "failed", "reason": "relative error 1e0"}
        return suite.Pending(runner.name, lambda *a: None, lambda *a: None)

    class Timer:
        def prepare(self, name):
            def sample():
                time.sleep(0.002)
                return {"wsattn": 1.0, "triton": 2.0}[name]
            return sample

    monkeypatch.setattr(power, "_start_log", lambda out, ms: FakeLogger(out))
    monkeypatch.setattr(runners, "all_runners", lambda: [Fake("wsattn"), Fake("triton"), Fake("fa4")])
    monkeypatch.setattr(runners, "make_inputs", lambda case, device: None)
    monkeypatch.setattr(suite, "check_one", check_one)
    monkeypatch.setattr(timing, "cuda_timer", lambda **kw: Timer())
    monkeypatch.setattr(timing, "release", lambda device: None)
    monkeypatch.setattr(env, "stamp", lambda device=None: {"commit": "test"})
    args = power.parse_args(["--impl", "wsattn", "triton", "fa4", "--prefill-seqlens", "1024",
                             "--causal", "no", "--seconds", "0.06", "--settle", "0.02",
                             "--idle", "0", "--rounds", "2", "--log", str(tmp_path / "l.csv")])
    rows = power.run(args)
    failed = [r for r in rows if r["status"] != "ok"]
    assert [(r["impl"], r["status"]) for r in failed] == [("fa4", "failed")]
    ok = [r for r in rows if r["status"] == "ok"]
    assert [(r["impl"], r["round"]) for r in ok] == [("wsattn", 0), ("triton", 0), ("triton", 1), ("wsattn", 1)]
    for r in ok:
        assert r["ms"] == {"wsattn": 1.0, "triton": 2.0}[r["impl"]] and r["commit"] == "test"
        assert r["sm_mhz"] == 1700.0 and r["power_cap_share"] == 1.0 and r["log_entries"] > 0
    summary = {s["impl"]: s for s in power.summarize(rows)}
    assert summary["triton"]["rounds"] == 2 and summary["triton"]["energy_mj"] == 690.0 * 2.0
