"""wsattn bench decode --step-shapes / --decode-settings on CPU: the step's case list, SPEC
parsing and its refusals, the L2 rotation, and the triton and triton[SPEC] columns through
the check-then-time path in the interpreter; one step-shape case on the GPU."""

from __future__ import annotations

import json

import pytest
import torch

import wsattn.cli
from conftest import interpreter_child
from wsattn.bench import suite
from wsattn.bench.cases import DecodeCase, decode_cases, step_decode_cases
from wsattn.bench.cli import decode_args_error
from wsattn.bench.runners import (MAX_COPIES, DecodeSettingsRunner, Prepared, Rotated, Runner,
                                  format_decode_settings, make_inputs, parse_decode_settings,
                                  rotation_copies)
from wsattn.bench.timing import Timing
from wsattn.kernels.decode_triton import DecodeSettings

TIMING = Timing(median_ms=0.02, q20_ms=0.019, q80_ms=0.021, reps=20)


def _stamp():
    return {"gpu": "none", "commit": "abc", "date": "2026-11-30T21:00:00Z", "torch": "x",
            "triton": "y"}


# --------------------------------------------------------------------------- cases

def test_step_shapes_every_combination_both_layouts():
    cases = step_decode_cases()
    sizes = {(1, 1024), (1, 4096), (8, 4096), (32, 4096), (64, 1024), (1, 32768)}
    heads = {(32, 8, 64), (32, 8, 128), (32, 4, 128)}
    assert len(cases) == len(sizes) * len(heads) * 2 == len({c.id for c in cases})
    assert {(c.B, c.L, (c.HQ, c.HKV, c.D), c.page_size) for c in cases} == {
        (b, l, h, p) for b, l in sizes for h in heads for p in (None, 64)}
    assert all(c.dtype == "bf16" and c.op == "decode" for c in cases)
    assert "decode-B1-L4096-HQ32-HKV8-D64-paged64-bf16" in {c.id for c in cases}
    assert "decode-B64-L1024-HQ32-HKV8-D128-contiguous-bf16" in {c.id for c in cases}
    quick = step_decode_cases(quick=True, dtype="fp16")
    assert {(c.B, c.L) for c in quick} == {(1, 4096), (8, 4096)}
    assert all(c.dtype == "fp16" for c in quick) and len(quick) == 12


def test_default_decode_cases_unchanged_and_never_rotated():
    """The default decode run keeps its long contexts, each far past L2: no input copies."""
    assert {(c.B, c.L, c.page_size) for c in decode_cases()} == {
        (b, l, p) for b, l in ((64, 8192), (8, 65536), (1, 131072)) for p in (None, 16, 64)}
    assert all(rotation_copies(c) == 1 for c in decode_cases())
    steps = {c.id: rotation_copies(c) for c in step_decode_cases()}
    assert steps["decode-B1-L1024-HQ32-HKV8-D64-paged64-bf16"] > 50  # 2 MB of K/V
    assert steps["decode-B64-L1024-HQ32-HKV8-D128-contiguous-bf16"] == 1  # 268 MB
    assert max(steps.values()) <= MAX_COPIES


# --------------------------------------------------------------------------- SPEC

@pytest.mark.parametrize("spec, want", [
    ("64,4,3,16", DecodeSettings(64, 4, 3, 16, False)),
    ("32,8,7,1,1", DecodeSettings(32, 8, 7, 1, True)),
    (" 128, 2, 1, 128, 0 ", DecodeSettings(128, 2, 1, 128, False)),
], ids=["four-fields", "bt-preload-on", "spaces-bt-preload-off"])
def test_spec_parses_and_round_trips(spec, want):
    got = parse_decode_settings(spec)
    assert got == want
    assert parse_decode_settings(format_decode_settings(got)) == got
    assert DecodeSettingsRunner(got).name == f"triton[{format_decode_settings(got)}]"


