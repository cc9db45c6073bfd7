"""Model families: config refusals, loading (model object, single and sharded safetensors
folders, bad checkpoints), FlashNorm folding, and the reference forward against
transformers (prefill logits, 32 greedy decode steps, paged vs contiguous cache)."""

from __future__ import annotations

import functools
import json
import os
import types

import pytest
import torch

import transformers  # the `test` extra pins it

from wsattn.models import (KVCache, ModelConfig, UnsupportedModelError, Weights, decode_step,
                           fold, load, prefill)
from wsattn.models.reference import inv_rms, rms_norm, rope_inv_freq
from wsattn.testing import rel_err

from conftest import rewrite_checkpoint

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
CONFIGS = {
    # the llama3 scaling with a short original context, so the tiny test's positions and
    # every frequency band (kept, interpolated, divided) are exercised
    "llama-tied-llama3": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True,
                                                          rope_parameters=LLAMA3_ROPE),
    "llama-untied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY),
}
FAMILIES = ["llama-tied-llama3", "qwen2", "qwen3"]
# fp32 transformers against the float64 reference on the same fp32 weights
LOGITS_TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: with one thread a matmul takes microseconds, with a thread
    pool on a loaded 2-core CI machine it spins for milliseconds (60x slower measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def tiny_model(name, attn="sdpa"):
    """A tiny random fp32 model whose norm weights and biases are random too (transformers
    initialises them to 1 and 0, which would hide a misplaced norm weight or bias); the
    same weights whatever the attention implementation."""
    torch.manual_seed(sorted(CONFIGS).index(name))
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](), dtype=torch.float32, attn_implementation=attn).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(3.0)  # sharper logits: greedy ties between fp32 and fp64 unlikely
    return model


@pytest.fixture
def saved(tmp_path):
    def save(name, **kw):
        folder = tmp_path / (name + "".join(f"-{v}" for v in kw.values()))
        tiny_model(name).save_pretrained(folder, safe_serialization=True, **kw)
        return folder
    return save


# --- config -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_from_object_and_dict_agree(name):
    hf = CONFIGS[name]()
    cfg = ModelConfig.from_hf(hf)
    assert cfg == ModelConfig.from_hf(json.loads(hf.to_json_string()))
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab) == \
        (64, 2, 4, 2, 64, 128, 256)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3")
    assert cfg.tie_embeddings == (name == "llama-tied-llama3")


# config.json of Llama-3.2-1B as published (pre-transformers-5 keys: rope_theta + rope_scaling)
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


def test_config_llama_3_2_1b_old_keys():
    """A published config.json (rope_scaling, torch_dtype) reads as transformers reads it."""
    cfg = ModelConfig.from_hf(LLAMA_3_2_1B)
    assert cfg.rope.type == "llama3" and cfg.rope.factor == 32.0 and cfg.rope.theta == 500000.0
    assert cfg.rope.original_max_positions == 8192 and cfg.tie_embeddings
    assert cfg.dtype == torch.bfloat16 and cfg.head_dim == 64 and cfg.rms_eps == 1e-5
    hf = transformers.LlamaConfig(**{k: v for k, v in LLAMA_3_2_1B.items() if k != "torch_dtype"})
    assert ModelConfig.from_hf(hf).rope == cfg.rope
    inv = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf)[0]
    assert torch.equal(rope_inv_freq(cfg), inv)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rope_inv_freq_bitwise_transformers(name):
    assert torch.equal(rope_inv_freq(ModelConfig.from_hf(tiny_model(name).config)),
                       tiny_model(name).model.rotary_emb.inv_freq)


def test_llama3_scaling_changes_frequencies():
    """The llama3 test config really scales: some frequencies kept, some divided, some between."""
    scaled = rope_inv_freq(ModelConfig.from_hf(CONFIGS["llama-tied-llama3"]()))
    plain = rope_inv_freq(ModelConfig.from_hf(transformers.LlamaConfig(
        **TINY, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})))
    ratio = plain / scaled
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def _dict(family, **over):
    base = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config}[family](**TINY).to_dict()
    base.update(over)
    return base


