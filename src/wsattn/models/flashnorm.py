"""FlashNorm: fold each RMSNorm weight into the projection that follows it.

RMSNorm followed by a projection is

    RMSNorm(x) @ W.T = (x / rms(x) * g) @ W.T = (x @ (W diag(g)).T) / rms(x)

with rms(x) = sqrt(mean(x^2) + eps), a per-row scalar. Scaling the columns of W by g
(W' = W diag(g), i.e. ``W * g[None, :]``) removes the norm's weight; what is left, one
scalar 1/rms(x) per row, can be applied in the projection's prologue (to x) or epilogue
(to x @ W'.T), so no norm kernel runs. The folds:

* ``attn_norm``  -> the columns of ``wqkv``      (the bias, added after the product, is untouched)
* ``mlp_norm``   -> the columns of ``w_gate_up``
* ``final_norm`` -> the columns of ``lm_head``; with tied embeddings the folded head is a
  new tensor and ``embed`` stays as it was (the embedding lookup is not followed by a norm).
* a mixture-of-experts layer's ``mlp_norm`` -> the columns of ``router`` [E, hidden] *and*
  of every expert's ``w_gate_up[e]`` [2F, hidden]. Both read the same normed input, so
  both take g; the fold is exact (as a function) because rmsnorm(x) is x * s * g with
  s = 1/rms(x) one scalar per token: router logits = (x @ (R diag g).T) * s and each
  expert's [gate; up] = (x @ (W_e diag g).T) * s, the scalar applied in each product's
  epilogue before anything nonlinear (the softmax, SiLU) sees it. ``w_down`` reads
  silu(gate) * up, not the norm's output, and is not touched. A shared expert reads the
  same normed input: ``w_shared_gate_up`` and ``shared_gate`` take g too (the scalar
  before the SiLU and before the sigmoid alike).

Qwen3's per-head ``q_norm``/``k_norm`` are *not* folded: they sit between the projection
and RoPE, and RoPE mixes channel i with channel i + D/2 (x_i cos - x_{i+D/2} sin), so a
per-channel weight g in front of it cannot move behind it unless g_i = g_{i+D/2}; and
folding it in front, into wqkv's rows, would scale the projection before the per-head
1/rms is taken, which changes that rms. They stay as they are, applied before RoPE.
"""

from __future__ import annotations

import dataclasses

import torch

from .weights import Weights

__all__ = ["fold", "fold_columns"]


def fold_columns(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """W diag(g): w [out, in] (or [E, out, in], each expert's matrix alike) with each
    column j scaled by g [in]; computed in float32 (float64 for float64 weights) and
    rounded once to w's dtype. Returns a new tensor."""
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    return (w.to(acc) * g.to(acc)).to(w.dtype)  # g broadcasts over the last (in) dim


def fold(weights: Weights) -> Weights:
    """Fold every RMSNorm weight into the following projection (see the module docstring).

    weights: as :func:`wsattn.models.weights.load` returns them (``norms_folded`` False).
    Returns new :class:`Weights` with ``norms_folded=True``: ``wqkv``, ``w_gate_up``,
    ``router``, ``w_shared_gate_up`` and ``shared_gate`` (MoE layers) and ``lm_head``
    replaced by their folded copies (same shapes,
    dtype, device), ``attn_norm``/``mlp_norm``/``final_norm`` set to None (they now live in the
    projections; a consumer applies only 1/rms(x) with the model's ``rms_eps``); every
    other tensor is shared with the input, which is not modified.

    >>> folded = fold(weights)  # doctest: +SKIP
    >>> folded.layers[0].wqkv.shape == weights.layers[0].wqkv.shape  # doctest: +SKIP
    True
    """
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be wsattn.models.Weights, got {type(weights).__name__}")
    if weights.norms_folded:
        raise ValueError("weights are already folded (norms_folded=True): folding twice would "
                         "apply the norm weights twice")
    layers = [
        dataclasses.replace(
            layer,
            wqkv=fold_columns(layer.wqkv, layer.attn_norm),
            w_gate_up=fold_columns(layer.w_gate_up, layer.mlp_norm),
            router=None if layer.router is None else fold_columns(layer.router, layer.mlp_norm),
            w_shared_gate_up=None if layer.w_shared_gate_up is None
            else fold_columns(layer.w_shared_gate_up, layer.mlp_norm),
            shared_gate=None if layer.shared_gate is None
            else fold_columns(layer.shared_gate, layer.mlp_norm),
            attn_norm=None,
            mlp_norm=None,
        )
        for layer in weights.layers
    ]
    return Weights(
        embed=weights.embed,
        layers=layers,
        final_norm=None,
        lm_head=fold_columns(weights.lm_head, weights.final_norm),  # new even when tied
        norms_folded=True,
    )
