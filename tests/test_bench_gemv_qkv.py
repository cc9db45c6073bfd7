"""wsattn bench gemv's qkv_rope cases (the step's fused QKV + RoPE + paged append) on CPU:
the cases per model and M, the --qkv-settings parser and its exit code, and run_case end to
end through the interpreter (default and swept settings, the cuBLAS peer, wrong kernels
not timed); a GPU twin at the Llama-3.2-1B shape."""

from __future__ import annotations

import types

import pytest

import wsattn.cli
from wsattn.bench import gemv, step

from conftest import BENCH_STAMP as STAMP, CHILD_TIMER, interpreter_child


# --------------------------------------------------------------------------- cases

def test_qkv_rope_cases_for_every_model_and_m():
    cases = [c for c in gemv.gemv_cases(m_values=[1, 8, 64], kernels=gemv.ALL_KERNELS)
             if c.kernel == "qkv_rope"]
    dense = [m for m in step.MODELS if not step.model_config(m).is_moe]
    assert {(c.model, c.M) for c in cases} == {(m, M) for m in dense for M in (1, 8, 64)}
    # a MoE model without dense layers: its attention projections and LM head, the fused
    # QKV case with its per-head QK-norm; its experts are `bench moe`'s
    moe = gemv.gemv_cases(["qwen3-30b-a3b"], [8], gemv.ALL_KERNELS)
    assert [(c.kernel, c.N, c.K) for c in moe] == [
        ("qkv", 5120, 2048), ("qkv_rope", 5120, 2048), ("o", 2048, 4096),
        ("lm_head", 151936, 2048)]
    assert moe[1].qk_norm and (moe[1].heads, moe[1].kv_heads, moe[1].head_dim) == (32, 4, 128)
    with pytest.raises(ValueError, match="qwen3-30b-a3b is a mixture-of-experts model "
                                         "without a dense layer"):
        gemv.gemv_cases(["qwen3-30b-a3b"], kernels=["gate_up", "down"])
    plain = {(c.model, c.M): c for c in gemv.gemv_cases(m_values=[1, 8, 64], kernels=["qkv"])}
    for c in cases:
        cfg = step.model_config(c.model)
        assert (c.heads, c.kv_heads, c.head_dim, c.K) == \
            (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden)
        assert (c.rope, c.eps, c.qk_norm, c.bias) == \
            (cfg.rope, cfg.rms_eps, cfg.qk_norm, cfg.qkv_bias)
        # the same weight bytes and copies as the plain qkv row of that model and M
        assert c.w_bytes() == plain[(c.model, c.M)].w_bytes()
        assert c.copies() == plain[(c.model, c.M)].copies()
        assert c.ctx - 1 == 4095 and c.page_size == 64  # the engine's page
    by_model = {c.model: c for c in cases if c.M == 1}
    assert by_model["llama-3.2-1b"].w_bytes() == 3072 * 2048 * 2  # notes: 12.6 MB
    assert by_model["llama-3.2-1b"].rope.type == "llama3"
    assert by_model["llama-3.2-1b"].epilogue == "norm+rope+append"
    assert by_model["qwen3-8b"].epilogue == "norm+qk_norm+rope+append"
    # the command line's default runs it, right after the plain qkv of each model and M
    args = wsattn.cli.build_parser().parse_args(["bench", "gemv"])
    assert "qkv_rope" in args.kernels
    kinds = [c.kernel for c in gemv.gemv_cases(["llama-3.2-1b"], [1], args.kernels)]
    assert kinds == ["qkv", "qkv_rope", "o", "gate_up", "down", "lm_head"]


def test_qkv_rope_case_refuses_a_wrong_n():
    from wsattn.models.config import RopeConfig
    with pytest.raises(ValueError, match="heads \\+ 2 kv_heads"):
        gemv.QkvRopeCase("tiny", "qkv_rope", 1, 200, 64, True, False, False, "fp32",
                         heads=2, kv_heads=1, head_dim=64, rope=RopeConfig(), eps=1e-5)


# --------------------------------------------------------------------------- --qkv-settings

@pytest.mark.parametrize("spec, match", [("128,4,8", "four integers"),
                                         ("128,4,8,4,2", "use_dot must be 0 or 1"),
                                         ("128,4,8,4,1,1", "four integers"),
                                         ("a,4,8,4", "four integers"),
                                         ("96,4,8,4", "BLOCK_K must be a power of two"),
                                         ("8,4,8,4", "BLOCK_K must be a power of two"),
                                         ("128,0,8,4", "split_k must be >= 1"),
                                         ("128,4,6,4", "num_warps must be"),
                                         ("128,4,8,0", "num_stages must be >= 1")])
def test_qkv_settings_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        gemv.parse_qkv_settings([spec])
    assert "--qkv-settings" in str(e.value)


