"""The decode-step kernels on the evidence ladder (evidence/library.py): registered, compiled
for every target they claim (sm_80/90/100/103/120, PDL only on sm_90+), gates 0-2 on the CPU
plus interpreter numerics (fp16 and fp32, one small shape each), the GPU shapes of the
split-K entry really split on an H200, the torch baselines agree with the float64
references, and the qkv entry's outputs catch a stray cache write."""

from __future__ import annotations

import random

import pytest
import torch

from wsattn.evidence import ladder, library
from wsattn.cli import main
from wsattn.evidence.compile_gate import compile_kernel
from wsattn.evidence.numerics import compare
from wsattn.target import KNOWN_CCS

NEW = ("gemv_norm_silu", "gemv_residual", "gemv_splitk", "qkv_rope_qwen3", "qkv_rope_qwen2",
       "qkv_rope_olmoe", "qkv_rope_fused", "qkv_rope_gemv", "moe", "moe_token",
       "moe_deepseek", "moe_token_deepseek")


def test_entries_are_registered_with_a_runner_and_sanitizer_shapes():
    for name in NEW:
        spec = library.get(name)
        assert name in library.NAMES and not spec.unavailable, spec.unavailable
        run = spec.run
        assert run.interpreter and set(run.interpreter_dtypes) == {"fp16", "fp32"}
        assert run.dtypes[0] == "bf16" and run.baseline is not None and run.profile_shapes
        assert len(run.sanitizer_shapes) >= 2


def test_gemv_sanitizer_shapes_reach_the_deep_pipeline_settings():
    """The last sanitizer shape of each plain GEMV entry takes the 33-64-row unsplit
    settings on an H200 (so gate 6 sees those builds too)."""
    from wsattn.kernels import gemv
    from wsattn.target import Target
    for name, silu in (("gemv_norm_silu", True), ("gemv_residual", False)):
        s = library.get(name).run.sanitizer_shapes[-1]
        st = gemv.default_settings(Target("cuda", 90, 132), M=s["M"], N=s["N"], K=s["K"],
                                   dtype=torch.bfloat16, silu_mul=silu)
        assert s["M"] > gemv.DOT_WIDE_MAX_M and st.split_k == 1, (name, st)
        assert st.num_stages >= 3, (name, st)


def test_gemv_sanitizer_shapes_reach_the_one_row_fold():
    """The first sanitizer shape of each GEMV entry is one row on the FMA path on an H200
    (the row fold of gemv.stream_w), split where the entry is the split-K path."""
    from wsattn.kernels import gemv
    from wsattn.target import Target
    for name, silu, split in (("gemv_norm_silu", True, False), ("gemv_residual", False, False),
                              ("gemv_splitk", False, True)):
        s = library.get(name).run.sanitizer_shapes[0]
        st = gemv.default_settings(Target("cuda", 90, 132), M=s["M"], N=s["N"], K=s["K"],
                                   dtype=torch.bfloat16, silu_mul=silu)
        assert s["M"] == 1 and not st.use_dot, (name, st)
        assert (gemv.launch_split(s["K"], st) > 1) == split, (name, st)


def test_targets_cli_compiles_them_for_every_target(capsys):
    assert main(["targets", *NEW]) == 0
    out = capsys.readouterr().out
    for name in NEW:
        assert name in out
        assert out.count(name) >= len(KNOWN_CCS)
    assert "does not compile" not in out and "no code path" not in out


@pytest.mark.parametrize("name", NEW)
def test_pdl_only_where_the_target_has_it(name):
    spec = library.get(name)
    for cc in KNOWN_CCS.values():
        cs = spec.compile_spec(cc)
        assert cs["constexprs"]["PDL"] is (cc >= 90)
        assert bool(cs["options"].get("launch_pdl")) is (cc >= 90)


@pytest.mark.parametrize("name, kernels", [("gemv_splitk", ("finish",)),
                                           ("moe", ("router_logits", "route", "group", "down",
                                                    "combine"))])
def test_the_other_kernels_of_an_entry_compile_on_every_target(name, kernels):
    """The ladder's gates 0-2 read one build per entry; the split-K finish and the other
    five MoE launches compile here for the same targets."""
    spec = library.get(name)
    for kernel in kernels:
        for cc in KNOWN_CCS.values():
            cs = spec.compile_spec(cc, kernel=kernel)
            r = compile_kernel(cs["fn"], cs["signature"], dict(cs["constexprs"]),
                               dict(cs["options"]), cc, cs.get("attrs"))
            assert r.ok, f"{name} {kernel} sm_{cc}: {r.failed_stage}: {r.error}"
            assert ("griddepcontrol.wait" in r.stages["ptx"]) is (cc >= 90)


