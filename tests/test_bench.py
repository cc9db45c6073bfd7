"""wsattn bench on CPU: the stamp, the rows and their arithmetic, the plot, check-before-time
with fake runners, the missing-GPU exit, the SP hook and the interpreter smoke run."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import socket
import subprocess
import sys
import types

import pytest

import wsattn
import torch

import wsattn.cli
from wsattn import reference
from wsattn.bench import cli as bench_cli
from wsattn.bench import env, plot, report, suite
from wsattn.bench.cases import DecodeCase, PrefillCase, decode_cases, prefill_cases, tbps, tflops
from wsattn.bench.ceilings import Ceiling
from wsattn.bench.runners import (BUILD_RUNNERS, DEFAULT_RUNNERS, GluonBuildRunner,
                                  NotAvailable, Prepared, Runner, SdpaRunner, WsattnRunner,
                                  check_output, make_inputs, multi_consumer_build,
                                  one_consumer_build)
from wsattn.bench.timing import Timing, summarize

from conftest import CountingTimer as _CountingTimer

TIMING = Timing(median_ms=2.0, q20_ms=1.9, q80_ms=2.2, reps=50)
SMALL = [
    pytest.param(PrefillCase(2, 33, 4, 2, 64, True, "fp32"), id="prefill-B2-S33-H4-HKV2-D64-causal"),
    pytest.param(PrefillCase(1, 300, 2, 2, 64, False, "fp16"), id="prefill-B1-S300-H2-D64-full"),
    pytest.param(DecodeCase(2, 100, 8, 1, 64, None, "fp32"), id="decode-B2-L100-H8-HKV1-D64-contiguous"),
    pytest.param(DecodeCase(3, 77, 8, 2, 64, 16, "fp16"), id="decode-B3-L77-H8-HKV2-D64-page16"),
]


def _stamp():
    return {"gpu": "none", "commit": "abc", "date": "2026-11-29T14:00:00Z", "torch": "x", "triton": "y"}


# --------------------------------------------------------------------------- stamp

def test_stamp_on_cpu_says_none_for_gpu_fields(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = env.stamp()
    for field in ("gpu", "cc", "num_sms", "driver", "cudnn"):
        assert s[field] == env.NONE, field
    import triton
    assert s["torch"] == torch.__version__ and s["triton"] == triton.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["date"])
    assert s["commit"]
    host = socket.gethostname()
    assert len(host) < 4 or host not in json.dumps(s), "the stamp must not carry the host name"


def test_commit_override_and_json_name(monkeypatch):
    monkeypatch.setenv("WSATTN_COMMIT", "deadbeef")
    assert env.git_commit() == "deadbeef"
    s = {"gpu": "NVIDIA H200", "date": "2026-11-29T14:05:09Z", "commit": "deadbeef-dirty"}
    assert env.json_name(s) == "bench_nvidia-h200_20261129T1405_deadbeef-dirty.json"


# --------------------------------------------------------------------------- arithmetic

def test_prefill_flops_halved_when_causal():
    full = PrefillCase(4, 4096, 16, 16, 128, False)
    assert full.flops() == 4 * 4 * 16 * 4096 * 4096 * 128
    assert PrefillCase(4, 4096, 16, 16, 128, True).flops() == full.flops() / 2
    # FACTS.md: cuDNN reaches about 610 TFLOP/s at this shape, i.e. 0.9 ms
    assert tflops(full.flops(), 0.9) == pytest.approx(610.8, abs=0.1)


def test_decode_bytes_count_kv_once_plus_q_and_out():
    case = DecodeCase(64, 8192, 32, 8, 128, None)
    kv = 2 * 64 * 8192 * 8 * 128 * 2
    assert case.bytes_moved() == kv + 2 * 64 * 32 * 128 * 2
    assert DecodeCase(64, 8192, 32, 8, 128, 16).bytes_moved() == case.bytes_moved()
    # FACTS.md: cuDNN at this shape, 496 us for 4.33 TB/s
    assert tbps(case.bytes_moved(), 0.496) == pytest.approx(4.33, abs=0.01)


def test_shapes_follow_facts():
    """16k tokens per batch and hidden 2048 for prefill; Hq32/Hkv8/D128 decode."""
    pre = prefill_cases()
    assert len(pre) == 16 and all(c.B * c.N == 16384 and c.H * c.D == 2048 for c in pre)
    assert {(c.D, c.N, c.causal) for c in pre} == {
        (d, n, cz) for d in (128, 64) for n in (1024, 4096, 8192, 16384) for cz in (False, True)}
    dec = decode_cases()
    assert {(c.B, c.L) for c in dec} == {(64, 8192), (8, 65536), (1, 131072)}
    assert {c.page_size for c in dec} == {None, 16, 64}
    assert all((c.HQ, c.HKV, c.D) == (32, 8, 128) for c in dec)
    assert set(prefill_cases(quick=True)) < set(pre) and set(decode_cases(quick=True)) < set(dec)


def test_prefill_lengths_and_dims_replace_the_defaults():
    """--prefill-seqlens / --prefill-dims pick the prefill shapes (still 16k tokens and
    hidden 2048 a batch); a length or head dim that does not divide them is named."""
    cases = prefill_cases(lengths=[2048], head_dims=[64])
    assert {(c.B, c.N, c.H, c.D, c.causal) for c in cases} == {
        (8, 2048, 32, 64, False), (8, 2048, 32, 64, True)}
    assert prefill_cases(lengths=[1024, 2048]) == [
        c for c in prefill_cases(lengths=[1024, 2048], head_dims=[128, 64])]
    with pytest.raises(ValueError, match=r"--prefill-seqlens: \[3000\] do not divide"):
        prefill_cases(lengths=[3000])
    with pytest.raises(ValueError, match=r"--prefill-dims: \[96\] do not divide"):
        prefill_cases(head_dims=[96])


@pytest.mark.parametrize("argv, words", [
    (["prefill", "--prefill-seqlens", "3000"], "--prefill-seqlens: [3000] do not divide"),
    (["prefill", "--prefill-dims", "96"], "--prefill-dims: [96] do not divide"),
    (["decode", "--prefill-seqlens", "2048"], "apply to `wsattn bench prefill` (or all)"),
    (["varlen", "--gluon-settings", "CONSUMERS=2"], "--gluon-settings applies to `wsattn "
                                                    "bench prefill`"),
], ids=["length", "dim", "not-prefill", "gluon-settings-not-prefill"])
def test_prefill_flag_misuse_exits_2_before_anything_runs(argv, words, monkeypatch, capsys):
    import wsattn.cli
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: ran.append(1) or True)
    assert wsattn.cli.main(["bench", *argv]) == 2
    assert words in capsys.readouterr().err and ran == []


def test_summarize_median_and_quantiles():
    t = summarize([5, 1, 4, 2, 3])
    assert (t.median_ms, t.q20_ms, t.q80_ms, t.reps) == (3, 1.8, 4.2, 5)


class _RoundTimer:
    """prepare(fn) -> a sampler returning fn's next value; the order of samples is logged."""
    samples = 4

    def __init__(self):
        self.log = []

    def prepare(self, fn):
        name, values = fn()
        if values is None:
            raise RuntimeError(f"{name} cannot be captured")
        values = iter(values)

        def sample():
            self.log.append(name)
            v = next(values)
            if v is None:
                raise RuntimeError(f"{name} failed in a replay")
            return v
        sample.method, sample.calls = "graph", 7
        return sample