REFUSALS = {
    "llama-mlp_bias": (_dict("llama", mlp_bias=True), "mlp_bias"),
    "llama-attention_bias": (_dict("llama", attention_bias=True), "o_proj"),
    "qwen3-attention_bias": (_dict("qwen3", attention_bias=True), "o_proj"),
    "llama-gelu": (_dict("llama", hidden_act="gelu"), "hidden_act 'gelu'"),
    "llama-head_dim-32": (_dict("llama", head_dim=32), "head_dim 32"),
    "qwen3-head_dim-96": (_dict("qwen3", head_dim=96), "head_dim 96"),
    "llama-rope-yarn": (_dict("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                        "rope_theta": 1e4}), "rope type 'yarn'"),
    "llama-rope-linear-old-keys": ({**_dict("llama", rope_parameters=None),
                                    "rope_scaling": {"type": "linear", "factor": 2.0}},
                                   "rope type 'linear'"),
    "llama-partial-rotary": (_dict("llama", rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5}),
                             "partial_rotary_factor"),
    "qwen2-sliding-window": (_dict("qwen2", use_sliding_window=True, sliding_window=16,
                                   max_window_layers=1, layer_types=None), "sliding-window"),
    "qwen3-layer-types": (_dict("qwen3", layer_types=["full_attention", "sliding_attention"]),
                          "sliding-window"),
    "qwen3-moe": ({**_dict("qwen3"), "model_type": "qwen3_moe", "num_experts": 128},
                  "mixture-of-experts"),
    "mixtral": ({**_dict("llama"), "model_type": "mixtral", "num_local_experts": 8},
                "mixture-of-experts"),
    "unknown-model_type": ({**_dict("llama"), "model_type": "gpt2"}, "model_type 'gpt2'"),
    "architecture": ({**_dict("llama"), "architectures": ["LlamaForSequenceClassification"]},
                     "architectures"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_config_refuses_unsupported_feature(case):
    d, feature = REFUSALS[case]
    with pytest.raises(UnsupportedModelError, match=feature.replace("(", r"\(")):
        ModelConfig.from_hf(d)


def test_config_refuses_sliding_window_from_object():
    hf = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 3}, use_sliding_window=True,
                                  sliding_window=16, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match=r"sliding-window.*layers \[1, 2\]"):
        ModelConfig.from_hf(hf)


def test_config_accepts_sliding_window_no_layer_uses():
    """Qwen2.5 configs ship sliding_window with use_sliding_window off (or every layer below
    max_window_layers): no layer slides, so the model is accepted."""
    assert ModelConfig.from_hf(_dict("qwen2", use_sliding_window=False, sliding_window=32768,
                                     layer_types=None)).family == "qwen2"
    assert ModelConfig.from_hf(_dict("qwen2", use_sliding_window=True, sliding_window=16,
                                     max_window_layers=2, layer_types=None)).family == "qwen2"


def test_config_malformed():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf({k: v for k, v in _dict("llama").items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelConfig.from_hf(_dict("llama", num_key_value_heads=3))
    with pytest.raises(TypeError, match="cfg must be"):
        ModelConfig.from_hf("config.json")


# --- loading ----------------------------------------------------------------------------

def _hf_layout(model):
    """What Weights must hold, built from the transformers module tree."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"],
           "lm_head": sd["lm_head.weight"]}
    for i in range(model.config.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[f"layers.{i}.wqkv"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if a + "q_proj.bias" in sd:
            out[f"layers.{i}.bqkv"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        if a + "q_norm.weight" in sd:
            out[f"layers.{i}.q_norm"] = sd[a + "q_norm.weight"]
            out[f"layers.{i}.k_norm"] = sd[a + "k_norm.weight"]
        out[f"layers.{i}.wo"] = sd[a + "o_proj.weight"]
        out[f"layers.{i}.w_gate_up"] = torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                  sd[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.w_down"] = sd[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.attn_norm"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_load_object_single_and_sharded_folder_agree(name, saved):
    model = tiny_model(name)
    expected = _hf_layout(model)
    single, sharded = saved(name), saved(name, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    for source in (model, single, str(sharded)):
        cfg, w = load(source)
        assert cfg == ModelConfig.from_hf(model.config)
        got = dict(w.tensors())
        if cfg.tie_embeddings:
            assert w.lm_head is w.embed and "lm_head" not in got
            got["lm_head"] = w.lm_head
        assert sorted(got) == sorted(expected)
        for key, t in expected.items():
            assert torch.equal(got[key], t), key
            assert got[key].dtype == torch.float32 and got[key].is_contiguous()


def test_folder_with_both_layouts_reads_what_transformers_reads(saved, tmp_path):
    """A folder holding model.safetensors beside an index (shards of another model) reads
    the single file, as transformers does; config.json's transformers_weights, when set,
    names the file instead, and must lie inside the folder."""
    import copy
    import shutil

    name = "qwen2"
    folder = saved(name, max_shard_size="40KB")  # model b, sharded
    a = copy.deepcopy(tiny_model(name))  # (a cached model: not negated in place)
    with torch.no_grad():
        for p in a.parameters():
            p.neg_()  # model a: the same config, other weights
    a.save_pretrained(tmp_path / "a", safe_serialization=True)
    shutil.copy(tmp_path / "a" / "model.safetensors", folder / "model.safetensors")
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    _, w = load(str(folder))
    assert torch.equal(w.embed, want["model.embed_tokens.weight"])
    assert torch.equal(w.embed, a.state_dict()["model.embed_tokens.weight"])
    cfg_file = folder / "config.json"
    d = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**d, "transformers_weights": "model.safetensors.index.json"}))
    _, w = load(str(folder))
    assert torch.equal(w.embed, tiny_model(name).state_dict()["model.embed_tokens.weight"])
    for named, match in (("../x.safetensors", "inside"), ("model.bin", "not a safetensors"),
                         ("other.safetensors", "not in")):
        cfg_file.write_text(json.dumps({**d, "transformers_weights": named}))
        with pytest.raises(ValueError, match=match):
            load(str(folder))


def test_tied_config_with_a_different_stored_head_keeps_the_head(saved):
    """config.json ties the embeddings but the checkpoint stores another lm_head.weight:
    transformers keeps the stored head (and warns), and so does the loader."""
    name = next(n for n in sorted(CONFIGS) if not CONFIGS[n]().tie_word_embeddings)
    folder = saved(name)
    cfg_file = folder / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                    "tie_word_embeddings": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    cfg, w = load(str(folder))
    assert not cfg.tie_embeddings and w.lm_head is not w.embed
    assert torch.equal(w.lm_head, hf.lm_head.weight)
    assert torch.equal(w.lm_head, tiny_model(name).lm_head.weight)


def test_rope_scaling_read_over_rope_parameters():
    """transformers takes rope_scaling over rope_parameters: a linear scaling there is
    refused by name, not run as the default rope."""
    d = json.loads(CONFIGS[sorted(CONFIGS)[0]]().to_json_string())
    d["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="rope type 'linear' is not supported"):
        ModelConfig.from_hf(d)


def test_load_converts_dtype(saved):
    cfg, w = load(saved("qwen2"), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for _, t in w.tensors())
    assert torch.equal(w.layers[1].w_down,
                       tiny_model("qwen2").model.layers[1].mlp.down_proj.weight.bfloat16())


def test_load_missing_tensor(saved):
    folder = saved("qwen3")
    rewrite_checkpoint(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_norm\.weight"):
        load(folder)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_load_dtype_it_cannot_take(saved, dtype):
    folder = saved("llama-untied")
    name = "model.layers.0.mlp.up_proj.weight"

    def quantize(t):
        t[name] = t[name].to(dtype)
    rewrite_checkpoint(folder, quantize)
    with pytest.raises(TypeError, match=rf"{name} \({dtype}\)"):
        load(folder)


def test_load_dtype_it_cannot_take_from_object():
    model = tiny_model("qwen2")
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.q_proj.bias"] = sd["model.layers.0.self_attn.q_proj.bias"].to(torch.int8)
    quantized = types.SimpleNamespace(config=model.config, state_dict=lambda: sd)
    with pytest.raises(TypeError, match=r"q_proj\.bias \(torch\.int8\)"):
        load(quantized)


def test_load_config_weights_mismatch_vocab(saved):
    folder = saved("llama-untied")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 512}))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: expected shape \[512, 64\].*got \[256, 64\]"):
        load(folder)


def test_load_config_weights_mismatch_family(saved):
    """Qwen3 weights under a Llama config: the q_norm/k_norm tensors would be ignored."""
    folder = saved("qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"does not use: .*model\.layers\.0\.self_attn\.q_norm\.weight"):
        load(folder)


def test_load_unexpected_o_proj_bias(saved):
    folder = saved("llama-untied")
    rewrite_checkpoint(folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        load(folder)


def test_load_bad_paths(tmp_path, saved):
    with pytest.raises(ValueError, match="not a folder with a config.json"):
        load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a folder with a config.json"):
        load(tmp_path)
    folder = saved("qwen2", max_shard_size="40KB")
    os.remove(sorted(folder.glob("model-*-of-*.safetensors"))[0])
    with pytest.raises(ValueError, match="names shards that are not there"):
        load(folder)
    with pytest.raises(TypeError, match="model_or_path"):
        load(42)
    with pytest.raises(TypeError, match="dtype"):
        load(tmp_path, dtype=torch.int8)


# --- FlashNorm ------------------------------------------------------------------------------

def _fp64(name):
    return load(tiny_model(name), dtype=torch.float64)


@pytest.mark.parametrize("name", FAMILIES)
def test_flashnorm_folded_projection_same_function(name):
    """rmsnorm(x) @ W.T == (x @ (W diag g).T) / rms(x), every norm of the model, fp64."""
    cfg, w = _fp64(name)
    f = fold(w)
    x = torch.randn(5, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pairs = [(w.final_norm, w.lm_head, f.lm_head)]
    for lw, lf in zip(w.layers, f.layers):
        pairs += [(lw.attn_norm, lw.wqkv, lf.wqkv), (lw.mlp_norm, lw.w_gate_up, lf.w_gate_up)]
    for g, plain, folded in pairs:
        ref = rms_norm(x, g, cfg.rms_eps) @ plain.T
        out = (x @ folded.T) * inv_rms(x, cfg.rms_eps)
        assert rel_err(out, ref) <= 1e-12
    for lw, lf in zip(w.layers, f.layers):  # what is not folded is shared, untouched
        assert lf.wo is lw.wo and lf.w_down is lw.w_down and lf.bqkv is lw.bqkv
        assert lf.q_norm is lw.q_norm and lf.attn_norm is None and lf.mlp_norm is None
    assert f.norms_folded and not w.norms_folded and f.final_norm is None


def test_flashnorm_tied_head_is_new_tensor():
    cfg, w = _fp64("llama-tied-llama3")
    embed = w.embed.clone()
    f = fold(w)
    assert f.embed is w.embed and torch.equal(w.embed, embed)
    assert f.lm_head is not f.embed and f.lm_head.data_ptr() != f.embed.data_ptr()
    assert torch.equal(f.lm_head, w.embed * w.final_norm)
    with pytest.raises(ValueError, match="already folded"):
        fold(f)


@pytest.mark.parametrize("name", FAMILIES)
def test_flashnorm_model_logits_unchanged(name):
    cfg, w = _fp64(name)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([7, 4])
    outs = []
    for weights in (w, fold(w)):
        cache = KVCache.contiguous(cfg, 2, 16)
        logits = [prefill(cfg, weights, ids, lengths, cache, all_logits=True)]
        logits.append(decode_step(cfg, weights, ids[:, 0], lengths, cache))
        outs.append(logits)
    for a, b in zip(*outs):
        assert rel_err(a, b) <= 1e-12


# --- the reference forward against transformers ---------------------------------------------

def _run_reference(cfg, w, ids, lengths, cache, steps):
    """Prefill then `steps` greedy decode steps: (tokens [B, steps + 1], logits list)."""
    logits = [prefill(cfg, w, ids, lengths, cache)]
    tokens = [logits[-1].argmax(-1)]
    positions = lengths.clone()
    for _ in range(steps):
        logits.append(decode_step(cfg, w, tokens[-1], positions, cache))
        tokens.append(logits[-1].argmax(-1))
        positions += 1
    return torch.stack(tokens, 1), logits


PROMPT_LENGTHS = torch.tensor([7, 4])
STEPS = 32


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_reference_matches_transformers_generate(name, attn):
    model = tiny_model(name, attn)
    assert model.config._attn_implementation == attn
    for k, t in tiny_model(name).state_dict().items():  # same weights as the sdpa model
        assert torch.equal(model.state_dict()[k], t), k
    cfg, w = load(model)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = KVCache.contiguous(cfg, 2, 7 + STEPS + 1)
    tokens, logits = _run_reference(cfg, w, ids, PROMPT_LENGTHS, cache, STEPS)
    full = prefill(cfg, w, ids, PROMPT_LENGTHS, KVCache.contiguous(cfg, 2, 7), all_logits=True)
    for b, n in enumerate(PROMPT_LENGTHS.tolist()):
        prompt = ids[b:b + 1, :n]
        with torch.no_grad():
            hf_prompt = model(prompt).logits[0]
        assert rel_err(full[b, :n], hf_prompt) <= LOGITS_TOL
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=STEPS + 1, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        assert out.sequences[0, n:].tolist() == tokens[b].tolist()
        for step, hf in enumerate(out.logits):
            err = rel_err(logits[step][b], hf[0])
            assert err <= LOGITS_TOL, f"{name} b={b} step {step}: {err:.2e}"
    assert len(set(tokens.flatten().tolist())) > 2  # not a degenerate one-token loop


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_cache_bitwise_contiguous(name):
    cfg, w = _fp64(name)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(4))
    page, max_pages = 4, 12  # 48 positions a sequence
    order = torch.randperm(2 * max_pages + 3, generator=torch.Generator().manual_seed(5))
    block_table = order[:2 * max_pages].view(2, max_pages).to(torch.int32)
    paged = KVCache.paged(cfg, 2 * max_pages + 3, page, block_table)
    contiguous = KVCache.contiguous(cfg, 2, page * max_pages)
    tok_p, log_p = _run_reference(cfg, w, ids, PROMPT_LENGTHS, paged, STEPS)
    tok_c, log_c = _run_reference(cfg, w, ids, PROMPT_LENGTHS, contiguous, STEPS)
    assert torch.equal(tok_p, tok_c)
    for a, b in zip(log_p, log_c):
        assert torch.equal(a, b)
    # the pages hold what the contiguous cache holds, at the block table's places
    n = int(PROMPT_LENGTHS[1]) + STEPS
    gathered = paged.k[:, block_table[1].long()].flatten(1, 2)[:, :n]
    assert torch.equal(gathered, contiguous.k[:, 1, :n])


def test_reference_bad_input_writes_nothing():
    cfg, w = _fp64("qwen2")
    cache = KVCache.contiguous(cfg, 2, 8)
    ids = torch.zeros(2, 7, dtype=torch.long)
    cases = [
        (lambda: prefill(cfg, w, torch.full((2, 7), cfg.vocab), torch.tensor([7, 7]), cache),
         "outside \\[0, vocab=256\\)"),
        (lambda: prefill(cfg, w, ids, torch.tensor([7, 0]), cache), "lengths"),
        (lambda: prefill(cfg, w, torch.zeros(2, 9, dtype=torch.long), torch.tensor([9, 9]), cache),
         "cache holds 8 positions"),
        (lambda: prefill(cfg, w, ids[:1], torch.tensor([7]), cache), "cache batch"),
        (lambda: decode_step(cfg, w, torch.tensor([1, 2]), torch.tensor([3, 8]), cache),
         "cache holds 8 positions"),
        (lambda: decode_step(cfg, w, torch.tensor([1.0, 2.0]), torch.tensor([3, 4]), cache),
         "token_ids"),
        (lambda: decode_step(cfg, fold(w), torch.tensor([1, 2]), torch.tensor([3, 4]),
                             KVCache(cache.k[:1], cache.v[:1])), "cache k/v"),
    ]
    paged = KVCache.paged(cfg, 4, 4, torch.tensor([[0, 1], [2, 9]], dtype=torch.int32))
    cases.append((lambda: prefill(cfg, w, ids, torch.tensor([7, 7]), paged), "pages outside"))
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    assert not cache.k.any() and not cache.v.any() and not paged.k.any()
    unfolded_flag = Weights(embed=w.embed, layers=fold(w).layers, final_norm=None,
                            lm_head=w.lm_head, norms_folded=False)
    with pytest.raises(ValueError, match="norms_folded=False"):
        prefill(cfg, unfolded_flag, ids, torch.tensor([7, 7]), cache)
