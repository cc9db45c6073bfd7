"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE with its shared
expert, dots1 with DeepSeek-V3's routing and ungated shared experts): configs and refusals, routing
and the MoE block against transformers' own, loading (object, per-expert and fused
folders, bad checkpoints), FlashNorm folding into the router and the experts, and the
reference forward against transformers generate (32 greedy tokens, per-step logits)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import types

import pytest
import torch

import safetensors.torch as safetensors_torch
import transformers  # the `test` extra pins it

from wsattn.models import KVCache, ModelConfig, UnsupportedModelError, decode_step, fold, load, prefill
from wsattn.models.moe import moe_block, route, select
from wsattn.models.reference import inv_rms, rms_norm
from wsattn.testing import rel_err

from conftest import rewrite_checkpoint

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
            num_experts_per_tok=2, eos_token_id=None, pad_token_id=None, bos_token_id=None)
QWEN3_MOE = dict(BASE, num_experts=8, moe_intermediate_size=32)
# OLMoE's q_norm spans hidden_size, so head_dim = hidden / heads: 2 heads of 64 (two heads,
# so a per-head norm would differ from the whole-projection one)
OLMOE = dict(BASE, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=64, num_experts=8)
OLMOE.pop("head_dim")
CONFIGS = {
    "qwen3_moe-norm": lambda: transformers.Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True),
    "qwen3_moe-unnormed": lambda: transformers.Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=False),
    # a dense layer interleaved: layer 1 is a plain MLP of width intermediate_size
    "qwen3_moe-dense1": lambda: transformers.Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True,
                                                           mlp_only_layers=[1]),
    "mixtral": lambda: transformers.MixtralConfig(**BASE, num_local_experts=4),
    "olmoe": lambda: transformers.OlmoeConfig(**OLMOE),
    # a shared expert of width 48 beside the routed ones, q/k/v bias, layer 1 dense
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**QWEN3_MOE, shared_expert_intermediate_size=48,
                                                     norm_topk_prob=True, mlp_only_layers=[1]),
    # DeepSeek-V3 routing: sigmoid, a correction bias, 4 groups of 2 with 2 kept, scale
    # 2.5; two shared experts (one ungated MLP of width 64); layer 0 dense
    "dots1": lambda: transformers.Dots1Config(
        **{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, n_routed_experts=8,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1),
}
NAMES = sorted(CONFIGS)
# each model's seed, fixed per name (a new config must not reseed the others' weights)
SEEDS = {name: i for i, name in enumerate(["mixtral", "olmoe", "qwen3_moe-dense1", "qwen3_moe-norm",
                                          "qwen3_moe-unnormed", "qwen2_moe", "dots1"])}
LOGITS_TOL = 1e-5  # fp32 transformers against the float64 reference, as tests/test_models.py


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread (a pool spins for milliseconds on a loaded CI box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def tiny_model(name):
    """A tiny random fp32 model with random norm weights (transformers' ones would hide a
    misplaced norm) and weights scaled up, so logits and routing are sharp (no near-ties
    between fp32 and fp64)."""
    torch.manual_seed(SEEDS[name])
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](), dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "experts" in pname:
                p.mul_(10.0)  # 0.02 init: expert outputs big enough to move the logits
            else:
                p.mul_(3.0)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:  # zeros as initialised: make it choose
                b.copy_(0.2 * torch.randn_like(b))
    return model


def _moe_layers(model):
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