def test_qkv_settings_parse_to_columns():
    from wsattn.kernels.qkv_rope import QkvRopeSettings, TwoLaunchSettings
    got = gemv.parse_qkv_settings(["128,4,8,4", "64, 1,4,6", "64,4,8,4,0", "64,4,8,4,1"])
    assert got == {"wsattn[qkv:128,4,8,4]": QkvRopeSettings(128, 4, 8, 4),
                   "wsattn[qkv:64,1,4,6]": QkvRopeSettings(64, 1, 4, 6),
                   "wsattn[qkv:64,4,8,4,0]": QkvRopeSettings(64, 4, 8, 4, use_dot=False),
                   "wsattn[qkv:64,4,8,4]": QkvRopeSettings(64, 4, 8, 4)}
    assert gemv.parse_qkv_settings(None) == {}
    assert gemv.parse_qkv_settings(["gemv"]) == {"wsattn[qkv:gemv]": TwoLaunchSettings()}
    from wsattn.kernels.qkv_rope import GemvRopeSettings
    assert gemv.parse_qkv_settings(["gemv-rope"]) == {
        "wsattn[qkv:gemv-rope]": GemvRopeSettings()}
    from wsattn.kernels.gemv import GemvSettings
    assert gemv.parse_qkv_settings(["gemv-rope:64,128,4,1,4,3"]) == {
        "wsattn[qkv:gemv-rope:64,128,4,1,4,3]":
            GemvRopeSettings(gemv=GemvSettings(64, 128, 4, True, 4, 3))}
    for bad, match in (("gemv-rope:64,128,4,1,4", "six integers"),
                       ("gemv-rope:64,128,4,2,4,3", "use_dot must be 0 or 1")):
        with pytest.raises(ValueError, match=match) as e:
            gemv.parse_qkv_settings([bad])
        assert f"--qkv-settings {bad!r}" in str(e.value)
    args = wsattn.cli.build_parser().parse_args(
        ["bench", "gemv", "--kernels", "qkv_rope", "--qkv-settings", "128,4,8,4", "64,2,4,6"])
    assert args.kernels == ["qkv_rope"] and args.qkv_settings == ["128,4,8,4", "64,2,4,6"]


def test_main_exits_2_on_a_bad_qkv_spec_before_the_gpu(capsys):
    args = wsattn.cli.build_parser().parse_args(
        ["bench", "gemv", "--models", "llama-3.2-1b", "--qkv-settings", "128,4,8"])
    assert gemv.main(args) == 2  # no GPU here: it must stop before looking for one
    assert "--qkv-settings '128,4,8': expected four integers" in capsys.readouterr().err


def test_sweep_columns_only_on_their_own_cases():
    """GemvSettings columns give no qkv_rope rows and QkvRopeSettings columns no plain ones."""
    sweep = {**gemv.parse_settings(["16,32,1,0,4,2"]), **gemv.parse_qkv_settings(["32,1,4,1"])}
    fused, plain = (gemv.gemv_cases(["llama-3.2-1b"], [1], [k]) for k in ("qkv_rope", "qkv"))
    assert [n for n in sweep if gemv._applies(fused[0], sweep[n])] == ["wsattn[qkv:32,1,4,1]"]
    assert [n for n in sweep if gemv._applies(plain[0], sweep[n])] == ["wsattn[16,32,1,0,4,2]"]
    assert gemv._applies(fused[0], None) and gemv._applies(plain[0], None)


# --------------------------------------------------------------------------- end to end

QKV_CHILD = CHILD_TIMER + r"""
import json, torch
torch.set_num_threads(1)
from wsattn.bench import gemv
from wsattn.models.config import RopeConfig
import wsattn.kernels.qkv_rope as kq

timer = FakeTimer(3)
LLAMA3 = RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
def case(M, **kw):
    kw = {"heads": 2, "kv_heads": 1, "head_dim": 64, "rope": LLAMA3, "eps": 1e-5, "ctx": 40,
          **kw}
    return gemv.QkvRopeCase("tiny", "qkv_rope", M, 256, 64, True, False, False, "fp32",
                            fresh_bytes=3 * 256 * 64 * 4, **kw)
cases = [case(1), case(3), case(3, rope=RopeConfig(), bias=True, qk_norm=True, eps=1e-6)]
sweep = {**gemv.parse_qkv_settings(["16,2,4,1", "16,2,4,1,0", "gemv"]),
         **gemv.parse_settings(["16,32,1,0,4,2"])}
impls = ["wsattn-nopdl", "cublas"] + list(sweep)
rows = []
for c in cases:
    rows += gemv.run_case(c, impls, timer, {"gpu": "none"}, "cpu", 4.0, settings=sweep)
calls = [timer.n]
real = kq.qkv_rope_append
kq.qkv_rope_append = lambda *a, **kw: real(*a, **kw).mul_(1.1)   # a wrong q
bad_q = gemv.run_case(cases[1], ["wsattn-nopdl"], timer, {"gpu": "none"}, "cpu", 4.0)
# right q, but the append goes to copies of the cache: the real slots are never written
kq.qkv_rope_append = lambda *a, k_cache, v_cache, **kw: real(
    *a, k_cache=k_cache.clone(), v_cache=v_cache.clone(), **kw)
no_append = gemv.run_case(cases[1], ["wsattn-nopdl"], timer, {"gpu": "none"}, "cpu", 4.0)
calls.append(timer.n)
print("RESULT " + json.dumps({"rows": rows, "bad_q": bad_q, "no_append": no_append,
                              "calls": calls}))
"""


