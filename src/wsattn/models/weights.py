"""Model weights in one per-layer layout, loaded from a transformers model object or a
local Hugging Face checkpoint folder, validated before any tensor is read.

Layout (``cfg`` a :class:`~wsattn.models.config.ModelConfig`; Hq = heads, Hkv = kv_heads,
D = head_dim; every matrix is ``[out_features, in_features]`` as ``nn.Linear`` stores it,
so a projection is ``x @ w.T``):

=================  ==============================  ==============================================
field              shape                           contents
=================  ==============================  ==============================================
embed              [vocab, hidden]                 token embeddings
layers[i].wqkv     [(Hq + 2*Hkv) * D, hidden]      q rows, then k rows, then v rows (each head's
                                                   D rows contiguous, heads in order)
layers[i].bqkv     [(Hq + 2*Hkv) * D] or None      q, k, v bias in the same order (Qwen2)
layers[i].q_norm   [D] or None                     per-head RMSNorm weight on q (Qwen3,
                   [Hq * D] (OLMoE)                Qwen3-MoE); OLMoE's spans the whole q
layers[i].k_norm   [D] or None                     per-head RMSNorm weight on k, or
                   [Hkv * D] (OLMoE)               OLMoE's over the whole k projection
layers[i].wo       [hidden, Hq * D]                output projection
layers[i].w_gate_up [2 * ffn, hidden]              gate rows, then up rows
layers[i].w_down   [hidden, ffn]                   down projection
layers[i].attn_norm [hidden] or None               RMSNorm before attention (None once folded)
layers[i].mlp_norm [hidden] or None                RMSNorm before the MLP (None once folded)
final_norm         [hidden] or None                RMSNorm before the LM head (None once folded)
lm_head            [vocab, hidden]                 LM head; with tied embeddings (and not
                                                   folded) the *same tensor object* as embed
norms_folded       bool                            False as loaded; True after
                                                   :func:`wsattn.models.flashnorm.fold`
layers[i].router   None, or [E, hidden] in a MoE   the router of a MoE layer (below), one row
                   layer                           per expert: logits = rmsnorm(h) @ router.T
=================  ==============================  ==============================================

A mixture-of-experts layer (``i in cfg.moe_layers``; E = cfg.experts, F = cfg.moe_ffn)
keeps the dense field names with an expert dimension in front, so a layer is MoE exactly
when ``router`` is not None; ``mlp_norm`` is the same [hidden] RMSNorm as a dense layer's
and both the router and every expert read its output:

=================  ==============================  ==============================================
layers[i].router   [E, hidden]                     router rows, expert e's in row e
layers[i].w_gate_up [E, 2 * F, hidden]             expert e's gate rows (F), then its up rows
                                                   (F): transformers' fused ``gate_up_proj``
layers[i].w_down   [E, hidden, F]                  expert e's down projection (``down_proj``)
=================  ==============================  ==============================================

With a shared expert (``cfg.shared_ffn`` = Fs > 0: Qwen2-MoE's ``mlp.shared_expert`` and
``mlp.shared_expert_gate``, dots1's ``mlp.shared_experts``; None otherwise), a MoE layer
also holds:

=========================  ==================  ==============================================
layers[i].w_shared_gate_up [2 * Fs, hidden]    its gate rows, then its up rows
layers[i].w_shared_down    [hidden, Fs]        its down projection
layers[i].shared_gate      [1, hidden] or      its gate (``cfg.shared_gated``, Qwen2-MoE):
                           None                y += sigmoid(rmsnorm(h) @ g.T) * mlp
=========================  ==================  ==============================================

With a router score-correction bias (``cfg.router_bias``: dots1's
``mlp.gate.e_score_correction_bias``), ``layers[i].router_bias`` is that [E] vector,
always float32 whatever the other tensors' dtype (transformers keeps it in float32 too:
``_keep_in_fp32_modules_strict``; rounding it would move expert choices); None otherwise.

Checkpoints hold the experts in one of two layouts, both read by :func:`load`:
transformers 5's fused parameters (what a model object's ``state_dict()`` holds:
``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) or one
tensor per expert, as published checkpoints (and transformers' ``save_pretrained``) write
them: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE, OLMoE) or
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` with ``block_sparse_moe.gate.weight``
(Mixtral: w1 gate, w3 up, w2 down).

All tensors but ``router_bias`` share one dtype (float16, bfloat16, float32 or float64)
and one device, and are contiguous. wqkv and w_gate_up are new tensors (except a MoE layer's w_gate_up read
from transformers' fused parameter); the others may share storage with the
model's parameters (nothing in wsattn writes into them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

from .config import ModelConfig

__all__ = ["Weights", "LayerWeights", "load", "read_config", "expected_tensors", "FLOAT_DTYPES", "EXPERT_LAYOUTS"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class LayerWeights:
    """One decoder layer (shapes in the module docstring)."""

    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    attn_norm: torch.Tensor | None
    mlp_norm: torch.Tensor | None
    router: torch.Tensor | None = None
    w_shared_gate_up: torch.Tensor | None = None
    w_shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None


@dataclass
class Weights:
    """A whole model (layout in the module docstring)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor | None
    lm_head: torch.Tensor
    norms_folded: bool = False
    dtype: torch.dtype = field(init=False)

    def __post_init__(self):
        self.dtype = self.embed.dtype

    def tensors(self):
        """Every (name, tensor) pair, None entries skipped; tied lm_head listed once."""
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for name, t in vars(layer).items():
                if t is not None:
                    yield f"layers.{i}.{name}", t
        if self.final_norm is not None:
            yield "final_norm", self.final_norm
        if self.lm_head is not self.embed:
            yield "lm_head", self.lm_head


