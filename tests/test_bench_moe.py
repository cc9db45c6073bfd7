"""wsattn bench moe on CPU: the missing-GPU exit, the model shapes and transformers' blocks
and experts implementations, the distinct-expert and touched-byte arithmetic on a hand-made
routing, the float64 reference, the row schema and the targets' met / missed logic, the
outputs written only when asked, the plot, and the runner end to end on a tiny shape
(transformers' blocks, torch._grouped_mm and the Triton path through the interpreter)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import wsattn.cli
from wsattn.bench import gemv, moe

from conftest import BENCH_STAMP as STAMP, CHILD_TIMER, bench_timing as _timing, interpreter_child


# --------------------------------------------------------------------------- command line

def test_without_gpu_exits_2_with_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wsattn.cli.main(["bench", "moe"]) == 2
    assert "wsattn bench needs a CUDA GPU" in capsys.readouterr().err


def test_console_without_gpu_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "wsattn.cli", "bench", "moe", "--moe-models",
                          "qwen3-30b-a3b", "--json", str(out), "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, res.stderr
    assert not out.exists() and not (tmp_path / "p.png").exists()


def test_help_and_options():
    parser = wsattn.cli.build_parser()
    args = parser.parse_args(["bench", "moe", "--moe-models", "mixtral-8x7b", "olmoe-1b-7b",
                              "--moe-batch", "1", "8", "--moe-impl", "wsattn-triton",
                              "hf-grouped_mm"])
    assert (args.what, args.moe_models, args.moe_batch, args.moe_impl) == \
        ("moe", ["mixtral-8x7b", "olmoe-1b-7b"], [1, 8], ["wsattn-triton", "hf-grouped_mm"])
    args = parser.parse_args(["bench", "moe"])
    assert (args.moe_models, args.moe_batch, args.moe_impl) == (None, [1, 8, 32, 64],
                                                                list(moe.IMPLS))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "moe", "--moe-impl", "vllm"])
    args = parser.parse_args(["bench", "moe", "--moe-settings", "16,64,128,4,4", "4,32,128,4,6"])
    assert args.moe_settings == ["16,64,128,4,4", "4,32,128,4,6"]
    assert moe.parse_settings("16,64,128,4,4") == \
        wsattn.kernels.moe.MoeSettings(16, 64, 128, 4, 4)
    for bad, says in (("16,64,128,4", "five ints"), ("16,64,x,4,4", "five ints"),
                      ("8,64,128,4,4", "block must be one of"),
                      ("16,48,128,4,4", "power of two")):
        with pytest.raises(ValueError, match=says):
            moe.parse_settings(bad)


def test_help_lists_moe(capsys):
    with pytest.raises(SystemExit) as e:
        wsattn.cli.main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("moe", "--moe-models", "--moe-batch", "--moe-impl", "wsattn.bench.moe"):
        assert word in text, word


# --------------------------------------------------------------------------- shapes, columns

def test_model_shapes_are_the_issue_shapes():
    got = {m: (c.family, c.hidden, c.experts, c.top_k, c.moe_ffn, c.norm_topk)
           for m in moe.MODELS for c in [moe.model_config(m)]}
    assert got == {"qwen3-30b-a3b": ("qwen3_moe", 2048, 128, 8, 768, True),
                   "mixtral-8x7b": ("mixtral", 4096, 8, 2, 14336, True),
                   "olmoe-1b-7b": ("olmoe", 2048, 64, 8, 1024, False),
                   "dots-llm1": ("dots1", 4096, 128, 6, 1408, True)}
    dots = moe.model_config("dots-llm1")
    assert (dots.scoring, dots.router_bias, dots.routed_scale) == ("sigmoid", True, 2.5)
    cases = moe.moe_cases()
    assert [(c.model, c.B) for c in cases] == [(m, b) for m in moe.MODELS for b in (1, 8, 32, 64)]
    assert cases[0].id == "moe-qwen3-30b-a3b-B1-bf16"
    with pytest.raises(ValueError, match="model must be one of"):
        moe.moe_cases(["deepseek-v3"])
    with pytest.raises(ValueError, match="batch must be an int in 1..64"):
        moe.moe_cases(batches=[65])


def test_columns_are_transformers_experts_implementations_and_its_blocks():
    """Every experts implementation the installed transformers offers is a column, and each
    model's block built from its config has the kernels' weight layout."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert set(moe.HF_EXPERTS) == {"eager"} | set(ALL_EXPERTS_FUNCTIONS)
    assert moe.IMPLS[-4:] == ("wsattn-triton", "wsattn-triton-pdl", "wsattn-triton-token",
                              "wsattn-gluon")
    for name in moe.MODELS:
        c = moe.model_config(name)
        E, H, F = c.experts, c.hidden, c.moe_ffn
        tensors = (torch.empty(E, H, device="meta"), torch.empty(E, 2 * F, H, device="meta"),
                   torch.empty(E, H, F, device="meta"))
        block = moe._hf_block(moe.MoeCase(name, 1), "grouped_mm", *tensors)
        assert type(block).__name__ == moe.HF_BLOCKS[c.family]
        assert block.experts.config._experts_implementation == "grouped_mm"
        assert block.gate.top_k == c.top_k
        assert block.experts.gate_up_proj is not None and \
            tuple(block.experts.down_proj.shape) == (E, H, F)
    with pytest.raises(moe.NotAvailable, match="bf16 only"):
        moe._hf_block(moe.MoeCase("olmoe-1b-7b", 1, "fp32"), "deepgemm", *tensors)


