"""wsattn bench chunked on CPU: the missing-GPU exit, the case list and ids, the FLOP count
on a hand example, the shuffled page table holding the contiguous keys, the row schema
and the ratio / target logic, the outputs written only when asked, the plot, and the
runner end to end on a tiny shape through the interpreter (check, then time; a wrong
kernel fails and is not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import wsattn.cli
from wsattn.bench import chunked, gemv

from conftest import BENCH_STAMP as STAMP, CHILD_TIMER, bench_timing as _timing, interpreter_child


# --------------------------------------------------------------------------- command line

def test_without_gpu_exits_2_with_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "chunked"]) == 2
    assert "wsattn bench needs a CUDA GPU" in capsys.readouterr().err


def test_console_without_gpu_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "wsattn.cli", "bench", "chunked",
                          "--chunked-prefix", "0", "--json", str(out), "--plot",
                          str(tmp_path / "p.png")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, res.stderr
    assert not out.exists() and not (tmp_path / "p.png").exists()


def test_options_and_help(capsys):
    from wsattn.kernels.prefill_paged import PagedPrefillSettings as chunked_settings_type
    parser = wsattn.cli.build_parser()
    args = parser.parse_args(["bench", "chunked", "--chunked-prefix", "0", "8192",
                              "--chunked-pages", "64", "--chunked-dims", "64",
                              "--chunked-impl", "triton-paged", "--chunked-batch", "4"])
    assert (args.what, args.chunked_prefix, args.chunked_pages, args.chunked_dims,
            args.chunked_impl, args.chunked_batch) == \
        ("chunked", [0, 8192], [64], [64], ["triton-paged"], 4)
    args = parser.parse_args(["bench", "chunked"])
    assert (args.chunked_prefix, args.chunked_pages, args.chunked_dims, args.chunked_impl,
            args.chunked_batch, args.chunked_chunk) == ([0, 2048, 8192, 32768], [16, 64],
                                                        [128, 64], list(chunked.DEFAULT_IMPLS),
                                                        8, 2048)
    assert "gluon-one-consumer-contiguous" in chunked.IMPLS
    assert "gluon-one-consumer-contiguous" not in chunked.DEFAULT_IMPLS
    args = parser.parse_args(["bench", "chunked", "--chunked-chunk", "256", "--chunked-impl",
                              "gluon-one-consumer-contiguous"])
    assert (args.chunked_chunk, args.chunked_impl) == (256, ["gluon-one-consumer-contiguous"])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "chunked", "--chunked-impl", "flashinfer"])
    args = parser.parse_args(["bench", "chunked", "--chunked-settings", "128,64,8,3,1",
                              "128,128,8,4"])
    assert args.chunked_settings == ["128,64,8,3,1", "128,128,8,4"]
    assert chunked.parse_settings("128,64,8,3,1") == \
        chunked_settings_type(128, 64, 8, 3, use_tma=True)
    assert chunked.parse_settings("128,128,8,4").use_tma is False
    for bad, says in (("128,64,8", "BLOCK_M,BLOCK_N"), ("128,64,8,3,2", "use_tma 0 or 1"),
                      ("128,48,8,3", "powers of two"), ("128,64,8,x", "BLOCK_M,BLOCK_N")):
        with pytest.raises(ValueError, match=says):
            chunked.parse_settings(bad)
    with pytest.raises(SystemExit) as e:
        wsattn.cli.main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    args = parser.parse_args(["bench", "chunked", "--chunked-gluon-settings",
                              "CONSUMERS=1,ctas_per_sm=2,BLOCK_N=64,STAGES=3", "STAGES=2"])
    assert args.chunked_gluon_settings == ["CONSUMERS=1,ctas_per_sm=2,BLOCK_N=64,STAGES=3",
                                           "STAGES=2"]
    from wsattn.bench.runners import parse_gluon_settings
    with pytest.raises(ValueError, match=r"--chunked-gluon-settings 'WARPS=4': 'WARPS' is not"):
        parse_gluon_settings("WARPS=4", "--chunked-gluon-settings")
    from wsattn.kernels import prefill_gluon as pg
    assert chunked.gluon_overrides("default", 64) == {}
    assert chunked.gluon_overrides("one_consumer", 64) == pg.ONE_CONSUMER[64]
    assert chunked.gluon_overrides("STAGES=2", 128) == {"STAGES": 2}
    with pytest.raises(ValueError, match="default or one_consumer, got 'fast'"):
        chunked.gluon_overrides("fast", 128)
    for word in ("chunked", "--chunked-prefix", "--chunked-pages", "--chunked-dims",
                 "--chunked-impl", "--chunked-batch", "--chunked-chunk", "--chunked-settings",
                 "--chunked-gluon-settings", "wsattn.bench.chunked"):
        assert word in text, word


# --------------------------------------------------------------------------- cases

def test_cases_and_ids():
    cases = chunked.chunked_cases()
    assert len(cases) == 2 * 4 * 3
    assert [(c.D, c.prefix, c.page) for c in cases[:6]] == \
        [(128, 0, None), (128, 0, 16), (128, 0, 64), (128, 2048, None), (128, 2048, 16),
         (128, 2048, 64)]
    assert {(c.B, c.chunk, c.Hq, c.Hkv, c.dtype) for c in cases} == {(8, 2048, 32, 8, "bf16")}
    assert cases[-1].id == "chunked-B8-C2048-P32768-H32-HKV8-D64-page64-bf16"
    assert cases[0].id == "chunked-B8-C2048-P0-H32-HKV8-D128-contiguous-bf16"
    assert len({c.id for c in cases}) == len(cases)
    assert [len(g) for g in chunked.group_by_shape(cases)] == [3] * 8
    assert cases[-1].seqlen_k == 32768 + 2048
    assert chunked.case_impls(cases[0], chunked.IMPLS) == ["wsattn-contiguous",
                                                           "triton-contiguous",
                                                           "gluon-contiguous",
                                                           "gluon-one-consumer-contiguous"]
    assert chunked.case_impls(cases[1], chunked.IMPLS) == ["wsattn", "wsattn-append",
                                                           "triton-paged", "triton-gather",
                                                           "gluon-gather", "gluon-paged",
                                                           "flashinfer-paged"]
    spec = ["gluon-paged[CONSUMERS=1]", "gluon-contiguous[CONSUMERS=1]", "triton-paged[1,2,3,4]"]
    assert chunked.case_impls(cases[0], spec) == ["gluon-contiguous[CONSUMERS=1]"]
    assert chunked.case_impls(cases[1], spec) == ["gluon-paged[CONSUMERS=1]",
                                                  "triton-paged[1,2,3,4]"]
    assert chunked.chunked_cases([5], [16], [64], batch=2)[1].id == \
        "chunked-B2-C2048-P5-H32-HKV8-D64-page16-bf16"
    for bad, match in ((dict(prefixes=[-1]), "prefix must be"), (dict(pages=[0]), "page must"),
                       (dict(batch=0), "batch must"), (dict(dims=[True]), "dim must"),
                       (dict(masks=["sliding"]), "mask must be")):
        with pytest.raises(ValueError, match=match):
            chunked.chunked_cases(**bad)
    # without a mask: its own ids and shapes (its own reference), the same inputs' seed
    both = chunked.chunked_cases([0], [16], [64], batch=2, masks=("causal", "full"))
    assert [c.causal for c in both] == [True, True, False, False]
    assert both[3].id == "chunked-B2-C2048-P0-H32-HKV8-D64-page16-full-bf16"
    assert both[1].id == "chunked-B2-C2048-P0-H32-HKV8-D64-page16-bf16"
    assert [len(g) for g in chunked.group_by_shape(both)] == [2, 2]
    assert both[0].shape[:-1] == both[2].shape[:-1] and both[0].shape != both[2].shape


def test_flops_on_a_hand_example():
    # chunk 3 after a prefix of 2: the queries see 3, 4 and 5 keys; without a mask 5 each
    c = chunked.ChunkedCase(prefix=2, D=1, page=16, B=1, chunk=3, Hq=1, Hkv=1)
    assert c.pairs() == 3 + 4 + 5 == 12
    assert c.flops() == 4 * 12
    full = chunked.ChunkedCase(prefix=2, D=1, page=16, B=1, chunk=3, Hq=1, Hkv=1, causal=False)
    assert full.pairs() == 3 * 5 and full.flops() == 4 * 15
    c = chunked.ChunkedCase(prefix=2, D=64, page=None, B=5, chunk=3, Hq=4, Hkv=2)
    assert c.flops() == 4 * 64 * 4 * 5 * 12
    big = chunked.ChunkedCase(prefix=8192, D=128, page=16)
    assert big.pairs() == 2048 * 8192 + 2048 * 2049 // 2
    assert big.flops() == 4 * 128 * 32 * 8 * big.pairs()
    # no prefix: the causal triangle of the chunk alone
    assert chunked.ChunkedCase(0, 128, 64).pairs() == 2048 * 2049 // 2


def test_paged_cache_scatters_pages_and_holds_the_keys():
    case = chunked.ChunkedCase(prefix=20, D=8, page=16, B=3, chunk=5, Hq=4, Hkv=2,
                               dtype="fp32")
    inp = chunked.make_inputs(case, "cpu")
    kc, vc, table = chunked.paged_cache(case, inp)
    per_seq = -(-25 // 16)
    assert tuple(kc.shape) == (3 * per_seq, 16, 2, 8) and tuple(table.shape) == (3, per_seq)
    assert sorted(table.reshape(-1).tolist()) == list(range(3 * per_seq))
    assert table.reshape(-1).tolist() != list(range(3 * per_seq))  # shuffled
    from wsattn.reference import gather_paged_kv
    for b in range(3):
        torch.testing.assert_close(gather_paged_kv(kc, table[b:b + 1], 25)[0],
                                   inp.k[b * 25:(b + 1) * 25], rtol=0, atol=0)
        torch.testing.assert_close(gather_paged_kv(vc, table[b:b + 1], 25)[0],
                                   inp.v[b * 25:(b + 1) * 25], rtol=0, atol=0)
    # the paged and the contiguous case of one shape see the same numbers
    other = chunked.make_inputs(chunked.ChunkedCase(20, 8, None, 3, 5, 4, 2, "fp32"), "cpu")
    assert torch.equal(other.q, inp.q) and torch.equal(other.k, inp.k)
    assert inp.cu_q.tolist() == [0, 5, 10, 15] and inp.cu_k.tolist() == [0, 25, 50, 75]
    assert inp.seqlens_k.tolist() == [25, 25, 25]
    plan = chunked.flashinfer_plan(case, inp, table)
    assert plan["paged_kv_indptr"].tolist() == [0, 2, 4, 6]
    assert plan["paged_kv_indices"].tolist() == table.reshape(-1).tolist()
    assert plan["paged_kv_last_page_len"].tolist() == [25 - 16] * 3
    assert plan["qo_indptr"].tolist() == [0, 5, 10, 15]
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim_qk"],
            plan["page_size"], plan["causal"]) == (4, 2, 8, 16, True)


# --------------------------------------------------------------------------- rows

def _row(prefix, page, impl, ms, status="ok", D=128):
    case = chunked.ChunkedCase(prefix, D, page)
    return chunked.make_row(STAMP, case, impl, status, rel_err=1e-3, tol=2e-2,
                            timing=_timing(ms) if status == "ok" else None,
                            matmul_tflops=800.0, check_slice="sequences [0, 7] of 8")


def test_row_schema_and_throughput():
    r = _row(8192, 16, "triton-paged", 2.0)
    assert set(r) == set(STAMP) | set(chunked.ROW_FIELDS)
    case = chunked.ChunkedCase(8192, 128, 16)
    assert (r["layout"], r["page_size"], r["prefix"], r["Sk"], r["chunk"], r["B"]) == \
        ("page16", 16, 8192, 10240, 2048, 8)
    assert r["flops"] == case.flops()
    assert r["tflops"] == pytest.approx(case.flops() / 2e-3 / 1e12)
    assert r["frac_matmul"] == pytest.approx(r["tflops"] / 800.0)
    assert (r["target_ratio"], r["target_met"], r["check_passed"]) == (0.95, None, True)
    c = _row(8192, None, "triton-contiguous", 1.0)
    assert c["layout"] == "contiguous" and c["target_ratio"] is None
    failed = chunked.make_row(STAMP, case, "triton-paged", "failed", rel_err=0.5, tol=2e-2,
                              reason="relative error; not timed")
    assert failed["check_passed"] is False and failed["median_ms"] is None
    assert failed["tflops"] is None
    na = chunked.make_row(STAMP, chunked.ChunkedCase(0, 128, None), "gluon-contiguous",
                          "not available", reason="no varlen path")
    assert set(na) == set(r)
    json.dumps([r, c, failed, na])


def test_ratio_and_target():
    rows = [_row(8192, None, "triton-contiguous", 1.0),
            _row(8192, 16, "triton-paged", 1.0 / 0.96),
            _row(8192, 64, "triton-paged", 1.0 / 0.90),
            _row(2048, 16, "triton-paged", 0.5),               # no contiguous row
            _row(8192, 16, "triton-paged", 1.0, D=64),         # other D: no partner
            _row(32768, None, "triton-contiguous", 1.0, status="failed"),
            _row(32768, 16, "triton-paged", 1.0),              # partner failed
            _row(8192, None, "gluon-contiguous", 0.5),
            # a --chunked-gluon-settings pair: the paged column against its own build's
            _row(8192, None, "gluon-contiguous[CONSUMERS=1]", 0.8),
            _row(8192, 16, "gluon-paged[CONSUMERS=1]", 1.0),
            _row(8192, 16, "gluon-paged", 1.0)]
    chunked.add_ratios(rows)
    assert rows[9]["ratio_contiguous"] == pytest.approx(0.8)
    assert rows[9]["target_met"] == "missed"
    assert rows[10]["ratio_contiguous"] == pytest.approx(0.5)
    assert rows[1]["ratio_contiguous"] == pytest.approx(0.96) and rows[1]["target_met"] == "met"
    assert rows[2]["ratio_contiguous"] == pytest.approx(0.90)
    assert rows[2]["target_met"] == "missed"
    for r in (rows[0], rows[3], rows[4], rows[6], rows[7]):
        assert r["ratio_contiguous"] is None and r["target_met"] is None
    # both timed in one interleaved loop: the ratio is paired by round, not of the medians
    slow_fast = [1.0, 1.11, 1.0, 1.11, 1.11]   # the contiguous column; median 1.11
    paired = [_row(2048, None, "triton-contiguous", 1.11), _row(2048, 64, "triton-paged", 1.0)]
    paired[0]["samples_ms"] = slow_fast
    paired[1]["samples_ms"] = [t / 0.97 for t in slow_fast]  # 0.97x in every round; median 1.144
    paired[0]["samples_t"] = [0.0, 1.0, 2.0, 3.0, 4.0]  # one loop: the spans overlap
    paired[1]["samples_t"] = [0.5, 1.5, 2.5, 3.5, 4.5]
    chunked.add_ratios(paired)
    assert paired[1]["ratio_contiguous"] == pytest.approx(0.97)
    assert chunked.paired_ratio(paired[0], paired[1]) == pytest.approx(0.97)
    paired[1]["samples_ms"] = paired[1]["samples_ms"][:4]  # not paired: the medians' ratio
    assert chunked.paired_ratio(paired[0], paired[1]) == pytest.approx(1.11 / 1.0)
    text = chunked.format_table(rows)
    assert "chunked-B8-C2048-P8192-H32-HKV8-D128-page64-bf16" in text
    assert "0.95 met" in text and "0.95 missed" in text


def test_plot_written(tmp_path):
    # matplotlib is the optional [plot] extra; the test venv installs it, so this runs in
    # CI and skips only where plotting is not installed at all
    pytest.importorskip("matplotlib")
    rows = [_row(p, page, impl, 1.0 + p / 8192, D=D) for D in (128, 64)
            for p in (0, 2048, 8192, 32768)
            for page, impl in ((None, "triton-contiguous"), (16, "triton-paged"),
                               (64, "triton-paged"))]
    path, msg = chunked.plot_rows(rows, tmp_path / "chunked.png")
    assert path.stat().st_size > 0, msg
    assert chunked.plot_rows([], tmp_path / "none.png")[0] is None
    assert not (tmp_path / "none.png").exists()


def test_write_only_when_asked(tmp_path):
    rows = [_row(0, 16, "triton-paged", 1.0)]
    args = types.SimpleNamespace(json=None, plot=None, no_plot=False, what="chunked")
    assert gemv.write(rows, STAMP, args, chunked.plot_rows) == []
    assert list(tmp_path.iterdir()) == []
    args.json, args.no_plot = str(tmp_path), True
    (path,) = gemv.write(rows, STAMP, args, chunked.plot_rows)
    assert path.parent == tmp_path and path.name.startswith("bench_chunked_none_")
    assert json.loads(path.read_text())[0]["impl"] == "triton-paged"
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


# --------------------------------------------------------------------------- end to end, tiny

CHUNKED_CHILD = CHILD_TIMER + r"""
import json, torch
torch.set_num_threads(1)
import wsattn
from wsattn.bench import chunked
timer = FakeTimer()
rows = []
SWEEP = ["triton-paged[16,16,4,1,1]", "triton-paged[16,32,4,1]",  # --chunked-settings columns
         "gluon-paged[CONSUMERS=1]", "gluon-contiguous[CONSUMERS=1]"]  # --chunked-gluon-settings
