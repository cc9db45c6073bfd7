"""The kernels as PyTorch custom ops, so torch.compile traces through them.

Each op takes validated input (see api.py) and has a fake implementation that only
computes output shapes, which is all torch.compile needs to trace without a graph break.
The ops always return the LSE: it costs one fp32 store per query row.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("wsattn::prefill", mutates_args=())
def prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
            cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
            causal: bool, sm_scale: float, impl: str) -> tuple[Tensor, Tensor]:
    if impl == "gluon":
        from .kernels import prefill_gluon
        return prefill_gluon.prefill(q, k, v, causal, sm_scale)
    from .kernels import prefill_triton
    return prefill_triton.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, sm_scale)


@prefill.register_fake
def _prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  sm_scale, impl):
    out = q.new_empty(q.shape)
    if q.dim() == 4:  # [B, S, H, D] -> lse [B, H, S]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:  # [T, H, D] -> lse [H, T]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("wsattn::decode", mutates_args=())
def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor,
           block_table: Optional[Tensor], sm_scale: float, num_splits: int) -> tuple[Tensor, Tensor]:
    from .kernels import decode_triton
    return decode_triton.decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits)


@decode.register_fake
def _decode_fake(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("wsattn::merge_states", mutates_args=())
def merge_states(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    from .kernels import merge
    return merge.merge_states(outputs, lses)


@merge_states.register_fake
def _merge_fake(outputs, lses):
    return outputs.new_empty(outputs.shape[1:]), lses.new_empty(lses.shape[1:])