@pytest.mark.parametrize("name", NEW)
def test_ladder_climbs_to_structure_and_interpreter_numerics_pass(name):
    r = ladder.climb(library.get(name), "sm_90", ladder.Config(interpreter_shapes=1))
    assert r.highest_gate == 2, r.verdict
    assert [g.status for g in r.gates] == ["pass", "pass", "pass", "not run"]
    (interp,) = r.extra
    assert interp.status == "pass", interp.detail
    assert interp.data["checked"] == 2 and interp.data["dtypes"] == ["fp16", "fp32"]
    assert "interpreter numerics pass (2 small shapes)" in r.verdict


def test_ladder_unknown_kernel_lists_the_new_ones(capsys):
    assert main(["ladder", "NO_SUCH", "--target", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert "unknown kernel 'NO_SUCH'" in err
    for name in NEW:
        assert name in err


def test_splitk_gpu_shapes_split_on_an_h200():
    from wsattn.kernels import gemv
    from wsattn.target import Target
    run = library.get("gemv_splitk").run
    rng = random.Random(0)
    shapes = [run.draw_shape(rng, False) for _ in range(200)]
    shapes += list(run.profile_shapes) + list(run.sanitizer_shapes)
    for s in shapes:
        for dt in (torch.bfloat16, torch.float16):
            st = gemv.default_settings(Target("cuda", 90, 132), M=s["M"], N=s["N"], K=s["K"], dtype=dt)
            assert st.split_k >= 2, (s, st)
    assert library.get("gemv_splitk").compile_spec(90)["constexprs"]["SPLIT_K"] >= 2


@pytest.mark.parametrize("name", NEW)
def test_baseline_agrees_with_the_reference(name):
    """The profile gate's peer computes the same thing (fp32 on the CPU, no kernel)."""
    run = library.get(name).run
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(2):
        inp = run.build(run.draw_shape(rng, True), "fp32", "cpu", gen)
        ref = run.reference(inp)
        out = run.baseline(inp)
        ref = ref[0] if isinstance(ref, tuple) else ref  # qkv: the peer returns q
        err, _ = compare(out, ref)
        assert err < 1e-5, (name, err)


def test_qkv_outputs_catch_a_missing_or_stray_cache_write():
    from wsattn.evidence.library import _qkv_outputs
    run = library.get("qkv_rope_qwen3").run
    inp = run.build({"M": 3, "K": 64, "Hq": 4, "Hkv": 2, "D": 64, "L": 40}, "fp32", "cpu",
                    torch.Generator().manual_seed(2))
    q, k, v, stray = run.reference(inp)
    kc, vc = inp["k_cache"], inp["v_cache"]
    # what a kernel that writes q and exactly the slots gives: passes
    kc[inp["page"], inp["off"]] = k.float()
    vc[inp["page"], inp["off"]] = v.float()
    assert compare(_qkv_outputs(q.float(), kc, vc, inp), (q, k, v, stray))[0] < 1e-6
    # one element changed outside the slots: fails on the fourth output
    page = int(inp["keep"].nonzero()[0, 0])
    kc[page, int(inp["keep"][page].nonzero()[0, 0]), 0, 0] += 1
    err, where = compare(_qkv_outputs(q.float(), kc, vc, inp), (q, k, v, stray))
    assert err > 1 and where == "output 3"
    # a slot left unwritten (still NaN-poisoned from build): fails
    inp2 = run.build({"M": 1, "K": 64, "Hq": 2, "Hkv": 1, "D": 64, "L": 1}, "fp32", "cpu",
                     torch.Generator().manual_seed(3))
    ref2 = run.reference(inp2)
    err, why = compare(_qkv_outputs(ref2[0].float(), inp2["k_cache"], inp2["v_cache"], inp2), ref2)
    assert err == float("inf") and "NaN" in why


def test_decode_ladder_entry_on_the_engines_pages():
    """decode_triton_paged64 is the decode kernel on the engine's KV pages (one page a tile
    at D128, two under D64's 128-key tiles, where the block table is preloaded): every
    shape it draws or sanitizes is on pages of 64, and it climbs the CPU gates."""
    from wsattn.engine.kv_cache import PAGE_SIZE
    spec = library.get("decode_triton_paged64")
    run = spec.run
    assert PAGE_SIZE == 64 and not spec.unavailable
    rng = random.Random(0)
    shapes = [run.draw_shape(rng, small) for small in (True, False) for _ in range(20)]
    for s in shapes + list(run.sanitizer_shapes) + list(run.profile_shapes):
        assert s["paged"] and s["page"] == PAGE_SIZE, s
    assert any(s["D"] == 64 for s in run.sanitizer_shapes)
    assert spec.compile_spec(90)["constexprs"]["PAGE_SIZE"] == PAGE_SIZE
    inp = run.build(run.sanitizer_shapes[-1], "fp32", "cpu", torch.Generator().manual_seed(0))
    assert inp["k"].shape[1] == PAGE_SIZE
    r = ladder.climb(spec, "sm_90", ladder.Config(interpreter_shapes=1))
    assert r.highest_gate == 2 and r.extra[0].status == "pass", r.verdict