def test_time_interleaved_takes_rounds_rotated_and_keeps_going_past_failures():
    """One sample of each function a round, the order rotated by one each round; a
    function that cannot be prepared, or fails in a round, gets its exception, the others
    their Timing and their samples in round order."""
    from wsattn.bench.timing import time_interleaved
    timer = _RoundTimer()
    fns = [lambda: ("a", [1.0, 2.0, 3.0, 4.0]), lambda: ("bad", None),
           lambda: ("b", [5.0, 6.0, 7.0, 8.0]), lambda: ("c", [9.0, None, 0.0, 0.0])]
    a, bad, b, c = time_interleaved(timer, fns)
    assert timer.log == ["a", "b", "c", "b", "c", "a", "a", "b", "b", "a"]
    assert a[1] == [1.0, 2.0, 3.0, 4.0] and b[1] == [5.0, 6.0, 7.0, 8.0]
    assert len(a[2]) == 4 and a[2] == sorted(a[2]) and a[2][0] <= b[2][0]  # host times
    assert a[0] == summarize([1.0, 2.0, 3.0, 4.0], "graph", 7)
    assert (b[0].median_ms, b[0].reps, b[0].calls, b[0].method) == (6.5, 4, 7, "graph")
    assert isinstance(bad, RuntimeError) and "captured" in str(bad)
    assert isinstance(c, RuntimeError) and "replay" in str(c)
    assert time_interleaved(timer, []) == []


# --------------------------------------------------------------------------- rows

