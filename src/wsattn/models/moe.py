"""The mixture-of-experts MLP block in plain PyTorch: routing exactly as transformers does
it, then the chosen experts summed in a fixed order. What the MoE decode kernels are
tested against; no kernel is imported.

For a token's normed input x (``rmsnorm(h)`` with the layer's ``mlp_norm``)::

    logits = x @ router.T                                  [E], in x's dtype
    probs  = softmax(logits) in float32
    w, e   = top_k(probs)                                  k largest, descending (torch.topk)
    w      = w / sum(w)                                    if cfg.norm_topk
    w      = float32(dtype(w))                             Qwen3-MoE, OLMoE (see below)
    y      = sum over k = 0, 1, ..., top_k - 1, in that order, of
             w[k] * down_e (silu(gate_e x) * up_e x),      [gate_e; up_e] = w_gate_up[e[k]]

Sigmoid routing (``cfg.scoring == "sigmoid"``: dots1, as DeepSeek-V3; transformers'
``Dots1TopkRouter``), in float32 throughout, logits included (``F.linear`` of x and the
router both cast to float32)::

    s      = sigmoid(logits)                               [E]
    c      = s + router_bias                               the choice's keys only
    groups (cfg.router_groups > 1): c in router_groups equal groups, a group's score the
           sum of its two largest c; the router_topk_groups best groups stay, the other
           groups' experts get c = -inf
    e      = top_k(c)                                      descending
    w      = s[e]                                          unbiased
    w      = w / (sum(w) + 1e-20)                          if cfg.norm_topk
    w      = w * cfg.routed_scale
    y      = as above, then + mlp_shared(x) (ungated: cfg.shared_gated False)

Dtypes, as transformers 5.17's ``*TopKRouter``: the logits are a linear in the model's
dtype, the softmax runs in float32 (``softmax(..., dtype=torch.float)``;
Mixtral's ``softmax(logits.float())`` is the same), top-k and the renormalisation run on
the float32 probabilities; Qwen3-MoE and OLMoE then cast the weights to the logits'
dtype (``router_top_value.to(router_logits.dtype)``), Mixtral keeps float32. :func:`route`
returns float32 weights either way, rounded through the logits' dtype where transformers
rounds (a no-op for float32/float64 logits).

Ties (equal probabilities, e.g. two equal router rows): broken by ``torch.topk`` on the
device at hand, exactly as transformers calls it. torch does not specify which index wins
(on the CPU the later of two equal indices came first in a measured case); a kernel that
picks the lower index agrees with this reference only where no exact tie occurs.

NaN: a token whose logits hold a NaN has NaN probabilities; ``torch.topk`` ranks NaN above
every number, so the token is routed to some experts with NaN weights and its output is
NaN (propagated, not dropped, not raised: checking would read a device value on the host).
Other tokens are unaffected.

The sum order (ascending slot k, each slot's contribution added once to the token's
accumulator) is the order the fused combine uses, so a kernel's fp32 sum can be compared
with this one term for term. transformers adds per expert in ascending expert id instead
(``index_add_`` in its expert loop); the two agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .weights import LayerWeights

__all__ = ["route", "select", "choice_keys", "sigmoid_weights", "moe_block",
           "check_moe_layer"]

# transformers' Qwen3MoeTopKRouter, OlmoeTopKRouter and Qwen2MoeTopKRouter cast the chosen
# weights to the logits' dtype; MixtralTopKRouter returns them in float32
_ROUNDS_WEIGHTS = ("qwen3_moe", "olmoe", "qwen2_moe")


def select(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None = None,
           stable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from router logits [T, E] (any float dtype): ``(weights [T, top_k] float32,
    experts [T, top_k] int64)``, slot 0 the most probable expert (module docstring).
    bias: the layer's ``router_bias`` [E] (float32) where ``cfg.router_bias``, else None.
    stable: exact ties to the lower expert index (and the lower group), the decode
    kernels' rule, by a stable descending sort; else ``torch.topk`` as transformers
    (whose order among equal values is unspecified)."""
    if (bias is not None) != cfg.router_bias:
        raise ValueError(f"bias must be {'the [E] router_bias' if cfg.router_bias else 'None'} "
                         f"for this config (router_bias={cfg.router_bias})")
    if cfg.scoring == "sigmoid":
        return _select_sigmoid(cfg, logits.float(), bias, stable)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = _top_k(probs, cfg.top_k, stable)
    if cfg.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.family in _ROUNDS_WEIGHTS:
        weights = weights.to(logits.dtype).to(torch.float32)
    return weights, experts