@pytest.mark.parametrize("spec, words", [
    ("64,4,3", "4 or 5 integers"),
    ("64,4,3,16,1,9", "4 or 5 integers"),
    ("64,4,4,16,0,1", "must be BLOCK_N,num_warps,num_stages,num_splits[,bt_preload] "),
    ("64,four,3,16", "num_warps must be an integer"),
    ("48,4,3,16", "BLOCK_N must be a power of two"),
    ("8,4,3,16", "BLOCK_N must be a power of two in [16, 256]"),
    ("64,3,3,16", "num_warps must be a power of two"),
    ("64,4,0,16", "num_stages must be in [1, 8]"),
    ("64,4,3,-1", "num_splits must be in [0, 128]"),
    ("64,4,3,129", "num_splits must be in [0, 128]"),
    ("64,4,3,16,2", "bt_preload must be 0 or 1"),
], ids=["too-few", "too-many", "six-fields", "not-int", "block-n-not-pow2", "block-n-small",
        "warps", "stages", "splits-negative", "splits-129", "bt-preload-2"])
def test_bad_spec_is_refused_by_name(spec, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_decode_settings(spec)


def test_bad_spec_on_the_command_line_exits_2_naming_the_option(capsys):
    with pytest.raises(SystemExit) as e:
        wsattn.cli.main(["bench", "decode", "--decode-settings", "64,4,3,16", "64,4,x,16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--decode-settings" in err and "num_stages must be an integer" in err


@pytest.mark.parametrize("argv, words", [
    (["prefill", "--step-shapes"], "--step-shapes applies to `wsattn bench decode`"),
    (["all", "--step-shapes"], "--step-shapes applies to `wsattn bench decode`"),
    (["prefill", "--decode-settings", "64,4,3,16"], "--decode-settings applies"),
    (["decode", "--decode-settings", "64,4,3,16", "64,4,3,16,0"], "given more than once"),
], ids=["step-shapes-prefill", "step-shapes-all", "settings-prefill", "duplicate"])
def test_flag_misuse_exits_2_before_anything_runs(argv, words, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: ran.append(1) or True)
    assert wsattn.cli.main(["bench", *argv]) == 2
    assert words in capsys.readouterr().err and ran == []


def test_good_flags_pass_the_pre_check():
    args = wsattn.cli.build_parser().parse_args(
        ["bench", "decode", "--step-shapes", "--decode-settings", "64,4,3,16", "32,4,4,8,1"])
    assert decode_args_error(args) is None and args.step_shapes
    assert [format_decode_settings(s) for s in args.decode_settings] == ["64,4,3,16", "32,4,4,8,1"]
    default = wsattn.cli.build_parser().parse_args(["bench", "decode"])
    assert not default.step_shapes and default.decode_settings is None


def _bench_plan(monkeypatch, *argv):
    """(cases, runners) `wsattn bench` hands to run_cases for argv, with the GPU parts faked."""
    from wsattn.bench import ceilings, cli as bench_cli, env, timing

    seen = {}

    def fake_run_cases(cases, runners, *rest, **kw):
        seen.update(cases=cases, runners=runners)
        return []

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(env, "stamp", lambda device=None: dict(_stamp(), cc="-", driver="-",
                                                               cudnn="-"))
    monkeypatch.setattr(timing, "cuda_timer", lambda *a: None)
    for name in ("copy_bandwidth", "matmul_rate"):
        monkeypatch.setattr(ceilings, name, lambda timer, device: 1 / 0)  # ceiling row skipped
    monkeypatch.setattr(suite, "run_cases", fake_run_cases)
    args = wsattn.cli.build_parser().parse_args(["bench", *argv])
    assert bench_cli._bench(args, torch) == 0
    return seen["cases"], seen["runners"]


def test_bench_decode_runs_step_cases_and_settings_columns(monkeypatch):
    cases, runners = _bench_plan(monkeypatch, "decode", "--step-shapes", "--impl", "triton",
                                 "--decode-settings", "64,4,3,16", "32,4,4,8,1")
    assert cases == step_decode_cases()
    assert [r.name for r in runners] == ["triton", "triton[64,4,3,16]", "triton[32,4,4,8,1]"]
    assert all(isinstance(r, Rotated) for r in runners)
    assert runners[2].inner.settings == DecodeSettings(32, 4, 4, 8, True)
    default_cases, default_runners = _bench_plan(monkeypatch, "decode", "--impl", "triton")
    assert default_cases == decode_cases() and [r.name for r in default_runners] == ["triton"]


# --------------------------------------------------------------------------- L2 rotation

class PointerRunner(Runner):
    """Returns the data pointer of the k_cache it was prepared on, to see which copy ran."""
    name, ops = "ptr", ("decode",)

    def prepare(self, case, inp):
        return Prepared(lambda: inp.k_cache.data_ptr(), lambda: inp.k_cache.data_ptr(),
                        note="inner")


def test_rotation_cycles_through_distinct_equal_copies():
    case = DecodeCase(2, 40, 4, 2, 64, 16, "fp16")
    inp = make_inputs(case, "cpu")
    rotated = Rotated(PointerRunner(), fresh_bytes=int(2.5 * case.bytes_moved()))
    assert rotation_copies(case, rotated.fresh_bytes) == 3
    p = rotated.prepare(case, inp)
    assert p.first() == inp.k_cache.data_ptr()  # the check runs on the suite's inputs
    assert p.note == "inner; timed over 3 input copies (past L2)"
    ptrs = [p.fn() for _ in range(7)]
    assert len(set(ptrs)) == 3 and ptrs[:3] == ptrs[3:6] and ptrs[6] == ptrs[0]
    for c in inp.peer["l2_copies"]:
        assert torch.equal(c.k_cache, inp.k_cache) and torch.equal(c.block_table, inp.block_table)
    # a second runner on the same case reuses the copies
    again = Rotated(PointerRunner(), rotated.fresh_bytes).prepare(case, inp)
    assert sorted(again.fn() for _ in range(3)) == sorted(set(ptrs))
    # a case past fresh_bytes runs unwrapped
    assert Rotated(PointerRunner(), 1).prepare(case, inp).note == "inner"


# --------------------------------------------------------------------------- interpreter

CHILD = r"""
import json, sys
import torch
from wsattn.bench import suite
from wsattn.bench.cases import DecodeCase
from wsattn.bench.runners import (DecodeSettingsRunner, Rotated, WsattnRunner, check_output,
                                  parse_decode_settings)
from wsattn.bench.timing import Timing

calls = []

def prepare(fn):
    # three timed calls, one per input copy: identical copies, so identical bits, no NaN
    outs = [fn() for _ in range(3)]
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs), "the copies gave different outputs"
    calls.extend(outs)
    sample = lambda: 0.02
    sample.method, sample.calls = "graph", 3
    return sample

def timer(fn):
    sample = prepare(fn)
    return Timing(sample(), 0.019, 0.021, 20)

timer.prepare, timer.samples = prepare, 1

cases = [DecodeCase(2, 40, 4, 2, 64, p, "fp16") for p in (16, None)]
runners = [WsattnRunner("triton")] + [DecodeSettingsRunner(parse_decode_settings(s))
                                      for s in sys.argv[1:]]
fresh = int(2.5 * cases[0].bytes_moved())
rows = suite.run_cases(cases, [Rotated(r, fresh) for r in runners], timer,
                       {"gpu": "none"}, "cpu")
print("RESULT " + json.dumps([{k: r[k] for k in ("case", "impl", "status", "reason", "rel_err",
                                                 "tol", "note", "median_ms")} for r in rows]
                             + [len(calls)]))
"""


def test_triton_and_settings_columns_checked_then_timed_in_the_interpreter():
    """triton and two triton[SPEC] columns (split and preloaded block table; one split) on
    tiny paged and contiguous caches: checked against float64, then timed over copies."""
    specs = ["32,4,1,2,1", "16,2,1,1"]
    *rows, n_timed = interpreter_child(CHILD, *specs, timeout=300)
    impls = ["triton", "triton[32,4,1,2,1]", "triton[16,2,1,1]"]
    assert [(r["case"], r["impl"]) for r in rows] == [
        (f"decode-B2-L40-HQ4-HKV2-D64-{layout}-fp16", impl)
        for layout in ("paged16", "contiguous") for impl in impls]
    assert n_timed == 3 * len(rows)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] <= r["tol"] and r["median_ms"] == 0.02
        assert r["note"].endswith("; timed over 3 input copies (past L2)"), r["note"]
    notes = {(r["case"].split("-")[-2], r["impl"]): r["note"].split(";")[0] for r in rows}
    # interpreter defaults: 16-key tiles, 40 keys = 3 tiles, so at most 3 splits
    assert notes["paged16", "triton"].startswith("launched 16,4,1,")
    # 16-key pages under 32-key tiles: the table preload applies; not on a contiguous cache
    assert notes["paged16", "triton[32,4,1,2,1]"] == "launched 32,4,1,2,1"
    assert notes["contiguous", "triton[32,4,1,2,1]"].startswith(
        "launched 32,4,1,2,1 (bt_preload inactive")
    assert notes["contiguous", "triton[16,2,1,1]"] == "launched 16,2,1,1"


def test_split_count_cut_to_the_key_tiles_is_noted():
    from wsattn.bench.runners import settings_note

    case = DecodeCase(1, 40, 4, 2, 64, None, "fp16")
    inp = make_inputs(case, "cpu")
    note = settings_note(case, inp, DecodeSettings(16, 4, 1, 64))
    assert note == "launched 16,4,1,3 (num_splits cut to the cache's 3 key tiles)"


def test_split_count_0_takes_the_default_rule_at_the_given_block_n(monkeypatch):
    """num_splits 0 in a spec: the count decode_triton.auto_splits gives the case at the
    spec's BLOCK_N (then cut to the key tiles, as every launch), named in the note."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU's target: the interpreter's SMs
    from wsattn.bench.runners import launched_settings, settings_note
    from wsattn.kernels import decode_triton as dt
    from wsattn.target import target_of

    assert parse_decode_settings("64,4,4,0").num_splits == 0
    case = DecodeCase(1, 4096, 32, 8, 64, None, "fp16")
    inp = make_inputs(case, "cpu")
    sms = target_of(inp.q.device).num_sms
    for block_n in (16, 64):
        got, _ = launched_settings(case, inp, DecodeSettings(block_n, 4, 4, 0))
        want = min(dt.auto_splits(1, 8, 4096, block_n, sms), -(-4096 // block_n))
        assert got.num_splits == want >= 1
    note = settings_note(case, inp, DecodeSettings(64, 4, 4, 0))
    assert note.startswith("launched 64,4,4,") and note.endswith("(num_splits the default rule's)")


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_step_shape_case_default_and_explicit_settings_on_cuda(tmp_path):
    """One step-shape case (1B heads, B 1, L 4096, the engine's page of 64) with the default
    launch and one explicit setting, checked then timed on the GPU, over input copies past L2."""
    from wsattn.bench.runners import WsattnRunner
    from wsattn.bench.timing import cuda_timer

    (case,) = [c for c in step_decode_cases()
               if c.id == "decode-B1-L4096-HQ32-HKV8-D64-paged64-bf16"]
    runners = [Rotated(WsattnRunner("triton")),
               Rotated(DecodeSettingsRunner(parse_decode_settings("64,4,3,16")))]
    rows = suite.run_cases([case], runners, cuda_timer(5, 20), _stamp(), "cuda")
    assert [r["impl"] for r in rows] == ["triton", "triton[64,4,3,16]"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] <= r["tol"] and r["median_ms"] > 0 and r["tbps"] > 0
        assert f"timed over {rotation_copies(case)} input copies" in r["note"]
    assert rows[1]["note"].startswith("launched 64,4,3,16")
    json.dumps(rows)  # rows stay JSON rows