def test_row_has_stamp_shape_check_and_throughput():
    case = PrefillCase(4, 4096, 16, 16, 128, True)
    check = types.SimpleNamespace(rel_err=3e-3, tol=2e-2, passed=True, where="slice")
    row = report.make_row(_stamp(), case, "triton", "ok", check=check, timing=TIMING)
    assert row["commit"] == "abc" and row["gpu"] == "none"
    assert (row["op"], row["B"], row["Sq"], row["Hq"], row["D"], row["causal"], row["dtype"]) == \
        ("prefill", 4, 4096, 16, 128, True, "bf16")
    assert (row["median_ms"], row["q20_ms"], row["q80_ms"]) == (2.0, 1.9, 2.2)
    assert row["tflops"] == pytest.approx(case.flops() / 2e-3 / 1e12)
    assert row["tbps"] is None and row["rel_err"] == 3e-3 and row["check_passed"] is True
    assert set(report.RESULT_FIELDS) <= set(row)


def test_ok_row_needs_a_passed_check():
    case = PrefillCase(4, 4096, 16, 16, 128, False)
    failed = types.SimpleNamespace(rel_err=1.0, tol=2e-2, passed=False, where="")
    with pytest.raises(ValueError, match="passed check"):
        report.make_row(_stamp(), case, "triton", "ok", check=failed, timing=TIMING)


def _ok(case, impl, ms):
    check = types.SimpleNamespace(rel_err=1e-3, tol=2e-2, passed=True, where="")
    return report.make_row(_stamp(), case, impl, "ok", check=check,
                           timing=Timing(ms, ms, ms, 1))


def test_ratios_to_cudnn_triton_ceilings_and_contiguous():
    pre = PrefillCase(4, 4096, 16, 16, 128, False)
    dec = DecodeCase(64, 8192, 32, 8, 128, None)
    paged = DecodeCase(64, 8192, 32, 8, 128, 16)
    rows = [_ok(pre, "sdpa-cudnn", 1.0), _ok(pre, "triton", 1.25), _ok(pre, "gluon", 0.8),
            _ok(dec, "sdpa-cudnn", 0.5), _ok(dec, "triton", 0.55), _ok(paged, "triton", 0.6),
            _ok(pre, "fa4", 0.9)]
    ceilings = {"matmul": Ceiling("matmul", "", TIMING, 700.0, "TFLOP/s"),
                "copy": Ceiling("copy", "", TIMING, 4.0, "TB/s")}
    report.add_ratios(rows, ceilings)
    cudnn, triton, gluon, dcudnn, dtriton, dpaged, fa4 = rows
    assert triton["ratio_cudnn"] == pytest.approx(0.8)
    assert gluon["ratio_cudnn"] == pytest.approx(1.25) and gluon["ratio_triton"] == pytest.approx(1.5625)
    assert triton["ratio_triton"] is None, "a row is not compared with itself"
    assert gluon["ratio_fa4"] == pytest.approx(0.9 / 0.8) and fa4["ratio_fa4"] is None
    assert dtriton["ratio_fa4"] is None  # prefill only
    assert gluon["ratio_matmul"] == pytest.approx(gluon["tflops"] / 700.0)
    assert dtriton["ratio_cudnn"] == pytest.approx(0.5 / 0.55)
    assert dtriton["frac_copy"] == pytest.approx(dtriton["tbps"] / 4.0)
    assert dpaged["ratio_contiguous"] == pytest.approx(0.55 / 0.6)
    assert dpaged["ratio_cudnn"] == pytest.approx(0.5 / 0.6)
    assert dtriton["ratio_contiguous"] is None and cudnn["ratio_cudnn"] is None


def test_a_paged_row_is_set_against_the_triton_row_of_its_own_case():
    """ratio_triton of a paged row pairs with the Triton default on the same page size (the
    same case and loop), not with the contiguous case's."""
    dec = DecodeCase(1, 4096, 32, 8, 128, None)
    paged = DecodeCase(1, 4096, 32, 8, 128, 64)
    rows = [_ok(dec, "triton", 0.50), _ok(paged, "triton", 0.60),
            _ok(paged, "triton[64,4,7,0]", 0.58)]
    report.add_ratios(rows)
    contiguous, paged_default, spec = rows
    assert spec["ratio_triton"] == pytest.approx(0.60 / 0.58)
    assert paged_default["ratio_triton"] is None  # not against itself, nor another case
    assert paged_default["ratio_contiguous"] == pytest.approx(0.50 / 0.60)


