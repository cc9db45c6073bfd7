"""The kernel step (wsattn.engine.runner.KernelStep) against the reference step: greedy
tokens and per-step logits for Llama (llama3 rope), Qwen2 (q/k/v bias) and Qwen3
(QK-norm), whole and chunked prefill, bucket padding, launches per layer, host-side
chunk lengths; refusals by name. CPU cases run the kernels through the Triton
interpreter in a fresh child process (TRITON_INTERPRET=1, fp32, tiny models); the GPU
cases (bf16, graphs, PDL, 1,000 steps) carry the gpu marker."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import interpreter_child

CHILD = textwrap.dedent(r'''
    import collections, json, sys
    import torch
    import transformers
    from triton.runtime import interpreter
    from wsattn.engine.generate import Engine
    from wsattn.testing import rel_err

    torch.manual_seed(0)
    torch.set_num_threads(1)
    case, arg = sys.argv[1], json.loads(sys.argv[2])
    res = {}

    def model(family):
        common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=256, vocab_size=256,
                      max_position_embeddings=256)
        if family == "llama":
            cfg = transformers.LlamaConfig(**common, rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64})
            cls = transformers.LlamaForCausalLM
        elif family == "qwen2":
            cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
        else:
            cfg = transformers.Qwen3Config(**common, head_dim=64)
            cls = transformers.Qwen3ForCausalLM
        m = cls(cfg).eval()
        with torch.no_grad():  # random norm weights and biases, so a dropped one shows
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0, 0.5)
        return m

    def prompts(lens, seed=7):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 256, (n,), generator=g) for n in lens]

    def run(m, step, ps, n, **kw):
        e = Engine(m, step=step, device="cpu", **kw)
        toks, logits = e.run(ps, n, return_logits=True)
        return e, toks, logits

    def err(a, b):  # worst per-step relative error of [B, n, vocab] logits
        return max(rel_err(a[:, i], b[:, i]) for i in range(a.shape[1]))

    if case == "family":
        m, ps, n = model(arg["family"]), prompts([11, 5]), 8
        _, ref_t, ref_l = run(m, "reference", ps, n)
        for name, kw in (("whole", {}), ("chunked", {"prefill_chunk": 4})):
            _, t, l = run(m, "kernels", ps, n, **kw)
            res[name] = {"tokens": all(torch.equal(a, b) for a, b in zip(ref_t, t)),
                         "err": err(l, ref_l), "nan": bool(l.isnan().any())}

    elif case == "padding":
        m, ps, n = model("llama"), prompts([9, 4, 6]), 8
        pad, pad_t, pad_l = run(m, "kernels", ps, n, buckets=(4,), num_pages=8, page_size=8)
        exact, t, l = run(m, "kernels", ps, n, buckets=(3,), num_pages=8, page_size=8)
        res["tokens"] = all(torch.equal(a, b) for a, b in zip(pad_t, t))
        res["err"] = err(pad_l, l)
        res["cache_equal"] = (torch.equal(pad.cache.k, exact.cache.k)
                              and torch.equal(pad.cache.v, exact.cache.v))
        res["buckets"] = sorted(pad.step._buffers), sorted(exact.step._buffers)
        _, ref_t, _ = run(m, "reference", ps, n)
        res["ref_tokens"] = all(torch.equal(a, b) for a, b in zip(ref_t, t))

    elif case == "launches":
        names = collections.Counter()
        counting = [False]
        orig = interpreter.InterpretedFunction.run

        def counted(self, *a, **k):
            if counting[0]:
                names[self.fn.__name__] += 1
            return orig(self, *a, **k)

        interpreter.InterpretedFunction.run = counted
        m = model(arg["family"])
        e = Engine(m, step="kernels", device="cpu", num_pages=8, page_size=8)
        step = e.step
        decode = step.decode
        steps = [0]

        def decode_counted(*a, **k):
            before = collections.Counter(step.launches)
            counting[0] = True
            try:
                out = decode(*a, **k)
            finally:
                counting[0] = False
            steps[0] += 1
            res.setdefault("runner", []).append(dict(step.launches - before))
            return out

        step.decode = decode_counted
        e.run(prompts([7, 3]), 3)
        res["triton"] = dict(names)
        res["steps"] = steps[0]
        res["layers"] = e.cfg.layers

    elif case == "prefill_host":
        m = model("qwen3")
        e = Engine(m, step="kernels", device="cpu", num_pages=8, page_size=8)
        step, cache = e.step, e.cache
        ids = cache.admit([20, 12])
        bt = cache.block_table(ids)
        ps = prompts([13, 6])
        # two chunks: [0, 8) and [0, 4) first (fresh), then the rest (after a prefix)
        out = {}
        for mode in ("read", "host"):
            cache.k.zero_(); cache.v.zero_()
            for lo, hi in ((8, 4), (13, 6)):
                a = [0, 0] if lo == 8 else [8, 4]
                chunks = [ps[0][a[0]:lo], ps[1][a[1]:hi]]
                lens = [c.numel() for c in chunks]
                cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
                start = torch.tensor(a, dtype=torch.int32)
                kw = {"lengths": lens, "starts": a} if mode == "host" else {}
                logits = step.prefill(torch.cat(chunks), cu, start, bt, **kw)
            out[mode] = (logits, cache.k.clone())
        res["equal"] = (torch.equal(out["read"][0], out["host"][0])
                        and torch.equal(out["read"][1], out["host"][1]))
        ref = Engine(m, step="reference", device="cpu", num_pages=8, page_size=8)
        ref.step.prefill(torch.cat([ps[0][:8], ps[1][:4]]),  # the prefix, into ref's cache
                         torch.tensor([0, 8, 12], dtype=torch.int32),
                         torch.zeros(2, dtype=torch.int32), bt)
        ref_l = ref.step.prefill(torch.cat([ps[0][8:], ps[1][4:]]),
                                 torch.tensor([0, 5, 7], dtype=torch.int32),
                                 torch.tensor([8, 4], dtype=torch.int32), bt)
        res["err"] = rel_err(out["host"][0], ref_l)
        res["cache_err"] = rel_err(out["host"][1], ref.cache.k)

    print("RESULT " + json.dumps(res))
''')


def _child(case: str, **arg) -> dict:
    return interpreter_child(CHILD, case, json.dumps(arg))


# relative, per step: the interpreter computes fp32 as fp32 (the shared table's fp32 2e-3
# allows for tf32 on the GPU), so the kernel step stays within rounding of the reference
FP32_LOGITS = 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kernels_match_reference(family):
    """Greedy tokens (8 new, batch 2 of lengths 11 and 5) equal to the reference step's
    and every step's logits within fp32 tolerance, with one prefill chunk (attention_varlen
    on the chunk) and with chunks of 4 (later chunks attend to the cached prefix)."""
    r = _child("family", family=family)
    for name in ("whole", "chunked"):
        assert r[name]["tokens"] and not r[name]["nan"], (name, r)
        assert r[name]["err"] <= FP32_LOGITS, (name, r)


def test_bucket_padding():
    """A batch of 3 padded to bucket 4 (the padding rows repeat row 0) gives the tokens,
    logits and KV cache of the unpadded batch of 3 at bucket 3."""
    r = _child("padding")
    assert r["buckets"] == [[4], [3]], r
    assert r["tokens"] and r["ref_tokens"], r
    assert r["err"] <= FP32_LOGITS, r
    assert r["cache_equal"], r


def test_launches_per_layer():
    """A decode step is 5 library calls a layer (qkv_rope, decode, three GEMVs) and, in
    the interpreter, 6 Triton launches a layer (decode splits the keys and combines);
    outside the layers: embedding + positions (torch) and the LM-head GEMV."""
    r = _child("launches", family="qwen2")
    L, steps = r["layers"], r["steps"]
    assert steps == 2, r
    per_layer = ("qkv_rope", "decode", "gemv_o", "gemv_gate_up", "gemv_down")
    for counts in r["runner"]:
        assert counts == {**{k: L for k in per_layer}, "embed": 1, "positions": 1,
                          "gemv_lm_head": 1}, r
        assert sum(counts[k] for k in per_layer) / L == 5
    tri = r["triton"]
    assert tri["_qkv_rope_kernel"] == tri["_decode_kernel"] == L * steps, r
    assert tri["_gemv_kernel"] == (3 * L + 1) * steps, r
    lm_head = steps  # one LM-head GEMV a step, no split-K finish in the interpreter
    per_layer_launches = (sum(tri.values()) - lm_head) / (L * steps)
    assert per_layer_launches <= 6, r
    assert set(tri) <= {"_qkv_rope_kernel", "_decode_kernel", "_combine_kernel",
                        "_gemv_kernel", "_splitk_finish_kernel"}, r


def test_prefill_host_lengths():
    """prefill with host-side lengths/starts (no device read) gives bitwise the logits and
    cache of the call that reads cu_seqlens/start; a second chunk after a prefix matches
    the reference step."""
    r = _child("prefill_host")
    assert r["equal"], r
    assert r["err"] <= FP32_LOGITS and r["cache_err"] <= FP32_LOGITS, r


# --------------------------------------------------------------------------- refusals

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=256, vocab_size=256,
            max_position_embeddings=64)


def _parts(dtype=torch.float32, **over):
    from wsattn.engine.kv_cache import PagedKVCache
    from wsattn.models import flashnorm
    from wsattn.models.config import ModelConfig
    from wsattn.models.weights import LayerWeights, Weights

    cfg = ModelConfig.from_hf({**TINY, **over})
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=g) / 8).to(dtype)

    rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    layers = [LayerWeights(wqkv=t(rows, cfg.hidden), bqkv=None, q_norm=None, k_norm=None,
                           wo=t(cfg.hidden, cfg.q_size), w_gate_up=t(2 * cfg.ffn, cfg.hidden),
                           w_down=t(cfg.hidden, cfg.ffn), attn_norm=t(cfg.hidden) + 1,
                           mlp_norm=t(cfg.hidden) + 1) for _ in range(cfg.layers)]
    w = Weights(embed=t(cfg.vocab, cfg.hidden), layers=layers, final_norm=t(cfg.hidden) + 1,
                lm_head=t(cfg.vocab, cfg.hidden))
    cache = PagedKVCache(cfg, num_pages=4, page_size=8, dtype=dtype, device="cpu", max_batch=4)
    return cfg, w, flashnorm.fold(w), cache


def test_refuses_cpu_without_interpreter(monkeypatch):
    from wsattn.engine.runner import KernelStep

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg, _, folded, cache = _parts()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        KernelStep(cfg, folded, cache)


def test_pdl_families_reach_their_kernels(monkeypatch):
    """pdl= a collection of PDL_FAMILIES: each kernel family's launches get PDL on or off
    as asked (the flags at the kernels' entry points, recorded by stand-ins)."""
    import types

    from wsattn.engine import runner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, w, cache = _parts()
    step = runner.KernelStep(cfg, w, cache, pdl=False)
    assert step.pdl_families == frozenset() and step.pdl is False
    seen = []

    def rec(name, ret=lambda *a, **k: None):
        def stand_in(*a, pdl=None, **k):
            seen.append((name, pdl))
            return ret(*a, **k)
        return stand_in

    monkeypatch.setattr(runner, "qkv_rope_append", rec("qkv_rope"))
    monkeypatch.setattr(runner, "gemv", rec("gemv"))
    monkeypatch.setattr(runner.ops, "decode", rec("decode", lambda q, *a, **k: (
        torch.zeros(q.shape[0], 1, cfg.heads, cfg.head_dim),)))
    monkeypatch.setattr(runner, "route", rec("moe", lambda *a, **k: (None, None)))
    for name in ("group", "moe_gate_up", "moe_down_combine"):
        monkeypatch.setattr(runner, name, rec("moe"))
    moe_layer = types.SimpleNamespace(router=None, w_gate_up=None, w_down=None,
                                      w_shared_gate_up=None, router_bias=None)
    for families in [(), ("gemv",), ("qkv_rope", "decode"), ("moe",), runner.PDL_FAMILIES]:
        seen.clear()
        step.pdl_families = runner._pdl_families(families, has_pdl=True)
        buf = runner._Buffers(cfg, 2, step.max_pages, w.dtype, w.embed.device)
        step._forward(buf)
        buf.moe_block = 1
        step._moe(moe_layer, buf.h, buf)
        assert {name for name, _ in seen} == set(runner.PDL_FAMILIES)
        assert all(pdl is (name in families) for name, pdl in seen), (families, seen)
    def variants(owner, name, kw, cases):
        """Each pdl= choice reaches owner.name's stand-in as (pdl, its kw argument)."""
        got = []

        def stand_in(*a, pdl=None, **k):
            got.append((pdl, k.get(kw, "unset")))
        monkeypatch.setattr(owner, name, stand_in)
        for families, want in cases:
            got.clear()
            step.pdl_families = runner._pdl_families(families, has_pdl=True)
            step._forward(runner._Buffers(cfg, 2, step.max_pages, w.dtype, w.embed.device))
            assert got and set(got) == {want}, (name, families, got)

    # the GEMVs' release: "gemv" leaves it to gemv (by rows, pdl_late=None), the variants
    # force it; nothing else moves
    variants(runner, "gemv", "pdl_late", [
        (("gemv:late",), (True, True)), (("gemv:early",), (True, False)),
        (("gemv",), (True, None)), (("gemv:kernel-wide",), (True, None)),
        ((), (False, None))])
    for both in [("gemv", "gemv:late"), ("gemv:early", "gemv:late"),
                 ("gemv", "gemv:kernel-wide")]:
        with pytest.raises(ValueError, match=r"name the same kernels \(gemv\)"):
            runner._pdl_families(both, has_pdl=True)
    # the QKV call: the default path (settings None) or, with a variant, the two-launch or
    # the GEMV-epilogue one
    from wsattn.kernels.qkv_rope import GemvRopeSettings, TwoLaunchSettings
    variants(runner, "qkv_rope_append", "settings", [
        (("qkv_rope:two-launch",), (True, TwoLaunchSettings())),
        (("qkv_rope:gemv-rope",), (True, GemvRopeSettings())), (("qkv_rope",), (True, None)),
        ((), (False, None))])
    for both in [("qkv_rope", "qkv_rope:two-launch"),
                 ("qkv_rope:gemv-rope", "qkv_rope:two-launch")]:
        with pytest.raises(ValueError, match=r"name the same kernels \(qkv_rope\)"):
            runner._pdl_families(both, has_pdl=True)
    # the default: every family where the GPU has PDL (the GEMVs' release by rows)
    assert runner._pdl_families(None, has_pdl=True) == frozenset(runner.PDL_FAMILIES)
    assert runner._pdl_families(True, has_pdl=True) == frozenset(runner.PDL_FAMILIES)
    assert runner._pdl_families(None, has_pdl=False) == frozenset()
    assert runner._pdl_families(True, has_pdl=False) == frozenset(runner.PDL_FAMILIES)


def test_moe_gluon_variant_reaches_the_grouped_launches(monkeypatch):
    """pdl variant "moe:gluon": the grouped gate/up and down get impl="gluon" (route,
    group and combine keep their PDL) and the buckets' grouping blocks are the Gluon
    kernel's; off the variant, impl="triton". Stand-ins
    record the calls (the Gluon kernel itself runs on sm_90 only: its GPU test)."""
    import types

    from wsattn.engine import runner
    from wsattn.kernels import moe_gluon

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, w, cache = _parts()
    step = runner.KernelStep(cfg, w, cache, pdl=False)
    seen = []

    def rec(name):
        def stand_in(*a, pdl=None, impl="unset", **k):
            seen.append((name, pdl, impl))
        return stand_in

    monkeypatch.setattr(runner, "route", lambda *a, **k: (None, None))
    monkeypatch.setattr(runner, "group", lambda *a, **k: None)
    monkeypatch.setattr(runner, "moe_gate_up", rec("gate_up"))
    monkeypatch.setattr(runner, "moe_down_combine", rec("down"))
    layer = types.SimpleNamespace(router=None, w_gate_up=None, w_down=None,
                                  w_shared_gate_up=None, router_bias=None)
    for gluon, families in ((True, ("moe:gluon",)), (False, ("moe",))):
        seen.clear()
        step.pdl_families = runner._pdl_families(families, has_pdl=True)
        step.moe_gluon = gluon
        buf = runner._Buffers(cfg, 2, step.max_pages, w.dtype, w.embed.device)
        buf.moe_block = 1
        step._moe(layer, buf.h, buf)
        impl = "gluon" if gluon else "triton"
        assert seen == [("gate_up", True, impl), ("down", True, impl)], seen
    for bucket in (1, 2, 8, 64):
        moe_cfg = types.SimpleNamespace(hidden=cfg.hidden, heads=cfg.heads,
                                        head_dim=cfg.head_dim, moe_layers=(0,), layers=1,
                                        is_moe=True, top_k=8, experts=128, ffn=cfg.ffn,
                                        shared_ffn=0, vocab=cfg.vocab)
        buf = runner._Buffers(moe_cfg, bucket, 4, w.dtype, w.embed.device, moe_gluon=True)
        assert buf.moe_block == moe_gluon.default_block(bucket, 8, 128), bucket
    # on the CPU the variant is refused with the other PDL choices (no sm_90 here)
    with pytest.raises(ValueError, match="needs a CUDA GPU of sm_90"):
        runner.KernelStep(cfg, w, cache, pdl=("moe:gluon",))


def test_residual_products_go_to_cublas_from_their_rows(monkeypatch):
    """Where the step takes cuBLAS for the o / down projections (``cublas_wide``: sm_90,
    16-bit; forced on here), from CUBLAS_WIDE_ROWS rows they are one addmm into the
    residual (h + x @ w^T), below them the GEMV kernel with the step's PDL arguments; the
    "gemv:kernel-wide" variant keeps the kernel at every row count, and so does a step
    without cublas_wide (the CPU's)."""
    from wsattn.engine import runner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, w, cache = _parts()
    step = runner.KernelStep(cfg, w, cache, pdl=False)
    assert step.cublas_wide is False  # the CPU, fp32
    calls = []
    monkeypatch.setattr(runner, "gemv", lambda x, wt, **k: calls.append((x.shape[0], k)))
    g = torch.Generator().manual_seed(0)
    wt = torch.randn(24, 40, generator=g)
    rows = runner.CUBLAS_WIDE_ROWS
    for wide, families, m, kernel in [(True, ("gemv",), rows, False), (True, ("gemv",), 64, False),
                                      (True, ("gemv",), rows - 1, True),
                                      (True, ("gemv:kernel-wide",), 64, True),
                                      (False, ("gemv",), 64, True)]:
        step.cublas_wide = wide
        step.pdl_families = runner._pdl_families(families, has_pdl=True)
        x, h = torch.randn(m, 40, generator=g), torch.randn(m, 24, generator=g)
        h0 = h.clone()
        calls.clear()
        step._residual_gemv(x, wt, h, step._gemv_launch())
        if kernel:
            assert calls == [(m, {"residual": h, "out": h, "pdl": True, "pdl_late": None})]
        else:
            # fp32 on the CPU: addmm rounds the product and the add in its own order
            assert calls == [] and torch.allclose(h, h0 + x @ wt.T, atol=1e-5)


@pytest.mark.parametrize("case, match", [
    ("unfolded", "FlashNorm-folded"),
    ("bf16", "bfloat16 is not run by the kernels in the Triton interpreter"),
    ("graphs", "graphs=True needs CUDA"),
    ("pdl", "pdl=True needs a CUDA GPU of sm_90"),
    ("pdl_families", r"pdl=\('gemv',\) needs a CUDA GPU of sm_90"),
    ("pdl_unknown", r"pdl: unknown kernel families \['norm'\]"),
    ("pdl_str", "pdl must be None, True, False or a collection of"),
    ("pdl_gemv_rope_whole", r"'qkv_rope:gemv-rope' \(the GEMV-epilogue QKV path\) takes no "
                            "QK-norm over the whole projection"),
    ("bucket65", "above the 64 the GEMV kernels take"),
    ("bucket_small", "below the cache's max_batch"),
    ("buckets_order", "buckets must be increasing"),
    ("cache_dtype", "cache k/v must be torch.float32"),
    ("wo_shape", r"layers\[1\]\.wo must be"),
    ("bias", "bqkv is present but cfg.qkv_bias=False"),
])
def test_construction_refusals(monkeypatch, case, match):
    """Every config the step does not run is refused at construction, by name."""
    import dataclasses

    from wsattn.engine.kv_cache import PagedKVCache
    from wsattn.engine.runner import KernelStep

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, raw, w, cache = _parts(torch.bfloat16 if case == "bf16" else torch.float32)
    kw = {}
    if case == "unfolded":
        w = raw
    elif case == "graphs":
        kw["graphs"] = True
    elif case == "pdl":
        kw["pdl"] = True
    elif case == "pdl_families":
        kw["pdl"] = ("gemv",)
    elif case == "pdl_unknown":
        kw["pdl"] = ("gemv", "norm")
    elif case == "pdl_str":
        kw["pdl"] = "gemv"
    elif case == "pdl_gemv_rope_whole":  # OLMoE's QK-norm: refused before any weight check
        cfg = dataclasses.replace(cfg, qk_norm_whole=True)
        kw["pdl"] = ("qkv_rope:gemv-rope", "gemv")
    elif case == "bucket65":
        kw["buckets"] = (1, 65)
    elif case == "bucket_small":
        kw["buckets"] = (1, 2)
    elif case == "buckets_order":
        kw["buckets"] = (4, 2)
    elif case == "cache_dtype":
        cache = PagedKVCache(cfg, num_pages=4, page_size=8, dtype=torch.float16, device="cpu")
    elif case == "wo_shape":
        w.layers[1] = dataclasses.replace(w.layers[1], wo=w.layers[1].wo[:, :64].contiguous())
    elif case == "bias":
        w.layers[0] = dataclasses.replace(w.layers[0], bqkv=torch.zeros(w.layers[0].wqkv.shape[0]))
    with pytest.raises(ValueError, match=match):
        KernelStep(cfg, w, cache, **kw)


def test_call_refusals(monkeypatch):
    """Index tensors of the wrong dtype, shape or width are refused before any launch."""
    from wsattn.engine.runner import KernelStep

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, w, cache = _parts()
    step = KernelStep(cfg, w, cache, buckets=(1, 2, 4))
    tok = torch.tensor([1, 2])
    sl = torch.tensor([3, 4], dtype=torch.int32)
    bt = torch.zeros(2, cache.max_pages, dtype=torch.int32)
    with pytest.raises(ValueError, match="seqlens must be torch.int32"):
        step.decode(tok, sl.long(), bt)
    with pytest.raises(ValueError, match="block_table must be torch.int32"):
        step.decode(tok, sl, bt[:1])
    with pytest.raises(ValueError, match="pages wide"):
        step.decode(tok, sl, torch.zeros(2, cache.max_pages + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens must be torch.int64"):
        step.decode(tok.int(), sl, bt)
    with pytest.raises(ValueError, match="above the largest bucket"):
        step.decode(torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int32),
                    torch.zeros(5, cache.max_pages, dtype=torch.int32))
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="sum to T=4"):
        step.prefill(torch.tensor([1, 2, 3, 4]), cu, torch.zeros(2, dtype=torch.int32), bt)
    with pytest.raises(ValueError, match="given together"):
        step.prefill(torch.tensor([1, 2, 3]), cu, torch.zeros(2, dtype=torch.int32), bt,
                     lengths=[2, 1])
    with pytest.raises(ValueError, match="block table's capacity"):
        step.prefill(torch.tensor([1, 2, 3]), cu, torch.tensor([0, 64], dtype=torch.int32), bt)


# --------------------------------------------------------------------------- GPU

def _gpu_engine(graphs=None, pdl=None, layers=4, max_pos=2048, num_pages=512,
                buckets=(1, 2, 4, 8)):
    """A bf16 Llama-shaped model (D 64, GQA 4:1, tied embeddings off) on CUDA."""
    import transformers

    from wsattn.engine.generate import Engine
    from wsattn.engine.runner import KernelStep

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=1536, vocab_size=4096,
                                   max_position_embeddings=max_pos)
    model = transformers.LlamaForCausalLM(cfg).eval()
    e = Engine(model, dtype=torch.bfloat16, device="cuda", step="kernels", num_pages=num_pages,
               page_size=16, buckets=buckets)
    e.step = KernelStep(e.cfg, e.weights, e.cache, buckets=e.buckets, graphs=graphs, pdl=pdl)
    return e, model


