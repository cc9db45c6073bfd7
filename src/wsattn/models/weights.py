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
layers[i].q_norm   [D] or None                     per-head RMSNorm weight on q (Qwen3)
layers[i].k_norm   [D] or None                     per-head RMSNorm weight on k (Qwen3)
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
=================  ==============================  ==============================================

All tensors share one dtype (float16, bfloat16, float32 or float64) and one device, and
are contiguous. wqkv and w_gate_up are new tensors; the others may share storage with the
model's parameters (nothing in wsattn writes into them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from .config import ModelConfig

__all__ = ["Weights", "LayerWeights", "load", "expected_tensors", "FLOAT_DTYPES"]

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


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names a checkpoint of ``cfg`` must hold, with their shapes
    (``lm_head.weight`` only when the embeddings are not tied)."""
    D, E = cfg.head_dim, cfg.hidden
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
            p + "mlp.gate_proj.weight": (cfg.ffn, E),
            p + "mlp.up_proj.weight": (cfg.ffn, E),
            p + "mlp.down_proj.weight": (E, cfg.ffn),
            p + "input_layernorm.weight": (E,),
            p + "post_attention_layernorm.weight": (E,),
        })
        if cfg.qkv_bias:
            names.update({p + "self_attn.q_proj.bias": (cfg.q_size,),
                          p + "self_attn.k_proj.bias": (cfg.kv_size,),
                          p + "self_attn.v_proj.bias": (cfg.kv_size,)})
        if cfg.qk_norm:
            names.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    return names


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
    dtype it cannot take (int8, fp8, ...) raises TypeError naming the tensors.

    >>> cfg, w = load("path/to/Llama-3.2-1B", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> w.layers[0].wqkv.shape  # [(32 + 2*8) * 64, 2048]  # doctest: +SKIP
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    if isinstance(model_or_path, (str, os.PathLike)):
        cfg, source = _open_folder(os.fspath(model_or_path))
    elif hasattr(model_or_path, "config") and hasattr(model_or_path, "state_dict"):
        cfg = ModelConfig.from_hf(model_or_path.config)
        source = _StateDict(model_or_path.state_dict())
    else:
        raise TypeError("model_or_path must be a transformers model or a checkpoint folder path, "
                        f"got {type(model_or_path).__name__}")
    _validate(cfg, source.meta())
    if dtype is None:
        dtype = source.meta()["model.embed_tokens.weight"][1]
    return cfg, _assemble(cfg, source, dtype, torch.device(device))


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


def _open_folder(path: str):
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise ValueError(f"model_or_path {path!r} is not a folder with a config.json "
                         "(a local Hugging Face checkpoint; nothing is downloaded)")
    with open(cfg_path) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        paths = sorted({os.path.join(path, shard) for shard in weight_map.values()})
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise ValueError(f"{index} names shards that are not there: {absent}")
        listed = list(weight_map)
    elif os.path.isfile(single):
        paths, listed = [single], []
    else:
        raise ValueError(f"{path!r} holds neither model.safetensors nor "
                         "model.safetensors.index.json")
    try:
        import safetensors  # noqa: F401
    except ImportError as e:
        raise ImportError("loading a checkpoint folder needs `safetensors` "
                          "(pip install 'wsattn[models]')") from e
    return cfg, _Safetensors(paths, listed)


def _few(names, n=8):
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _validate(cfg: ModelConfig, meta: dict):
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in meta]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s) {_few(missing)} (for a {cfg.family} "
                         f"config with {cfg.layers} layers, qkv_bias={cfg.qkv_bias}, "
                         f"qk_norm={cfg.qk_norm}, tie_embeddings={cfg.tie_embeddings})")
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
            raise ValueError(f"tensor {n}: expected shape {list(shape)} from the config "
                             f"(hidden={cfg.hidden}, heads={cfg.heads}, kv_heads={cfg.kv_heads}, "
                             f"head_dim={cfg.head_dim}, ffn={cfg.ffn}, vocab={cfg.vocab}), "
                             f"got {list(meta[n][0])}")


def _assemble(cfg: ModelConfig, source, dtype, device) -> Weights:
    def get(name):
        return source.get(name).to(device=device, dtype=dtype).contiguous()

    def cat(*names):
        return torch.cat([source.get(n).to(device=device, dtype=dtype) for n in names])

    layers = []
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(LayerWeights(
            wqkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if cfg.qkv_bias else None,
            q_norm=get(a + "q_norm.weight") if cfg.qk_norm else None,
            k_norm=get(a + "k_norm.weight") if cfg.qk_norm else None,
            wo=get(a + "o_proj.weight"),
            w_gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            w_down=get(p + "mlp.down_proj.weight"),
            attn_norm=get(p + "input_layernorm.weight"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_embeddings else get("lm_head.weight")
    return Weights(embed=embed, layers=layers, final_norm=get("model.norm.weight"), lm_head=lm_head)