def choice_keys(scores: torch.Tensor, bias: torch.Tensor | None, groups: int,
                topk_groups: int, stable: bool = False) -> torch.Tensor:
    """Sigmoid routing's selection keys [T, E], in scores' dtype: ``scores + bias``, and
    with ``groups`` > 1 the experts outside the ``topk_groups`` best groups (a group's
    score: the sum of its two largest keys) set to -inf. ``stable``: the kernels' tie rule
    (equal group scores: the lower group first, by a stable descending sort) instead of
    ``torch.topk``'s unspecified one, which transformers uses."""
    keys = scores if bias is None else scores + bias.to(scores.dtype)
    if groups > 1:
        T, E = keys.shape
        group_scores = keys.view(T, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)
        if stable:
            best = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1]
            best = best[:, :topk_groups]
        else:
            best = torch.topk(group_scores, topk_groups, dim=-1)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, best, True)
        keys = keys.masked_fill(~kept.repeat_interleave(E // groups, dim=1), float("-inf"))
    return keys


def sigmoid_weights(scores: torch.Tensor, experts: torch.Tensor, renormalize: bool,
                    scale: float) -> torch.Tensor:
    """The chosen experts' routing weights under sigmoid routing, in scores' dtype: their
    unbiased scores, renormalised as transformers does (``+ 1e-20``) where asked
    (``cfg.norm_topk``), times ``scale`` (``cfg.routed_scale``)."""
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def _top_k(values, k, stable):
    if not stable:
        return torch.topk(values, k, dim=-1)
    order = torch.sort(values, dim=-1, descending=True, stable=True)[1][:, :k]
    return values.gather(1, order), order


def _select_sigmoid(cfg, logits, bias, stable=False):
    scores = torch.sigmoid(logits)
    keys = choice_keys(scores, bias, cfg.router_groups, cfg.router_topk_groups, stable)
    experts = _top_k(keys, cfg.top_k, stable)[1]
    return sigmoid_weights(scores, experts, cfg.norm_topk, cfg.routed_scale), experts


def route(cfg: ModelConfig, x_normed: torch.Tensor, router: torch.Tensor,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a MoE layer, as transformers computes it.

    x_normed: [T, hidden], the layer's ``mlp_norm`` output (any float dtype; the logits
    are computed in it, or in float32 for sigmoid routing); router: [E, hidden]
    (:class:`~wsattn.models.weights.LayerWeights` ``router``, unfolded); bias: its
    ``router_bias`` where the config has one. Returns ``weights`` [T, top_k] float32 and ``experts``
    [T, top_k] int64, slot 0 the largest probability.

    >>> w, e = route(cfg, rms_norm(h, layer.mlp_norm, cfg.rms_eps), layer.router)  # doctest: +SKIP
    >>> w.shape, e.dtype  # ([T, cfg.top_k], torch.int64)  # doctest: +SKIP
    """
    if not cfg.experts:
        raise ValueError(f"cfg is dense ({cfg.family}, experts=0): no routing")
    if x_normed.dim() != 2 or x_normed.shape[1] != cfg.hidden:
        raise ValueError(f"x_normed must be [T, hidden={cfg.hidden}], got {list(x_normed.shape)}")
    if tuple(router.shape) != (cfg.experts, cfg.hidden):
        raise ValueError(f"router must be [experts={cfg.experts}, hidden={cfg.hidden}], got "
                         f"{list(router.shape)}")
    return select(cfg, _logits(cfg, x_normed, router), bias)


def _logits(cfg, x, router):
    """Router logits as transformers computes them: in float32 for sigmoid routing
    (Dots1TopkRouter casts both), else in x's dtype."""
    if cfg.scoring == "sigmoid":
        return F.linear(x.float(), router.float())
    return F.linear(x, router.to(x.dtype))


def check_moe_layer(cfg: ModelConfig, layer: LayerWeights, where: str = "layer"):
    """Raise ValueError naming the field if a MoE layer's tensors do not have the shapes
    of ``weights.py``'s layout for ``cfg``."""
    X, F_, H, Fs = cfg.experts, cfg.moe_ffn, cfg.hidden, cfg.shared_ffn
    for name, shape in (("router", (X, H)), ("w_gate_up", (X, 2 * F_, H)), ("w_down", (X, H, F_))):
        t = getattr(layer, name)
        if t is None or tuple(t.shape) != shape:
            raise ValueError(f"{where}.{name} must be {list(shape)} (experts={X}, "
                             f"moe_ffn={F_}, hidden={H}), got "
                             f"{None if t is None else list(t.shape)}")
    b = layer.router_bias
    if cfg.router_bias and (b is None or tuple(b.shape) != (X,) or b.dtype != torch.float32):
        raise ValueError(f"{where}.router_bias must be a float32 [{X}] tensor (experts={X}), "
                         f"got {None if b is None else (b.dtype, list(b.shape))}")
    if not cfg.router_bias and b is not None:
        raise ValueError(f"{where}.router_bias is set but the config has none (router_bias=False)")
    for name, shape in (("w_shared_gate_up", (2 * Fs, H)), ("w_shared_down", (H, Fs)),
                        ("shared_gate", (1, H))):
        t = getattr(layer, name)
        if name == "shared_gate" and not cfg.shared_gated:
            if t is not None:
                raise ValueError(f"{where}.shared_gate is set but the config's shared expert "
                                 "has no gate (shared_gated=False)")
            continue
        if Fs and (t is None or tuple(t.shape) != shape):
            raise ValueError(f"{where}.{name} must be {list(shape)} (shared_ffn={Fs}, "
                             f"hidden={H}), got {None if t is None else list(t.shape)}")
        if not Fs and t is not None:
            raise ValueError(f"{where}.{name} is set but the config has no shared expert "
                             "(shared_ffn=0)")


def moe_block(cfg: ModelConfig, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The MLP of a MoE layer: x [..., hidden], the residual stream after attention (the
    block applies the layer's RMSNorm itself, or, with FlashNorm-folded weights
    (``layer.mlp_norm`` None), only 1/rms(x) after the router's and each expert's gate/up
    product). Returns y [..., hidden] in x's dtype, without the residual; the caller adds
    it. Computes in x's dtype (the weights are cast to it); routing per :func:`select`;
    experts summed in ascending slot order (module docstring), then a shared expert's
    output added where the config has one (sigmoid-gated for Qwen2-MoE, not for dots1).

    >>> h = h + moe_block(cfg, weights.layers[i], h)  # doctest: +SKIP
    """
    from .reference import inv_rms, rms_norm  # reference imports this module at its top

    check_moe_layer(cfg, layer)
    if x.shape[-1] != cfg.hidden:
        raise ValueError(f"x must be [..., hidden={cfg.hidden}], got {list(x.shape)}")
    x2 = x.reshape(-1, cfg.hidden)
    dtype = x2.dtype
    if layer.mlp_norm is None:  # folded: g lives in the router's and experts' columns
        xin, scale = x2, inv_rms(x2, cfg.rms_eps)  # [T, 1]
        logits = _logits(cfg, xin, layer.router) * scale
    else:
        xin, scale = rms_norm(x2, layer.mlp_norm, cfg.rms_eps), None
        logits = _logits(cfg, xin, layer.router)
    weights, experts = select(cfg, logits, layer.router_bias)  # [T, k] float32, int64
    y = torch.zeros_like(x2)
    for k in range(cfg.top_k):
        for e in experts[:, k].unique().tolist():
            rows = (experts[:, k] == e).nonzero().squeeze(1)
            gate_up = F.linear(xin[rows], layer.w_gate_up[e].to(dtype))  # [n, 2F]
            if scale is not None:
                gate_up = gate_up * scale[rows]
            gate, up = gate_up.chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, layer.w_down[e].to(dtype))  # [n, hidden]
            y[rows] += out * weights[rows, k, None].to(dtype)
    if cfg.shared_ffn:  # every token: its SiLU-gated MLP, times sigmoid(gate) if gated
        gate_up = F.linear(xin, layer.w_shared_gate_up.to(dtype))
        if scale is not None:
            gate_up = gate_up * scale
        gate, up = gate_up.chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, layer.w_shared_down.to(dtype))
        if cfg.shared_gated:
            g = F.linear(xin, layer.shared_gate.to(dtype))  # [T, 1]
            shared = torch.sigmoid(g if scale is None else g * scale) * shared
        y = y + shared
    return y.reshape(x.shape)
