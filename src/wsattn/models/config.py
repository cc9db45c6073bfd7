"""The model shape the decode step runs: one frozen dataclass, built from a Hugging Face
config, that refuses at construction whatever the step does not implement.

Supported families (all decoder-only, pre-norm, RMSNorm, SiLU-gated MLP, GQA, RoPE):

* ``llama``: Llama 3.x (``LlamaForCausalLM``), rope ``default`` or ``llama3``; tied
  embeddings allowed (Llama-3.2-1B/3B).
* ``qwen2``: Qwen2/2.5 (``Qwen2ForCausalLM``): bias on the q, k and v projections only.
* ``qwen3``: Qwen3 dense (``Qwen3ForCausalLM``): per-head RMSNorm ``q_norm``/``k_norm``
  on the head dimension, before RoPE.

Mixture-of-experts families (the MLP of a MoE layer is a softmax router over ``experts``
SiLU-gated expert MLPs of width ``moe_ffn``, ``top_k`` of them per token; the routing
arithmetic is in :mod:`wsattn.models.moe`):

* ``qwen3_moe``: Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's per-head QK-norm;
  ``norm_topk_prob`` renormalises the chosen probabilities; dense layers interleaved by
  ``mlp_only_layers`` / ``decoder_sparse_step`` are supported (``moe_layers`` lists the
  MoE ones, the others are dense MLPs of width ``intermediate_size``).
* ``mixtral``: Mixtral (``MixtralForCausalLM``): always renormalised over the chosen;
  no QK-norm. ``router_jitter_noise`` is accepted: transformers applies it only in
  training mode, never in a forward the decode step mirrors.
* ``olmoe``: OLMoE (``OlmoeForCausalLM``): ``norm_topk_prob`` as Qwen3-MoE; its q/k
  RMSNorm spans the whole projection (``q_norm`` [Hq*D], ``k_norm`` [Hkv*D]), not each
  head (``qk_norm_whole``), so head_dim must be hidden // heads.
* ``qwen2_moe``: Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): Qwen2's q/k/v bias
  (``qkv_bias``), routing and dense-layer placement as Qwen3-MoE, and a shared expert
  beside the routed ones: a SiLU-gated MLP of width ``shared_ffn``
  (``shared_expert_intermediate_size``) that every token takes, scaled by
  ``sigmoid(rmsnorm(h) @ shared_expert_gate)`` and added to the routed experts' sum.
* ``dots1``: dots.llm1 (``Dots1ForCausalLM``): Qwen3's per-head QK-norm and DeepSeek-V3's
  routing (``scoring="sigmoid"``): per-expert sigmoid scores, a score-correction bias
  (``e_score_correction_bias``, [E] float32) added for the choice only, group-limited
  top-k (``n_group`` groups, ``topk_group`` kept, a group ranked by the sum of its two
  best biased scores), the chosen unbiased scores renormalised (``norm_topk_prob``) and
  scaled by ``routed_scaling_factor``; ``n_shared_experts`` shared experts as one ungated
  SiLU MLP of width ``moe_intermediate_size * n_shared_experts`` (``shared_gated``
  False); the first ``first_k_dense_replace`` layers dense.

Anything else is an :class:`UnsupportedModelError` (a ``ValueError``) naming the feature:
a sliding window some layer actually uses, a head dim other than 64/128/256, a rope type
other than default/llama3 (or a partial rotary factor), a bias on the o projection or
the MLP, an activation other than SiLU, an unknown model type; for mixture-of-experts,
shared experts outside Qwen2-MoE and dots1, DeepSeek-style routing (grouped top-k, sigmoid
scoring, a routed scaling factor, a router score bias) outside dots1, DeepSeek-V2/V3
themselves (their multi-head latent attention), OLMoE's ``clip_qkv``, a MoE config that
does not state its routing (``num_experts_per_tok``, the expert width), or experts on a
dense family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ModelConfig", "RopeConfig", "UnsupportedModelError", "HEAD_DIMS", "FAMILIES",
           "MOE_FAMILIES"]

HEAD_DIMS = (64, 128, 256)  # what the attention kernels are built for
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
            "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "dots1": "Dots1ForCausalLM"}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "dots1")
SCORINGS = ("softmax", "sigmoid")

# transformers' defaults for keys a config.json may leave out (the model classes'
# dataclass defaults); the shape keys have no default here: a config without them is
# refused rather than silently given a 7B shape.
_DEFAULTS = {
    "llama": dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=2048),
    "qwen2": dict(head_dim=None, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(head_dim=128, num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3_moe": dict(head_dim=None, num_key_value_heads=4, max_position_embeddings=32768,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(head_dim=None, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-5,
                    rope_theta=1000000.0),
    "olmoe": dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=4096,
                  rms_norm_eps=1e-5,
                  norm_topk_prob=False),
    "qwen2_moe": dict(head_dim=None, num_key_value_heads=16, max_position_embeddings=32768,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      qkv_bias=True),
    "dots1": dict(head_dim=None, num_key_value_heads=32, max_position_embeddings=2048,
                  norm_topk_prob=False, n_group=1, topk_group=1, first_k_dense_replace=0,
                  routed_scaling_factor=1.0, sliding_window=4096, max_window_layers=62),
}
# what a MoE config must state itself: the routing is never guessed from a default
_MOE_REQUIRED = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
                 "mixtral": ("num_experts_per_tok",), "olmoe": ("num_experts_per_tok",),
                 "qwen2_moe": ("num_experts_per_tok", "moe_intermediate_size",
                               "shared_expert_intermediate_size"),
                 "dots1": ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")}
# the families whose shared expert the step runs (the config key that sizes it)
_SHARED_EXPERT_KEY = {"qwen2_moe": "shared_expert_intermediate_size",
                      "dots1": "n_shared_experts"}
# routing keys of _MOE_REFUSED_KEYS a family implements (not refused for it)
_FAMILY_ROUTING_KEYS = {"qwen2_moe": ("shared_expert_intermediate_size",),
                        "dots1": ("n_shared_experts", "n_group", "topk_group",
                                  "routed_scaling_factor")}
# routing keys whose accepted values differ for a family: what its transformers class
# runs whatever the key says (dots1's published config.json states scoring_func
# "sigmoid"; DeepSeek-V3's name for its bias-corrected top-k is topk_method "noaux_tc")
_FAMILY_NEUTRAL = {"dots1": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}}
# model types that are MoE in a way the step does not implement, and what that way is
_MOE_REFUSED_TYPES = {
    "deepseek_v2": "multi-head latent attention (kv_lora_rank) and DeepSeek-V2's "
                   "group-limited softmax routing",
    "deepseek_v3": "multi-head latent attention (kv_lora_rank; its sigmoid, grouped, "
                   "bias-corrected routing is run for dots1)",
}
# config keys that ask for routing the step does not implement (refused when set to
# anything but the neutral value given)
_MOE_REFUSED_KEYS = {
    "shared_expert_intermediate_size": (0, "shared experts"),
    "n_shared_experts": (0, "shared experts"),
    "num_shared_experts": (0, "shared experts"),
    "n_group": (1, "DeepSeek-style grouped top-k routing"),
    "topk_group": (1, "DeepSeek-style grouped top-k routing"),
    "topk_method": ("greedy", "DeepSeek-style top-k method"),
    "scoring_func": ("softmax", "a router scoring function other than softmax"),
    "routed_scaling_factor": (1.0, "a routed scaling factor"),
    "router_bias": (False, "a bias on the router"),
    "moe_router_bias": (False, "a bias on the router"),
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


class UnsupportedModelError(ValueError):
    """A model configuration the decode step does not implement; the message names the
    feature and the config key that asks for it."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, as transformers reads them from ``rope_parameters``
    (or the older ``rope_theta`` + ``rope_scaling``).

    type: ``"default"`` or ``"llama3"``; the last four fields are only used by
    ``llama3`` (``None`` for ``default``).
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_positions: int | None = None

    def __post_init__(self):
        if self.type not in ("default", "llama3"):
            raise UnsupportedModelError(
                f"rope type {self.type!r} is not supported (only 'default' and 'llama3')")
        if self.type == "llama3":
            missing = [f.name for f in dataclasses.fields(self)[2:] if getattr(self, f.name) is None]
            if missing:
                raise ValueError(f"llama3 rope needs {missing}")
            if self.high_freq_factor == self.low_freq_factor:
                raise ValueError("llama3 rope: high_freq_factor must differ from low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a supported decoder model (see the module docstring for the families).

    hidden: model width; layers: decoder layers; heads / kv_heads: query and key-value
    heads (GQA: heads % kv_heads == 0); head_dim: D, one of 64, 128, 256 (may differ
    from hidden // heads); ffn: MLP intermediate size; vocab: embedding rows;
    rms_eps: RMSNorm epsilon; rope: :class:`RopeConfig`; tie_embeddings: the LM head is
    the embedding matrix; qkv_bias: q/k/v projections carry a bias (Qwen2); qk_norm:
    per-head RMSNorm on q and k before RoPE (Qwen3); max_positions: the model's
    ``max_position_embeddings``; dtype: the checkpoint's torch dtype, or None if unstated.
    MoE (experts > 0): experts, top_k, moe_ffn (an expert's width), norm_topk, moe_layers,
    shared_ffn (the shared expert's width, 0 for none), shared_gated (the shared expert's
    output scaled by a sigmoid gate: Qwen2-MoE's; dots1's is not); the router: scoring
    (``"softmax"`` over the experts, or ``"sigmoid"`` per expert), router_bias (a
    score-correction bias [E] added to the scores for the choice only), router_groups /
    router_topk_groups (group-limited top-k: experts in router_groups equal groups, only
    the router_topk_groups best groups eligible), routed_scale (the chosen weights'
    factor after any renormalisation). :mod:`wsattn.models.moe` has the arithmetic.
    """

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_positions: int = 2048
    dtype: torch.dtype | None = None
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    norm_topk: bool = False
    moe_layers: tuple[int, ...] = ()
    qk_norm_whole: bool = False
    shared_ffn: int = 0
    shared_gated: bool = True
    scoring: str = "softmax"
    router_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scale: float = 1.0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported (one of {tuple(FAMILIES)})")
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                     "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim not in HEAD_DIMS:
            raise UnsupportedModelError(
                f"head_dim {self.head_dim} is not supported (the kernels take {HEAD_DIMS})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not self.rms_eps > 0:
            raise ValueError(f"rms_eps must be > 0, got {self.rms_eps!r}")
        if self.dtype is not None and self.dtype not in _DTYPES.values():
            raise UnsupportedModelError(f"dtype {self.dtype} is not supported ({tuple(_DTYPES)})")
        if self.qk_norm and self.qk_norm_whole:
            raise ValueError("qk_norm (per head) and qk_norm_whole (whole projection) exclude "
                             "each other")
        self._check_moe()

    def _check_moe(self):
        for name in ("experts", "top_k", "moe_ffn", "shared_ffn", "router_groups",
                     "router_topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if self.scoring not in SCORINGS:
            raise UnsupportedModelError(f"scoring {self.scoring!r} is not supported (one of "
                                        f"{SCORINGS})")
        scale = self.routed_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
                not 0 < scale < float("inf"):
            raise ValueError(f"routed_scale must be a positive finite float, got {scale!r}")
        object.__setattr__(self, "routed_scale", float(scale))
        routing = (self.scoring, self.router_bias, self.router_groups,
                   self.router_topk_groups, self.routed_scale)
        if not self.experts:
            if self.top_k or self.moe_layers or self.moe_ffn or self.shared_ffn or \
                    routing != ("softmax", False, 1, 1, 1.0):
                raise ValueError(f"a dense config (experts=0) has top_k={self.top_k}, "
                                 f"moe_ffn={self.moe_ffn}, moe_layers={self.moe_layers}, "
                                 f"shared_ffn={self.shared_ffn}, routing (scoring, "
                                 f"router_bias, router_groups, router_topk_groups, "
                                 f"routed_scale)={routing}")
            return
        G, TG, E = self.router_groups, self.router_topk_groups, self.experts
        if G < 1 or E % G or not 1 <= TG <= G:
            raise ValueError(f"router_groups ({G}) must divide experts ({E}) and "
                             f"router_topk_groups ({TG}) lie in [1, router_groups]")
        if G > 1 and (self.scoring != "sigmoid" or E // G < 2):
            # a group is ranked by its two best sigmoid scores (DeepSeek-V3)
            raise UnsupportedModelError(
                f"group-limited routing (router_groups={G}) is supported with sigmoid "
                f"scoring and >= 2 experts a group only, got scoring={self.scoring!r}, "
                f"{E // G} a group")
        if self.router_bias and self.scoring != "sigmoid":
            raise UnsupportedModelError("a router score-correction bias is supported with "
                                        "sigmoid scoring only")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k (num_experts_per_tok) must lie in [1, num_experts="
                             f"{self.experts}], got {self.top_k}")
        if self.top_k > TG * (E // G):
            raise ValueError(f"top_k ({self.top_k}) exceeds the experts of the "
                             f"router_topk_groups={TG} eligible groups ({TG * (E // G)})")
        if self.moe_ffn <= 0:
            raise ValueError(f"moe_ffn (the expert intermediate size) must be > 0, got {self.moe_ffn}")
        if list(self.moe_layers) != sorted(set(self.moe_layers)) or \
                any(not 0 <= i < self.layers for i in self.moe_layers):
            raise ValueError(f"moe_layers must be ascending distinct layer indices in "
                             f"[0, {self.layers}), got {self.moe_layers}")

    @property
    def is_moe(self) -> bool:
        """Some layer's MLP is the mixture-of-experts block."""
        return bool(self.moe_layers)

    @property
    def q_size(self) -> int:
        """Rows of q in wqkv: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k (and of v) in wqkv: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig`` or the dict of a ``config.json``.

        Raises :class:`UnsupportedModelError` naming the feature for anything the step
        does not implement, ``ValueError`` for a malformed config.

        >>> ModelConfig.from_hf({"model_type": "llama", "hidden_size": 128,
        ...     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        ...     "intermediate_size": 256, "vocab_size": 512}).head_dim
        64
        """
        d = _as_dict(cfg)
        model_type = d.get("model_type")
        if model_type in _MOE_REFUSED_TYPES:
            raise UnsupportedModelError(f"model_type {model_type!r}: "
                                        f"{_MOE_REFUSED_TYPES[model_type]} is not supported")
        if model_type in MOE_FAMILIES:
            _refuse_moe_routing(d)
        else:
            _refuse_moe(d)
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (one of {tuple(FAMILIES)})")
        arch = d.get("architectures") or []
        if arch and arch != [FAMILIES[model_type]]:
            raise UnsupportedModelError(
                f"architectures {arch} is not supported for model_type {model_type!r} "
                f"(expected [{FAMILIES[model_type]!r}])")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"config lacks {missing}")
        # a key left out takes the config class's default; num_key_value_heads given as
        # null means one KV head a query head, as every config class's __post_init__ has it
        kv_null = "num_key_value_heads" in d and d["num_key_value_heads"] is None
        d = {**_DEFAULTS[model_type], **{k: v for k, v in d.items() if v is not None}}
        if kv_null:
            d["num_key_value_heads"] = None

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True (a bias on the MLP projections) is not supported")
        if d.get("attention_bias", False):
            # Llama and Qwen3 put attention_bias on o_proj as well as on q/k/v
            raise UnsupportedModelError(
                "attention_bias=True (a bias on o_proj) is not supported; only Qwen2's "
                "q/k/v bias is")
        if model_type in MOE_FAMILIES and model_type not in ("qwen2_moe", "dots1"):
            _refuse_moe_sliding_window(model_type, d)
        else:  # Qwen2-MoE and dots1 decide per layer, each as its config class does
            _refuse_sliding_window(d)
        if d.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"clip_qkv={d['clip_qkv']} (clamping q, k, v) is not supported")

        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if model_type == "olmoe" and head_dim * heads != d["hidden_size"]:
            # transformers sizes OLMoE's q_norm by hidden_size and applies it to q_proj's
            # heads * head_dim outputs: only head_dim = hidden // heads is a working model
            raise UnsupportedModelError(
                f"olmoe with head_dim={head_dim} * num_attention_heads={heads} != hidden_size="
                f"{d['hidden_size']} is not supported (its q_norm spans hidden_size)")
        return cls(
            family=model_type,
            hidden=d["hidden_size"],
            layers=d["num_hidden_layers"],
            heads=heads,
            kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn=d["intermediate_size"],
            vocab=d["vocab_size"],
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope(d),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe"
                                               and bool(d["qkv_bias"])),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "dots1"),
            qk_norm_whole=model_type == "olmoe",
            max_positions=d["max_position_embeddings"],
            dtype=_dtype(d.get("dtype", d.get("torch_dtype"))),
            **_moe_fields(model_type, d),
        )


