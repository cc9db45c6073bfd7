"""The kernel step on mixture-of-experts models (Qwen3-MoE with an interleaved dense layer,
Mixtral): greedy tokens and per-step logits against the reference step, whole and chunked
prefill, the FMA (block 1, 4) and tl.dot (block 16) grouping paths, bucket padding,
launches per MoE layer; OLMoE through the two-launch QKV path; Qwen2-MoE's shared expert;
impl="auto" on CUDA picks the kernel step for 16-bit models. CPU cases run the kernels through the Triton interpreter in a
fresh child process (TRITON_INTERPRET=1, fp32, tiny models: hidden 128, head_dim 64);
the GPU cases (bf16, graph replay, PDL) carry the gpu marker.

fp32 on purpose: the route kernel keeps the router logits and the chosen weights in
fp32, the reference step (fp32 weights, fp32 compute) computes them in fp32 too, so the
two route identically and agree to rounding; in bf16 transformers rounds the logits
(and Qwen3-MoE the weights) to bf16 and the kernel does not (runner.py's docstring)."""

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
                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=256,
                      num_experts_per_tok=2, eos_token_id=None, pad_token_id=None,
                      bos_token_id=None)
        if family == "qwen3_moe":  # 8 experts top-2, layer 1 a dense MLP of width 256
            cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=256,
                                              moe_intermediate_size=64, num_experts=8,
                                              norm_topk_prob=True, mlp_only_layers=[1])
        elif family == "qwen2_moe":  # 8 experts top-2, a shared expert of width 96, q/k/v
            # bias, layer 1 a dense MLP
            cfg = transformers.Qwen2MoeConfig(**common, head_dim=64, intermediate_size=256,
                                              moe_intermediate_size=64,
                                              shared_expert_intermediate_size=96,
                                              num_experts=8, norm_topk_prob=False,
                                              mlp_only_layers=[1])
        elif family == "dots1":  # DeepSeek-V3 routing: sigmoid, a score-correction bias,
            # 8 experts in 4 groups (2 kept), top-2 renormalised and scaled by 2.5; two
            # ungated shared experts of 64; layer 0 dense
            cfg = transformers.Dots1Config(**common, head_dim=64, intermediate_size=256,
                                           moe_intermediate_size=64, n_routed_experts=8,
                                           n_shared_experts=2, n_group=4, topk_group=2,
                                           norm_topk_prob=True, routed_scaling_factor=2.5,
                                           first_k_dense_replace=1)
        elif family == "olmoe":  # 8 experts top-2, not renormalised, QK-norm over the
            # whole q and k projections (head_dim 128 / 2 = 64)
            cfg = transformers.OlmoeConfig(**common, intermediate_size=64, num_experts=8,
                                           norm_topk_prob=False)
        else:  # mixtral: 4 experts top-2, always renormalised, head_dim 128 / 2 = 64
            cfg = transformers.MixtralConfig(**common, intermediate_size=128,
                                             num_local_experts=4)
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" in name:  # random norm weights: a dropped one shows
                    p.uniform_(0.5, 1.5)
                elif name.endswith("gate.weight"):  # the router: decisive routing
                    p.mul_(20.0)
                elif "experts" in name:  # expert outputs big enough to move the logits
                    p.mul_(5.0)
                else:
                    p.mul_(2.0)
            for name, b in m.named_buffers():
                if "e_score_correction_bias" in name:  # zeros as initialised
                    b.copy_(0.2 * torch.randn_like(b))
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

    def triton_launches():
        """A Counter of interpreted Triton launches by module.kernel from now on (the
        previous counter, if any, stops counting)."""
        names = collections.Counter()
        orig = getattr(interpreter.InterpretedFunction, "_wsattn_orig",
                       interpreter.InterpretedFunction.run)

        def counted(self, *a, **k):
            names[self.fn.__module__.rsplit(".", 1)[-1] + "." + self.fn.__name__] += 1
            return orig(self, *a, **k)

        interpreter.InterpretedFunction._wsattn_orig = orig
        interpreter.InterpretedFunction.run = counted
        return names

    if case == "family":
        m = model(arg["family"])
        for label, lens, n, kw in arg["runs"]:
            ps = prompts(lens)
            _, ref_t, ref_l = run(m, "reference", ps, n)
            e, t, l = run(m, "kernels", ps, n, **kw)
            res[label] = {"tokens": all(torch.equal(a, b) for a, b in zip(ref_t, t)),
                          "err": err(l, ref_l), "nan": bool(l.isnan().any()),
                          "blocks": {str(b): buf.moe_block for b, buf in e.step._buffers.items()}}

    elif case == "one_token":
        # KernelStep(moe_one_token=True) at bucket 1: the same bits as the grouping kernel,
        # and no moe_group call
        from wsattn.engine.runner import KernelStep
        for fam in ("qwen3_moe", "mixtral"):
            m, ps, n = model(fam), prompts([9]), 8
            runs = {}
            for on, topk_in in ((False, False), (True, False), (True, True)):
                e = Engine(m, step="kernels", device="cpu", num_pages=8, page_size=8,
                           buckets=(1,))
                e.step = KernelStep(e.cfg, e.weights, e.cache, buckets=e.buckets,
                                    moe_one_token=on, moe_topk_in_gate_up=topk_in)
                launched = triton_launches()
                runs[on, topk_in] = e.run(ps, n, return_logits=True) + (
                    dict(e.step.launches), dict(launched))
            (t0, l0, c0, k0), (t1, l1, c1, _), (t2, l2, _, k2) = runs.values()
            res[fam] = {"equal": all(torch.equal(a, b) for a, b in zip(t0, t1))
                        and bool(torch.equal(l0, l1)),
                        "group_calls": [c0.get("moe_group", 0), c1.get("moe_group", 0)],
                        # the top-k inside gate/up: the same tokens, logits within rounding
                        "topk_in_tokens": all(torch.equal(a, b) for a, b in zip(t0, t2)),
                        "topk_in_err": err(l2, l0),
                        "route_launches": [k0.get("moe._route_kernel", 0),
                                           k2.get("moe._route_kernel", 0)]}

    elif case == "prefill_grouped":
        # KernelStep(moe_prefill_grouped=): the prefill's MoE MLP by torch._grouped_mm (two
        # calls a MoE layer and chunk) against the per-expert loop, whole and chunked
        from wsattn.engine.runner import KernelStep
        calls = [0]
        gmm = torch._grouped_mm

        def counted_gmm(*a, **k):
            calls[0] += 1
            return gmm(*a, **k)

        torch._grouped_mm = counted_gmm
        for fam in ("qwen3_moe", "mixtral"):  # OLMoE's MoE MLP is the same call
            m = model(fam)
            for chunk in (512, 4):
                runs = {}
                for on in (False, True):
                    e = Engine(m, step="kernels", device="cpu", prefill_chunk=chunk,
                               num_pages=8, page_size=8)
                    e.step = KernelStep(e.cfg, e.weights, e.cache, buckets=e.buckets,
                                        moe_prefill_grouped=on)
                    calls[0] = 0
                    t, l = e.run(prompts([11, 5]), 2, return_logits=True)
                    runs[on] = (t, l, calls[0])
                (t0, l0, c0), (t1, l1, c1) = runs[False], runs[True]
                res[f"{fam}/{chunk}"] = {
                    "tokens": all(torch.equal(a, b) for a, b in zip(t0, t1)),
                    "err": err(l1, l0), "nan": bool(l1.isnan().any()), "calls": [c0, c1],
                    "moe_layers": len(e.cfg.moe_layers)}

    elif case == "padding":
        m, ps, n = model("qwen3_moe"), prompts([9, 4, 6]), 6
        pad, pad_t, pad_l = run(m, "kernels", ps, n, buckets=(4,), num_pages=8, page_size=8)
        exact, t, l = run(m, "kernels", ps, n, buckets=(3,), num_pages=8, page_size=8)
        res["tokens"] = all(torch.equal(a, b) for a, b in zip(pad_t, t))
        res["err"] = err(pad_l, l)
        res["cache_equal"] = (torch.equal(pad.cache.k, exact.cache.k)
                              and torch.equal(pad.cache.v, exact.cache.v))
        res["buckets"] = sorted(pad.step._buffers), sorted(exact.step._buffers)

    elif case == "launches":
        names = collections.Counter()
        counting = [False]
        orig = interpreter.InterpretedFunction.run

        def counted(self, *a, **k):
            if counting[0]:  # module too: decode and the MoE both have a _combine_kernel
                names[self.fn.__module__.rsplit(".", 1)[-1] + "." + self.fn.__name__] += 1
            return orig(self, *a, **k)

        interpreter.InterpretedFunction.run = counted
        m = model("qwen3_moe")
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
        res["moe_layers"] = list(e.cfg.moe_layers)
        res["layers"] = e.cfg.layers

    print("RESULT " + json.dumps(res))