for prefix, chunk in ((0, 5), (20, 17)):
    cases = chunked.chunked_cases([prefix], [16], [64], batch=3, chunk=chunk, dtype="fp32",
                                  hq=4, hkv=2)
    rows += chunked.run_shape(cases, list(chunked.IMPLS) + SWEEP, timer, {"gpu": "none"}, "cpu",
                              100.0)
chunked.add_ratios(rows)
full = chunked.run_shape(chunked.chunked_cases([20], [16], [64], batch=2, chunk=7,
                                               dtype="fp32", hq=4, hkv=2, masks=("full",)),
                         ["wsattn", "triton-paged", "wsattn-contiguous"], timer,
                         {"gpu": "none"}, "cpu", 100.0)
chunked.add_ratios(full)
real = wsattn.attention_paged
wsattn.attention_paged = lambda *a, **kw: real(*a, **kw).mul_(1.1)   # a wrong kernel
before = timer.n
bad = chunked.run_shape(chunked.chunked_cases([20], [16], [64], batch=2, chunk=7,
                                              dtype="fp32", hq=4, hkv=2),
                        ["triton-paged"], timer, {"gpu": "none"}, "cpu", 100.0)
print("RESULT " + json.dumps({"rows": rows, "bad": bad, "timed_bad": timer.n - before,
                              "timed": before, "full": full}))
