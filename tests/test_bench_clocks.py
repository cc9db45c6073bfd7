"""wsattn.bench.clocks: an nvidia-smi clock log lined up with a bench run's samples."""

from __future__ import annotations

import json

import pytest

from wsattn.bench import clocks

HEADER = ("timestamp, index, clocks.current.sm [MHz], clocks.current.memory [MHz], "
          "power.draw [W], power.limit [W], temperature.gpu, clocks_event_reasons.active")


def _line(t_s, mhz, watts, reasons="0x0000000000000000"):
    """A log line at t_s seconds after 2026/12/04 21:00:00 UTC."""
    whole = int(t_s)
    ms = round((t_s - whole) * 1000)
    return (f"2026/12/04 21:{whole // 60:02d}:{whole % 60:02d}.{ms:03d}, 0, {mhz} MHz, 3201 MHz, "
            f"{watts} W, 700.00 W, 51, {reasons}")


T0 = 1796418000.0  # 2026-12-04 21:00:00 UTC


def test_parse_skips_the_header_and_bad_lines_and_reads_utc():
    log = clocks.parse_clock_log([HEADER, _line(1.0, 1980, 512.5), "garbage",
                                  _line(0.5, 1755, 699.9, "0x0000000000000004"),
                                  "2026/12/04 21:00:02.000, 0, [N/A], [N/A], [N/A], [N/A], 50, "
                                  "[N/A]"])
    assert [e["t"] - T0 for e in log] == pytest.approx([0.5, 1.0, 2.0])
    assert log[0]["sm_mhz"] == 1755 and log[0]["power_w"] == 699.9 and log[0]["reasons"] == 4
    assert log[1]["reasons"] == 0 and log[1]["mem_mhz"] == 3201 and log[1]["temp_c"] == 51
    assert log[2]["sm_mhz"] is None and log[2]["reasons"] is None
    shifted = clocks.parse_clock_log([_line(1.0, 1980, 500)], utc_offset_h=1.0)
    assert shifted[0]["t"] == pytest.approx(T0 + 1.0 - 3600)


def test_slow_samples_line_up_with_the_low_clock():
    """Samples taken while the log shows 1755 MHz are the slow ones: negative correlation,
    the medians at the top clock and below it, the reasons counted; a row without
    samples_t is left out."""
    lines = [HEADER]
    for i in range(40):  # every 50 ms for 2 s; 1755 MHz with the power cap in [0.5, 1.0)
        t = i * 0.05
        low = 0.5 <= t < 1.0
        lines.append(_line(t, 1755 if low else 1980, 700.0 if low else 560.0,
                           "0x0000000000000004" if low else "0x0000000000000000"))
    log = clocks.parse_clock_log(lines)
    ends = [T0 + 0.1 * (k + 1) for k in range(19)]  # samples of 5 ms x 20 calls = 100 ms
    ms = [5.5 if 0.5 < e - T0 <= 1.0 else 5.0 for e in ends]
    row = {"status": "ok", "case": "c", "impl": "gluon", "median_ms": 5.0, "calls": 20,
           "samples_ms": ms, "samples_t": ends}
    bare = {"status": "ok", "case": "c", "impl": "fa4", "median_ms": 5.0, "calls": 20,
            "samples_ms": ms, "samples_t": None}
    failed = {"status": "failed", "samples_ms": None}
    (res,) = clocks.summarize_run([row, bare, failed], log)
    assert res["corr_ms_vs_sm_mhz"] < -0.9
    assert (res["sm_mhz_min"], res["sm_mhz_max"]) == (1755, 1980)
    assert res["median_ms_at_top_clock"] == 5.0 and res["median_ms_below_top_clock"] == 5.5
    assert res["samples_with_reasons"] >= 5
    assert res["samples_power_capped"] == res["samples_with_reasons"]  # 0x4 is the cap
    assert all(s["log_entries"] >= 1 for s in res["samples"])
    text = clocks.format_summary([res])
    assert "gluon" in text and "1755-1980" in text


def test_cli_prints_and_writes(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    log = tmp_path / "clocks.csv"
    bench.write_text(json.dumps([{"status": "ok", "case": "c", "impl": "i", "median_ms": 1.0,
                                  "calls": 1, "samples_ms": [1.0, 1.0, 1.0],
                                  "samples_t": [T0 + 0.1, T0 + 0.2, T0 + 0.3]}]))
    log.write_text("\n".join([HEADER, _line(0.1, 1980, 500), _line(0.2, 1980, 500)]) + "\n")
    out = tmp_path / "out.json"
    assert clocks.main([str(bench), str(log), "--json", str(out)]) == 0
    assert "1980-1980" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["impl"] == "i"
    log.write_text(HEADER + "\n")
    assert clocks.main([str(bench), str(log)]) == 1
    assert "no clock entries" in capsys.readouterr().err


def test_cli_reads_a_gzipped_log(tmp_path, capsys):
    """The committed clock logs are gzipped; the tool reads them as they are."""
    import gzip
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"status": "ok", "case": "c", "impl": "i", "median_ms": 1.0,
                                  "calls": 1, "samples_ms": [1.0, 1.0, 1.0],
                                  "samples_t": [T0 + 0.1, T0 + 0.2, T0 + 0.3]}]))
    log = tmp_path / "clocks.csv.gz"
    with gzip.open(log, "wt") as fh:
        fh.write("\n".join([HEADER, _line(0.1, 1755, 690, "0x0000000000000004"),
                            _line(0.2, 1755, 690, "0x0000000000000004")]) + "\n")
    assert clocks.main([str(bench), str(log)]) == 0
    assert "1755-1755" in capsys.readouterr().out


def test_power_cap_counted_apart_from_other_reasons():
    """A sample under the idle reason (0x1) counts as one with a reason, not as capped."""
    log = clocks.parse_clock_log([_line(0.05, 1980, 90, "0x0000000000000001"),
                                  _line(0.15, 1700, 690, "0x0000000000000004")])
    row = {"status": "ok", "case": "c", "impl": "i", "median_ms": 1.0, "calls": 100,
           "samples_ms": [1.0, 1.0], "samples_t": [T0 + 0.1, T0 + 0.2]}
    (res,) = clocks.summarize_run([row], log)
    assert res["samples_with_reasons"] == 2 and res["samples_power_capped"] == 1
    assert "capped" in clocks.format_summary([res])


def test_a_sample_the_log_does_not_cover_gets_no_clock():
    """A sample between two entries takes the nearer (a sample shorter than the logging
    interval); one hours past the log's end gets none, not the last reading."""
    log = [{"t": float(t), "sm_mhz": 1980} for t in range(0, 10)]
    assert clocks._window(log, 4.4, 4.45) == [log[4]]
    assert clocks._window(log, 7200.0, 7200.5) == []
    assert len(clocks._window(log, 2.0, 5.0)) == 4