# --------------------------------------------------------------------------- arithmetic

def test_distinct_experts_and_touched_bytes_on_a_hand_made_routing():
    ids = torch.tensor([[3, 0], [3, 1], [7, 0]])
    assert moe.distinct_experts(ids) == len({3, 0, 1, 7}) == 4
    assert moe.distinct_experts([[5, 5]]) == 1
    q = moe.MoeCase("qwen3-30b-a3b", 8)
    # 9.44 MB an expert (notes/moe.md) plus the 0.5 MB router
    assert q.touched_bytes(1) == 3 * 2048 * 768 * 2 + 128 * 2048 * 2
    assert q.touched_bytes(8) == 8 * 9_437_184 + 524_288 == 76_021_760
    assert moe.MoeCase("mixtral-8x7b", 1).touched_bytes(2) == \
        2 * 3 * 4096 * 14336 * 2 + 8 * 4096 * 2
    assert moe.MoeCase("olmoe-1b-7b", 1, "fp32").touched_bytes(8) == \
        (8 * 3 * 2048 * 1024 + 64 * 2048) * 4
    # copies: enough that the touched bytes of all copies span FRESH_BYTES, no more
    assert q.copies(8) == math.ceil(gemv.FRESH_BYTES / 76_021_760) == 3
    assert moe.MoeCase("mixtral-8x7b", 1).copies(2) == 1
    assert moe.rerouted([[1, 2], [3, 4]], [[2, 1], [3, 5]]) == 1