def _as_dict(cfg) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):  # a transformers PretrainedConfig
        return cfg.to_dict()
    raise TypeError(f"cfg must be a transformers PretrainedConfig or a dict, got {type(cfg).__name__}")


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _refuse_moe(d):
    for key in _EXPERT_KEYS:
        if d.get(key):
            raise UnsupportedModelError(f"mixture-of-experts ({key}={d[key]}) is not supported "
                                        f"for model_type {d.get('model_type')!r}")


def _num_experts(d):
    # Qwen3MoeConfig.to_dict() writes num_local_experts (its attribute_map points
    # num_experts there) while published config.json files say num_experts; dots1 (as
    # DeepSeek) says n_routed_experts
    return d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts")


def _refuse_moe_routing(d):
    model_type = d["model_type"]
    for key, (neutral, feature) in _MOE_REFUSED_KEYS.items():
        if key in _FAMILY_ROUTING_KEYS.get(model_type, ()):
            continue  # this family's shared expert or routing is run
        accepted = _FAMILY_NEUTRAL.get(model_type, {}).get(key, (neutral,))
        if d.get(key) is not None and d[key] not in accepted:
            raise UnsupportedModelError(f"mixture-of-experts with {feature} ({key}={d[key]!r}) "
                                        "is not supported")
    missing = [k for k in _MOE_REQUIRED[model_type] if d.get(k) is None]
    if not _num_experts(d):
        missing.insert(0, "n_routed_experts" if model_type == "dots1" else "num_experts")
    if missing:
        # a ValueError like any malformed config, typed as a refusal: transformers would
        # fill these from its defaults (8 of 128 experts, width 768), a shape and a routing
        # this config never stated
        raise UnsupportedModelError(
            f"mixture-of-experts config (model_type {model_type!r}) lacks {missing}: the "
            "routing is not taken from transformers' defaults")


