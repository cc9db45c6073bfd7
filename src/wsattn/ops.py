"""The kernels as PyTorch custom ops, so torch.compile traces through them.

Each op takes validated input (see api.py) and has a fake implementation that only
computes output shapes, which is all torch.compile needs to trace without a graph break.
The ops always return the LSE: it costs one fp32 store per query row.

Eager calls skip the dispatcher: :func:`prefill`, :func:`decode` and
:func:`merge_states` call the kernel launchers directly unless torch.compile is tracing
or autograd would record the call (see :func:`_via_dispatcher`).
Measured on H200 (torch 2.11, ``python -m wsattn.bench.host``): a call through the
custom-op dispatcher cost 120-315 us of host time against ~10 us for a plain torch op,
which made every small eager call (decode, merge, the sequence-parallel chunks) host
bound. Traced graphs still see one custom op per call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["prefill", "decode", "merge_states"]


# --------------------------------------------------------------------------- launchers

_interpreter_patched = False


def _interpreter_ready(device):
    """The library works as installed (``pip install -e .`` resolves any numpy): it
    applies its Triton-interpreter work-arounds itself, once, when a kernel first runs
    on CPU tensors; not in traced code, since the launchers below run eagerly."""
    global _interpreter_patched
    if not _interpreter_patched and device.type != "cuda":
        from ._triton_compat import patch_interpreter
        patch_interpreter()
        _interpreter_patched = True


def _prefill_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  sm_scale, impl):
    _interpreter_ready(q.device)
    if impl == "gluon":
        from .kernels import prefill_gluon
        if cu_seqlens_q is not None:
            return prefill_gluon.prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, causal, sm_scale)
        return prefill_gluon.prefill(q, k, v, causal, sm_scale)
    from .kernels import prefill_triton
    return prefill_triton.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, sm_scale)


def _decode_impl(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits, pdl=False):
    _interpreter_ready(q.device)
    from .kernels import decode_triton
    return decode_triton.decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits,
                                pdl=pdl)


def _merge_impl(outputs, lses):
    _interpreter_ready(outputs.device)
    from .kernels import merge
    return merge.merge_states(outputs, lses)


# --------------------------------------------------------------------------- custom ops

@torch.library.custom_op("wsattn::prefill", mutates_args=())
def prefill_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
               cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
               causal: bool, sm_scale: float, impl: str) -> tuple[Tensor, Tensor]:
    return _prefill_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal, sm_scale, impl)


@prefill_op.register_fake
def _prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  sm_scale, impl):
    out = q.new_empty(q.shape)
    if q.dim() == 4:  # [B, S, H, D] -> lse [B, H, S]
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:  # [T, H, D] -> lse [H, T]
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("wsattn::decode", mutates_args=())
def decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor,
              block_table: Optional[Tensor], sm_scale: float,
              num_splits: int) -> tuple[Tensor, Tensor]:
    return _decode_impl(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("wsattn::merge_states", mutates_args=())
def merge_states_op(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    return _merge_impl(outputs, lses)


@merge_states_op.register_fake
def _merge_fake(outputs, lses):
    return outputs.new_empty(outputs.shape[1:]), lses.new_empty(lses.shape[1:])


# --------------------------------------------------------------------------- entry points

def _via_dispatcher(*tensors) -> bool:
    """Use the custom op (not the bare launcher) under a torch.compile trace, or when
    autograd would record the call: the op then marks the outputs as needing a backward
    it does not have, and backward() raises a clear error instead of gradients silently
    going missing. Inference (no_grad, inference_mode, plain tensors) takes the fast path."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
            impl):
    fn = prefill_op if _via_dispatcher(q, k, v) else _prefill_impl
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
              sm_scale, impl)


def decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits, *, pdl=False):
    # pdl (decode_triton.decode's launch switch, for the engine's decode step) goes to the
    # launcher itself: the custom op carries no such argument
    if pdl:
        return _decode_impl(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits,
                            pdl=True)
    fn = decode_op if _via_dispatcher(q, k_cache, v_cache) else _decode_impl
    return fn(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits)


def merge_states(outputs, lses):
    fn = merge_states_op if _via_dispatcher(outputs, lses) else _merge_impl
    return fn(outputs, lses)