def test_routing64_ties_to_the_lower_index_and_reference_matches_a_per_token_sum():
    g = torch.Generator().manual_seed(1)
    T, E, H, F, k = 5, 6, 16, 8, 3
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    rw = torch.randn(E, H, generator=g, dtype=torch.float64)
    rw[4] = rw[1]  # experts 1 and 4 tie for every token
    wgu = torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64) / 4
    wd = torch.randn(E, H, F, generator=g, dtype=torch.float64) / 3
    cfg = types.SimpleNamespace(scoring="softmax", top_k=k)
    probs, ids = moe.routing64(x, rw, cfg)
    assert not ((ids == 4).any(dim=1) & ~(ids == 1).any(dim=1)).any()  # 4 never without 1
    for renorm in (True, False):
        y = moe.reference(x, rw, wgu, wd, ids,
                          types.SimpleNamespace(scoring="softmax", top_k=k, norm_topk=renorm))
        for t in range(T):
            w = probs[t, ids[t]]
            w = w / w.sum() if renorm else w
            want = sum(w[j] * wd[e] @ (torch.nn.functional.silu(wgu[e, :F] @ x[t])
                                       * (wgu[e, F:] @ x[t])) for j, e in enumerate(ids[t]))
            torch.testing.assert_close(y[t], want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- rows

def _row(model, B, impl, frac, status="ok"):
    case = moe.MoeCase(model, B)
    hit = 8
    ms = 0.01
    copy = case.touched_bytes(hit) / (ms * 1e-3) / 1e12 / frac  # so frac_copy == frac
    return moe.make_row(STAMP, case, impl, status, experts_hit=hit, copies=1, rel_err=1e-3,
                        tol=2e-2, timing=_timing(ms), copy_tbps=copy, tokens_rerouted=0)


def test_row_schema_fields_and_targets():
    r = _row("qwen3-30b-a3b", 1, "wsattn-triton", 0.85)
    assert set(r) == set(STAMP) | set(moe.ROW_FIELDS)
    assert (r["family"], r["hidden"], r["experts"], r["top_k"], r["ffn"], r["renormalize"]) == \
        ("qwen3_moe", 2048, 128, 8, 768, True)
    assert r["touched_bytes"] == 76_021_760 and r["experts_hit"] == 8
    assert r["tbps"] == pytest.approx(76_021_760 / 1e-5 / 1e12)
    assert r["frac_copy"] == pytest.approx(0.85)
    assert r["floor_us"] == pytest.approx(0.85 * 10.0)  # floor / time = frac
    assert (r["target_frac"], r["target_met"], r["check_passed"]) == (0.80, "met", True)
    assert _row("qwen3-30b-a3b", 8, "wsattn-triton-pdl", 0.79)["target_met"] == "missed"
    assert _row("qwen3-30b-a3b", 64, "wsattn-triton", 0.72)["target_met"] == "met"
    assert _row("qwen3-30b-a3b", 64, "wsattn-triton", 0.69)["target_met"] == "missed"
    for no_target in (_row("qwen3-30b-a3b", 32, "wsattn-triton", 0.5),
                      _row("mixtral-8x7b", 1, "wsattn-triton", 0.5),
                      _row("olmoe-1b-7b", 8, "wsattn-triton", 0.99),
                      _row("qwen3-30b-a3b", 1, "hf-grouped_mm", 0.1),
                      _row("qwen3-30b-a3b", 1, "torch-grouped-mm", 0.9)):
        assert no_target["target_frac"] is None and no_target["target_met"] is None
    case = moe.MoeCase("qwen3-30b-a3b", 8)
    failed = moe.make_row(STAMP, case, "wsattn-triton", "failed", experts_hit=52, rel_err=0.5,
                          tol=2e-2, reason="relative error; not timed", copy_tbps=4.0)
    assert failed["check_passed"] is False and failed["median_ms"] is None
    assert failed["tbps"] is None and failed["target_met"] is None
    na = moe.make_row(STAMP, case, "wsattn-gluon", "not available", reason=moe.GLUON_MISSING)
    assert set(na) == set(r) and na["touched_bytes"] is None
    json.dumps([r, failed, na])


def test_ratios_and_table():
    rows = [_row("qwen3-30b-a3b", 8, "hf-eager", 0.05),
            _row("qwen3-30b-a3b", 8, "hf-grouped_mm", 0.2),
            _row("qwen3-30b-a3b", 8, "wsattn-triton", 0.7),
            _row("qwen3-30b-a3b", 8, "wsattn-triton-pdl", 0.8)]
    for r, ms in zip(rows, (1.0, 0.25, 0.05, 0.04)):
        r["median_ms"] = ms
    moe.add_ratios(rows)
    assert rows[0]["ratio_best_hf"] is None and rows[1]["ratio_best_hf"] is None
    assert rows[2]["ratio_best_hf"] == pytest.approx(5.0)
    assert rows[3]["pdl_speedup"] == pytest.approx(1.25) and rows[2]["pdl_speedup"] is None
    text = moe.format_table(rows)
    assert "moe-qwen3-30b-a3b-B8-bf16" in text and "wsattn-triton-pdl" in text and "missed" in text


def test_plot_written(tmp_path):
    # matplotlib is the optional [plot] extra; the test venv installs it, so this runs in
    # CI and skips only where plotting is not installed at all
    pytest.importorskip("matplotlib")
    rows = [_row(m, b, i, f) for m in ("qwen3-30b-a3b", "mixtral-8x7b") for b in (1, 8, 64)
            for i, f in (("hf-grouped_mm", 0.2), ("wsattn-triton", 0.75))]
    path, msg = moe.plot_rows(rows, tmp_path / "moe.png")
    assert path.stat().st_size > 0, msg
    assert moe.plot_rows([], tmp_path / "none.png")[0] is None
    assert not (tmp_path / "none.png").exists()


def test_write_only_when_asked(tmp_path):
    rows = [_row("qwen3-30b-a3b", 1, "wsattn-triton", 0.85)]
    args = types.SimpleNamespace(json=None, plot=None, no_plot=False, what="moe")
    assert gemv.write(rows, STAMP, args, moe.plot_rows) == []
    assert list(tmp_path.iterdir()) == []
    args.json, args.no_plot = str(tmp_path), True
    (path,) = gemv.write(rows, STAMP, args, moe.plot_rows)
    assert path.parent == tmp_path and path.name.startswith("bench_moe_none_")
    assert json.loads(path.read_text())[0]["impl"] == "wsattn-triton"
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


# --------------------------------------------------------------------------- end to end, tiny

MOE_CHILD = CHILD_TIMER + r"""
import json, torch
torch.set_num_threads(1)
from wsattn.bench import moe
moe.MODELS["tiny-qwen3-moe"] = {**moe.MODELS["qwen3-30b-a3b"], "hidden_size": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 64, "vocab_size": 16, "intermediate_size": 64, "max_window_layers": 1}
timer = FakeTimer(3)  # cycles through the weight copies as a capture would
rows = []
SWEEP = ["wsattn-triton[16,32,32,4,1]", "wsattn-triton[4,16,32,4,1]"]  # --moe-settings columns
for B in (1, 5):
    case = moe.MoeCase("tiny-qwen3-moe", B, "fp32", fresh_bytes=100_000)
    rows += moe.run_case(case, list(moe.IMPLS) + SWEEP, timer, {"gpu": "none"}, "cpu", 4.0)
# dots.llm1's routing (sigmoid, score-correction bias, scale 2.5), groups added: 8
# experts in 4 groups, 2 kept
moe.MODELS["tiny-dots1"] = {**moe.MODELS["dots-llm1"], "hidden_size": 64,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "n_group": 4, "topk_group": 2, "num_hidden_layers": 2, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 16, "intermediate_size": 64}
dots = moe.run_case(moe.MoeCase("tiny-dots1", 5, "fp32", fresh_bytes=1),
                    ["hf-eager", "hf-grouped_mm", "torch-grouped-mm", "wsattn-triton"],
                    timer, {"gpu": "none"}, "cpu", 4.0)
import wsattn.kernels.moe as km
real = km.moe
km.moe = lambda *a, **kw: real(*a, **kw).mul_(1.1)   # a wrong kernel
before = timer.n
bad = moe.run_case(moe.MoeCase("tiny-qwen3-moe", 5, "fp32", fresh_bytes=1), ["wsattn-triton"],
                   timer, {"gpu": "none"}, "cpu", 4.0)
print("RESULT " + json.dumps({"rows": rows, "bad": bad, "timed_bad": timer.n - before,
                              "timed": before, "dots": dots}))
"""


def test_runner_checks_then_times_on_the_interpreter():
    """transformers' blocks, torch._grouped_mm and the Triton path (interpreter; at one
    token also the decode step's one-token path) on a tiny Qwen3-MoE shape: each output within fp32 tolerance of the float64 layer, then timed;
    columns that cannot run here are 'not available'; a wrong kernel fails and is not timed."""
    r = interpreter_child(MOE_CHILD, timeout=300)
    rows = {(row["B"], row["impl"]): row for row in r["rows"]}
    assert len(r["rows"]) == 2 * (len(moe.IMPLS) + 2)
    for B in (1, 5):
        for impl in ("hf-eager", "hf-batched_mm", "hf-grouped_mm", "torch-grouped-mm",
                     "wsattn-triton", "wsattn-triton[16,32,32,4,1]", "wsattn-triton[4,16,32,4,1]"):
            row = rows[(B, impl)]
            assert row["status"] == "ok", row
            assert row["rel_err"] <= 2e-3 and row["check_passed"] and row["median_ms"] == 1.0
            assert row["tokens_rerouted"] == 0 and row["tbps"] > 0
        assert 2 <= rows[(B, "wsattn-triton")]["experts_hit"] <= min(8, 2 * B)
        assert rows[(B, "wsattn-gluon")]["status"] == "not available"
        assert rows[(B, "wsattn-triton-pdl")]["status"] == "not available"  # no sm_90 here
        assert rows[(B, "hf-deepgemm")]["status"] == "not available"  # fp32
        assert rows[(B, "hf-sonicmoe")]["status"] in ("not available", "error")
    hit1 = rows[(1, "wsattn-triton")]["experts_hit"]
    assert hit1 == 2 and rows[(1, "wsattn-triton")]["copies"] == \
        math.ceil(100_000 / ((2 * 3 * 64 * 32 + 8 * 64) * 4)) == 2
    assert rows[(1, "torch-grouped-mm")]["note"] == "routing and grouping precomputed, not timed"
    # the decode step's one-token path: checked and timed at B 1 only, the same experts
    token = rows[(1, "wsattn-triton-token")]
    assert token["status"] == "ok" and token["rel_err"] <= 2e-3 and token["median_ms"] == 1.0
    assert token["experts_hit"] == hit1 and token["tokens_rerouted"] == 0
    assert "bucket-1 path" in token["note"]
    assert rows[(5, "wsattn-triton-token")]["status"] == "not available"
    assert "B = 1" in rows[(5, "wsattn-triton-token")]["reason"]
    assert r["timed"] == 2 * 7 + 4 + 1
    for row in r["dots"]:  # DeepSeek-V3 routing: transformers' Dots1MoE (shared experts
        # out), the grouped GEMMs and the Triton path against the float64 routed layer
        assert row["status"] == "ok" and row["rel_err"] <= 2e-3, row
        assert row["tokens_rerouted"] == 0 and row["family"] == "dots1", row
    (bad,) = r["bad"]
    assert bad["status"] == "failed" and bad["median_ms"] is None and r["timed_bad"] == 0
    assert "not timed" in bad["reason"] and bad["rel_err"] > 2e-3


def test_touched_experts_come_from_each_columns_own_routing(monkeypatch):
    """experts_hit (and the touched bytes and floor from it) counts the experts the
    column's own routing hit, which can differ from the float64 routing's: a stub column
    that sends every token to experts 0 and 1 is charged for two experts."""
    monkeypatch.setitem(moe.MODELS, "tiny-qwen3-moe", {
        **moe.MODELS["qwen3-30b-a3b"], "hidden_size": 64, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "vocab_size": 16, "intermediate_size": 64, "max_window_layers": 1})
    case = moe.MoeCase("tiny-qwen3-moe", 6, "fp32", fresh_bytes=1)
    x, router_w, w_gate_up, w_down, bias = moe._inputs(case, "cpu")
    assert bias is None  # a softmax family
    ref_hit = moe.distinct_experts(moe.routing64(x, router_w, case.cfg)[1])
    assert ref_hit > 2
    ids = torch.tensor([[0, 1]] * 6)
    y = moe.reference(x, router_w, w_gate_up, w_down, ids, case.cfg).float()

    def calls(case_, impl, x_, copies, plan):
        return (lambda: y), (lambda: y), ids, None

    monkeypatch.setattr(moe, "_calls", calls)
    (row,) = moe.run_case(case, ["wsattn-triton"], lambda fn: _timing(0.01), STAMP, "cpu",
                          4.0)
    assert row["status"] == "ok" and row["tokens_rerouted"] > 0
    assert row["experts_hit"] == 2 and row["touched_bytes"] == case.touched_bytes(2)


def test_an_import_error_in_a_wsattn_column_is_an_error(monkeypatch):
    """ImportError / OSError mean a missing package behind one of transformers' experts
    implementations ('not available'); raised by a wsattn column they are a bug: 'error'."""
    monkeypatch.setitem(moe.MODELS, "tiny-qwen3-moe", {
        **moe.MODELS["qwen3-30b-a3b"], "hidden_size": 64, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "vocab_size": 16, "intermediate_size": 64, "max_window_layers": 1})
    case = moe.MoeCase("tiny-qwen3-moe", 6, "fp32", fresh_bytes=1)

    def calls(case_, impl, x_, copies, plan):
        raise ImportError("cannot import name 'route' (a broken module)")

    monkeypatch.setattr(moe, "_calls", calls)
    rows = moe.run_case(case, ["wsattn-triton", "hf-grouped_mm"], lambda fn: _timing(0.01),
                        STAMP, "cpu", 4.0)
    assert [r["status"] for r in rows] == ["error", "not available"], rows


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_runner_on_the_gpu():
    """The Qwen3-30B-A3B layer at B 8 in bf16: the Triton path checked against float64 and
    timed from a CUDA graph; torch._grouped_mm and transformers' grouped_mm block beside it."""
    from wsattn.bench.timing import cuda_timer

    timer = cuda_timer(5, 20, "graph")
    case = moe.MoeCase("qwen3-30b-a3b", 8)
    rows = moe.run_case(case, ["hf-grouped_mm", "torch-grouped-mm", "wsattn-triton",
                               "wsattn-triton-pdl"], timer, STAMP, "cuda", 4.0)
    by = {r["impl"]: r for r in rows}
    for impl in ("wsattn-triton", "wsattn-triton-pdl"):
        r = by[impl]
        assert r["status"] == "ok", r
        assert r["timing"] == "graph" and r["rel_err"] <= r["tol"] and r["tbps"] > 0
        assert 8 <= r["experts_hit"] <= 64 and r["target_met"] in ("met", "missed")
    for impl in ("hf-grouped_mm", "torch-grouped-mm"):
        assert by[impl]["status"] in ("ok", "not available"), by[impl]


@pytest.mark.gpu
def test_token_column_on_the_gpu():
    """The Qwen3-30B-A3B layer at B 1 in bf16 through the decode step's one-token path,
    checked against float64 and timed from a CUDA graph beside moe()'s six launches, both
    routing to the same experts."""
    from wsattn.bench.timing import cuda_timer

    timer = cuda_timer(5, 20, "graph")
    rows = moe.run_case(moe.MoeCase("qwen3-30b-a3b", 1), ["wsattn-triton-pdl",
                                                          "wsattn-triton-token"],
                        timer, STAMP, "cuda", 4.0)
    by = {r["impl"]: r for r in rows}
    for r in by.values():
        assert r["status"] == "ok", r
        assert r["timing"] == "graph" and r["rel_err"] <= r["tol"] and r["experts_hit"] == 8
    assert by["wsattn-triton-token"]["tokens_rerouted"] == \
        by["wsattn-triton-pdl"]["tokens_rerouted"]