# --- config -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_config_from_object_and_dict_agree(name):
    hf = CONFIGS[name]()
    cfg = ModelConfig.from_hf(hf)
    assert cfg == ModelConfig.from_hf(json.loads(hf.to_json_string()))
    family = name.split("-")[0]
    assert cfg.family == family and cfg.top_k == 2 and cfg.head_dim == 64
    assert cfg.experts == {"mixtral": 4}.get(family, 8)
    assert cfg.moe_ffn == {"qwen3_moe": 32, "mixtral": 128, "olmoe": 64, "qwen2_moe": 32,
                           "dots1": 32}[family]
    assert cfg.norm_topk == (name != "qwen3_moe-unnormed" and family != "olmoe")
    assert cfg.moe_layers == {"qwen3_moe-dense1": (0,), "qwen2_moe": (0,),
                              "dots1": (1,)}.get(name, (0, 1))
    assert cfg.moe_layers == tuple(_moe_layers(tiny_model(name)))
    assert cfg.qk_norm == (family in ("qwen3_moe", "dots1"))
    assert cfg.qk_norm_whole == (family == "olmoe")
    assert cfg.shared_ffn == {"qwen2_moe": 48, "dots1": 64}.get(family, 0)
    assert cfg.shared_gated == (family != "dots1")
    assert cfg.qkv_bias == (family == "qwen2_moe")
    routing = ("sigmoid", True, 4, 2, 2.5) if family == "dots1" else ("softmax", False, 1, 1, 1.0)
    assert (cfg.scoring, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups,
            cfg.routed_scale) == routing


def test_config_decoder_sparse_step():
    """Qwen3-MoE's grid: layer i is MoE when (i + 1) % decoder_sparse_step == 0."""
    hf = transformers.Qwen3MoeConfig(**dict(QWEN3_MOE, num_hidden_layers=5), decoder_sparse_step=2,
                                     mlp_only_layers=[3])
    model = transformers.AutoModelForCausalLM.from_config(hf)
    assert ModelConfig.from_hf(hf).moe_layers == (1,) == tuple(_moe_layers(model))


