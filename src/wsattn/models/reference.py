"""The model forward in plain PyTorch, over :class:`~wsattn.models.weights.Weights`, with a
KV cache: prefill of a right-padded batch of prompts, then one decode step at a time.

This is what the fused decode kernels are tested against. It follows transformers'
Llama/Qwen2/Qwen3 forward exactly (pre-norm residual blocks, GQA, RoPE in the
``rotate_half`` convention with cos/sin of the concatenated frequencies, Llama-3 frequency
scaling) and computes in ``compute_dtype`` (float64 in the tests). Attention goes through
:mod:`wsattn.reference` (``attention`` for prefill, ``decode`` for a step); no kernel is
imported.

One decoder layer, as the step's kernels will split it::

    h = x + wo @ attention(rope(qk_norm(wqkv @ rmsnorm(x) + bqkv)), cache)
    x = h + w_down @ (silu(gate) * up),   [gate; up] = w_gate_up @ rmsnorm(h)

In a mixture-of-experts layer (``layer.router`` set) the MLP line is
:func:`wsattn.models.moe.moe_block` (route rmsnorm(h), sum the chosen experts' MLPs). QK-norm
is per head (Qwen3, Qwen3-MoE) or over the whole q and k projections before the split
into heads (OLMoE, ``cfg.qk_norm_whole``).

With folded weights (``weights.norms_folded``, see :mod:`wsattn.models.flashnorm`)
``w @ rmsnorm(x)`` is computed as ``(w' @ x) / rms(x)``: the norm's weight lives in w'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import torch.nn.functional as F

from .. import reference as attn_ref
from .config import ModelConfig
from .moe import check_moe_layer, moe_block
from ..rope import rope_inv_freq as _rope_inv_freq
from .weights import Weights

__all__ = ["KVCache", "prefill", "decode_step", "rope_inv_freq", "rope_cos_sin", "apply_rope",
           "rms_norm", "inv_rms"]


# --- the KV cache -----------------------------------------------------------------------

@dataclass
class KVCache:
    """Keys and values of every layer.

    Contiguous: ``k``, ``v`` [layers, B, L, Hkv, D], sequence b's token at position p in
    row ``[l, b, p]``; ``block_table`` None.
    Paged: ``k``, ``v`` [layers, num_pages, page_size, Hkv, D] and ``block_table`` int32
    [B, max_pages]: sequence b's token at position p is in page ``block_table[b, p //
    page_size]``, row ``p % page_size`` (the layout ``wsattn.decode`` reads).
    The cache's dtype is what the keys are rounded to when stored; attention reads them
    back as stored. Lengths are not kept here: the caller passes positions.
    """

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor | None = None

    @classmethod
    def contiguous(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float64,
                   device="cpu") -> "KVCache":
        shape = (cfg.layers, batch, max_len, cfg.kv_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def paged(cls, cfg: ModelConfig, num_pages: int, page_size: int, block_table: torch.Tensor,
              dtype=torch.float64, device="cpu") -> "KVCache":
        shape = (cfg.layers, num_pages, page_size, cfg.kv_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), block_table)

    @property
    def is_paged(self) -> bool:
        return self.block_table is not None

    def capacity(self) -> int:
        """Positions a sequence can hold."""
        if self.is_paged:
            return self.block_table.shape[1] * self.k.shape[2]
        return self.k.shape[2]

    def write(self, layer: int, batch_index: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor):
        """Store token n's k[n], v[n] [Hkv, D] for sequence batch_index[n] at positions[n]."""
        if self.is_paged:
            page = self.k.shape[2]
            rows = self.block_table[batch_index, positions // page].long(), positions % page
        else:
            rows = batch_index, positions
        self.k[layer][rows] = k.to(self.k.dtype)
        self.v[layer][rows] = v.to(self.v.dtype)


# --- the pieces of a layer --------------------------------------------------------------

def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim: [..., 1]."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers' LlamaRMSNorm (weight [x.shape[-1]])."""
    return x * inv_rms(x, eps) * weight.to(x.dtype)


def _norm_project(x, w, norm_weight, eps, folded):
    """rmsnorm(x) @ w.T; with folded weights the norm weight is in w's columns already
    and only 1/rms(x) is left, applied to the product (an epilogue)."""
    w = w.to(x.dtype)
    if folded:
        return (x @ w.T) * inv_rms(x, eps)
    return rms_norm(x, norm_weight, eps) @ w.T


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequencies [D/2], float32, as transformers computes them (bitwise equal
    to a transformers model's ``rotary_emb.inv_freq``); the one implementation lives in
    :mod:`wsattn.rope`, which the fused QKV kernel's host side uses too."""
    rope = cfg.rope
    scaling = None if rope.type == "default" else {
        "rope_type": rope.type, "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_positions}
    return _rope_inv_freq(cfg.head_dim, rope.theta, scaling)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype=torch.float64):
    """cos, sin [..., D] for integer positions [...]: angles position * inv_freq, the
    D/2 frequencies concatenated with themselves (transformers' convention)."""
    inv_freq = rope_inv_freq(cfg).to(device=positions.device, dtype=dtype)
    freqs = positions.to(dtype)[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated: x * cos + rotate_half(x) * sin, with rotate_half(x) =
    cat(-x[D/2:], x[:D/2]) (channel i pairs with i + D/2); cos/sin [..., D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def _qkv(cfg, layer, x, cos, sin, folded):
    """x [..., hidden] -> q [..., Hq, D], k, v [..., Hkv, D]: projection, bias, QK-norm
    (per head, before RoPE), RoPE on q and k."""
    qkv = _norm_project(x, layer.wqkv, layer.attn_norm, cfg.rms_eps, folded)
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv.to(x.dtype)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    if cfg.qk_norm_whole:
        q = rms_norm(q, layer.q_norm, cfg.rms_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_eps)
    q = q.unflatten(-1, (cfg.heads, cfg.head_dim))
    k = k.unflatten(-1, (cfg.kv_heads, cfg.head_dim))
    v = v.unflatten(-1, (cfg.kv_heads, cfg.head_dim))
    if cfg.qk_norm:
        q = rms_norm(q, layer.q_norm, cfg.rms_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _mlp(cfg, layer, h, folded):
    if layer.router is not None:
        return moe_block(cfg, layer, h)
    gate, up = _norm_project(h, layer.w_gate_up, layer.mlp_norm, cfg.rms_eps, folded).chunk(2, -1)
    return (F.silu(gate) * up) @ layer.w_down.to(h.dtype).T


def _logits(cfg, weights, x):
    return _norm_project(x, weights.lm_head, weights.final_norm, cfg.rms_eps, weights.norms_folded)


# --- prefill and decode -----------------------------------------------------------------

@torch.no_grad()
def prefill(cfg: ModelConfig, weights: Weights, input_ids: torch.Tensor, lengths: torch.Tensor,
            cache: KVCache, *, compute_dtype=torch.float64, all_logits: bool = False):
    """Run the prompts through the model and fill the cache from position 0.

    input_ids: int [B, S], right-padded (sequence b's tokens are input_ids[b, :lengths[b]],
    the rest is ignored); lengths: int [B], 1 <= lengths[b] <= S; cache: a
    :class:`KVCache` of batch B (contiguous) or with a B-row block table, holding at least
    max(lengths) positions. Only real tokens are written to the cache.
    Returns the logits of each sequence's last prompt token [B, vocab] in compute_dtype,
    or with ``all_logits=True`` the logits of every position [B, S, vocab] (rows past a
    sequence's length are junk).

    >>> cache = KVCache.contiguous(cfg, batch=2, max_len=64)  # doctest: +SKIP
    >>> logits = prefill(cfg, w, ids, torch.tensor([7, 5]), cache)  # doctest: +SKIP
    """
    _check_weights(cfg, weights)
    B, S = _check_ids("input_ids", input_ids, cfg, dims=2)
    lengths = _check_lengths(lengths, B, S)
    _check_cache(cfg, cache, B, lengths)
    folded = weights.norms_folded
    device = input_ids.device
    positions = torch.arange(S, device=device).expand(B, S)
    real = positions < lengths[:, None]  # [B, S]
    batch_index = torch.arange(B, device=device)[:, None].expand(B, S)[real]
    cos, sin = rope_cos_sin(cfg, positions, compute_dtype)  # [B, S, D]

    x = weights.embed[input_ids].to(compute_dtype)  # [B, S, hidden]
    for i, layer in enumerate(weights.layers):
        q, k, v = _qkv(cfg, layer, x, cos, sin, folded)  # [B, S, H, D]
        cache.write(i, batch_index, positions[real], k[real], v[real])
        # attend to keys as the cache stores them (rounded to its dtype), like decode does
        k, v = k.to(cache.k.dtype).to(compute_dtype), v.to(cache.v.dtype).to(compute_dtype)
        attn, _ = attn_ref.attention(q, k, v, causal=True, compute_dtype=compute_dtype)
        h = x + attn.flatten(-2) @ layer.wo.to(compute_dtype).T
        x = h + _mlp(cfg, layer, h, folded)
    if not all_logits:
        x = x[torch.arange(B, device=device), lengths - 1]  # [B, hidden]
    return _logits(cfg, weights, x)


@torch.no_grad()
def decode_step(cfg: ModelConfig, weights: Weights, token_ids: torch.Tensor,
                positions: torch.Tensor, cache: KVCache, *, compute_dtype=torch.float64):
    """One decode step: token_ids int [B] at positions int [B] (the number of tokens of
    that sequence already in the cache); writes their k/v at those positions and attends
    over positions 0..positions[b]. Returns logits [B, vocab] in compute_dtype.

    >>> logits = decode_step(cfg, w, logits.argmax(-1), lengths, cache)  # doctest: +SKIP
    """
    _check_weights(cfg, weights)
    (B,) = _check_ids("token_ids", token_ids, cfg, dims=1)
    positions = _check_positions(positions, B)
    _check_cache(cfg, cache, B, positions + 1)
    folded = weights.norms_folded
    batch_index = torch.arange(B, device=token_ids.device)
    seqlens = (positions + 1).to(torch.int32)
    cos, sin = rope_cos_sin(cfg, positions, compute_dtype)  # [B, D]

    x = weights.embed[token_ids].to(compute_dtype)  # [B, hidden]
    for i, layer in enumerate(weights.layers):
        q, k, v = _qkv(cfg, layer, x, cos, sin, folded)  # [B, H, D]
        cache.write(i, batch_index, positions, k, v)
        attn, _ = attn_ref.decode(q, cache.k[i], cache.v[i], seqlens, cache.block_table,
                                  compute_dtype=compute_dtype)  # [B, Hq, D]
        h = x + attn.flatten(-2) @ layer.wo.to(compute_dtype).T
        x = h + _mlp(cfg, layer, h, folded)
    return _logits(cfg, weights, x)


# --- input checks (all before anything is written to the cache) ------------------------

def _check_weights(cfg, weights):
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be Weights, got {type(weights).__name__}")
    if len(weights.layers) != cfg.layers or tuple(weights.embed.shape) != (cfg.vocab, cfg.hidden):
        raise ValueError(f"weights ({len(weights.layers)} layers, embed {list(weights.embed.shape)}) "
                         f"do not match cfg ({cfg.layers} layers, vocab {cfg.vocab}, hidden {cfg.hidden})")
    moe = tuple(i for i, layer in enumerate(weights.layers) if layer.router is not None)
    if moe != cfg.moe_layers:
        raise ValueError(f"weights have a router in layers {list(moe)}, cfg.moe_layers is "
                         f"{list(cfg.moe_layers)}")
    for i in moe:
        check_moe_layer(cfg, weights.layers[i], f"weights.layers[{i}]")
    if (cfg.qk_norm or cfg.qk_norm_whole) and any(l.q_norm is None or l.k_norm is None
                                                  for l in weights.layers):
        raise ValueError("cfg asks for QK-norm but some layer has no q_norm/k_norm")
    norms = [weights.final_norm] + [n for l in weights.layers for n in (l.attn_norm, l.mlp_norm)]
    if any((n is None) != weights.norms_folded for n in norms):
        raise ValueError(f"weights.norms_folded={weights.norms_folded} but the norm weights are "
                         f"{'absent' if not weights.norms_folded else 'present'}")


def _check_ids(name, ids, cfg, dims):
    if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 tensor of {dims} dims, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab):
        raise ValueError(f"{name} holds ids outside [0, vocab={cfg.vocab}): "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    return tuple(ids.shape)


def _check_lengths(lengths, B, S):
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be int [B={B}], got {lengths.dtype} {list(lengths.shape)}")
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > S):
        raise ValueError(f"lengths must lie in [1, S={S}], got {lengths.tolist()}")
    return lengths.long()


def _check_positions(positions, B):
    positions = torch.as_tensor(positions)
    if positions.shape != (B,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int [B={B}], got {positions.dtype} {list(positions.shape)}")
    if B and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {positions.tolist()}")
    return positions.long()


def _check_cache(cfg, cache, B, needed):
    """needed [B]: positions each sequence must be able to hold."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    k = cache.k
    if k.dim() != 5 or k.shape[0] != cfg.layers or k.shape[3:] != (cfg.kv_heads, cfg.head_dim) \
            or cache.v.shape != k.shape:
        raise ValueError(f"cache k/v must both be [layers={cfg.layers}, ..., Hkv={cfg.kv_heads}, "
                         f"D={cfg.head_dim}], got {list(k.shape)} and {list(cache.v.shape)}")
    if cache.is_paged:
        bt = cache.block_table
        if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != B:
            raise ValueError(f"cache.block_table must be int32 [B={B}, max_pages], got "
                             f"{bt.dtype} {list(bt.shape)}")
    elif k.shape[1] != B:
        raise ValueError(f"cache batch {k.shape[1]} != batch {B}")
    if B and int(needed.max()) > cache.capacity():
        raise ValueError(f"cache holds {cache.capacity()} positions a sequence; "
                         f"{int(needed.max())} needed")
    if cache.is_paged and B:
        page = k.shape[2]
        used = torch.arange(bt.shape[1], device=bt.device)[None] < (-(-needed // page))[:, None]
        pages = bt[used.to(bt.device)]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k.shape[1]):
            raise ValueError(f"cache.block_table names pages outside [0, {k.shape[1]})")