EXPERT_LAYOUTS = ("fused", "per_expert")


def _mlp_names(cfg: ModelConfig, i: int, expert_layout: str) -> dict[str, tuple[str, ...]]:
    """Layer i's MLP: {Weights field: the checkpoint names it is built from, in order}."""
    p = f"model.layers.{i}."
    if i not in cfg.moe_layers:
        return {"w_gate_up": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                "w_down": (p + "mlp.down_proj.weight",)}
    bias = {"router_bias": (p + "mlp.gate.e_score_correction_bias",)} if cfg.router_bias else {}
    if expert_layout == "fused":
        return {"router": (p + "mlp.gate.weight",),
                "w_gate_up": (p + "mlp.experts.gate_up_proj",),
                "w_down": (p + "mlp.experts.down_proj",), **bias}
    m, (gate, up, down) = ((p + "block_sparse_moe.", ("w1", "w3", "w2")) if cfg.family == "mixtral"
                           else (p + "mlp.", ("gate_proj", "up_proj", "down_proj")))
    experts = range(cfg.experts)
    return {"router": (m + "gate.weight",),
            "w_gate_up": tuple(m + f"experts.{e}.{n}.weight" for e in experts for n in (gate, up)),
            "w_down": tuple(m + f"experts.{e}.{down}.weight" for e in experts), **bias}