def test_ratios_pair_the_samples_of_one_round():
    """Rows timed in one interleaved loop carry their samples and host times; a ratio is
    then the median over the rounds of the two samples of a round (here 1.0), not the
    medians' ratio (0.5); rows with different sample counts, or timed in two loops one
    after the other (their times do not overlap), fall back to the medians."""
    pre = PrefillCase(4, 4096, 16, 16, 128, False)
    cudnn, gluon = _ok(pre, "sdpa-cudnn", 1.0), _ok(pre, "gluon", 2.0)
    cudnn["samples_ms"], gluon["samples_ms"] = [1.0, 1.0, 4.0], [1.0, 2.0, 2.0]
    cudnn["samples_t"], gluon["samples_t"] = [10.0, 10.2, 10.4], [10.1, 10.3, 10.5]
    report.add_ratios([cudnn, gluon])
    assert gluon["ratio_cudnn"] == pytest.approx(1.0) and cudnn["ratio_cudnn"] is None
    assert report.paired_ratio(cudnn, gluon) == pytest.approx(1.0)
    gluon["samples_t"] = [11.0, 11.1, 11.2]  # a later loop: not paired
    assert report.paired_ratio(cudnn, gluon) == pytest.approx(0.5)
    gluon["samples_t"], gluon["samples_ms"] = [10.1, 10.3, 10.5], [2.0]
    assert report.paired_ratio(cudnn, gluon) == pytest.approx(0.5)
    check = types.SimpleNamespace(rel_err=1e-3, tol=2e-2, passed=True, where="")
    # rows of different work (a pack and its equal-length batch): the work ratio times the
    # paired time ratio, i.e. the throughput ratio when the samples agree with the medians
    pack = {"tflops": 2.0, "median_ms": 1.0, "samples_ms": [1.0, 1.0, 1.0],
            "samples_t": [0.0, 1.0, 2.0]}
    batch = {"tflops": 1.0, "median_ms": 3.0, "samples_ms": [3.0, 3.0, 3.0],
             "samples_t": [0.5, 1.5, 2.5]}
    assert report.throughput_ratio(pack, batch, "tflops") == pytest.approx(2.0)
    batch["samples_ms"] = [3.0, 6.0, 6.0]  # slower in the rounds the pack ran at 1.0 too
    assert report.throughput_ratio(pack, batch, "tflops") == pytest.approx(4.0)
    row = report.make_row(_stamp(), pre, "gluon", "ok", check=check, timing=TIMING,
                          samples=[2, 1.9], stamps=[1700000000.123456, 1700000000.2])
    assert row["samples_ms"] == [2.0, 1.9] and row["samples_t"] == [1700000000.1235, 1700000000.2]


def test_json_rows_and_table(tmp_path):
    case = DecodeCase(8, 65536, 32, 8, 128, 64)
    failed = types.SimpleNamespace(rel_err=math.inf, tol=2e-2, passed=False, where="")
    rows = [_ok(case, "triton", 0.5),
            report.make_row(_stamp(), case, "sdpa-flash", "failed", check=failed, reason="NaN"),
            report.make_row(_stamp(), PrefillCase(1, 16384, 16, 16, 128, True), "gluon",
                            "not available", reason="not built yet")]
    path = report.write_json(rows, tmp_path / "sub" / "r.json")
    back = json.loads(path.read_text())
    assert [r["status"] for r in back] == ["ok", "failed", "not available"]
    assert back[1]["rel_err"] == "inf" and back[1]["median_ms"] is None
    table = report.format_table(rows)
    assert "TB/s" in table and "TFLOP/s" in table and "not available: not built yet" in table


# --------------------------------------------------------------------------- plot