def _moe_fields(model_type, d) -> dict:
    if model_type not in MOE_FAMILIES:
        return {}
    layers, experts = d["num_hidden_layers"], _num_experts(d)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        step, dense = d["decoder_sparse_step"], set(d["mlp_only_layers"] or ())
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be an int >= 1, got {step!r}")
        # transformers' Qwen3MoeDecoderLayer (and Qwen2Moe's): MoE unless listed in
        # mlp_only_layers or off the decoder_sparse_step grid
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        moe_ffn = d["moe_intermediate_size"]
    elif model_type == "dots1":
        first = d["first_k_dense_replace"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"first_k_dense_replace must be an int >= 0, got {first!r}")
        moe_layers, moe_ffn = tuple(range(first, layers)), d["moe_intermediate_size"]
    else:
        moe_layers, moe_ffn = tuple(range(layers)), d["intermediate_size"]
    shared = d[_SHARED_EXPERT_KEY[model_type]] if model_type in _SHARED_EXPERT_KEY else 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0 or \
            (model_type in _SHARED_EXPERT_KEY and shared == 0):
        raise ValueError(f"{_SHARED_EXPERT_KEY.get(model_type, 'shared expert width')} must be "
                         f"a positive int, got {shared!r}")
    routing = {}
    if model_type == "dots1":
        # transformers' Dots1TopkRouter (DeepSeek-V3's): sigmoid, a correction bias,
        # group-limited top-k, a routed scale; n_shared_experts experts of moe_ffn each,
        # run as one MLP (transformers' Dots1MLP of width moe_ffn * n_shared_experts)
        shared *= moe_ffn
        routing = dict(shared_gated=False, scoring="sigmoid", router_bias=True,
                       router_groups=d["n_group"], router_topk_groups=d["topk_group"],
                       routed_scale=d["routed_scaling_factor"])
    return dict(experts=experts, top_k=d["num_experts_per_tok"], moe_ffn=moe_ffn,
                norm_topk=True if model_type == "mixtral" else bool(d["norm_topk_prob"]),
                moe_layers=moe_layers, shared_ffn=shared, **routing)