def _gpu_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 4096, (n,), generator=g) for n in (37, 5, 120)]


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    """CUDA-graph replay gives bitwise the logits of the eager step (batch 3 at bucket 4)."""
    ps = _gpu_prompts()
    graph_t, graph_l = _gpu_engine(graphs=True)[0].run(ps, 24, return_logits=True)
    eager_t, eager_l = _gpu_engine(graphs=False)[0].run(ps, 24, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(graph_t, eager_t))
    assert torch.equal(graph_l, eager_l)


@pytest.mark.gpu
def test_gpu_pdl_on_equals_off():
    """PDL changes when programs start, not what they compute: bitwise equal logits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ps = _gpu_prompts()
    off_t, off_l = _gpu_engine(pdl=False)[0].run(ps, 24, return_logits=True)
    # every family, the library's default, both forced GEMV releases and the QKV call on
    # either path (the A/B variants; without QK-norm both paths compute the same bits)
    for pdl in (True, None, ("qkv_rope", "decode", "gemv:late"),
                ("qkv_rope", "decode", "gemv:early"), ("qkv_rope:two-launch", "decode", "gemv"),
                ("qkv_rope:gemv-rope", "decode", "gemv")):
        on_t, on_l = _gpu_engine(pdl=pdl)[0].run(ps, 24, return_logits=True)
        assert all(torch.equal(a, b) for a, b in zip(on_t, off_t)), pdl
        assert torch.equal(on_l, off_l), pdl


@pytest.mark.gpu
def test_gpu_residual_products_on_cublas_at_64_rows():
    """A bucket of 64 rows on sm_90 (the o and down projections on cuBLAS): the first
    step's logits within bf16 tolerance of the same step on the GEMV kernel
    ("gemv:kernel-wide"; later steps are free-running and random weights make the greedy
    tokens part at any rounding difference), and graph replay = eager bitwise."""
    from wsattn.testing import rel_err, tol

    # the step hands these products to cuBLAS on sm_90 only (where it was measured); on
    # other GPUs there is no cuBLAS path to check, and the kernel path has its own tests
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS takes the wide residual products on sm_90 only")
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 4096, (int(n),), generator=g)
          for n in torch.randint(3, 60, (40,), generator=g)]
    kernel = ("qkv_rope", "decode", "gemv:kernel-wide", "moe")
    runs = {}
    for name, pdl, graphs in [("cublas", None, True), ("kernel", kernel, True),
                              ("cublas-eager", None, False)]:
        e = _gpu_engine(graphs=graphs, pdl=pdl, layers=2, buckets=(64,))[0]
        assert e.step.cublas_wide
        runs[name] = e.run(ps, 4, return_logits=True)
    (ct, cl), (kt, kl), (et, el) = runs["cublas"], runs["kernel"], runs["cublas-eager"]
    assert rel_err(cl[:, 0], kl[:, 0]) <= tol(torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(ct, et)) and torch.equal(cl, el)


@pytest.mark.gpu
def test_gpu_matches_reference_step():
    """bf16 kernels vs the reference step (fp32 compute over the same bf16 weights): the
    prefill's logits within bf16 tolerance; then 32 decode steps teacher-forced on the
    kernels' own tokens (one transformers forward over prompt + tokens, so every step is
    compared whatever the last one chose), within bf16 tolerance of the same weights in
    fp32 or within twice transformers' own bf16 error there."""
    import copy

    from wsattn.bench.step import teacher_forced_check
    from wsattn.engine.generate import Engine
    from wsattn.testing import rel_err, tol

    e, model = _gpu_engine()
    ps = _gpu_prompts()
    _, kl = e.run(ps, 1, return_logits=True)
    ref = Engine(model, dtype=torch.bfloat16, device="cuda", step="reference")
    _, rl = ref.run(ps, 1, return_logits=True)
    assert rel_err(kl[:, 0], rl[:, 0]) <= tol(torch.bfloat16)
    del ref
    ids = torch.stack([p[:5] for p in ps])  # the shortest prompt's length
    fp32 = copy.deepcopy(model).to("cuda", torch.float32).eval()
    bf16 = copy.deepcopy(model).to("cuda", torch.bfloat16).eval()
    rel, bound, detail = teacher_forced_check(bf16, e, ids, 32, "bf16", ref_model=fp32)
    assert rel <= bound, (rel, bound, detail)