def test_qkv_rope_runner_checks_then_times_on_the_interpreter():
    """The fused kernel (defaults, a split-K column and the FMA path), the two-launch path
    and their cuBLAS peer, checked on q and
    the appended k/v slots against float64, then timed; a wrong q or a missing append is
    'failed' and never timed; the plain GEMV column gives no qkv_rope row."""
    r = interpreter_child(QKV_CHILD, timeout=300)
    rows = r["rows"]
    assert [row["impl"] for row in rows] == ["wsattn-nopdl", "cublas", "wsattn[qkv:16,2,4,1]",
                                             "wsattn[qkv:16,2,4,1,0]", "wsattn[qkv:gemv]"] * 3
    for row in rows:
        assert row["status"] == "ok", row
        assert row["kernel"] == "qkv_rope" and row["rel_err"] <= 2e-3 and row["copies"] == 3
        assert row["calls"] == 3 and row["w_bytes"] == 256 * 64 * 4 and row["N"] == 256
        if row["impl"] == "cublas":
            assert row["epilogue"] == "none"
            assert "F.linear" in row["note"] and "no FlashNorm" in row["note"] \
                and "RoPE" in row["note"] and "append" in row["note"]
        else:
            assert row["epilogue"].endswith("rope+append")
            assert "rel_err q/k/v" in row["note"]
    assert rows[0]["note"].startswith("default settings 32,1,4,1")  # the interpreter's
    assert rows[-1]["epilogue"] == "norm+bias+qk_norm+rope+append"
    for bad in (r["bad_q"], r["no_append"]):
        (row,) = bad
        assert row["status"] == "failed" and row["median_ms"] is None, row
        assert "not timed" in row["reason"]
    assert r["no_append"][0]["rel_err"] == float("inf")  # the NaN slots were left as they were
    assert r["calls"][1] == r["calls"][0]  # neither wrong kernel reached the timer


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_qkv_rope_runner_on_the_gpu():
    """The 1B fused QKV at M 1 with PDL on and off, a swept column and the cuBLAS peer: each
    checked against float64, then timed in a graph."""
    from wsattn.bench.timing import cuda_timer

    timer = cuda_timer(5, 20, "graph")
    (case,) = gemv.gemv_cases(["llama-3.2-1b"], [1], ["qkv_rope"])
    sweep = gemv.parse_qkv_settings(["128,1,8,4"])
    rows = gemv.run_case(case, ["wsattn", "wsattn-nopdl", "cublas", *sweep], timer, STAMP,
                         "cuda", 4.0, settings=sweep)
    assert [r["impl"] for r in rows] == ["wsattn", "wsattn-nopdl", "cublas",
                                         "wsattn[qkv:128,1,8,4]"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["timing"] == "graph" and r["tbps"] > 0 and r["rel_err"] <= r["tol"]
    assert gemv.add_ratios(rows)[0]["ratio_cublas"] > 0


def test_table_and_plot_take_qkv_rope_rows(tmp_path):
    from wsattn.bench.timing import Timing
    timing = Timing(median_ms=0.01, q20_ms=0.009, q80_ms=0.011, reps=20, method="graph",
                    calls=7)
    rows = [gemv.make_row(STAMP, c, i, "ok", rel_err=0.0, tol=1.0, timing=timing, copy_tbps=4.0)
            for c in gemv.gemv_cases(["llama-3.2-1b"], [1], ["qkv", "qkv_rope"])
            for i in gemv.IMPLS]
    assert "gemv-llama-3.2-1b-qkv_rope-M1" in gemv.format_table(rows)
    path, msg = gemv.plot_rows(rows, tmp_path / "gemv.png")
    assert path is None or path.exists(), msg
    args = types.SimpleNamespace(json=None, plot=None, no_plot=True, what="gemv")
    assert gemv.write(rows, STAMP, args, gemv.plot_rows) == []