def _shared_names(cfg: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's shared expert (a MoE layer of a config with one), else {}."""
    if not cfg.shared_ffn or i not in cfg.moe_layers:
        return {}
    m = f"model.layers.{i}.mlp."
    s = m + ("shared_experts." if cfg.family == "dots1" else "shared_expert.")
    names = {"w_shared_gate_up": (s + "gate_proj.weight", s + "up_proj.weight"),
             "w_shared_down": (s + "down_proj.weight",)}
    if cfg.shared_gated:
        names["shared_gate"] = (m + "shared_expert_gate.weight",)
    return names


def expected_tensors(cfg: ModelConfig, expert_layout: str = "fused") -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names a checkpoint of ``cfg`` must hold, with their shapes
    (``lm_head.weight`` only when the embeddings are not tied); MoE layers' experts in
    ``expert_layout`` ("fused" or "per_expert", see the module docstring)."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    D, E = cfg.head_dim, cfg.hidden
    F, X = cfg.moe_ffn, cfg.experts
    names = {"model.embed_tokens.weight": (cfg.vocab, E), "model.norm.weight": (E,)}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = (cfg.vocab, E)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        names.update({
            p + "self_attn.q_proj.weight": (cfg.q_size, E),
            p + "self_attn.k_proj.weight": (cfg.kv_size, E),
            p + "self_attn.v_proj.weight": (cfg.kv_size, E),
            p + "self_attn.o_proj.weight": (E, cfg.q_size),
            p + "input_layernorm.weight": (E,),
            p + "post_attention_layernorm.weight": (E,),
        })
        if cfg.qkv_bias:
            names.update({p + "self_attn.q_proj.bias": (cfg.q_size,),
                          p + "self_attn.k_proj.bias": (cfg.kv_size,),
                          p + "self_attn.v_proj.bias": (cfg.kv_size,)})
        if cfg.qk_norm:
            names.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if cfg.qk_norm_whole:
            names.update({p + "self_attn.q_norm.weight": (cfg.q_size,),
                          p + "self_attn.k_norm.weight": (cfg.kv_size,)})
        mlp = _mlp_names(cfg, i, expert_layout)
        if "router" not in mlp:  # dense
            (gate, up), (down,) = mlp["w_gate_up"], mlp["w_down"]
            names.update({gate: (cfg.ffn, E), up: (cfg.ffn, E), down: (E, cfg.ffn)})
        elif expert_layout == "fused":
            names.update({mlp["router"][0]: (X, E), mlp["w_gate_up"][0]: (X, 2 * F, E),
                          mlp["w_down"][0]: (X, E, F)})
        else:
            names[mlp["router"][0]] = (X, E)
            names.update({n: (F, E) for n in mlp["w_gate_up"]})
            names.update({n: (E, F) for n in mlp["w_down"]})
        if "router_bias" in mlp:
            names[mlp["router_bias"][0]] = (X,)
        shared = _shared_names(cfg, i)
        if shared:
            Fs = cfg.shared_ffn
            (gate, up), (down,) = shared["w_shared_gate_up"], shared["w_shared_down"]
            names.update({gate: (Fs, E), up: (Fs, E), down: (E, Fs)})
            if "shared_gate" in shared:
                names[shared["shared_gate"][0]] = (1, E)
    return names


def _expert_layout(cfg: ModelConfig, meta: dict) -> str:
    """The layout of the checkpoint's experts: fused where any MoE layer holds transformers'
    fused parameter, else one tensor per expert (a checkpoint mixing them is then reported
    as missing the per-expert names)."""
    fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in cfg.moe_layers]
    return "fused" if any(n in meta for n in fused) else "per_expert"


# tensors a checkpoint may carry that the model does not use (old Llama checkpoints
# saved the rotary buffer; tied checkpoints sometimes save the head anyway and
# transformers ties it over)
def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def load(model_or_path, dtype: torch.dtype | None = None, device="cpu") -> tuple[ModelConfig, Weights]:
    """Load a supported model into the layout of :class:`Weights`.

    model_or_path: a transformers ``*ForCausalLM`` model object (its ``config`` and
    ``state_dict()``), or a local folder with ``config.json`` and either
    ``model.safetensors`` or sharded ``model-0000x-of-0000y.safetensors`` files with
    ``model.safetensors.index.json``; nothing is ever downloaded.
    dtype: float16/bfloat16/float32/float64 to convert every tensor to (default: the
    stored embedding's dtype; a checkpoint with fp32 norms and bf16 matrices comes out
    all bf16).
    device: where the tensors go.

    Before any tensor data is read, the checkpoint's names, shapes and dtypes are checked
    against the config: a missing tensor, an unexpected one (e.g. an o_proj bias the step
    would ignore), a wrong shape (names the tensor, expected vs got) raise ValueError; a
    dtype it cannot take (int8, fp8, ...) raises TypeError naming the tensors. A MoE
    layer's experts may be stored fused or one tensor per expert (module docstring); a
    missing expert tensor or one of the wrong shape is named like any other.

    >>> cfg, w = load("path/to/Llama-3.2-1B", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> w.layers[0].wqkv.shape  # [(32 + 2*8) * 64, 2048]  # doctest: +SKIP
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    if isinstance(model_or_path, (str, os.PathLike)):
        cfg, source = _open_folder(os.fspath(model_or_path))
    else:
        cfg = read_config(model_or_path)
        source = _StateDict(model_or_path.state_dict())
    meta = source.meta()
    if cfg.tie_embeddings and "lm_head.weight" in meta and not _same_tensor(
            source, "lm_head.weight", "model.embed_tokens.weight"):
        # transformers does not tie a head the checkpoint stores with other values than the
        # embedding (it warns and keeps the stored head): neither does this loader
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    layout = _expert_layout(cfg, meta)
    _validate(cfg, meta, layout)
    if dtype is None:
        dtype = meta["model.embed_tokens.weight"][1]
    return cfg, _assemble(cfg, source, dtype, torch.device(device), layout)


class _StateDict:
    def __init__(self, state_dict):
        self.sd = state_dict

    def meta(self):
        return {k: (tuple(v.shape), v.dtype) for k, v in self.sd.items()}

    def get(self, name):
        return self.sd[name].detach()


class _Safetensors:
    """Tensors spread over one or more .safetensors files; only headers read until get()."""

    def __init__(self, paths: list[str], listed: list[str]):
        from safetensors import safe_open

        self.where = {}  # name -> open handle
        for path in paths:
            h = safe_open(path, framework="pt")
            for name in h.keys():
                self.where[name] = h
        self.listed = listed  # the index's claim, checked in meta()

    def meta(self):
        out = {}
        for name, h in self.where.items():
            s = h.get_slice(name)
            out[name] = (tuple(s.get_shape()), _st_dtype(s.get_dtype()))
        lost = sorted(set(self.listed) - set(self.where))
        if lost:
            raise ValueError(f"model.safetensors.index.json lists tensors its shards do not hold: "
                             f"{_few(lost)}")
        return out

    def get(self, name):
        return self.where[name].get_tensor(name)


_ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
              "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
              "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _st_dtype(code: str):
    """safetensors' dtype code -> torch dtype (the code itself for one torch lacks)."""
    return _ST_DTYPES.get(code, code)