def _plot_rows():
    rows = [_ok(PrefillCase(16384 // n, n, 16, 16, 128, False), impl, ms * n / 1024)
            for n in (1024, 4096) for impl, ms in (("triton", 1.2), ("sdpa-cudnn", 1.0))]
    rows += [_ok(DecodeCase(64, 8192, 32, 8, 128, None), "triton", 0.5)]
    rows += [report.ceiling_row(_stamp(), Ceiling("copy", "copy", TIMING, 4.2, "TB/s"))]
    return rows


def test_plot_writes_png(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        path, message = plot.plot_rows(_plot_rows(), tmp_path / "p.png")
        assert path is None and message == plot.MISSING
        return
    path, message = plot.plot_rows(_plot_rows(), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(path) in message


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path, message = plot.plot_rows(_plot_rows(), tmp_path / "p.png")
    assert path is None and "matplotlib is not installed" in message
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------- check, then time

class FakeRunner(Runner):
    ops = ("prefill", "decode")

    def __init__(self, name, make):
        self.name, self.make = name, make

    def prepare(self, case, inp):
        return Prepared(lambda: self.make(case, inp), lambda: self.make(case, inp))


def _reference_out(case, inp):
    if case.op == "prefill":
        out, _ = reference.attention(inp.q, inp.k, inp.v, case.causal, inp.scale)
    else:
        out, _ = reference.decode(inp.q, inp.k_cache, inp.v_cache, inp.seqlens, inp.block_table,
                                  inp.scale)
    return out.to(inp.q.dtype)


CountingTimer = functools.partial(_CountingTimer, TIMING)


@pytest.mark.parametrize("case", SMALL)
def test_correct_output_is_checked_then_timed(case):
    timer = CountingTimer()
    rows = suite.run_cases([case], [FakeRunner("right", _reference_out)], timer, _stamp(), "cpu")
    (row,) = rows
    assert row["status"] == "ok", row["reason"]
    assert row["rel_err"] < 1e-3 and timer.calls == 1 and row["median_ms"] == 2.0


@pytest.mark.parametrize("case", SMALL)
def test_wrong_output_is_recorded_failed_and_not_timed(case):
    def wrong(case, inp):
        out = _reference_out(case, inp)
        if case.op == "prefill":  # wrong only in the last query rows of the last batch element
            out[-1, -1] += 1.0
        else:
            out[-1] += 1.0
        return out

    timer = CountingTimer()
    (row,) = suite.run_cases([case], [FakeRunner("wrong", wrong)], timer, _stamp(), "cpu")
    assert row["status"] == "failed" and row["check_passed"] is False
    assert row["rel_err"] > row["tol"] and "not timed" in row["reason"]
    assert timer.calls == 0 and row["median_ms"] is None and row["tflops"] is None


def test_nan_output_fails_the_check():
    case = PrefillCase(1, 17, 2, 2, 64, False, "fp32")
    inp = make_inputs(case, "cpu")
    out = _reference_out(case, inp)
    out[0, 3, 1, 7] = float("nan")
    assert check_output(inp, out).rel_err == math.inf and not check_output(inp, out).passed


def test_unavailable_and_raising_runners_do_not_stop_the_run():
    def refuse(case, inp):
        raise NotAvailable("no kernel for this GPU")

    def crash(case, inp):
        raise RuntimeError("illegal memory access\nmore lines")

    timer = CountingTimer()
    case = PrefillCase(1, 17, 2, 2, 64, True, "fp32")
    runners = [FakeRunner("refuse", refuse), FakeRunner("crash", crash),
               FakeRunner("right", _reference_out)]
    rows = suite.run_cases([case], runners, timer, _stamp(), "cpu")
    assert [(r["impl"], r["status"]) for r in rows] == \
        [("refuse", "not available"), ("crash", "error"), ("right", "ok")]
    assert rows[0]["reason"] == "no kernel for this GPU"
    assert rows[1]["reason"] == "RuntimeError: illegal memory access"
    assert timer.calls == 1


def test_a_wsattn_call_that_passes_the_checks_and_fails_is_an_error(monkeypatch):
    """'not available' is what the API's checks refuse; a ValueError from the call itself
    (a bug, like this unpacking error) is an error row, which sets the exit status."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = PrefillCase(1, 17, 2, 2, 64, False, "fp32")

    def broken(*a, **k):
        raise ValueError("too many values to unpack (expected 2)")
    monkeypatch.setattr(wsattn, "attention", broken)
    (row,) = suite.run_cases([case], [WsattnRunner("reference", ops=("prefill",))],
                             CountingTimer(), _stamp(), "cpu")
    assert row["status"] == "error" and "too many values" in row["reason"], row


def test_wsattn_impl_refusing_the_call_is_not_available(monkeypatch):
    """impl='gluon' raising ValueError (here: CPU tensors) becomes 'not available: <why>'."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = PrefillCase(1, 17, 2, 2, 64, False, "fp32")
    timer = CountingTimer()
    (row,) = suite.run_cases([case], [WsattnRunner("gluon", ops=("prefill",))], timer,
                             _stamp(), "cpu")
    assert row["status"] == "not available" and "gluon" in row["reason"] and timer.calls == 0


def test_gluon_build_columns_are_asked_for_by_name_and_refuse_cpu_tensors(monkeypatch):
    """The build columns are not in the default run; each names its build by head dim and
    mask, and on CPU tensors the Gluon launcher's refusal is their 'not available'."""
    from wsattn.kernels import prefill_gluon as pg

    assert set(BUILD_RUNNERS).isdisjoint(DEFAULT_RUNNERS)
    assert wsattn.cli.build_parser().parse_args(["bench", "prefill"]).impl == list(DEFAULT_RUNNERS)
    for d in (64, 128):
        for causal in (False, True):
            one = one_consumer_build(d, causal)
            assert (one.CONSUMERS, one.BLOCK_M, one.persistent) == (1, 64, False)
            assert one == pg.settings_for(d, causal, **pg.ONE_CONSUMER[d])
            multi = multi_consumer_build(d, causal)
            assert multi.CONSUMERS == (3 if d == 64 else 2) and not multi.persistent
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = PrefillCase(1, 17, 2, 2, 64, False, "fp32")
    timer = CountingTimer()
    rows = suite.run_cases([case], [GluonBuildRunner("gluon-one-consumer", one_consumer_build)],
                           timer, _stamp(), "cpu")
    (row,) = rows
    assert row["status"] == "not available" and "gluon" in row["reason"] and timer.calls == 0


def test_gluon_settings_columns_parse_and_name_what_is_wrong(capsys):
    """--gluon-settings SPEC adds a gluon[SPEC] column, settings_for with those overrides
    (bools 0/1 or true/false, ints); a bad SPEC exits 2 naming the field or the form, and
    a build a head dim does not have is that case's 'not available'."""
    from wsattn.bench.runners import parse_gluon_settings, settings_build
    from wsattn.kernels import prefill_gluon as pg

    assert parse_gluon_settings("CONSUMERS=2,persistent=1") == {"CONSUMERS": 2,
                                                                "persistent": True}
    assert parse_gluon_settings("PINGPONG=false, STAGES = 3") == {"PINGPONG": False,
                                                                  "STAGES": 3}
    assert settings_build({"CONSUMERS": 2})(64, False) == pg.settings_for(64, False,
                                                                          CONSUMERS=2)
    for bad, says in (("CONSUMERS", "FIELD=VALUE"), ("WARPS=4", "not a GluonSettings field"),
                      ("persistent=2", "0/1 or true/false"), ("STAGES=-1", "non-negative"),
                      ("STAGES=3,STAGES=4", "given twice"), ("", "FIELD=VALUE")):
        with pytest.raises(ValueError, match=says):
            parse_gluon_settings(bad)
    args = wsattn.cli.build_parser().parse_args(
        ["bench", "prefill", "--gluon-settings", "CONSUMERS=2", "CONSUMERS=2,persistent=1"])
    assert args.gluon_settings == ["CONSUMERS=2", "CONSUMERS=2,persistent=1"]
    with pytest.raises(SystemExit) as e:
        wsattn.cli.build_parser().parse_args(["bench", "prefill", "--gluon-settings", "X=1"])
    assert e.value.code == 2 and "'X' is not a GluonSettings field" in capsys.readouterr().err
    case = PrefillCase(1, 17, 2, 2, 128, False, "fp32")  # three consumers: D64 only
    runner = GluonBuildRunner("gluon[CONSUMERS=3]", settings_build({"CONSUMERS": 3}))
    (row,) = suite.run_cases([case], [runner], CountingTimer(), _stamp(), "cpu")
    assert row["status"] == "not available" and "CONSUMERS" in row["reason"], row


def test_sdpa_peer_skips_paged_decode_and_reports_missing_backend():
    runner = SdpaRunner("sdpa-cudnn", "CUDNN_ATTENTION")
    assert not runner.applies(DecodeCase(2, 100, 8, 2, 64, 16, "fp32"))
    case = PrefillCase(1, 17, 2, 2, 64, False, "fp32")
    (row,) = suite.run_cases([case], [runner], CountingTimer(), _stamp(), "cpu")
    if row["status"] != "ok":  # cuDNN attention does not run on CPU tensors
        assert row["status"] == "not available" and "CUDNN_ATTENTION" in row["reason"]


# --------------------------------------------------------------------------- command line

def test_bench_without_gpu_exits_2_with_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "wsattn bench needs a CUDA GPU" in err and "wsattn.bench.smoke" in err


def test_console_bench_without_gpu_exits_2():
    env_ = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "wsattn.cli", "bench", "decode", "--quick"],
                         capture_output=True, text=True, env=env_, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr


def _bench_args(*argv):
    return wsattn.cli.build_parser().parse_args(["bench", *argv])


def test_bench_writes_nothing_unless_asked(tmp_path, monkeypatch, capsys):
    """Without --json / --plot the bench only prints: it used to write its JSON and PNG
    into benchmarks/results/ of the checkout it ran from."""
    results = env.REPO_ROOT / "benchmarks" / "results"
    before = sorted(results.iterdir()) if results.exists() else []
    monkeypatch.chdir(tmp_path)
    assert bench_cli.write_outputs(_plot_rows(), _stamp(), _bench_args()) == []
    assert list(tmp_path.iterdir()) == []
    assert (sorted(results.iterdir()) if results.exists() else []) == before
    assert "written" not in capsys.readouterr().out


def test_bench_writes_json_and_plot_where_asked(tmp_path):
    rows = _plot_rows()
    (path,) = bench_cli.write_outputs(rows, _stamp(), _bench_args("--json", str(tmp_path / "r.json"),
                                                                  "--no-plot"))
    assert path == tmp_path / "r.json" and len(json.loads(path.read_text())) == len(rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]

    # a directory gets the conventional name; the plot goes beside the JSON or to --plot
    written = bench_cli.write_outputs(rows, _stamp(), _bench_args("--json", str(tmp_path)))
    assert written[0] == tmp_path / env.json_name(_stamp())
    plotted = bench_cli.write_outputs(rows, _stamp(), _bench_args("--plot", str(tmp_path / "p.png")))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written[1:] == [] and plotted == []
    else:
        assert written[1:] == [written[0].with_suffix(".png")] and written[1].exists()
        assert plotted == [tmp_path / "p.png"] and plotted[0].exists()


def test_bench_sp_without_gpus_exits_2_with_message(monkeypatch, capsys):
    """`wsattn bench sp` on a machine without GPUs said nothing useful and ran on gloo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "sp", "--quick"]) == 2
    assert "wsattn bench sp needs CUDA GPUs" in capsys.readouterr().err


def test_console_sp_bench_without_gpus_exits_2():
    env_ = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "wsattn.sp.bench", "--quick"],
                         capture_output=True, text=True, env=env_, timeout=120)
    assert res.returncode == 2 and "needs CUDA GPUs" in res.stderr, res.stdout + res.stderr


def test_bench_sp_hook(monkeypatch, capsys):
    """`wsattn bench sp` dispatches to wsattn.sp.bench.main(args), or says it is not built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_cli, "SP_MODULE", "wsattn.sp.bench_not_here")
    assert wsattn.cli.main(["bench", "sp"]) == 2
    assert "not built yet" in capsys.readouterr().err

    seen = {}
    fake = types.ModuleType("wsattn_fake_sp_bench")
    fake.add_arguments = lambda group: group.add_argument("--world", type=int, default=1)
    fake.main = lambda args: seen.setdefault("args", args) and 0
    monkeypatch.setitem(sys.modules, "wsattn_fake_sp_bench", fake)
    monkeypatch.setattr(bench_cli, "SP_MODULE", "wsattn_fake_sp_bench")
    assert wsattn.cli.main(["bench", "sp", "--world", "2", "--quick"]) == 0
    assert seen["args"].world == 2 and seen["args"].quick


def test_host_time_entries_call_the_api_with_and_without_validate():
    """Every call the host-time module times is a valid API call (here through the
    reference, at toy sizes), each decode/varlen call with the default and validate=True."""
    from wsattn.bench import host

    calls = host.entries(torch.device("cpu"), torch.float32, B=2, L=32, Hq=4, Hkv=2, D=16,
                         page=4, varlen_lens=(3, 7))
    for kind in ("decode contiguous", "decode paged4", "attention_varlen causal"):
        assert {f"{kind}, default", f"{kind}, validate=True"} <= set(calls)
    for name, (shape, fn) in calls.items():
        fn()
        assert shape.get("validate") in (None, "default", "validate=True"), name
    host_us, wall_us = host.per_call_us(calls["merge_states"][1], calls=3, sync=lambda: None)
    assert 0 < host_us <= wall_us


def test_host_time_without_gpu_exits_2(monkeypatch, capsys):
    from wsattn.bench import host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host.main(["--json", "unused.json"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_smoke_run_sets_the_interpreter_before_triton():
    """The smoke module runs the kernels through the interpreter in a fresh process."""
    env_ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "wsattn.bench.smoke", "--only", "merge_states"],
                         capture_output=True, text=True, env=env_, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ok    merge_states") == 2 and "all passed" in res.stdout


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_graph_timer_times_a_copy_and_falls_back_when_capture_fails():
    from wsattn.bench.timing import cuda_timer

    timer = cuda_timer(warmup_ms=5, rep_ms=20, method="graph")
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    assert t.method == "graph" and 0 < t.q20_ms <= t.median_ms <= t.q80_ms
    stream = torch.cuda.current_stream()
    syncing = timer(lambda: dst[:1].sum().item())  # a host sync cannot be captured
    assert syncing.method.startswith("eager (graph capture failed")
    assert torch.cuda.current_stream() == stream  # not the failed capture's side stream
    # the failed capture must leave the CUDA generator usable, eagerly and in a new capture
    assert torch.randn(4, device="cuda").isfinite().all()
    assert timer(lambda: torch.randn(1024, device="cuda")).method == "graph"


@pytest.mark.sm90
def test_gluon_build_columns_run_their_builds_checked():
    """Each build column on an sm_90 GPU: checked against float64 first, then timed, its
    row's note naming the settings it launched (the multi-consumer build at D64 N 300,
    where `auto` takes the one-consumer build: a column runs what auto would not)."""
    from wsattn.kernels import prefill_gluon as pg

    timer = CountingTimer()
    cases = [PrefillCase(2, 300, 4, 2, 64, False, "bf16"),
             PrefillCase(1, 257, 4, 1, 128, True, "bf16")]
    runners = [GluonBuildRunner(n, b) for n, b in
               (("gluon-one-consumer", one_consumer_build),
                ("gluon-multi-consumer", multi_consumer_build))]
    rows = suite.run_cases(cases, runners, timer, _stamp(), "cuda")
    assert [r["status"] for r in rows] == ["ok"] * 4, rows
    assert all(r["check_passed"] for r in rows) and timer.calls == 4
    notes = {(r["impl"], r["D"]): r["note"] for r in rows}
    for (impl, d), note in notes.items():
        build = one_consumer_build if impl == "gluon-one-consumer" else multi_consumer_build
        assert note == f"settings: {build(d, d == 128)}"
    assert pg.call_settings(64, False, 300) == one_consumer_build(64, False)
    assert pg.call_settings(64, False, 300) != multi_consumer_build(64, False)


@pytest.mark.gpu
def test_bench_quick_end_to_end(tmp_path, capsys):
    """`wsattn bench decode --quick` on the GPU writes checked rows and a table."""
    out = tmp_path / "rows.json"
    rc = wsattn.cli.main(["bench", "decode", "--quick", "--impl", "triton", "sdpa-cudnn",
                          "--json", str(out), "--no-plot", "--rep-ms", "20", "--warmup-ms", "5"])
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"ceiling", "decode"}
    wsattn_rows = [r for r in rows if r["impl"] == "triton"]
    assert rc == (0 if all(r["status"] == "ok" for r in wsattn_rows) else 1)
    for r in rows:
        if r["status"] == "ok" and r["op"] == "decode":
            assert r["check_passed"] and r["tbps"] > 0 and r["frac_copy"] > 0
    assert "TB/s" in capsys.readouterr().out


def test_copy_ceiling_rows_for_the_decode_step_benchmarks(monkeypatch, capsys):
    """One row and its TB/s when the copy ceiling is measured; no row, None and a message
    when it fails (the benchmark's rows are still measured, without fractions)."""
    from wsattn.bench import ceilings
    from wsattn.bench.timing import Timing
    stamp = {"gpu": "none", "commit": "x"}
    t = Timing(0.5, 0.49, 0.51, 20, "graph", 10)
    monkeypatch.setattr(ceilings, "copy_bandwidth",
                        lambda timer, device: ceilings.Ceiling("copy", "1 GiB copy", t, 4.25, "TB/s"))
    rows, tbps = ceilings.copy_ceiling_rows(None, "cpu", stamp)
    assert tbps == 4.25 and len(rows) == 1 and rows[0]["op"] == "ceiling"
    assert rows[0]["impl"] == "copy" and rows[0]["tbps"] == 4.25 and rows[0]["gpu"] == "none"

    def boom(timer, device):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(ceilings, "copy_bandwidth", boom)
    assert ceilings.copy_ceiling_rows(None, "cpu", stamp) == ([], None)
    assert "ceiling copy failed: RuntimeError: out of memory" in capsys.readouterr().err


def test_exit_status_names_our_broken_columns(capsys):
    """1 and a line per failed or raising column of ours; peers' failures and ok rows do
    not count."""
    from wsattn.bench.report import exit_status
    rows = [{"impl": "wsattn-graph", "status": "ok", "case": "a", "reason": None},
            {"impl": "wsattn-graph", "status": "failed", "case": "b", "reason": "rel err"},
            {"impl": "hf-eager", "status": "error", "case": "c", "reason": "oom"}]
    assert exit_status(rows, lambda i: i.startswith("wsattn")) == 1
    assert capsys.readouterr().err == "wsattn wsattn-graph failed on b: rel err\n"
    assert exit_status(rows, lambda i: i.startswith("wsattn"), "gemv") == 1
    assert capsys.readouterr().err == "wsattn gemv failed on b: rel err\n"
    assert exit_status(rows[:1] + rows[2:], lambda i: i.startswith("wsattn")) == 0


def test_decode_plot_lines_are_one_batch_each():
    """--step-shapes gives several batches at one length: each batch its own panel, not
    one line joining them as if one case."""
    from wsattn.bench import plot

    rows = [dict(_ok(DecodeCase(B, 4096, 32, 8, 128, None), "triton", 0.5), layout="contiguous")
            for B in (1, 8)]
    titles = [t for _, t in plot._panels(rows)]
    assert len(titles) == 2 and any("B=1 " in t for t in titles), titles