def _refuse_moe_sliding_window(model_type, d):
    """Qwen3-MoE slides every layer when use_sliding_window is set (no max_window_layers
    there); Mixtral and OLMoE hand sliding_window to the attention whenever it is set."""
    window = d.get("sliding_window")
    on = window is not None and (model_type != "qwen3_moe" or d.get("use_sliding_window", False))
    if on or any(t != "full_attention" for t in d.get("layer_types") or ()):
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}, use_sliding_window="
            f"{d.get('use_sliding_window')}, layer_types={d.get('layer_types')}) is not "
            "supported")


def _refuse_sliding_window(d):
    """Refuse a sliding window only where a layer uses it, as transformers decides: from
    ``layer_types`` when given, else by each config class's own rule. Qwen2/3: layers >=
    ``max_window_layers`` when ``use_sliding_window`` is set and there is a
    ``sliding_window`` (they ship one with the switch off); dots1 has no switch: its
    window applies from ``max_window_layers`` on whenever set; Qwen2-MoE: the even layers
    below ``max_window_layers`` when ``use_sliding_window`` is set."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers", 28)
        if d.get("model_type") == "qwen2_moe":
            on = bool(d.get("use_sliding_window", False))
            layer_types = ["sliding_attention" if on and i % 2 == 0 and i < first
                           else "full_attention" for i in range(d["num_hidden_layers"])]
        else:
            switch = True if d.get("model_type") == "dots1" else d.get("use_sliding_window",
                                                                       False)
            on = switch and d.get("sliding_window") is not None
            layer_types = ["sliding_attention" if on and i >= first else "full_attention"
                           for i in range(d["num_hidden_layers"])]
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding:
        kinds = sorted({layer_types[i] for i in sliding})
        raise UnsupportedModelError(
            f"sliding-window attention ({kinds} in layers {sliding}; use_sliding_window="
            f"{d.get('use_sliding_window')}, sliding_window={d.get('sliding_window')}) is "
            f"not supported")


def _rope(d) -> RopeConfig:
    params = d.get("rope_parameters")
    if d.get("rope_scaling"):  # transformers reads rope_scaling over rope_parameters
        params = {**d["rope_scaling"], "rope_theta": (params or {}).get(
            "rope_theta", d.get("rope_theta", 10000.0))}
    elif params is None:  # config.json written before transformers 5
        params = {"rope_theta": d.get("rope_theta", 10000.0)}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig("default", theta)
    return RopeConfig("llama3", theta, float(params["factor"]), float(params["low_freq_factor"]),
                      float(params["high_freq_factor"]),
                      int(params.get("original_max_position_embeddings")
                          or d["max_position_embeddings"]))


def _dtype(value):
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPES.values():
            raise UnsupportedModelError(f"dtype {value} is not supported ({tuple(_DTYPES)})")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedModelError(f"dtype {value!r} is not supported ({tuple(_DTYPES)})")
    return _DTYPES[name]