PUBLISHED = {  # config.json keys as published, trimmed to what the shape reads
    "Qwen3-30B-A3B": ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                       "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                       "moe_intermediate_size": 768, "num_experts": 128,
                       "num_experts_per_tok": 8, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
                       "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                       "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": 48, "tie_word_embeddings": False,
                       "vocab_size": 151936, "torch_dtype": "bfloat16", "attention_bias": False},
                      dict(experts=128, top_k=8, moe_ffn=768, norm_topk=True, head_dim=128,
                           moe_layers=tuple(range(48)), qk_norm=True)),
    "Mixtral-8x7B": ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                      "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
                      "sliding_window": None, "vocab_size": 32000,
                      "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                      "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"},
                     dict(experts=8, top_k=2, moe_ffn=14336, norm_topk=True, head_dim=128,
                          moe_layers=tuple(range(32)), qk_norm=False)),
    "OLMoE-1B-7B": ({"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
                     "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                     "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                     "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
                     "rope_theta": 10000.0, "vocab_size": 50304,
                     "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
                    dict(experts=64, top_k=8, moe_ffn=1024, norm_topk=False, head_dim=128,
                         moe_layers=tuple(range(16)), qk_norm_whole=True)),
    # dots.llm1: n_group / topk_group null, scoring_func stated, no head_dim (hidden / heads)
    "dots.llm1": ({"architectures": ["Dots1ForCausalLM"], "model_type": "dots1",
                   "hidden_size": 4096, "num_hidden_layers": 62, "intermediate_size": 10944,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
                   "vocab_size": 152064, "first_k_dense_replace": 1,
                   "moe_intermediate_size": 1408, "n_routed_experts": 128,
                   "n_shared_experts": 2, "num_experts_per_tok": 6, "norm_topk_prob": True,
                   "routed_scaling_factor": 2.5, "n_group": None, "topk_group": None,
                   "max_position_embeddings": 32768, "rope_theta": 10000000,
                   "scoring_func": "sigmoid", "attention_bias": False,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
                  dict(experts=128, top_k=6, moe_ffn=1408, norm_topk=True, head_dim=128,
                       moe_layers=tuple(range(1, 62)), qk_norm=True, shared_ffn=2816,
                       shared_gated=False, scoring="sigmoid", router_bias=True,
                       router_groups=1, router_topk_groups=1, routed_scale=2.5)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_published(name):
    d, fields = PUBLISHED[name]
    cfg = ModelConfig.from_hf(d)
    assert {k: getattr(cfg, k) for k in fields} == fields


def _dict(name, **over):
    d = json.loads(CONFIGS[name]().to_json_string())
    d.update(over)
    return d


REFUSALS = {
    "qwen2_moe-shared-expert-unstated": ({k: v for k, v in _dict("qwen2_moe").items()
                                          if k != "shared_expert_intermediate_size"},
                                         r"lacks \['shared_expert_intermediate_size'\]"),
    "deepseek_v3": ({**_dict("qwen3_moe-norm"), "model_type": "deepseek_v3"},
                    "multi-head latent attention"),
    "dots1-softmax": (_dict("dots1", scoring_func="softmax"), "scoring function"),
    "dots1-experts-unstated": ({k: v for k, v in _dict("dots1").items()
                                if k != "n_routed_experts"}, r"lacks \['n_routed_experts'\]"),
    "dots1-shared-unstated": (_dict("dots1", n_shared_experts=None),
                              r"lacks \['n_shared_experts'\]"),
    "dots1-sliding-window": (_dict("dots1", layer_types=None, max_window_layers=1),
                             "sliding-window"),
    "dots1-attention_bias": (_dict("dots1", attention_bias=True), "o_proj"),
    "dots1-topk-method": (_dict("dots1", topk_method="group_limited_greedy"), "top-k method"),
    "shared_expert_intermediate_size": (_dict("qwen3_moe-norm", shared_expert_intermediate_size=64),
                                        "shared experts"),
    "grouped-topk": (_dict("qwen3_moe-norm", n_group=4, topk_group=2), "grouped top-k"),
    "sigmoid-scoring": (_dict("mixtral", scoring_func="sigmoid"), "scoring function"),
    "routed-scaling": (_dict("olmoe", routed_scaling_factor=2.5), "routed scaling factor"),
    "router-bias": (_dict("mixtral", router_bias=True), "bias on the router"),
    "mixtral-sliding-window": (_dict("mixtral", sliding_window=16), "sliding-window"),
    "qwen3_moe-sliding-window": (_dict("qwen3_moe-norm", use_sliding_window=True, sliding_window=16),
                                 "sliding-window"),
    "olmoe-clip_qkv": (_dict("olmoe", clip_qkv=8.0), "clip_qkv=8.0"),
    "olmoe-head_dim": (_dict("olmoe", head_dim=128), "q_norm spans hidden_size"),
    "qwen3_moe-attention_bias": (_dict("qwen3_moe-norm", attention_bias=True), "o_proj"),
    "routing-not-stated": ({k: v for k, v in _dict("mixtral").items()
                            if k != "num_experts_per_tok"}, r"lacks \['num_experts_per_tok'\]"),
    "experts-on-dense-family": ({**_dict("qwen3_moe-norm"), "model_type": "qwen3",
                                 "num_experts": 8}, "mixture-of-experts .* model_type 'qwen3'"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_config_refuses_unsupported_feature(case):
    d, feature = REFUSALS[case]
    with pytest.raises(UnsupportedModelError, match=feature):
        ModelConfig.from_hf(d)


def test_qwen2_moe_sliding_layers_as_transformers_decides():
    """Without layer_types (older published configs), Qwen2-MoE slides its even layers
    below max_window_layers when use_sliding_window is set (not Qwen2's layers from
    max_window_layers on): refused exactly where transformers' config has a sliding
    layer."""
    for use, window_layers in ((True, 28), (True, 1), (True, 0), (False, 28)):
        hf = transformers.Qwen2MoeConfig(**{**json.loads(CONFIGS["qwen2_moe"]().to_json_string()),
                                            "layer_types": None, "use_sliding_window": use,
                                            "sliding_window": 4,
                                            "max_window_layers": window_layers})
        slides = any(t != "full_attention" for t in hf.layer_types)
        d = _dict("qwen2_moe", layer_types=None, use_sliding_window=use, sliding_window=4,
                  max_window_layers=window_layers)
        if slides:
            with pytest.raises(UnsupportedModelError, match=r"sliding-window .*layers \[0"):
                ModelConfig.from_hf(d)
        else:
            ModelConfig.from_hf(d)
        assert slides == (use and window_layers > 0), (use, window_layers)


@pytest.mark.parametrize("name", ["mixtral", "dots1", "qwen2_moe", "olmoe", "qwen3_moe-norm"])
def test_kv_heads_left_out_or_null_as_transformers_reads_them(name):
    """A config.json without num_key_value_heads takes the config class's default (Mixtral
    8, dots1 32, ...); one with it null takes one KV head a query head."""
    cls = type(CONFIGS[name]())
    full = _dict(name)
    if name != "olmoe":  # enough query heads for every default; OLMoE's q_norm ties them
        full.update(num_attention_heads=32, head_dim=64)  # to hidden, its default is None
    heads = full["num_attention_heads"]
    left_out = {k: v for k, v in full.items() if k != "num_key_value_heads"}
    want = cls(**left_out).num_key_value_heads
    assert ModelConfig.from_hf(left_out).kv_heads == want, name
    assert name != "mixtral" or want == 8
    if name in ("dots1", "olmoe"):  # the classes here that take a null and resolve it
        null = {**full, "num_key_value_heads": None}
        assert cls(**null).num_key_value_heads == heads
        assert ModelConfig.from_hf(null).kv_heads == heads


def test_config_bad_top_k():
    with pytest.raises(ValueError, match=r"top_k \(num_experts_per_tok\) must lie in \[1, num_experts=8\], got 9"):
        ModelConfig.from_hf(_dict("qwen3_moe-norm", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.from_hf(_dict("mixtral", num_experts_per_tok=0))


@pytest.mark.parametrize("over, match", [
    (dict(n_group=3), r"router_groups \(3\) must divide experts \(8\)"),
    (dict(topk_group=5), r"router_topk_groups \(5\) lie in \[1, router_groups\]"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"top_k \(3\) exceeds .* \(2\)"),
    (dict(n_group=8, topk_group=2), "group-limited routing .* >= 2 experts a group"),
    (dict(routed_scaling_factor=0.0), "routed_scale must be a positive finite float"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace must be an int >= 0"),
])
def test_config_dots1_bad_routing(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(_dict("dots1", **over))


def test_dots1_bias_and_groups_change_the_choice():
    """The routing test above would pass for a router that ignored the bias or the groups
    if neither moved a choice: both do, at the tiny model's layer."""
    model = tiny_model("dots1")
    cfg, w = load(model)
    layer = w.layers[cfg.moe_layers[0]]
    x = _x(64, cfg.hidden, 11)
    got = route(cfg, x, layer.router, layer.router_bias)[1].sort(-1)[0]
    plain = dataclasses.replace(cfg, router_groups=1, router_topk_groups=1)
    assert not torch.equal(got, route(plain, x, layer.router, layer.router_bias)[1].sort(-1)[0])
    unbiased = torch.zeros_like(layer.router_bias)
    assert not torch.equal(got, route(cfg, x, layer.router, unbiased)[1].sort(-1)[0])


def test_config_dots1_states_what_its_class_runs():
    """scoring_func "sigmoid" and topk_method "noaux_tc" name what Dots1TopkRouter runs."""
    cfg = ModelConfig.from_hf(_dict("dots1", scoring_func="sigmoid", topk_method="noaux_tc"))
    assert cfg == ModelConfig.from_hf(_dict("dots1"))


def test_config_router_jitter_accepted():
    """Mixtral's router_jitter_noise acts only in training mode: the forward is unchanged."""
    assert ModelConfig.from_hf(_dict("mixtral", router_jitter_noise=0.1)).family == "mixtral"


# --- routing and the MoE block against transformers' ------------------------------------

def _x(n, hidden, seed):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_routing_identical_to_transformers(name):
    """Chosen experts and their weights bit-equal to transformers' router module's."""
    model = tiny_model(name)
    cfg, w = load(model)
    for i in cfg.moe_layers:
        x = _x(37, cfg.hidden, i)
        with torch.no_grad():
            _, hf_weights, hf_experts = model.model.layers[i].mlp.gate(x)
        weights, experts = route(cfg, x, w.layers[i].router, w.layers[i].router_bias)
        assert weights.dtype == torch.float32 and experts.dtype == torch.int64
        if cfg.scoring == "sigmoid":
            # transformers' top-k there is sorted=False: the same set, listed its own way
            order = hf_experts.argsort(-1)
            hf_experts, hf_weights = hf_experts.gather(1, order), hf_weights.gather(1, order)
            order = experts.argsort(-1)
            experts, weights = experts.gather(1, order), weights.gather(1, order)
        assert torch.equal(experts, hf_experts)
        assert torch.equal(weights, hf_weights.float())
        if cfg.norm_topk:
            assert torch.allclose(weights.sum(-1), torch.full((37,), cfg.routed_scale))
        else:
            assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe-norm", "olmoe", "mixtral"])
def test_routing_weights_rounded_as_transformers_in_bf16(name):
    """In bf16 the chosen weights are bit-equal to the router module's: rounded to the
    logits' dtype where transformers rounds them (Qwen2-MoE, Qwen3-MoE, OLMoE), not for
    Mixtral."""
    model = copy.deepcopy(tiny_model(name)).to(torch.bfloat16)
    cfg, w = load(model)
    i = cfg.moe_layers[0]
    x = _x(37, cfg.hidden, i).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_weights, hf_experts = model.model.layers[i].mlp.gate(x)
    weights, experts = route(cfg, x, w.layers[i].router, w.layers[i].router_bias)
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights.float()), (weights - hf_weights.float()).abs().max()


def test_left_out_rms_norm_eps_is_the_class_default():
    """Mixtral and OLMoE default to 1e-5 (the others to 1e-6), as their config classes."""
    for name in ("mixtral", "olmoe", "qwen3_moe-norm", "qwen2_moe", "dots1"):
        d = {k: v for k, v in _dict(name).items() if k != "rms_norm_eps"}
        want = type(CONFIGS[name]())(**d).rms_norm_eps
        assert ModelConfig.from_hf(d).rms_eps == want, name


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "mixtral"])
def test_routing_ties_as_transformers(name):
    """Two equal router rows tie exactly; the pick is torch.topk's, as transformers'."""
    model = tiny_model(name)
    cfg = ModelConfig.from_hf(model.config)
    gate = model.model.layers[0].mlp.gate
    router = gate.weight.detach().clone()
    router[2] = router[1]
    router[3] = router[1]
    x = _x(16, cfg.hidden, 7)
    x[:, :] = x[:1]  # every token the same
    with torch.no_grad():
        saved = gate.weight.detach().clone()
        gate.weight.copy_(router)
        try:
            _, hf_weights, hf_experts = gate(x)
        finally:
            gate.weight.copy_(saved)
    weights, experts = route(cfg, x, router)
    assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights.float())


@pytest.mark.parametrize("name", NAMES)
def test_moe_block_matches_transformers(name):
    model = tiny_model(name)
    cfg, w = load(model)
    for i in cfg.moe_layers:
        layer = model.model.layers[i]
        h = _x(23, cfg.hidden, 10 + i)
        with torch.no_grad():
            ref = layer.mlp(layer.post_attention_layernorm(h)[None])[0]
        out = moe_block(cfg, w.layers[i], h)
        assert out.dtype == torch.float32 and not out.isnan().any()
        assert rel_err(out, ref) <= 1e-6, name
        out64 = moe_block(cfg, w.layers[i], h.double())
        assert rel_err(out64, ref) <= LOGITS_TOL


def test_moe_block_sums_slots_in_order():
    """y is sum_k w[t, k] * expert_{e[t, k]}(x[t]), k ascending: one token by hand, fp64."""
    cfg, w = load(tiny_model("mixtral"), dtype=torch.float64)
    layer = w.layers[0]
    h = _x(1, cfg.hidden, 3).double()
    xn = rms_norm(h, layer.mlp_norm, cfg.rms_eps)
    weights, experts = route(cfg, xn, layer.router)
    y = torch.zeros_like(h)
    for k in range(cfg.top_k):
        gate, up = (xn @ layer.w_gate_up[experts[0, k]].T).chunk(2, -1)
        y = y + weights[0, k].double() * ((torch.nn.functional.silu(gate) * up) @ layer.w_down[experts[0, k]].T)
    assert torch.equal(moe_block(cfg, layer, h), y)


def test_moe_block_nan_token_propagates():
    """A NaN in one token gives that token a NaN output (not dropped), the others as before
    up to fp32 rounding: the NaN token routes elsewhere, so an expert's batch has another
    row count, and CPU BLAS may take another kernel for it (on some CPUs the other tokens'
    outputs differ in their last bit; passed bitwise on one CI machine, failed on the next
    with the same torch)."""
    cfg, w = load(tiny_model("qwen3_moe-norm"))
    h = _x(5, cfg.hidden, 4)
    clean = moe_block(cfg, w.layers[0], h)
    h[2, 7] = float("nan")
    out = moe_block(cfg, w.layers[0], h)
    assert out[2].isnan().all()
    # not bitwise: another row count for an expert may take another BLAS kernel (last-bit
    # differences, 4.8e-7 at most here against outputs up to 4.3); a dropped or leaked NaN
    # would still fail
    torch.testing.assert_close(out[[0, 1, 3, 4]], clean[[0, 1, 3, 4]], rtol=1e-6, atol=1e-6)


def test_moe_block_bad_layer_shapes():
    cfg, w = load(tiny_model("olmoe"))
    layer = w.layers[0]
    h = _x(3, cfg.hidden, 5)
    cases = [(dataclasses.replace(layer, w_down=layer.w_down[:, :, :-1]), r"layer\.w_down must be \[8, 128, 64\]"),
             (dataclasses.replace(layer, w_gate_up=layer.w_gate_up[:7]), r"layer\.w_gate_up must be \[8, 128, 128\]"),
             (dataclasses.replace(layer, router=None), r"layer\.router must be \[8, 128\].*got None")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            moe_block(cfg, bad, h)
    with pytest.raises(ValueError, match="x must be"):
        moe_block(cfg, layer, h[:, :64])
    with pytest.raises(ValueError, match="router must be"):
        route(cfg, h, layer.router[:, :64])


# --- loading ----------------------------------------------------------------------------

def _fused_folder(model, folder):
    """transformers 5's fused expert parameters, as the object's state_dict holds them."""
    folder.mkdir()
    (folder / "config.json").write_text(model.config.to_json_string())
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture
def saved(tmp_path):
    def save(name):
        folder = tmp_path / name
        tiny_model(name).save_pretrained(folder, safe_serialization=True)
        return folder
    return save


@pytest.mark.parametrize("name", NAMES)
def test_load_object_per_expert_and_fused_folders_agree(name, saved, tmp_path):
    model = tiny_model(name)
    folder = saved(name)
    keys = safetensors_torch.load_file(folder / "model.safetensors").keys()
    per_expert = "w1" if name == "mixtral" else "gate_proj"
    moe = ModelConfig.from_hf(model.config).moe_layers[0]
    assert any(k.endswith(f"layers.{moe}.{'block_sparse_moe' if name == 'mixtral' else 'mlp'}"
                          f".experts.3.{per_expert}.weight") for k in keys), "save_pretrained's layout"
    sd = model.state_dict()
    cfg0, w0 = load(model)
    for source in (folder, _fused_folder(model, tmp_path / "fused")):
        cfg, w = load(source)
        assert cfg == cfg0
        got, want = dict(w.tensors()), dict(w0.tensors())
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    for i in cfg0.moe_layers:
        p = f"model.layers.{i}.mlp."
        assert torch.equal(w0.layers[i].router, sd[p + "gate.weight"])
        assert torch.equal(w0.layers[i].w_gate_up, sd[p + "experts.gate_up_proj"])
        assert torch.equal(w0.layers[i].w_down, sd[p + "experts.down_proj"])
        assert w0.layers[i].w_gate_up.shape == (cfg0.experts, 2 * cfg0.moe_ffn, cfg0.hidden)
    for i in set(range(cfg0.layers)) - set(cfg0.moe_layers):  # the interleaved dense layer
        p = f"model.layers.{i}.mlp."
        assert w0.layers[i].router is None
        assert torch.equal(w0.layers[i].w_gate_up, torch.cat([sd[p + "gate_proj.weight"],
                                                              sd[p + "up_proj.weight"]]))


def test_load_missing_expert_tensor(saved):
    folder = saved("qwen3_moe-unnormed")
    rewrite_checkpoint(folder, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load(folder)


def test_load_dots1_router_bias_float32_and_named_when_missing(saved):
    """dots1's score-correction bias stays float32 when the rest loads in bf16 (as
    transformers keeps it), and a checkpoint without it is refused naming it."""
    model = tiny_model("dots1")
    cfg, w = load(model, dtype=torch.bfloat16)
    layer = w.layers[cfg.moe_layers[0]]
    assert layer.router.dtype == torch.bfloat16 and layer.router_bias.dtype == torch.float32
    assert torch.equal(layer.router_bias,
                       model.model.layers[1].mlp.gate.e_score_correction_bias.float())
    sd = {k: v for k, v in model.state_dict().items() if "e_score_correction_bias" not in k}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.gate\."
                                         r"e_score_correction_bias"):
        load(types.SimpleNamespace(config=model.config, state_dict=lambda: sd))


def test_load_missing_router_mixtral(saved):
    folder = saved("mixtral")
    rewrite_checkpoint(folder, lambda t: t.pop("model.layers.0.block_sparse_moe.gate.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.0\.block_sparse_moe\.gate\.weight"):
        load(folder)


def test_load_expert_of_mismatched_shape(saved, tmp_path):
    folder = saved("olmoe")
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    rewrite_checkpoint(folder, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"{name}: expected shape \[128, 64\].*moe_ffn=64.*got \[128, 63\]"):
        load(folder)
    model = tiny_model("olmoe")
    sd = dict(model.state_dict())
    sd["model.layers.1.mlp.experts.gate_up_proj"] = sd["model.layers.1.mlp.experts.gate_up_proj"][:7]
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: expected shape \[8, 128, 128\].*got \[7, 128, 128\]"):
        load(types.SimpleNamespace(config=model.config, state_dict=lambda: sd))


def test_load_config_experts_mismatch(saved):
    """A config with more experts than the checkpoint holds: the absent experts are named."""
    folder = saved("mixtral")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 5}))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight"):
        load(folder)


# --- FlashNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_moe-dense1", "mixtral", "olmoe", "qwen2_moe", "dots1"])
def test_flashnorm_folds_router_and_experts(name):
    """rmsnorm(x) @ W.T == (x @ W'.T) / rms(x) for the router, every expert's gate/up and
    a shared expert's gate/up and gate, and the whole model's logits are unchanged, in
    fp64."""
    cfg, w = load(tiny_model(name), dtype=torch.float64)
    f = fold(w)
    x = _x(5, cfg.hidden, 1).double()
    # dots1's router computes its logits in float32 even from float64 inputs (transformers'
    # Dots1TopkRouter casts both), so the fold's fp64 rounding can move a routing weight by
    # an fp32 ulp; the softmax families take float64 logits and their weights come out
    # the same, so they keep the exact bound
    fold_tol = 2 ** -23 if cfg.scoring == "sigmoid" else 1e-12
    for lw, lf in zip(w.layers, f.layers):
        ref_in = rms_norm(x, lw.mlp_norm, cfg.rms_eps)
        if lw.router is None:
            assert lf.router is None
            continue
        assert rel_err((x @ lf.router.T) * inv_rms(x, cfg.rms_eps), ref_in @ lw.router.T) <= 1e-12
        for e in range(cfg.experts):
            assert rel_err((x @ lf.w_gate_up[e].T) * inv_rms(x, cfg.rms_eps),
                           ref_in @ lw.w_gate_up[e].T) <= 1e-12
        assert lf.w_down is lw.w_down and lf.mlp_norm is None
        if cfg.shared_ffn:
            for name_ in ("w_shared_gate_up",) + (("shared_gate",) if cfg.shared_gated else ()):
                assert rel_err((x @ getattr(lf, name_).T) * inv_rms(x, cfg.rms_eps),
                               ref_in @ getattr(lw, name_).T) <= 1e-12
            assert lf.w_shared_down is lw.w_shared_down
        else:
            assert lf.w_shared_gate_up is lf.shared_gate is lf.w_shared_down is None
        assert rel_err(moe_block(cfg, lf, x), moe_block(cfg, lw, x)) <= fold_tol
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(2))
    outs = []
    for weights in (w, f):
        cache = KVCache.contiguous(cfg, 2, 16)
        outs.append([prefill(cfg, weights, ids, torch.tensor([7, 4]), cache, all_logits=True),
                     decode_step(cfg, weights, ids[:, 0], torch.tensor([7, 4]), cache)])
    for a, b in zip(*outs):
        assert rel_err(a, b) <= fold_tol


# --- the reference forward against transformers ---------------------------------------------

STEPS = 32
PROMPT_LENGTHS = torch.tensor([7, 4])


@pytest.mark.parametrize("name", NAMES)
def test_reference_matches_transformers_generate(name):
    model = tiny_model(name)
    cfg, w = load(model)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = KVCache.contiguous(cfg, 2, 7 + STEPS + 1)
    logits = [prefill(cfg, w, ids, PROMPT_LENGTHS, cache)]
    tokens = [logits[-1].argmax(-1)]
    positions = PROMPT_LENGTHS.clone()
    for _ in range(STEPS):
        logits.append(decode_step(cfg, w, tokens[-1], positions, cache))
        tokens.append(logits[-1].argmax(-1))
        positions += 1
    tokens = torch.stack(tokens, 1)
    for b, n in enumerate(PROMPT_LENGTHS.tolist()):
        prompt = ids[b:b + 1, :n]
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=STEPS + 1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        assert out.sequences[0, n:].tolist() == tokens[b].tolist()
        for step, hf in enumerate(out.logits):
            err = rel_err(logits[step][b], hf[0])
            assert err <= LOGITS_TOL, f"{name} b={b} step {step}: {err:.2e}"
    assert len(set(tokens.flatten().tolist())) > 2  # not a degenerate one-token loop


@pytest.mark.parametrize("name", ["qwen3_moe-dense1", "olmoe", "qwen2_moe", "dots1"])
def test_engine_reference_step_runs_moe(name):
    """wsattn.engine's reference step runs MoE models unchanged (paged cache, folded
    weights, a batch of two prompt lengths): greedy tokens as transformers'."""
    from wsattn.engine.generate import generate

    model = tiny_model(name)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4)]
    got = generate(model, prompts, 12, impl="reference", device="cpu")
    for prompt, tokens in zip(prompts, got):
        hf = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                            max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert tokens.tolist() == hf[0].tolist()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-norm", "dots1"])
def test_stable_select_breaks_exact_ties_to_the_lower_expert(name):
    """select(stable=True), what the kernel step's prefill routes with, gives exact ties
    to the lower expert (and group) as the decode kernels do (a zero router: every score
    equal), so a prompt and its decode steps route alike."""
    cfg = ModelConfig.from_hf(_dict(name))
    logits = torch.zeros(3, cfg.experts)
    bias = torch.zeros(cfg.experts) if cfg.router_bias else None
    weights, experts = select(cfg, logits, bias, stable=True)
    assert experts.tolist() == [list(range(cfg.top_k))] * 3, experts
    assert torch.equal(weights, select(cfg, logits, bias)[0])