"""


def test_runner_checks_then_times_on_the_interpreter():
    """wsattn (the default route) and wsattn-append (the same call appending the chunk),
    triton-paged and triton-gather (page 16, shuffled pages), wsattn-contiguous and
    triton-contiguous on a tiny fp32 shape through the
    interpreter: each output within tolerance of float64, then timed; the Gluon columns
    are 'not available' with the dispatcher's reason, flashinfer-paged with the import
    error; a wrong kernel fails and is not timed."""
    r = interpreter_child(CHUNKED_CHILD, timeout=300)
    rows = {(row["prefix"], row["impl"]): row for row in r["rows"]}
    assert len(r["rows"]) == 2 * 15
    for prefix in (0, 20):
        for impl in ("wsattn", "wsattn-append", "triton-paged", "triton-gather",
                     "wsattn-contiguous",
                     "triton-contiguous", "triton-paged[16,16,4,1,1]",
                     "triton-paged[16,32,4,1]"):
            row = rows[(prefix, impl)]
            assert row["status"] == "ok", row
            assert row["rel_err"] <= 2e-3 and row["check_passed"] and row["median_ms"] == 1.0
            assert row["samples_ms"] == [1.0] * 3  # FakeTimer.samples rounds
            assert len(row["samples_t"]) == 3
            assert row["frac_matmul"] == pytest.approx(row["tflops"] / 100.0)
            assert row["check_slice"] == "sequences [0, 2] of 3"
        paged = rows[(prefix, "triton-paged")]
        assert paged["page_size"] == 16 and paged["ratio_contiguous"] == pytest.approx(1.0)
        assert paged["target_met"] == "met"
        gather = rows[(prefix, "triton-gather")]  # against the same backend's contiguous
        assert gather["ratio_contiguous"] == pytest.approx(1.0) and gather["target_met"] == "met"
        default = rows[(prefix, "wsattn")]  # against wsattn-contiguous
        assert default["ratio_contiguous"] == pytest.approx(1.0)
        append = rows[(prefix, "wsattn-append")]  # the call that appends, against the same
        assert append["ratio_contiguous"] == pytest.approx(1.0)
        for impl in ("gluon-contiguous", "gluon-gather", "gluon-paged",
                     "gluon-one-consumer-contiguous", "gluon-paged[CONSUMERS=1]",
                     "gluon-contiguous[CONSUMERS=1]"):
            gluon = rows[(prefix, impl)]
            # the Gluon kernel takes varlen now; on CPU tensors the dispatcher names the device
            assert gluon["status"] == "not available" and "sm_90" in gluon["reason"]
        fi = rows[(prefix, "flashinfer-paged")]  # not installed on the CPU machines
        assert fi["status"] == "not available" and "flashinfer" in fi["reason"]
    assert rows[(20, "triton-paged")]["flops"] == 4 * 64 * 4 * 3 * (17 * 20 + 17 * 18 // 2)
    assert r["timed"] == 16 + 3  # the causal shapes, then the three columns without a mask
    assert rows[(20, "triton-paged[16,16,4,1,1]")]["ratio_contiguous"] == pytest.approx(1.0)
    # without a mask: checked against its own float64 reference (every key seen), timed
    assert [(row["impl"], row["status"], row["causal"]) for row in r["full"]] == \
        [("wsattn-contiguous", "ok", False), ("wsattn", "ok", False),
         ("triton-paged", "ok", False)], r["full"]
    assert all(row["rel_err"] <= 2e-3 for row in r["full"])
    assert r["full"][1]["flops"] == 4 * 64 * 4 * 2 * 7 * 27
    assert r["full"][1]["ratio_contiguous"] == pytest.approx(1.0)
    (bad,) = r["bad"]
    assert bad["status"] == "failed" and bad["median_ms"] is None and r["timed_bad"] == 0
    assert "not timed" in bad["reason"] and bad["rel_err"] > 2e-3


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_runner_on_the_gpu():
    """A small bf16 shape (B 2, chunk 256, prefix 1000: the prefix ends mid-page) through the
    real runner: triton-paged (page 16 and 64) and triton-contiguous checked against float64
    and timed from a CUDA graph."""
    from wsattn.bench.timing import cuda_timer

    timer = cuda_timer(5, 20, "graph")
    cases = chunked.chunked_cases([1000], [16, 64], [128], batch=2, chunk=256)
    extra = ["gluon-paged[one_consumer]", "gluon-contiguous[one_consumer]",
             "gluon-paged[default]", "gluon-contiguous[default]", "gluon-paged[STAGES=2]",
             "gluon-contiguous[STAGES=2]"]
    rows = chunked.run_shape(cases, list(chunked.IMPLS) + extra, timer, STAMP, "cuda", 800.0)
    chunked.add_ratios(rows)
    by = {(r["impl"], r["page_size"]): r for r in rows}
    if torch.cuda.get_device_capability() == (9, 0):  # the --chunked-gluon-settings columns
        for impl in extra:
            for page in ((None,) if "contiguous" in impl else (16, 64)):
                assert by[(impl, page)]["status"] == "ok", by[(impl, page)]
        assert by[("gluon-paged[one_consumer]", 16)]["ratio_contiguous"] is not None
    for key in (("triton-contiguous", None), ("triton-paged", 16), ("triton-paged", 64),
                ("triton-gather", 16), ("triton-gather", 64), ("wsattn-contiguous", None),
                ("wsattn", 16), ("wsattn", 64), ("wsattn-append", 16), ("wsattn-append", 64)):
        r = by[key]
        assert r["status"] == "ok", r
        assert r["timing"] == "graph" and r["rel_err"] <= r["tol"] and r["tflops"] > 0
        assert len(r["samples_ms"]) == timer.samples  # one a round of the interleaved loop
        assert len(r["samples_t"]) == timer.samples
    for page in (16, 64):
        assert by[("triton-paged", page)]["target_met"] in ("met", "missed")
    for impl in ("gluon-contiguous", "gluon-one-consumer-contiguous"):
        assert by[(impl, None)]["status"] in ("ok", "not available")
        if torch.cuda.get_device_capability() == (9, 0):  # the Gluon kernel's target
            assert by[(impl, None)]["status"] == "ok", by[(impl, None)]
    for page in (16, 64):
        assert by[("gluon-gather", page)]["status"] in ("ok", "not available")
        assert by[("gluon-paged", page)]["status"] in ("ok", "not available")
    for page in (16, 64):  # the peer wheel may be absent, but a wrong answer is not allowed
        assert by[("flashinfer-paged", page)]["status"] in ("ok", "not available")


def test_the_flashinfer_peer_is_not_set_against_wsattns_contiguous_column():
    """ratio_contiguous and the 0.95 target belong to wsattn's paged columns: the flashinfer
    peer has no contiguous column of its own, so it gets neither."""
    from wsattn.bench import chunked

    shape = dict(prefix=4096, D=128, B=1, chunk=512, Hq=8, Hkv=8, dtype="bf16", causal=True)

    def row(impl, ms, page):
        return {"op": "chunked", "impl": impl, "status": "ok", "page_size": page,
                "median_ms": ms, **shape}
    rows = chunked.add_ratios([row("triton-contiguous", 1.0, None),
                               row("triton-paged", 1.02, 64), row("flashinfer-paged", 1.02, 64)])
    assert rows[1]["ratio_contiguous"] == pytest.approx(1 / 1.02)
    assert rows[2].get("ratio_contiguous") is None and rows[2].get("target_met") is None


def test_a_gluon_columns_failure_sets_the_exit_status():
    from wsattn.bench import chunked
    from wsattn.bench.report import exit_status

    rows = [{"op": "chunked", "impl": "gluon-paged", "status": "error", "case": "c", "reason": "r"},
            {"op": "chunked", "impl": "flashinfer-paged", "status": "error", "case": "c",
             "reason": "r"}]
    assert exit_status(rows[:1], chunked.is_wsattn) == 1
    assert exit_status(rows[1:], chunked.is_wsattn) == 0  # a peer's failure is its row