def read_config(model_or_path) -> ModelConfig:
    """The :class:`ModelConfig` of what :func:`load` would load, reading no tensor: a
    folder's ``config.json`` or a model object's ``config``. Refuses what :func:`load`
    refuses about the config itself (an unsupported family or feature, by name), so
    callers can check a request against the model (vocabulary, positions) before any
    weight is read or moved."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return _folder_config(os.fspath(model_or_path))
    if hasattr(model_or_path, "config") and hasattr(model_or_path, "state_dict"):
        return ModelConfig.from_hf(model_or_path.config)
    raise TypeError("model_or_path must be a transformers model or a checkpoint folder path, "
                    f"got {type(model_or_path).__name__}")


def _folder_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise ValueError(f"model_or_path {path!r} is not a folder with a config.json "
                         "(a local Hugging Face checkpoint; nothing is downloaded)")
    with open(cfg_path) as f:
        return ModelConfig.from_hf(json.load(f))


def _weights_file(path: str) -> str:
    """The file transformers loads a folder's weights from: config.json's
    ``transformers_weights`` when set (a file inside the folder), else
    ``model.safetensors``, else ``model.safetensors.index.json`` (in that order, so a
    folder holding both reads the single file, as transformers does)."""
    with open(os.path.join(path, "config.json")) as f:
        named = json.load(f).get("transformers_weights")
    if named is not None:
        file = os.path.join(path, named)
        base = os.path.abspath(path)
        if not isinstance(named, str) or os.path.commonpath(
                [base, os.path.abspath(file)]) != base:
            raise ValueError(f"config.json's transformers_weights must name a file inside "
                             f"{path!r}, got {named!r}")
        if not named.endswith((".safetensors", ".safetensors.index.json")):
            raise ValueError(f"config.json's transformers_weights {named!r} is not a "
                             "safetensors file or index (only safetensors are read)")
        if not os.path.isfile(file):
            raise ValueError(f"config.json's transformers_weights names {named!r}, which is "
                             f"not in {path!r}")
        return file
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"{path!r} holds neither model.safetensors nor "
                     "model.safetensors.index.json")


def _open_folder(path: str):
    cfg = _folder_config(path)
    file = _weights_file(path)
    if file.endswith(".index.json"):
        index = file
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        paths = sorted({os.path.join(os.path.dirname(index), shard)
                        for shard in weight_map.values()})
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise ValueError(f"{index} names shards that are not there: {absent}")
        listed = list(weight_map)
    else:
        paths, listed = [file], []
    try:
        import safetensors  # noqa: F401
    except ImportError as e:
        raise ImportError("loading a checkpoint folder needs `safetensors` "
                          "(pip install 'wsattn[models]')") from e
    return cfg, _Safetensors(paths, listed)


def _few(names, n=8):
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _validate(cfg: ModelConfig, meta: dict, expert_layout: str = "fused"):
    expected = expected_tensors(cfg, expert_layout)
    missing = [n for n in expected if n not in meta]
    if missing:
        moe = (f", {cfg.experts} experts in layers {list(cfg.moe_layers)} stored {expert_layout}"
               if cfg.is_moe else "")
        raise ValueError(f"checkpoint is missing tensor(s) {_few(missing)} (for a {cfg.family} "
                         f"config with {cfg.layers} layers, qkv_bias={cfg.qkv_bias}, "
                         f"qk_norm={cfg.qk_norm}, tie_embeddings={cfg.tie_embeddings}{moe})")
    unexpected = [n for n in meta if n not in expected and not _ignorable(n, cfg)]
    if unexpected:
        raise ValueError(f"checkpoint holds tensor(s) this {cfg.family} config does not use: "
                         f"{_few(unexpected)} (a config/weights mismatch, or a feature such as "
                         "a bias or quantization scales that is not supported)")
    bad_dtype = [f"{n} ({meta[n][1]})" for n in expected if meta[n][1] not in FLOAT_DTYPES]
    if bad_dtype:
        raise TypeError(f"tensor(s) of a dtype that cannot be taken (float16, bfloat16, "
                        f"float32, float64 only; no quantized weights): {_few(bad_dtype)}")
    for n, shape in expected.items():
        if meta[n][0] != shape:
            moe = (f", experts={cfg.experts}, moe_ffn={cfg.moe_ffn}" if cfg.is_moe else "")
            raise ValueError(f"tensor {n}: expected shape {list(shape)} from the config "
                             f"(hidden={cfg.hidden}, heads={cfg.heads}, kv_heads={cfg.kv_heads}, "
                             f"head_dim={cfg.head_dim}, ffn={cfg.ffn}, vocab={cfg.vocab}{moe}), "
                             f"got {list(meta[n][0])}")


def _same_tensor(source, a: str, b: str) -> bool:
    ta, tb = source.get(a), source.get(b)
    return ta.shape == tb.shape and ta.dtype == tb.dtype and bool(torch.equal(ta, tb))


def _assemble(cfg: ModelConfig, source, dtype, device, expert_layout="fused") -> Weights:
    def get(name):
        return source.get(name).to(device=device, dtype=dtype).contiguous()

    def cat(*names):
        return torch.cat([source.get(n).to(device=device, dtype=dtype) for n in names])

    def mlp(i):
        names = _mlp_names(cfg, i, expert_layout)
        if "router" not in names:
            return dict(w_gate_up=cat(*names["w_gate_up"]), w_down=get(names["w_down"][0]))
        shared = {field: cat(*n) if len(n) > 1 else get(n[0])
                  for field, n in _shared_names(cfg, i).items()}
        bias = names.pop("router_bias", None)
        if bias is not None:  # float32 whatever dtype is (module docstring)
            shared["router_bias"] = source.get(bias[0]).to(device=device,
                                                           dtype=torch.float32).contiguous()
        if expert_layout == "fused":
            return {**{field: get(n) for field, (n,) in names.items()}, **shared}
        gate_up, down = names["w_gate_up"], names["w_down"]  # expert e: gate_up[2e:2e+2], down[e]
        return dict(router=get(names["router"][0]),
                    w_gate_up=torch.stack([cat(*gate_up[2 * e:2 * e + 2]) for e in range(cfg.experts)]),
                    w_down=torch.stack([get(n) for n in down]), **shared)

    qk_norm = cfg.qk_norm or cfg.qk_norm_whole
    layers = []
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            wqkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if cfg.qkv_bias else None,
            q_norm=get(a + "q_norm.weight") if qk_norm else None,
            k_norm=get(a + "k_norm.weight") if qk_norm else None,
            wo=get(a + "o_proj.weight"),
            attn_norm=get(p + "input_layernorm.weight"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            **mlp(i),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_embeddings else get("lm_head.weight")
    return Weights(embed=embed, layers=layers, final_norm=get("model.norm.weight"), lm_head=lm_head)