''')


def _child(case: str, **arg) -> dict:
    return interpreter_child(CHILD, case, json.dumps(arg))


# relative, per step: fp32 in the interpreter is fp32, as tests/test_runner.py
FP32_LOGITS = 1e-5

# (label, prompt lengths, new tokens, Engine kwargs); the grouping block per bucket is
# default_block(bucket, top_k=2, experts): 16 (tl.dot) at these buckets
RUNS = {
    "qwen3_moe": [("batch2", [11, 5], 8, {}), ("chunked", [11, 5], 6, {"prefill_chunk": 4}),
                  ("batch1", [9], 6, {})],
    "mixtral": [("batch2", [11, 5], 8, {}), ("batch6", [5, 9, 3, 7, 4, 6], 6, {})],
    "olmoe": [("batch2", [11, 5], 8, {}), ("chunked", [11, 5], 6, {"prefill_chunk": 4})],
    "qwen2_moe": [("batch2", [11, 5], 8, {}), ("chunked", [11, 5], 6, {"prefill_chunk": 4})],
    "dots1": [("batch2", [11, 5], 8, {}), ("batch1", [9], 6, {})],
}
BLOCKS = {("qwen3_moe", "batch2"): {"2": 16}, ("qwen3_moe", "chunked"): {"2": 16},
          ("qwen3_moe", "batch1"): {"1": 16}, ("mixtral", "batch2"): {"2": 16},
          ("mixtral", "batch6"): {"8": 16}, ("olmoe", "batch2"): {"2": 16},
          ("olmoe", "chunked"): {"2": 16}, ("qwen2_moe", "batch2"): {"2": 16},
          ("qwen2_moe", "chunked"): {"2": 16}, ("dots1", "batch2"): {"2": 16},
          ("dots1", "batch1"): {"1": 16}}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "dots1"])
def test_kernels_match_reference_moe(family):
    """Greedy tokens (6-8 new) equal to the reference step's and every step's logits
    within fp32 tolerance: Qwen3-MoE (8 experts top-2 renormalised, QK-norm, layer 1 a
    dense MLP) with one prefill chunk, chunks of 4 and a single sequence; Mixtral (4
    experts top-2) at buckets 2 and 8 (tl.dot block 16); OLMoE (8 experts top-2 not
    renormalised, QK-norm over the whole q/k projection: the two-launch QKV path), whole
    and chunked prefill; Qwen2-MoE (a sigmoid-gated shared expert beside 8 experts top-2,
    q/k/v bias, a dense layer), whole and chunked prefill; dots1 (DeepSeek-V3 routing with
    its bias and groups, ungated shared experts) at buckets 2 and 1 (there the top-k runs
    inside the gate/up launch)."""
    r = _child("family", family=family, runs=RUNS[family])
    for label, *_ in RUNS[family]:
        assert r[label]["tokens"] and not r[label]["nan"], (label, r)
        assert r[label]["err"] <= FP32_LOGITS, (label, r)
        assert r[label]["blocks"] == BLOCKS[family, label], (label, r)


def test_moe_one_token_grouping_in_the_step():
    """moe_one_token at bucket 1 (Qwen3-MoE with a dense layer, Mixtral): bitwise the
    tokens and logits of the step with the grouping kernel, and no grouping call."""
    r = _child("one_token")
    for fam, v in r.items():
        assert v["equal"] is True, (fam, v)
        assert v["group_calls"][0] > 0 and v["group_calls"][1] == 0, (fam, v)
        # moe_topk_in_gate_up (the default): no top-k launch, the same tokens
        assert v["topk_in_tokens"] is True and v["topk_in_err"] <= 1e-5, (fam, v)
        assert v["route_launches"][0] > 0 and v["route_launches"][1] == 0, (fam, v)


def test_moe_prefill_grouped_mm_matches_the_per_expert_loop():
    """The prefill's MoE MLP through torch._grouped_mm (the default: no host read of the
    per-expert counts) gives the tokens and, within fp32 rounding, the logits of the
    per-expert matmul loop, in one chunk and in chunks of 4 (a chunk of one sequence
    touches only some experts: empty groups), for Qwen3-MoE (with a dense layer) and
    Mixtral; two grouped calls a MoE layer and chunk, none with the switch off (the GPU
    test adds OLMoE and Qwen2-MoE)."""
    r = _child("prefill_grouped")
    assert len(r) == 4, r
    for key, v in r.items():
        assert v["tokens"] and not v["nan"], (key, v)
        assert v["err"] <= FP32_LOGITS, (key, v)
        # prefill calls: one packed chunk, or three by 4 ([4, 4], [4, 1], [3])
        prefills = 1 if key.endswith("/512") else 3
        assert v["calls"] == [0, 2 * v["moe_layers"] * prefills], (key, v)


def test_moe_bucket_padding():
    """A batch of 3 padded to bucket 4 (padding rows repeat row 0, so they route to row 0's
    experts and join its blocks) gives the tokens, logits and KV cache of the batch of 3
    at bucket 3."""
    r = _child("padding")
    assert r["buckets"] == [[4], [3]], r
    assert r["tokens"], r
    assert r["err"] <= FP32_LOGITS, r
    assert r["cache_equal"], r


def test_moe_launches_per_layer():
    """A MoE layer is 7 library calls (qkv_rope, decode, gemv_o, moe_route, moe_group,
    moe_gate_up, moe_down_combine) and 8 Triton launches in the interpreter (qkv_rope,
    decode, gemv o, route, group, grouped gate/up, grouped down, combine; 9 where decode
    splits the keys); the interleaved dense layer stays 5 calls / 5-6 launches."""
    r = _child("launches")
    steps, L, moe = r["steps"], r["layers"], r["moe_layers"]
    assert steps == 2 and moe == [0] and L == 2, r
    for counts in r["runner"]:
        assert counts == {"embed": 1, "positions": 1, "qkv_rope": 2, "decode": 2, "gemv_o": 2,
                          "moe_route": 1, "moe_group": 1, "moe_gate_up": 1,
                          "moe_down_combine": 1, "gemv_gate_up": 1, "gemv_down": 1,
                          "gemv_lm_head": 1}, r
    tri = dict(r["triton"])
    # decode's combine launches only where it splits the keys (not at these short lengths
    # with the current split rule): 0 or once a layer
    split = tri.pop("decode_triton._combine_kernel", 0)
    assert split in (0, L * steps), r
    assert tri == {"qkv_rope._qkv_rope_kernel": L * steps,
                   "decode_triton._decode_kernel": L * steps,
                   "gemv._gemv_kernel": (1 + 3 + 1) * steps,  # o, o + gate/up + down, lm_head
                   "moe._router_logits_kernel": steps, "moe._route_kernel": steps,
                   "moe._group_kernel": steps,
                   "moe._grouped_kernel": 2 * steps, "moe._combine_kernel": steps}, r
    # qkv, decode, o, router logits, route, group, gate/up, down, combine
    moe_layer = 1 + 1 + 1 + 2 + 1 + 2 + 1
    dense_layer = 1 + 1 + 3
    assert sum(tri.values()) == (moe_layer + dense_layer + 1) * steps, r  # + the LM head


# --------------------------------------------------------------------------- refusals, auto

def _hf(name):
    import transformers

    base = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2,
                max_position_embeddings=64)
    if name == "olmoe":
        return transformers.OlmoeConfig(**base, num_experts=8)
    if name == "mixtral":
        return transformers.MixtralConfig(**base, num_local_experts=4)
    return transformers.Qwen3MoeConfig(**base, head_dim=64, moe_intermediate_size=32,
                                       num_experts=8)


def test_moe_weights_checked_by_name(monkeypatch):
    """A MoE layer's expert tensors of the wrong shape, or a router where cfg has a dense
    layer, are refused at construction with the field named."""
    import dataclasses

    import transformers

    from wsattn.engine.kv_cache import PagedKVCache
    from wsattn.engine.runner import KernelStep
    from wsattn.models import flashnorm
    from wsattn.models.weights import load

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    cfg, w = load(transformers.AutoModelForCausalLM.from_config(_hf("qwen3_moe")).eval())
    w = flashnorm.fold(w)
    cache = PagedKVCache(cfg, num_pages=4, page_size=8, dtype=torch.float32, device="cpu",
                         max_batch=4)
    KernelStep(cfg, w, cache, buckets=(1, 2, 4))  # the unchanged weights are taken
    layer = w.layers[0]
    bad = dataclasses.replace(layer, w_down=layer.w_down[:, :, :16].contiguous())
    with pytest.raises(ValueError, match=r"layers\[0\]\.w_down must be \[8, 128, 32\]"):
        KernelStep(cfg, dataclasses.replace(w, layers=[bad]), cache, buckets=(1, 2, 4))
    dense_cfg = dataclasses.replace(cfg, moe_layers=(), experts=0, top_k=0, moe_ffn=0)
    with pytest.raises(ValueError, match=r"router in layers \[0\], cfg.moe_layers is \[\]"):
        KernelStep(dense_cfg, w, cache, buckets=(1, 2, 4))


def test_auto_on_cuda_picks_kernels_for_16_bit_models():
    """impl="auto" resolves to the kernel step on CUDA for a bf16 / fp16 model (every family,
    OLMoE included), to the reference step on the CPU and for fp32 (no GPU needed)."""
    from wsattn.engine.generate import _resolve_impl

    assert _resolve_impl("auto", "cuda", torch.bfloat16) == "kernels"
    assert _resolve_impl("auto", "cuda", torch.float16) == "kernels"
    assert _resolve_impl("auto", "cpu", torch.bfloat16) == "reference"
    assert _resolve_impl("auto", "cuda", torch.float32) == "reference"
    assert _resolve_impl("kernels", "cpu") == "kernels"


# --------------------------------------------------------------------------- GPU

def _gpu_engine(family="qwen3_moe", graphs=None, pdl=None, moe_one_token=True,
                moe_prefill_grouped=True, moe_topk_in_gate_up=True):
    """A bf16 MoE model (hidden 512, D 64, 8/2 heads, 4 layers; Qwen3-MoE 16 experts top-4
    with layer 2 dense, Mixtral 8 experts top-2, OLMoE 16 experts top-4 with its
    whole-projection QK-norm, or Qwen2-MoE 16 experts top-4 with a shared expert and
    layer 2 dense) on CUDA."""
    import transformers

    from wsattn.engine.generate import Engine
    from wsattn.engine.runner import KernelStep

    torch.manual_seed(0)
    common = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=1024,
                                          moe_intermediate_size=256, num_experts=16,
                                          num_experts_per_tok=4, norm_topk_prob=True,
                                          mlp_only_layers=[2])
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=256, num_experts=16,
                                       num_experts_per_tok=4, norm_topk_prob=False)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, head_dim=64, intermediate_size=1024,
                                          moe_intermediate_size=256,
                                          shared_expert_intermediate_size=512, num_experts=16,
                                          num_experts_per_tok=4, mlp_only_layers=[2])
    elif family == "dots1":
        cfg = transformers.Dots1Config(**common, intermediate_size=1024,
                                       moe_intermediate_size=256, n_routed_experts=16,
                                       n_shared_experts=2, n_group=4, topk_group=2,
                                       num_experts_per_tok=4, norm_topk_prob=True,
                                       routed_scaling_factor=2.5, first_k_dense_replace=1)
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=512, num_local_experts=8,
                                         num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:  # zeros as initialised: make it choose
                b.copy_(0.02 * torch.randn_like(b))
    e = Engine(model, dtype=torch.bfloat16, device="cuda", step="kernels", num_pages=512,
               page_size=16, buckets=(1, 2, 4, 8, 16))
    e.step = KernelStep(e.cfg, e.weights, e.cache, buckets=e.buckets, graphs=graphs, pdl=pdl,
                        moe_one_token=moe_one_token, moe_prefill_grouped=moe_prefill_grouped,
                        moe_topk_in_gate_up=moe_topk_in_gate_up)
    return e, model


def _gpu_prompts(n=3):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 4096, (37 + 13 * i,), generator=g) for i in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "dots1"])
@pytest.mark.parametrize("batch", [1, 3, 12])  # buckets 1, 4 and 16 (grouping block 16 at each)
def test_gpu_moe_graph_replay_equals_eager(family, batch):
    """CUDA-graph replay gives bitwise the tokens and logits of the eager step."""
    ps = _gpu_prompts(batch)
    graph_t, graph_l = _gpu_engine(family, graphs=True)[0].run(ps, 24, return_logits=True)
    eager_t, eager_l = _gpu_engine(family, graphs=False)[0].run(ps, 24, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(graph_t, eager_t))
    assert torch.equal(graph_l, eager_l)


@pytest.mark.gpu
@pytest.mark.parametrize("family, pdl", [
    ("qwen3_moe", True), ("mixtral", True), ("olmoe", True), ("qwen2_moe", True),
    ("dots1", True),
    # PDL on some kernel families only: PDL and plain launches next to each other in a graph
    ("qwen3_moe", ("gemv", "moe")), ("qwen3_moe", ("qkv_rope", "decode"))])
def test_gpu_moe_pdl_on_equals_off(family, pdl):
    """PDL changes when programs start, not what they compute: bitwise equal logits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ps = _gpu_prompts()
    on_t, on_l = _gpu_engine(family, pdl=pdl)[0].run(ps, 24, return_logits=True)
    off_t, off_l = _gpu_engine(family, pdl=False)[0].run(ps, 24, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(on_t, off_t))
    assert torch.equal(on_l, off_l)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "dots1"])
def test_gpu_moe_one_token_equals_the_grouping_kernel(family):
    """One sequence (bucket 1), PDL on, in a graph: the kernel-free grouping gives bitwise
    the tokens and logits of the step with the grouping kernel; with the top-k inside the
    gate/up launch as well (the default) the same tokens, logits within rounding of the
    renormalising sum's order, and bit-identical on a second engine."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ps = _gpu_prompts(1)
    group_t, group_l = _gpu_engine(family, pdl=True, moe_one_token=False)[0] \
        .run(ps, 24, return_logits=True)
    one_t, one_l = _gpu_engine(family, pdl=True, moe_topk_in_gate_up=False)[0] \
        .run(ps, 24, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(group_t, one_t))
    assert torch.equal(group_l, one_l)
    runs = [_gpu_engine(family, pdl=True)[0].run(ps, 24, return_logits=True) for _ in range(2)]
    (in_t, in_l), (in_t2, in_l2) = runs
    assert all(torch.equal(a, b) for a, b in zip(group_t, in_t))
    assert (in_l.float() - one_l.float()).abs().max().item() <= 2e-2 * one_l.float().abs().max().item()
    assert all(torch.equal(a, b) for a, b in zip(in_t, in_t2)) and torch.equal(in_l, in_l2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "dots1"])
@pytest.mark.parametrize("batch", [1, 3])  # buckets 1 (Gluon block 1) and 4
def test_gpu_moe_gluon_variant_matches_the_triton_step(family, batch):
    """pdl variant "moe:gluon" (the grouped projections on the sm_90 Gluon kernel): graph
    replay bitwise the eager step, and the first decode step's logits (prefill is torch,
    the same for both) within bf16 tolerance of the Triton step's."""
    if torch.cuda.get_device_capability()[:1] != (9,):
        pytest.skip("the Gluon grouped kernel is sm_90's")
    from wsattn.testing import rel_err, tol

    ps = _gpu_prompts(batch)
    pdl = ("qkv_rope", "decode", "gemv", "moe:gluon")
    e, _ = _gpu_engine(family, pdl=pdl)
    assert e.step.moe_gluon and not e.step.moe_topk_in_gate_up
    graph_t, graph_l = e.run(ps, 24, return_logits=True)
    eager_t, eager_l = _gpu_engine(family, pdl=pdl, graphs=False)[0] \
        .run(ps, 24, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(graph_t, eager_t))
    assert torch.equal(graph_l, eager_l)
    triton_l = _gpu_engine(family)[0].run(ps, 2, return_logits=True)[1]
    assert not graph_l.isnan().any()
    assert rel_err(graph_l[:, 1], triton_l[:, 1]) <= tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "dots1"])
def test_gpu_moe_matches_reference_step(family):
    """bf16 kernels vs the reference step (fp32 compute over the same bf16 weights): the
    first step's logits (prefill) within bf16 tolerance; then 32 decode steps,
    teacher-forced on the kernels' own tokens (one transformers forward over prompt +
    tokens, so every step is compared whatever token the last one chose), within bf16
    tolerance of the same weights in fp32 or within twice transformers' own bf16 error
    there (random weights make logits flat)."""
    import copy

    from wsattn.bench.step import teacher_forced_check
    from wsattn.engine.generate import Engine
    from wsattn.testing import rel_err, tol

    e, model = _gpu_engine(family)
    ps = _gpu_prompts()
    kl = e.run(ps, 1, return_logits=True)[1]
    ref = Engine(model, dtype=torch.bfloat16, device="cuda", step="reference")
    rl = ref.run(ps, 1, return_logits=True)[1]
    assert rel_err(kl[:, 0], rl[:, 0]) <= tol(torch.bfloat16)
    del ref
    ids = torch.stack([p[:37] for p in ps])
    fp32 = copy.deepcopy(model).to("cuda", torch.float32).eval()
    bf16 = copy.deepcopy(model).to("cuda", torch.bfloat16).eval()
    rel, bound, detail = teacher_forced_check(bf16, e, ids, 32, "bf16", ref_model=fp32)
    assert rel <= bound, (rel, bound, detail)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "dots1"])
@pytest.mark.parametrize("chunk", [2048, 24])
def test_gpu_moe_prefill_grouped_mm_matches_the_per_expert_loop(family, chunk):
    """bf16 on CUDA: the prefill's MoE MLP through torch._grouped_mm (the default) gives
    the per-expert loop's prefill logits within bf16 tolerance (cuBLAS's grouped and
    plain GEMMs may sum in different orders), whole and in chunks of 24 tokens."""
    from wsattn.testing import rel_err, tol

    ps = _gpu_prompts()
    logits = []
    for grouped in (True, False):
        e = _gpu_engine(family, moe_prefill_grouped=grouped)[0]
        e.prefill_chunk = chunk
        logits.append(e.run(ps, 1, return_logits=True)[1][:, 0])
    assert not logits[0].isnan().any()
    assert rel_err(logits[0], logits[1]) <= tol(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_generate_auto_runs_kernels_for_moe():
    """wsattn.generate(impl="auto") on CUDA builds the kernel step for a bf16 Qwen3-MoE."""
    from wsattn.engine import generate as gen

    _, model = _gpu_engine()
    built = []
    orig = gen._make_step

    def spy(name, *a, **k):
        built.append(name)
        return orig(name, *a, **k)

    gen._make_step = spy
    try:
        gen.generate(model, [p[:8] for p in _gpu_prompts(2)], 4, dtype=torch.bfloat16)
    finally:
        gen._make_step = orig
    assert built == ["kernels"]
