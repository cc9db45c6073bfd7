"""wsattn bench varlen: the pack (reproducible, within bounds, summing to the total), the
equal-length batch's N and B, the FLOP counts, the command line, the row schema and the
ratio / target logic, the outputs written only when asked, the plot, the peers' calling
conventions against fakes that compute from what they were given, and the runner end to
end on a tiny pack through the interpreter (check, then time; a wrong kernel fails and is
not timed)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import wsattn
import wsattn.cli
from wsattn import reference
from wsattn.bench import gemv, varlen
from wsattn.bench.peers import FA4_MODULE, FLASHINFER_MODULE
from wsattn.bench.report import exit_status

from conftest import BENCH_STAMP as STAMP, CHILD_TIMER, bench_timing as _timing, interpreter_child
from conftest import CountingTimer as _CountingTimer
from test_bench_peers import fake_fa4, fake_flashinfer


CountingTimer = functools.partial(_CountingTimer, _timing(1.0))


# --------------------------------------------------------------------------- the pack

@pytest.mark.parametrize("dist", varlen.DISTS)
@pytest.mark.parametrize("total, lo, hi", [(16384, 64, 8192), (16384, 64, 128), (64, 64, 128),
                                           (129, 64, 128), (8193, 64, 8192), (1000, 16, 48)],
                         ids=lambda v: str(v))
def test_pack_sums_to_the_total_within_bounds(dist, total, lo, hi):
    for seed in range(20):
        p = varlen.draw_pack(total, seed, dist, lo, hi)
        assert p.total == total and sum(p.lengths) == total
        assert all(lo <= n <= hi for n in p.lengths), p.lengths
        assert p.offsets()[0] == 0 and p.offsets()[-1] == total
        assert len(p.offsets()) == p.num_seqs + 1
        assert (p.seed, p.dist, p.lo, p.hi) == (seed, dist, lo, hi)


def test_pack_is_reproducible_and_seeded():
    a, b = varlen.draw_pack(), varlen.draw_pack()
    assert a == b and a.lengths == varlen.draw_pack(seed=varlen.SEED).lengths
    # Python's random.Random(seed) draws the same numbers on every machine
    assert a.lengths == (3851, 2531, 493, 225, 765, 457, 2870, 279, 646, 1085, 3182)
    assert a.dist == "loguniform" and (a.lo, a.hi, a.total) == (64, 8192, 16384)
    assert varlen.draw_pack(seed=1).lengths != a.lengths
    assert varlen.draw_pack(dist="uniform").lengths != a.lengths
    # log-uniform packs many short sequences, uniform a few long ones
    many = [varlen.draw_pack(seed=s).num_seqs for s in range(20)]
    few = [varlen.draw_pack(seed=s, dist="uniform").num_seqs for s in range(20)]
    assert sum(many) > 2 * sum(few)


def test_pack_checked_sequences():
    p = varlen.Pack((100, 64, 300, 80, 90), 0, "uniform", 64, 300)
    assert p.checked() == [0, 1, 2, 4]  # first, shortest, longest, last
    assert varlen.Pack((70,), 0, "uniform", 64, 300).checked() == [0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(lo=0), "lengths lo must be an int >= 1"),
    (dict(lo=64, hi=100), "lengths hi must be an int >= 128"),
    (dict(total=10), "tokens must be an int >= 64"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(dist="normal"), "dist must be one of"),
    (dict(total=True), "tokens must be an int"),
])
def test_pack_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        varlen.draw_pack(**kwargs)


def test_equal_length_batch_maths():
    # sum(len^2) / sum(len) = (64^2 + 192^2) / 256 = 160 = 2.5 tiles of 64: halves up to 192
    p = varlen.Pack((64, 192), 0, "uniform", 64, 192)
    assert p.sum_sq() == 64 * 64 + 192 * 192 and (p.n_eq, p.b_eq) == (192, 1)
    p = varlen.Pack((64,) * 4, 0, "uniform", 64, 128)
    assert (p.n_eq, p.b_eq) == (64, 4)
    p = varlen.Pack((100, 100, 100), 0, "uniform", 64, 200)  # 100 -> 1.56 tiles -> 128
    assert (p.n_eq, p.b_eq) == (128, 2)
    p = varlen.Pack((20, 30), 0, "uniform", 16, 48)  # 26 -> 0.4 tiles: at least one tile
    assert (p.n_eq, p.b_eq) == (64, 1)
    p = varlen.Pack((1000, 3000), 0, "uniform", 64, 8192)  # 2500 -> 39.06 tiles -> 2496
    assert (p.n_eq, p.b_eq) == (2496, 1)
    p = varlen.draw_pack()
    mean = sum(n * n for n in p.lengths) / 16384
    assert p.n_eq % 64 == 0 and abs(p.n_eq - mean) <= 32
    assert p.b_eq == 16384 // p.n_eq and p.b_eq * p.n_eq <= 16384


def test_flops_on_a_hand_example():
    p = varlen.Pack((3, 5), 0, "uniform", 2, 5)
    full = varlen.VarlenCase(p, "test", 4, 2, 2, False, "fp32")
    assert full.flops() == 4 * 2 * 4 * (9 + 25) == 1088
    causal = varlen.VarlenCase(p, "test", 4, 2, 2, True, "fp32")
    assert causal.flops() == 544
    eq = full.equal()  # N 64, B 1
    assert (eq.B, eq.N, eq.H, eq.HKV, eq.D, eq.causal) == (1, 64, 4, 2, 2, False)
    assert full.flops("equal") == 4 * 1 * 4 * 64 * 64 * 2
    assert causal.flops("equal") == full.flops("equal") / 2
    big = varlen.VarlenCase(varlen.draw_pack(), "gqa", 32, 8, 128, True)
    assert big.flops() == 4 * 128 * 32 * sum(n * n for n in big.pack.lengths) / 2


def test_cases_and_ids():
    pack = varlen.draw_pack()
    cases = varlen.varlen_cases(pack)
    assert [(c.heads, c.Hq, c.Hkv, c.D, c.causal) for c in cases] == [
        ("mha", 16, 16, 128, True), ("mha", 16, 16, 128, False),
        ("mha", 32, 32, 64, True), ("mha", 32, 32, 64, False),
        ("gqa", 32, 8, 128, True), ("gqa", 32, 8, 128, False),
        ("gqa", 32, 8, 64, True), ("gqa", 32, 8, 64, False)]
    assert len({c.id for c in cases}) == len(cases)
    assert cases[4].id == "varlen-T16384-log64-8192-s0-H32-HKV8-D128-causal-bf16"
    assert all(c.pack is pack and c.dtype == "bf16" for c in cases)
    for kwargs, match in ((dict(dims=[32]), "dim must be one of"), (dict(dims=[True]), "dim must"),
                          (dict(heads=["mqa"]), "heads must be"),
                          (dict(masks=["window"]), "mask must be")):
        with pytest.raises(ValueError, match=match):
            varlen.varlen_cases(pack, **kwargs)


# --------------------------------------------------------------------------- command line

def test_without_gpu_exits_2_with_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "varlen"]) == 2
    assert "wsattn bench needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--varlen-lengths", "64", "100"], "--varlen-lengths HI must be >= 2 x LO = 128"),
    (["--varlen-lengths", "0", "100"], "--varlen-lengths LO must be >= 1, got 0"),
    (["--varlen-tokens", "10"], "--varlen-tokens must be >= LO = 64, got 10"),
    (["--varlen-seed", "-3"], "--varlen-seed must be >= 0, got -3"),
    (["--varlen-dims", "96"], "--varlen-dims: dim must be one of the kernels' head dims (64, "
                              "128, 256), got 96"),
])
def test_bad_options_are_named_before_the_gpu_is_looked_for(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "varlen", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wsattn bench varlen: ") and message in err, err
    assert "CUDA GPU" not in err


def test_options_and_help(capsys):
    parser = wsattn.cli.build_parser()
    args = parser.parse_args(["bench", "varlen", "--varlen-tokens", "4096", "--varlen-lengths",
                              "32", "1024", "--varlen-dist", "uniform", "--varlen-seed", "7",
                              "--varlen-dims", "64", "--varlen-heads", "gqa", "--varlen-masks",
                              "causal", "--varlen-impl", "wsattn", "torch-fa2"])
    assert (args.what, args.varlen_tokens, args.varlen_lengths, args.varlen_dist,
            args.varlen_seed, args.varlen_dims, args.varlen_heads, args.varlen_masks,
            args.varlen_impl) == ("varlen", 4096, [32, 1024], "uniform", 7, [64], ["gqa"],
                                  ["causal"], ["wsattn", "torch-fa2"])
    (case,) = varlen.cases_from_args(args)
    assert (case.Hq, case.Hkv, case.D, case.causal, case.pack.total, case.pack.seed,
            case.pack.dist, case.pack.lo, case.pack.hi) == (32, 8, 64, True, 4096, 7,
                                                            "uniform", 32, 1024)
    args = parser.parse_args(["bench", "varlen"])
    assert (args.varlen_tokens, args.varlen_lengths, args.varlen_dist, args.varlen_seed,
            args.varlen_dims, args.varlen_heads, args.varlen_masks, args.varlen_impl) == \
        (16384, [64, 8192], "loguniform", 0, [128, 64], ["mha", "gqa"], ["causal", "full"],
         list(varlen.IMPLS))
    assert len(varlen.cases_from_args(args)) == 8 and varlen.args_error(args) is None
    for bad in (["--varlen-impl", "flashinfer"], ["--varlen-dist", "normal"],
                ["--varlen-heads", "mqa"], ["--varlen-lengths", "64"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "varlen", *bad])
    with pytest.raises(SystemExit) as e:
        wsattn.cli.main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("varlen", "--varlen-tokens", "--varlen-lengths", "--varlen-dist",
                 "--varlen-seed", "--varlen-dims", "--varlen-heads", "--varlen-masks",
                 "--varlen-impl", "wsattn.bench.varlen"):
        assert word in text, word


def test_console_without_gpu_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "wsattn.cli", "bench", "varlen", "--json",
                          str(out), "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, res.stderr
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- rows

CASE = varlen.VarlenCase(varlen.draw_pack(), "gqa", 32, 8, 128, True)


def _row(impl, layout, ms, status="ok", case=CASE):
    return varlen.make_row(STAMP, case, impl, layout, status, rel_err=1e-3, tol=2e-2,
                           timing=_timing(ms) if status == "ok" else None, matmul_tflops=800.0,
                           check_slice="sequences [0, 3, 10] of 11")


def test_row_schema_and_throughput():
    r = _row("wsattn", "varlen", 2.0)
    assert set(r) == set(STAMP) | set(varlen.ROW_FIELDS)
    p = CASE.pack
    assert (r["layout"], r["tokens"], r["B"], r["N"], r["num_seqs"], r["lengths"], r["seed"],
            r["dist"], r["len_lo"], r["len_hi"], r["max_len"]) == \
        ("varlen", 16384, 11, None, 11, list(p.lengths), 0, "loguniform", 64, 8192, 3851)
    assert (r["N_eq"], r["B_eq"]) == (p.n_eq, p.b_eq)
    assert r["flops"] == CASE.flops()
    assert r["tflops"] == pytest.approx(CASE.flops() / 2e-3 / 1e12)
    assert r["frac_matmul"] == pytest.approx(r["tflops"] / 800.0)
    assert (r["target_equal"], r["target_torch_fa2"], r["target_equal_met"]) == (0.95, 1.4, None)
    e = _row("wsattn", "equal", 1.0)
    assert (e["tokens"], e["B"], e["N"]) == (p.b_eq * p.n_eq, p.b_eq, p.n_eq)
    assert e["flops"] == CASE.flops("equal") and e["target_equal"] is None
    peer = _row("torch-fa2", "varlen", 1.0)
    assert peer["target_equal"] is None and peer["target_torch_fa2"] is None
    failed = varlen.make_row(STAMP, CASE, "wsattn-triton", "varlen", "failed", rel_err=0.5,
                             tol=2e-2, reason="relative error; not timed")
    assert failed["check_passed"] is False and failed["median_ms"] is None
    assert failed["tflops"] is None
    na = varlen.make_row(STAMP, CASE, "wsattn-gluon", "varlen", "not available",
                         reason="no varlen path")
    assert set(na) == set(r)
    json.dumps([r, e, peer, failed, na])


def test_ratios_and_targets():
    other = varlen.VarlenCase(CASE.pack, "gqa", 32, 8, 64, True)
    rows = [_row("wsattn", "varlen", 1.0), _row("wsattn", "equal", 1.0),
            _row("wsattn-triton", "varlen", 1.0), _row("wsattn-triton", "equal", 0.5),
            _row("torch-fa2", "varlen", 2.0), _row("torch-fa2", "equal", 1.0),
            _row("wsattn-gluon", "varlen", 1.0, status="not available"),
            _row("wsattn-gluon", "equal", 1.0),
            _row("fa4", "varlen", 1.0, case=other)]          # other shape: no partners
    varlen.add_ratios(rows)
    by = {(r["impl"], r["layout"]): r for r in rows if r["case"] == CASE.id}
    flops_v, flops_e = CASE.flops(), CASE.flops("equal")
    r = by[("wsattn", "varlen")]
    assert r["ratio_equal"] == pytest.approx(flops_v / flops_e)
    assert r["ratio_torch_fa2"] == pytest.approx(2.0)
    assert r["target_torch_fa2_met"] == "met"
    assert r["target_equal_met"] == ("met" if flops_v / flops_e >= 0.95 else "missed")
    t = by[("wsattn-triton", "varlen")]
    assert t["ratio_equal"] == pytest.approx(flops_v / flops_e / 2)
    assert t["target_equal_met"] == ("met" if flops_v / flops_e / 2 >= 0.95 else "missed")
    assert by[("wsattn", "equal")]["ratio_torch_fa2"] == pytest.approx(1.0)
    assert by[("wsattn", "equal")]["ratio_equal"] is None
    assert by[("wsattn", "equal")]["target_equal_met"] is None
    fa2 = by[("torch-fa2", "varlen")]
    assert fa2["ratio_torch_fa2"] is None and fa2["target_torch_fa2_met"] is None
    assert fa2["ratio_equal"] == pytest.approx(flops_v / flops_e / 2)
    gl = by[("wsattn-gluon", "varlen")]
    assert gl["ratio_equal"] is None and gl["target_equal_met"] is None
    assert rows[-1]["ratio_equal"] is None and rows[-1]["ratio_torch_fa2"] is None
    text = varlen.format_table(rows)
    assert CASE.id in text and "0.95 " in text and "1.4 met" in text
    assert "pack: 11 sequences, 16384 tokens, lengths loguniform in [64, 8192] seed 0" in text
    assert f"B {CASE.pack.b_eq} x N {CASE.pack.n_eq}" in text


def test_exit_status_names_our_broken_columns(capsys):
    rows = [_row("wsattn-gluon", "varlen", 1.0, status="not available"),
            _row("torch-fa2", "varlen", 1.0, status="error"),
            _row("fa4", "varlen", 1.0, status="failed")]
    assert exit_status(rows, varlen.WSATTN_IMPLS.__contains__) == 0
    rows.append(_row("wsattn-gluon", "equal", 1.0, status="error"))
    assert exit_status(rows, varlen.WSATTN_IMPLS.__contains__) == 1
    assert "wsattn wsattn-gluon error on varlen-" in capsys.readouterr().err


def test_plot_written(tmp_path):
    # matplotlib is the optional [plot] extra; the test venv installs it, so this runs in
    # CI and skips only where plotting is not installed at all
    pytest.importorskip("matplotlib")
    rows = [_row(i, layout, 1.0 + j, case=c) for c in varlen.varlen_cases(CASE.pack)
            for j, i in enumerate(varlen.IMPLS) for layout in varlen.LAYOUTS]
    path, msg = varlen.plot_rows(rows, tmp_path / "varlen.png")
    assert path.stat().st_size > 0, msg
    assert varlen.plot_rows([], tmp_path / "none.png")[0] is None
    assert not (tmp_path / "none.png").exists()


def test_write_only_when_asked(tmp_path):
    rows = [_row("wsattn", "varlen", 1.0)]
    args = types.SimpleNamespace(json=None, plot=None, no_plot=False, what="varlen")
    assert gemv.write(rows, STAMP, args, varlen.plot_rows) == []
    assert list(tmp_path.iterdir()) == []
    args.json, args.no_plot = str(tmp_path), True
    (path,) = gemv.write(rows, STAMP, args, varlen.plot_rows)
    assert path.parent == tmp_path and path.name.startswith("bench_varlen_none_")
    back = json.loads(path.read_text())[0]
    assert back["impl"] == "wsattn" and back["lengths"] == list(CASE.pack.lengths)
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


def test_main_prints_writes_and_exits(monkeypatch, tmp_path, capsys):
    """main() end to end with the GPU work faked: every case of the options run, the table
    printed, JSON and plot written where asked, exit status 1 only for a broken wsattn
    column."""
    # matplotlib is the optional [plot] extra; the test venv installs it, so this runs in
    # CI and skips only where plotting is not installed at all
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = []

    def fake_run_case(case, impls, timer, stamp, device, matmul_tflops=None):
        seen.append((case.id, tuple(impls), str(device)))
        return [varlen.make_row(stamp, case, i, layout, "ok", rel_err=1e-3, tol=2e-2,
                                timing=_timing(1.0)) for i in impls for layout in varlen.LAYOUTS]

    monkeypatch.setattr(varlen, "run_case", fake_run_case)
    parser = wsattn.cli.build_parser()
    args = parser.parse_args(["bench", "varlen", "--varlen-heads", "gqa", "--varlen-impl",
                              "wsattn", "torch-fa2", "--json", str(tmp_path)])
    assert varlen.main(args) == 0
    out = capsys.readouterr().out
    assert [s[0] for s in seen] == [c.id for c in varlen.cases_from_args(args)]
    assert all(s[1:] == (("wsattn", "torch-fa2"), "cuda:0") for s in seen)
    assert "x equal" in out and "x fa2" in out and "1.4 missed" in out
    (js,) = tmp_path.glob("bench_varlen_*.json")
    rows = json.loads(js.read_text())
    assert len(rows) == 4 * 2 * 2 and {r["impl"] for r in rows} == {"wsattn", "torch-fa2"}
    assert all(r["ratio_torch_fa2"] == pytest.approx(1.0) for r in rows if r["impl"] == "wsattn")
    assert js.with_suffix(".png").stat().st_size > 0

    def broken(case, impls, timer, stamp, device, matmul_tflops=None):
        return [varlen.make_row(stamp, case, "wsattn-triton", "varlen", "failed", rel_err=1.0,
                                tol=2e-2, reason="relative error; not timed")]

    monkeypatch.setattr(varlen, "run_case", broken)
    args = parser.parse_args(["bench", "varlen", "--varlen-dims", "64", "--varlen-heads", "mha",
                              "--varlen-masks", "full"])
    assert varlen.main(args) == 1
    assert "wsattn wsattn-triton failed on varlen-" in capsys.readouterr().err


# --------------------------------------------------------------------------- peers, faked

TINY = varlen.draw_pack(total=160, seed=3, lo=16, hi=48)


def _tiny(causal, hq=4, hkv=2, D=64):
    return varlen.VarlenCase(TINY, "test", hq, hkv, D, causal, "fp32")


def fake_fa2(calls):
    """aten::_flash_attention_forward as torch declares it, computing with the reference
    from exactly what it was given (cu_seqlens and max lengths, or a dense batch)."""
    def op(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
           return_debug_mask, *, scale=None):
        calls.append(dict(q=tuple(query.shape), cu=cum_seq_q, max=(max_q, max_k),
                          causal=is_causal, scale=scale))
        assert dropout_p == 0.0 and return_debug_mask is False
        if cum_seq_q is None:
            assert query.dim() == 4 and max_q == query.shape[1]
            out, lse = reference.attention(query, key, value, is_causal, scale)
        else:
            cu = cum_seq_q.tolist()
            assert cum_seq_k is cum_seq_q and max_q == max_k
            assert max_q >= max(b - a for a, b in zip(cu, cu[1:]))
            out, lse = reference.attention_varlen(query, key, value, cum_seq_q, cum_seq_k,
                                                  is_causal, scale)
        return out.to(query.dtype), lse, None, None, None
    return op


def fake_fa4_varlen(kernels):
    """fake_fa4 plus the varlen kernels: q/k/v [T, H, D] with cu_seqlens, MHA only."""
    mod = fake_fa4("float32", kernels)
    dense = mod.forward

    def forward(name, q, k, v, out, softmax_scale, *, cu_seqlens_q=None, cu_seqlens_k=None,
                seqused_k=None, page_table=None):
        if cu_seqlens_q is None:
            return dense(name, q, k, v, out, softmax_scale, seqused_k=seqused_k,
                         page_table=page_table)
        assert name.startswith("varlen_") and name in mod.MANIFEST["kernels"], name
        assert q.shape[1] == k.shape[1], "FA4 varlen kernels are MHA only"
        mod.calls.append(dict(name=name, q=tuple(q.shape), k=tuple(k.shape),
                              cu_seqlens=(cu_seqlens_q, cu_seqlens_k), out=out))
        o, _ = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          name.endswith("_causal"), softmax_scale)
        out.copy_(o.to(out.dtype))
        return out

    mod.forward = forward
    return mod


def test_the_peers_get_the_pack_and_the_batch(monkeypatch):
    """torch-fa2, FlashInfer (fa3, fa2) and FA4 against fakes that compute from their
    arguments: each gets cu_seqlens = the pack's offsets (FA4's GQA case with K/V repeated),
    is checked against float64 and only then timed, for the pack and the batch."""
    calls = []
    monkeypatch.setattr(varlen, "fa2_op", lambda: fake_fa2(calls))
    fi = fake_flashinfer()
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fi)
    fa4 = fake_fa4_varlen(("varlen_d64_causal", "prefill_d64_causal"))
    monkeypatch.setitem(sys.modules, FA4_MODULE, fa4)
    peers = ["torch-fa2", "flashinfer-fa3", "flashinfer-fa2", "fa4"]
    timer = CountingTimer()
    case = _tiny(True)
    rows = varlen.run_case(case, peers, timer, STAMP, "cpu", 100.0)
    by = {(r["impl"], r["layout"]): r for r in rows}
    assert len(rows) == 8 and timer.n == 8
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] <= 2e-3 and r["median_ms"] == 1.0
    assert by[("fa4", "varlen")]["note"].endswith("K/V repeated to 4 heads (the FA4 AOT varlen "
                                                  "kernels are MHA only)")
    assert by[("torch-fa2", "varlen")]["check_slice"].startswith("sequences ")
    assert by[("torch-fa2", "equal")]["check_slice"].startswith("batch ")
    offsets = TINY.offsets()
    varlen_calls = [c for c in calls if c["cu"] is not None]
    assert varlen_calls and all(c["cu"].tolist() == offsets and c["causal"]
                                and c["max"] == (TINY.max_len, TINY.max_len)
                                and c["scale"] == 64 ** -0.5 for c in varlen_calls)
    dense = [c for c in calls if c["cu"] is None]
    assert dense and dense[0]["q"] == (TINY.b_eq, TINY.n_eq, 4, 64)
    backends = [w.init.get("backend") for w in fi.wrappers]
    assert backends == ["fa3", "fa3", "fa2", "fa2"]
    ragged = fi.wrappers[0].planned
    assert ragged["qo_indptr"].tolist() == offsets and ragged["kv_indptr"].tolist() == offsets
    assert (ragged["num_qo_heads"], ragged["num_kv_heads"], ragged["head_dim_qk"],
            ragged["causal"]) == (4, 2, 64, True)
    names = [c["name"] for c in fa4.calls]
    assert "varlen_d64_causal" in names and "prefill_d64_causal" in names
    vc = next(c for c in fa4.calls if c["name"] == "varlen_d64_causal")
    assert vc["k"] == (160, 4, 64) and vc["cu_seqlens"][0].tolist() == offsets
    # FA4 carries no full-mask D64 varlen kernel: 'not available' naming it, not a failure
    rows = varlen.run_case(_tiny(False), ["fa4"], timer, STAMP, "cpu")
    assert rows[0]["status"] == "not available" and "varlen_d64_full" in rows[0]["reason"]


def test_a_peer_that_leaves_rows_unwritten_fails_and_is_not_timed(monkeypatch):
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fake_flashinfer(write=False))
    timer = CountingTimer()
    rows = varlen.run_case(_tiny(False), ["flashinfer-fa3"], timer, STAMP, "cpu")
    assert [r["status"] for r in rows] == ["failed", "failed"] and timer.n == 0
    assert all(r["median_ms"] is None and "not timed" in r["reason"] for r in rows)


def test_absent_peers_and_a_refusing_gluon_are_not_available(monkeypatch):
    """Without the wheels (and torch's FA2 on the CPU) the peers' rows say why; a ValueError
    is 'not available' for the Gluon columns alone: from the other wsattn columns it is an error,
    and the run's exit status is 1."""
    for module in (FA4_MODULE, FLASHINFER_MODULE):
        monkeypatch.setitem(sys.modules, module, None)

    def refuse(*args, **kwargs):
        raise ValueError(f"impl={kwargs['impl']!r} cannot run this call: test refusal")

    monkeypatch.setattr(wsattn, "attention_varlen", refuse)
    monkeypatch.setattr(wsattn, "attention", refuse)
    rows = varlen.run_case(_tiny(True), list(varlen.IMPLS), CountingTimer(), STAMP, "cpu")
    by = {(r["impl"], r["layout"]): r for r in rows}
    assert len(rows) == 2 * len(varlen.IMPLS)
    for layout in varlen.LAYOUTS:
        for impl in ("wsattn-gluon", "wsattn-gluon-plain", "wsattn-gluon-packorder",
                     "wsattn-gluon-unbounded", "wsattn-gluon-one-consumer",
                     "wsattn-gluon-multi-consumer"):  # checked
            assert by[(impl, layout)]["status"] == "not available"  # call validates first
            assert "test refusal" in by[(impl, layout)]["reason"]
        for impl in ("wsattn", "wsattn-triton"):
            assert by[(impl, layout)]["status"] == "error", by[(impl, layout)]
        assert by[("torch-fa2", layout)]["status"] == "not available"
        assert by[("torch-fa2", layout)]["reason"].startswith("torch-fa2: ")
        for impl, module in (("flashinfer-fa3", FLASHINFER_MODULE),
                             ("flashinfer-fa2", FLASHINFER_MODULE), ("fa4", FA4_MODULE)):
            assert by[(impl, layout)]["status"] == "not available"
            assert by[(impl, layout)]["reason"].startswith(f"{module} is not importable")
    assert exit_status(rows, varlen.WSATTN_IMPLS.__contains__) == 1


def test_fa2_call_matches_torchs_schema():
    """The positional order the torch-fa2 column passes is the op's own (query, key, value,
    cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask; scale by
    keyword), as declared by the torch installed here."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                          "dropout_p", "is_causal", "return_debug_mask"]
    scale = next(a for a in schema.arguments if a.name == "scale")
    assert scale.kwarg_only


# --------------------------------------------------------------------------- end to end, tiny

VARLEN_CHILD = CHILD_TIMER + r"""
import json, torch
torch.set_num_threads(1)
import wsattn
from wsattn.bench import varlen
timer = FakeTimer()
pack = varlen.draw_pack(total=160, seed=3, lo=16, hi=48)
rows = []
for causal in (True, False):
    case = varlen.VarlenCase(pack, "test", 4, 2, 64, causal, "fp32")
    rows += varlen.run_case(case, list(varlen.IMPLS), timer, {"gpu": "none"}, "cpu", 100.0)
varlen.add_ratios(rows)
real = wsattn.attention_varlen
wsattn.attention_varlen = lambda *a, **kw: real(*a, **kw).mul_(1.1)   # a wrong kernel
before = timer.n
bad = varlen.run_case(varlen.VarlenCase(pack, "test", 4, 2, 64, True, "fp32"),
                      ["wsattn-triton"], timer, {"gpu": "none"}, "cpu", 100.0)
print("RESULT " + json.dumps({"rows": rows, "bad": bad, "timed_bad": timer.n - before,
                              "timed": before, "lengths": list(pack.lengths)}))
"""


def test_runner_checks_then_times_on_the_interpreter():
    """wsattn (auto) and wsattn-triton on a tiny fp32 pack (GQA 4/2, D 64, causal and full)
    and its equal-length batch through the interpreter: each output within tolerance of
    float64, then timed; wsattn-gluon is 'not available' with the dispatcher's reason (on
    the CPU), the peers with theirs; a wrong kernel fails and is not timed."""
    r = interpreter_child(VARLEN_CHILD, timeout=300)
    rows = {(row["causal"], row["impl"], row["layout"]): row for row in r["rows"]}
    assert len(r["rows"]) == 2 * len(varlen.IMPLS) * 2
    assert r["lengths"] == list(TINY.lengths) and len(TINY.lengths) > 3
    for causal in (True, False):
        for impl in ("wsattn", "wsattn-triton"):
            for layout in varlen.LAYOUTS:
                row = rows[(causal, impl, layout)]
                assert row["status"] == "ok", row
                assert row["rel_err"] <= 2e-3 and row["check_passed"] and row["median_ms"] == 1.0
                assert row["frac_matmul"] == pytest.approx(row["tflops"] / 100.0)
            v = rows[(causal, impl, "varlen")]
            assert v["ratio_equal"] == pytest.approx(v["flops"] / rows[(causal, impl,
                                                                        "equal")]["flops"])
            assert v["target_equal_met"] in ("met", "missed")
            assert v["ratio_torch_fa2"] is None  # no torch-fa2 row on the CPU
        assert rows[(causal, "wsattn", "varlen")]["note"] == "auto -> triton"
        for layout in varlen.LAYOUTS:
            gluon = rows[(causal, "wsattn-gluon", layout)]
            assert gluon["status"] == "not available", gluon
            for impl in ("torch-fa2", "flashinfer-fa3", "flashinfer-fa2", "fa4"):
                assert rows[(causal, impl, layout)]["status"] == "not available"
            assert gluon["reason"].startswith("impl='gluon'"), gluon  # the dispatcher's
    assert r["timed"] == 2 * 2 * 2
    (bad_v, bad_e) = r["bad"]
    assert bad_v["status"] == "failed" and bad_v["median_ms"] is None and r["timed_bad"] == 1
    assert "not timed" in bad_v["reason"] and bad_v["rel_err"] > 2e-3
    assert bad_e["status"] == "ok"  # the batch goes through wsattn.attention, left right


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_the_benchmark_on_the_gpu(tmp_path, capsys):
    """The real command on a small pack (4096 tokens of 64-1024, GQA 32/8, D 128, causal and
    full): every wsattn and wsattn-triton row checked against float64 and timed from a CUDA
    graph, wsattn-gluon and the peers ok or not available (a wrong answer or an error from
    any wsattn column would exit 1), and the JSON rows read back as written."""
    out = tmp_path / "varlen.json"
    code = wsattn.cli.main(["bench", "varlen", "--varlen-tokens", "4096", "--varlen-lengths",
                            "64", "1024", "--varlen-dims", "128", "--varlen-heads", "gqa",
                            "--warmup-ms", "5", "--rep-ms", "20", "--json", str(out),
                            "--no-plot"])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = json.loads(out.read_text())
    assert rows[0]["op"] == "ceiling"
    rows = [r for r in rows if r["op"] == "varlen"]
    assert len(rows) == 2 * len(varlen.IMPLS) * 2
    for r in rows:
        assert r["gpu"] != "none" and r["total_tokens"] == 4096 and r["Hq"] == 32
        if r["impl"] in ("wsattn", "wsattn-triton"):
            assert r["status"] == "ok", r
            assert r["timing"] == "graph" and r["rel_err"] <= r["tol"] and r["tflops"] > 0
        else:  # Gluon refuses varlen (and GPUs but sm_90); the peer wheels may be absent
            assert r["status"] in ("ok", "not available"), r
        if r["impl"] in ("wsattn", "wsattn-triton") and r["layout"] == "varlen":
            assert r["ratio_equal"] > 0 and r["target_equal_met"] in ("met", "missed")
    assert "x equal" in text and "x fa2" in text