@pytest.mark.gpu
def test_gpu_1000_replayed_steps():
    """1,000 graph replays produce the eager step's tokens: no drift from stale buffers,
    workspace counters or the split-K reductions."""
    ps = [p[:16] for p in _gpu_prompts()[:2]]
    graph = _gpu_engine(graphs=True, layers=2)[0].run(ps, 1000)
    eager = _gpu_engine(graphs=False, layers=2)[0].run(ps, 1000)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))


@pytest.mark.gpu
def test_gpu_chunked_prefill_through_the_paged_call():
    """A prompt prefilled in chunks (the later ones through ``attention_paged`` over the
    cached prefix, by dispatch.paged_gather's rule: on sm_90 the Gluon kernel, reading the
    pages in place or gathered keys) gives the first steps' logits of the whole-prompt prefill
    and of the reference step, within bf16 tolerance. Random weights make the logits flat,
    so free-running tokens may part at a near tie: the reference (other kernels) is
    compared on the prefill's logits only, and the later steps against the whole-prompt
    run (the same decode kernels, reading the cache the chunks wrote) once its tokens so
    far are checked equal."""
    from wsattn.engine.generate import Engine
    from wsattn.testing import rel_err, tol

    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, 4096, (n,), generator=g) for n in (37, 5, 2500)]
    whole, model = _gpu_engine(max_pos=4096)
    whole.prefill_chunk = 4096
    wt, wl = whole.run(ps, 4, return_logits=True)
    chunked = _gpu_engine(max_pos=4096)[0]
    chunked.prefill_chunk = 1100  # chunks 1100 (fresh), 1100 and 300 over the prefix
    ct, cl = chunked.run(ps, 4, return_logits=True)
    ref = Engine(model, dtype=torch.bfloat16, device="cuda", step="reference")
    _, rl = ref.run(ps, 1, return_logits=True)
    assert not cl.isnan().any()
    assert rel_err(cl[:, 0], rl[:, 0]) <= tol(torch.bfloat16)
    ct = torch.stack([t[len(p):] for t, p in zip(ct, ps)])  # the new tokens, [B, 4]
    wt = torch.stack([t[len(p):] for t, p in zip(wt, ps)])
    for s in range(4):
        assert torch.equal(ct[:, :s], wt[:, :s]), f"the tokens before step {s} parted"
        assert rel_err(cl[:, s], wl[:, s]) <= tol(torch.bfloat16), s
