"""Public API: validate every input, then dispatch to a kernel or the reference.

Everything a caller can get wrong is checked here, before any kernel runs, with an
error that names the argument and what was expected. Kernels may assume valid input.
Each public function has a ``check_*`` twin that runs exactly its checks and launches
nothing; :mod:`wsattn.sp` runs them on every rank before the ranks agree.

impl (resolved in :mod:`wsattn.dispatch`):
  "auto"      - the fastest qualified kernel for the device: Gluon on sm_90 where it
                qualifies and measured faster, Triton elsewhere on CUDA; the Triton
                kernels on CPU tensors when TRITON_INTERPRET=1; the reference on CPU
                otherwise.
  "triton"    - the Triton (``tl``) kernels.
  "gluon"     - the warp-specialized Gluon kernel (sm_90 only; fixed-length and varlen prefill,
                and paged prefill, its pages read in place by TMA or gathered first).
  "reference" - the PyTorch reference (float64 inside, returns q's dtype).

Value checks and host synchronisation: shapes, dtypes, devices and strides are host
metadata and are always checked. The *values* of index tensors (``cu_seqlens``,
``seqlens``, ``block_table``) can only be read on the host, which on a GPU waits for
the device; ``validate`` decides: ``True`` reads and checks them, ``False`` never does,
``None`` (the default) checks them where that is free (index tensors on the CPU) or
when the environment sets ``WSATTN_VALIDATE=1``. A default call on CUDA tensors never
synchronises; unchecked values are then the caller's contract, as in flash-attn.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from . import dispatch, reference
from .dispatch import IMPLS, Call

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_HEAD_DIMS = (64, 128, 256)
MAX_NUM_SPLITS = 128  # = decode_triton.MAX_SPLITS: the combine unrolls its split loop, and
                      # compiling it for far more splits took minutes
LSE_LAYOUTS = ("outputs", "heads_first")


# --------------------------------------------------------------------------- checks

def _tensor(name, t, ndim=None, what=""):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {what or f'{ndim}-D'}, got shape {tuple(t.shape)}")
    return t


def _flag(name, value):
    """Python bool only: "False" (a non-empty string) or 0/1 must not pass as a mask switch."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")


def _validate_flag(validate):
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be True, False or None, got {type(validate).__name__} "
                        f"{validate!r}")


def _values_checked(validate, *index_tensors) -> bool:
    """Whether this call reads index values on the host (see the module docstring)."""
    if validate is not None:
        return validate
    if os.environ.get("WSATTN_VALIDATE", "0") == "1":
        return True
    return all(t.device.type == "cpu" for t in index_tensors if t is not None)


def _last_dim_contiguous(name, t):
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), "
                         f"got strides {tuple(t.stride())}")


def _same(names, tensors, what):
    first = getattr(tensors[0], what)
    for n, t in zip(names[1:], tensors[1:]):
        if getattr(t, what) != first:
            raise (TypeError if what == "dtype" else ValueError)(
                f"{n} has {what} {getattr(t, what)} but {names[0]} has {first}; "
                f"all of {', '.join(names)} must share one {what}")


def _check_impl(impl):
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _check_float(name, t):
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_head_dim(D):
    if D <= 0:
        raise ValueError(f"head dim (q.shape[-1]) must be positive, got {D}")


def _check_kernel_inputs(dtype, impl, head_dim, op):
    """Checks that only the kernels need (the reference takes any float dtype and D)."""
    if impl == "reference":
        return
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"q dtype must be one of float16, bfloat16, float32 for impl={impl!r}, "
                        f"got {dtype}")
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {KERNEL_HEAD_DIMS} for "
                         f"impl={impl!r} ({op}), got {head_dim}")


def _check_heads(hq, hkv, q_name="q", k_name="k"):
    if hkv == 0 or hq == 0 or hq % hkv:
        raise ValueError(f"the number of query heads ({q_name}: {hq}) must be a positive "
                         f"multiple of the number of KV heads ({k_name}: {hkv})")


def _index_tensor(name, t, ndim, what):
    _tensor(name, t, ndim, what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")


def _cu_values(name, cu, total):
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of packed tokens ({total}), "
                         f"got {vals[-1]}")
    return vals


def _max_seqlen(name, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"{name} must be a non-negative int or None, got "
                        f"{type(value).__name__} {value!r}")


def _scale(sm_scale, d):
    if sm_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a positive finite number or None, got "
                        f"{type(sm_scale).__name__} {sm_scale!r}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    if not _FP32_TINY <= sm_scale * _LOG2E <= _FP32_MAX:
        # the kernels take sm_scale * log2(e) as an fp32 argument
        raise ValueError(f"sm_scale must be a positive finite number with sm_scale * log2(e) "
                         f"in fp32's normal range (sm_scale in [{_FP32_TINY / _LOG2E:.4e}, "
                         f"{_FP32_MAX / _LOG2E:.4e}]), got {sm_scale!r}")
    return float(sm_scale)


_LOG2E = 1.4426950408889634
_FP32_MAX = float(torch.finfo(torch.float32).max)
_FP32_TINY = float(torch.finfo(torch.float32).tiny)


GRID_YZ_MAX = 65535  # CUDA's limit on a grid's y and z extents


def _check_grid(impl, batch, heads) -> str:
    """impl, once the Triton prefill's grid (tiles, heads, batch) fits CUDA's limits; a
    ValueError before any launch (a paged call's append included) otherwise."""
    if impl == "triton" and max(batch, heads) > GRID_YZ_MAX:
        raise ValueError(f"impl='triton' launches one program row per (head, sequence): "
                         f"heads ({heads}) and sequences ({batch}) must each be <= "
                         f"{GRID_YZ_MAX}; split the batch")
    return impl


def _resolve(impl, call: Call) -> str:
    if impl not in ("auto", "reference"):  # what the caller asked for first, then where
        _check_kernel_inputs(call.dtype, impl, call.head_dim, call.op)
    impl = dispatch.resolve(impl, call)
    _check_kernel_inputs(call.dtype, impl, call.head_dim, call.op)
    return impl


# --------------------------------------------------------------------------- running

def _kernel_dtype(t: torch.Tensor) -> torch.Tensor:
    """Triton's interpreter multiplies bf16 operands of tl.dot as raw bits (garbage), so
    on the CPU bf16 inputs run in fp32 and the outputs are rounded back to bf16."""
    return t.float() if t.dtype == torch.bfloat16 and t.device.type != "cuda" else t


def _run_kernels(impl, device, *tensors):
    """Tensors as the kernels take them on this device."""
    if impl == "triton" and device.type != "cuda":
        return tuple(_kernel_dtype(t) if isinstance(t, torch.Tensor) and t.is_floating_point()
                     else t for t in tensors)
    return tensors


def _finish(out, lse, dtype, return_lse):
    out = out.to(dtype)
    lse = lse.to(torch.float32)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- prefill

def _attention_call(q, k, v, causal, sm_scale, impl):
    _check_impl(impl)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _tensor(n, t, 4, "4-D [batch, seqlen, heads, head_dim]")
        _check_float(n, t)
        _last_dim_contiguous(n, t)
    _flag("causal", causal)
    _same(("q", "k", "v"), (q, k, v), "dtype")
    _same(("q", "k", "v"), (q, k, v), "device")
    B, Sq, Hq, D = q.shape
    _check_head_dim(D)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, Sk, Hkv, D={D}] to match q, got {tuple(k.shape)}")
    _check_heads(Hq, k.shape[2])
    if causal and Sq > k.shape[1]:
        raise ValueError(f"causal attention needs q_len <= kv_len (bottom-right aligned), "
                         f"got q seqlen {Sq} > k seqlen {k.shape[1]}")
    scale = _scale(sm_scale, D)
    call = Call("prefill", q.device, q.dtype, D, causal, Sq, k.shape[1])
    return scale, _check_grid(_resolve(impl, call), B, Hq)


def check_attention(q, k, v, causal=False, sm_scale=None, *, impl="auto") -> None:
    """Every check :func:`attention` runs, and nothing else (ValueError / TypeError)."""
    _attention_call(q, k, v, causal, sm_scale, impl)


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, *,
              return_lse: bool = False, impl: str = "auto"):
    """Prefill attention forward over fixed-length batches.

    Args:
        q: [B, Sq, Hq, D], float16 / bfloat16 (float32 for the interpreter and the
           reference), last dimension contiguous.
        k, v: [B, Sk, Hkv, D], same dtype and device; Hq must be a multiple of Hkv (GQA).
        causal: bool; mask keys after each query, aligned bottom-right: query i sees keys
           j <= i + Sk - Sq (so Sq <= Sk is required), as in chunked prefill.
        sm_scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the log-sum-exp, natural log, float32, [B, Hq, Sq]
           (``merge_states(..., lse_layout="heads_first")`` takes it as it is).
        impl: "auto", "triton", "gluon" or "reference" (see module docstring).

    Returns:
        out [B, Sq, Hq, D] in q's dtype, or (out, lse).

    Example:
        >>> q = torch.randn(1, 17, 4, 64); k = v = torch.randn(1, 17, 2, 64)
        >>> out, lse = attention(q, k, v, causal=True, return_lse=True, impl="reference")
        >>> out.shape, lse.shape
        (torch.Size([1, 17, 4, 64]), torch.Size([1, 4, 17]))
    """
    _flag("return_lse", return_lse)
    scale, impl = _attention_call(q, k, v, causal, sm_scale, impl)
    B, Sq, Hq, D = q.shape
    if q.numel() == 0:  # nothing to compute: no kernel, no reference
        out = torch.empty_like(q)
        lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    if impl == "reference":
        out, lse = reference.attention(q, k, v, causal, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    qk, kk, vk = _run_kernels(impl, q.device, q, k, v)
    out, lse = ops.prefill(qk, kk, vk, None, None, 0, 0, causal, scale, impl)
    return _finish(out, lse, q.dtype, return_lse)


def _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 sm_scale, impl, validate):
    _check_impl(impl)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _tensor(n, t, 3, "3-D [total_tokens, heads, head_dim]")
        _check_float(n, t)
        _last_dim_contiguous(n, t)
    _index_tensor("cu_seqlens_q", cu_seqlens_q, 1, "a 1-D int32 tensor [batch + 1]")
    _index_tensor("cu_seqlens_k", cu_seqlens_k, 1, "a 1-D int32 tensor [batch + 1]")
    _flag("causal", causal)
    _validate_flag(validate)
    _max_seqlen("max_seqlen_q", max_seqlen_q)
    _max_seqlen("max_seqlen_k", max_seqlen_k)
    _same(("q", "k", "v"), (q, k, v), "dtype")
    _same(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
          (q, k, v, cu_seqlens_q, cu_seqlens_k), "device")
    Tq, Hq, D = q.shape
    _check_head_dim(D)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"k must be [Tk, Hkv, D={D}] to match q, got {tuple(k.shape)}")
    _check_heads(Hq, k.shape[1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold at least 2 offsets (batch + 1), got {cu.numel()}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if _values_checked(validate, cu_seqlens_q, cu_seqlens_k):
        cq = _cu_values("cu_seqlens_q", cu_seqlens_q, Tq)
        ck = _cu_values("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        lq = [b - a for a, b in zip(cq, cq[1:])]
        lk = [b - a for a, b in zip(ck, ck[1:])]
        if causal:
            bad = [i for i, (a, b) in enumerate(zip(lq, lk)) if a > b]
            if bad:
                raise ValueError(f"causal attention needs q_len <= kv_len per sequence; sequence "
                                 f"{bad[0]} has q_len {lq[bad[0]]} > kv_len {lk[bad[0]]}")
        for name, given, lens in (("max_seqlen_q", max_seqlen_q, lq),
                                  ("max_seqlen_k", max_seqlen_k, lk)):
            if given is not None and given < max(lens):
                raise ValueError(f"{name}={given} is shorter than the longest sequence "
                                 f"({max(lens)})")
    scale = _scale(sm_scale, D)
    call = Call("prefill_varlen", q.device, q.dtype, D, causal,
                Tq if max_seqlen_q is None else min(int(max_seqlen_q), Tq),
                k.shape[0] if max_seqlen_k is None else min(int(max_seqlen_k), k.shape[0]))
    return scale, _check_grid(_resolve(impl, call), cu_seqlens_q.numel() - 1, Hq)


def check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, sm_scale=None, *, impl="auto",
                           validate=None) -> None:
    """Every check :func:`attention_varlen` runs, and nothing else (ValueError / TypeError)."""
    _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 sm_scale, impl, validate)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, causal: bool = False,
                     sm_scale: float | None = None, *, return_lse: bool = False,
                     impl: str = "auto", validate: bool | None = None):
    """Prefill attention over variable-length sequences packed along the token axis.

    Args:
        q: [Tq, Hq, D] packed queries; k, v: [Tk, Hkv, D] packed keys and values.
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] tensors on q's device (views with
            any stride are fine), starting at 0, non-decreasing, ending at Tq / Tk;
            sequence i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
        max_seqlen_q, max_seqlen_k: the longest sequence, or an upper bound. Omitted, the
            kernel's grid covers Tq rows per sequence (no host read; surplus programs
            exit at once); given, it must not be shorter than the longest sequence
            (checked when values are checked). The bounds (Tq / Tk where omitted) also
            pick the Gluon build: packs whose bounds both fall within
            ``prefill_gluon.VARLEN_ONE_CONSUMER_UP_TO``, and packs whose query bound is
            at most ``prefill_gluon.ONE_CONSUMER_CHUNK_UP_TO``, run its one-consumer
            build (64-row tiles, several CTAs an SM), so one pack given other bounds may
            differ in the last bits (each within the kernel's tolerance of float64).
        causal: bool; bottom-right aligned per sequence (each q_len <= its kv_len).
        validate: read cu_seqlens on the host and check them: True, False, or None (the
            default: where free, i.e. CPU tensors, or with WSATTN_VALIDATE=1; see the
            module docstring). A default call on CUDA tensors never synchronises.

    Non-finite inputs: a NaN or Inf in one sequence's k or v does not reach another
    sequence's output. The Gluon kernel (sm_90) reads each key tile whole by TMA, so a
    sequence's last key tile also spans rows of the sequence packed after it; their scores
    are masked, and that tile's V is loaded through a descriptor bounded at the sequence's
    own rows (zeros past it; the one-consumer build zeroes those rows in shared memory
    instead), since 0 * v would be NaN for a non-finite v. The Gluon
    setting ``varlen_bounded_v=False`` drops that bound (no measurable speed difference on
    the H200) for packs whose values are known finite; the Triton kernel bounds every load.

    Returns:
        out [Tq, Hq, D], or (out, lse) with lse float32 [Hq, Tq].
    """
    _flag("return_lse", return_lse)
    scale, impl = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, sm_scale, impl, validate)
    # the kernels read offsets with unit stride: a strided view becomes one small copy
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if q.numel() == 0:
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    if impl == "reference":
        out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    max_q = q.shape[0] if max_seqlen_q is None else min(int(max_seqlen_q), q.shape[0])
    max_k = k.shape[0] if max_seqlen_k is None else min(int(max_seqlen_k), k.shape[0])
    qk, kk, vk = _run_kernels(impl, q.device, q, k, v)
    out, lse = ops.prefill(qk, kk, vk, cu_q, cu_k, max_q, max_k, causal, scale, impl)
    return _finish(out, lse, q.dtype, return_lse)


# --------------------------------------------------------------------------- decode

def check_decode_values(seqlens, block_table, num_pages, page, T, capacity):
    """Value checks of seqlens (in [T, capacity]) and of the block-table pages a sequence
    uses (in [0, num_pages)), computed where the tensors live with one host read; the
    first offending entry is looked up only when there is one. Also used by
    wsattn.sp.decode (T = 0)."""
    lens_bad = (seqlens < T) | (seqlens > capacity)
    if block_table is not None:
        pages_bad = _pages_bad(block_table, seqlens, page, num_pages)
        flags = torch.stack([lens_bad.any(), pages_bad.any()]).tolist()
    else:
        flags = [bool(lens_bad.any()), False]
    if flags[0]:
        b = int(lens_bad.nonzero()[0, 0])
        raise ValueError(f"seqlens[{b}]={int(seqlens[b])} must lie in [{T}, {capacity}] (at "
                         f"least the {T} new token(s), at most the cache's "
                         f"{'block table' if block_table is not None else 'L_max'} capacity)")
    if flags[1]:
        _raise_bad_page(block_table, pages_bad, num_pages)


def _pages_bad(block_table, seqlens, page, num_pages):
    """[B, max_pages] bool: block-table entries a sequence of seqlens keys uses (its first
    ceil(seqlens / page) pages) that lie outside [0, num_pages)."""
    used = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
            < (seqlens[:, None] + page - 1) // page)
    return used & ((block_table < 0) | (block_table >= num_pages))


def _raise_bad_page(block_table, pages_bad, num_pages):
    b, j = (int(x) for x in pages_bad.nonzero()[0])
    raise ValueError(f"block_table[{b}] holds page {int(block_table[b, j])}, outside "
                     f"[0, {num_pages}) (num_pages of k_cache)")


def _decode_call(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits, impl,
                 validate):
    _check_impl(impl)
    _tensor("q", q, (3, 4), "[B, Hq, D] or [B, T, Hq, D]")
    _tensor("k_cache", k_cache, 4,
            "4-D ([B, L_max, Hkv, D] or paged [num_pages, page_size, Hkv, D])")
    _tensor("v_cache", v_cache, 4,
            "4-D ([B, L_max, Hkv, D] or paged [num_pages, page_size, Hkv, D])")
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(n, t)
        _last_dim_contiguous(n, t)
    _index_tensor("seqlens", seqlens, 1, "a 1-D int32 tensor [B]")
    if block_table is not None:
        _index_tensor("block_table", block_table, 2, "a 2-D int32 tensor [B, max_pages]")
    _validate_flag(validate)
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"num_splits must be an int in [1, {MAX_NUM_SPLITS}] or None, got "
                        f"{type(num_splits).__name__} {num_splits!r}")
    if num_splits is not None and not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}] or None (auto), got "
                         f"{num_splits}")
    _same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), "dtype")
    names, tens = ["q", "k_cache", "v_cache", "seqlens"], [q, k_cache, v_cache, seqlens]
    if block_table is not None:
        names.append("block_table")
        tens.append(block_table)
    _same(tuple(names), tuple(tens), "device")
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, T, Hq, D = q4.shape
    _check_head_dim(D)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache head dim must be D={D} to match q, got {tuple(k_cache.shape)}")
    _check_heads(Hq, k_cache.shape[2], "q", "k_cache")
    if seqlens.shape[0] != B:
        raise ValueError(f"seqlens must be [B={B}], got {tuple(seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"a contiguous k_cache must be [B={B}, L_max, Hkv, D], got "
                             f"{tuple(k_cache.shape)} (pass block_table for a paged cache)")
        capacity = k_cache.shape[1]
    else:
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must be [B={B}, max_pages], got "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[1] == 0:
            raise ValueError("a paged k_cache must have page_size >= 1, got shape "
                             f"{tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[1]
    if _values_checked(validate, seqlens, block_table):
        check_decode_values(seqlens, block_table, k_cache.shape[0], k_cache.shape[1], T,
                            capacity)
    scale = _scale(sm_scale, D)
    call = Call("decode", q.device, q.dtype, D, True)
    return scale, _resolve(impl, call)


def check_decode(q, k_cache, v_cache, seqlens, block_table=None, sm_scale=None, *,
                 num_splits=None, impl="auto", validate=None) -> None:
    """Every check :func:`decode` runs, and nothing else (ValueError / TypeError)."""
    _decode_call(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits, impl,
                 validate)


def decode(q, k_cache, v_cache, seqlens, block_table=None, sm_scale: float | None = None, *,
           num_splits: int | None = None, return_lse: bool = False, impl: str = "auto",
           validate: bool | None = None):
    """Decode attention: a few new query tokens per sequence against a KV cache.

    Args:
        q: [B, Hq, D] (one new token) or [B, T, Hq, D] (T tokens, e.g. speculative
           decoding; token t sees keys j <= seqlens[b] - T + t).
        k_cache, v_cache: contiguous [B, L_max, Hkv, D], or paged
           [num_pages, page_size, Hkv, D] when block_table is given.
        seqlens: int32 [B], keys per sequence including the T new ones (T <= seqlens[b]).
        block_table: int32 [B, max_pages], page indices of each sequence (paged cache).
           Index tensors may be views with any strides (one small copy makes them dense).
        num_splits: split-KV count per sequence in [1, 128] (default: chosen from B, the
           cache capacity and the SM count so that B=1 with a long context fills the GPU);
           splits past the keys a sequence has are empty and cost little.
        validate: read seqlens and block_table on the host and check their values: True,
           False, or None (the default: where free, i.e. CPU tensors, or with
           WSATTN_VALIDATE=1). A default call on CUDA tensors never synchronises, so it
           can be captured in a CUDA graph.

    Returns:
        out shaped like q, or (out, lse) with lse float32 [B, Hq] or [B, T, Hq].
    """
    _flag("return_lse", return_lse)
    scale, impl = _decode_call(q, k_cache, v_cache, seqlens, block_table, sm_scale, num_splits,
                               impl, validate)
    seqlens = seqlens.contiguous()
    block_table = None if block_table is None else block_table.contiguous()
    if q.numel() == 0:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    if impl == "reference":
        out, lse = reference.decode(q, k_cache, v_cache, seqlens, block_table, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    q4, kc, vc = _run_kernels(impl, q.device, q4, k_cache, v_cache)
    out, lse = ops.decode(q4, kc, vc, seqlens, block_table, scale, num_splits or 0)
    if q.dim() == 3:
        out, lse = out[:, 0], lse[:, 0]
    return _finish(out, lse, q.dtype, return_lse)


# --------------------------------------------------------------------------- paged prefill

def check_attention_paged_values(cu_seqlens_q, seqlens_k, block_table, num_pages, page, total_q,
                                 causal, max_seqlen_q=None, appending=False):
    """Value checks of :func:`attention_paged`'s index tensors, with two host reads
    (cu_seqlens_q, then one stacked set of flags): cu_seqlens_q well formed, each
    seqlens_k[b] within the block table's capacity (and >= the chunk's length when
    causal or when the call appends the chunk), the pages a sequence uses in
    [0, num_pages), max_seqlen_q not short."""
    cq = _cu_values("cu_seqlens_q", cu_seqlens_q, total_q)
    lq = [b - a for a, b in zip(cq, cq[1:])]
    if max_seqlen_q is not None and lq and max_seqlen_q < max(lq):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is shorter than the longest query "
                         f"sequence ({max(lq)})")
    if not lq:
        return
    capacity = block_table.shape[1] * page
    lens_bad = (seqlens_k < 0) | (seqlens_k > capacity)
    lq_t = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(seqlens_k.device)
    short = (seqlens_k < lq_t) & (causal or appending)
    pages_bad = _pages_bad(block_table, seqlens_k, page, num_pages)
    shared = _appended_rows_shared(block_table, seqlens_k, lq_t, page) if appending else \
        torch.zeros((), dtype=torch.bool, device=seqlens_k.device)
    flags = torch.stack([lens_bad.any(), short.any(), pages_bad.any(), shared]).tolist()
    if flags[0]:
        b = int(lens_bad.nonzero()[0, 0])
        raise ValueError(f"seqlens_k[{b}]={int(seqlens_k[b])} must lie in [0, {capacity}] (the "
                         f"block table's capacity: block_table.shape[1]={block_table.shape[1]} "
                         f"pages of page_size={page})")
    if flags[1]:
        b = int(short.nonzero()[0, 0])
        why = ("k_new / v_new append the chunk at positions seqlens_k[b] - q_len .. "
               "seqlens_k[b] - 1" if appending else
               "causal attention needs them (the chunk's own keys are in the cache)")
        raise ValueError(f"seqlens_k[b] must be >= the chunk's query length: {why}; sequence "
                         f"{b} has seqlens_k {int(seqlens_k[b])} < q_len {lq[b]}")
    if flags[2]:
        _raise_bad_page(block_table, pages_bad, num_pages)
    if flags[3]:
        raise ValueError("k_new / v_new: two sequences' appended rows land on the same cache "
                         "row (block_table maps their new positions to one page slot); one "
                         "would overwrite the other's keys")


def _appended_rows_shared(block_table, seqlens_k, q_lens, page):
    """Whether two appended rows (sequence b's positions seqlens_k[b] - q_len[b] ..
    seqlens_k[b] - 1) map to one (page, slot) of the cache: a 0-d bool tensor, computed
    on the device (read with the other flags). Shared prefix pages that are only read are
    fine; only the rows the append writes must be distinct."""
    dev = block_table.device
    q_lens = q_lens.to(dev, torch.int64)
    ends = seqlens_k.to(dev, torch.int64)
    seq = torch.repeat_interleave(torch.arange(block_table.shape[0], device=dev), q_lens)
    if seq.numel() < 2:
        return torch.zeros((), dtype=torch.bool, device=dev)
    first = torch.cumsum(q_lens, 0) - q_lens
    pos = ends[seq] - q_lens[seq] + (torch.arange(seq.numel(), device=dev) - first[seq])
    pos = pos.clamp(0, block_table.shape[1] * page - 1)  # (out-of-range rows: lens_bad)
    pages = block_table.to(torch.int64)[seq, pos // page]
    rows = torch.sort(pages * page + pos % page).values
    return (rows[1:] == rows[:-1]).any()


def _check_new_kv(k_new, v_new, k_cache, v_cache, Tq) -> bool:
    """k_new / v_new of a paged call: both None, or both [Tq, Hkv, D] like the cache's
    rows, its dtype and device, last dim contiguous. Returns whether the call appends."""
    if k_new is None and v_new is None:
        return False
    if k_new is None or v_new is None:
        raise ValueError("k_new and v_new must be given together (the chunk's keys and "
                         "values) or not at all")
    want = (Tq, k_cache.shape[2], k_cache.shape[3])
    for n, t in (("k_new", k_new), ("v_new", v_new)):
        _tensor(n, t, 3, "3-D [total_tokens, Hkv, head_dim]")
        if tuple(t.shape) != want:
            raise ValueError(f"{n} must be [Tq={Tq}, Hkv={want[1]}, D={want[2]}] (q's rows, "
                             f"the cache's heads and head dim), got {tuple(t.shape)}")
        _last_dim_contiguous(n, t)
    _same(("k_cache", "k_new", "v_new"), (k_cache, k_new, v_new), "dtype")
    _same(("k_cache", "k_new", "v_new"), (k_cache, k_new, v_new), "device")
    from .kernels._overlap import check_caches, overlaps
    # the append writes both caches: aliased caches would take the values over the keys,
    # and k_new / v_new inside a cache would be read while being written
    check_caches(k_cache, v_cache, "k_new / v_new append to it",
                 " when k_new / v_new append to them")
    for n, t in (("k_new", k_new), ("v_new", v_new)):
        for cn, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if overlaps(t, c):
                raise ValueError(f"{n} must not overlap {cn}: the append writes the cache "
                                 "while reading it")
    return True


def _paged_call(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q,
                causal, sm_scale, impl, validate, gather=None, k_new=None, v_new=None):
    """The paged call's checks; returns (scale, impl, gather): the backend, and whether the
    keys are gathered into a packed buffer first (then impl is the varlen backend)."""
    _check_impl(impl)
    if gather is not None and not isinstance(gather, bool):
        raise TypeError(f"gather must be True, False or None, got {type(gather).__name__} "
                        f"{gather!r}")
    _tensor("q", q, 3, "3-D [total_tokens, heads, head_dim]")
    for n in ("k_cache", "v_cache"):
        _tensor(n, k_cache if n == "k_cache" else v_cache, 4,
                "4-D paged [num_pages, page_size, Hkv, D]")
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_float(n, t)
        _last_dim_contiguous(n, t)
    _index_tensor("cu_seqlens_q", cu_seqlens_q, 1, "a 1-D int32 tensor [batch + 1]")
    _index_tensor("seqlens_k", seqlens_k, 1, "a 1-D int32 tensor [batch]")
    _index_tensor("block_table", block_table, 2, "a 2-D int32 tensor [batch, max_pages]")
    _flag("causal", causal)
    _validate_flag(validate)
    _max_seqlen("max_seqlen_q", max_seqlen_q)
    _same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), "dtype")
    _same(("q", "k_cache", "v_cache", "cu_seqlens_q", "seqlens_k", "block_table"),
          (q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table), "device")
    Tq, Hq, D = q.shape
    _check_head_dim(D)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be [num_pages, page_size, Hkv, D={D}] to match q, got "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape[1] == 0:
        raise ValueError(f"k_cache must have page_size (shape[1]) >= 1, got shape "
                         f"{tuple(k_cache.shape)}")
    _check_heads(Hq, k_cache.shape[2], "q", "k_cache")
    if cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q must hold batch + 1 offsets (at least [0]), got 0")
    B = cu_seqlens_q.numel() - 1
    if seqlens_k.shape[0] != B:
        raise ValueError(f"seqlens_k must be [batch={B}] (cu_seqlens_q holds {B + 1} offsets), "
                         f"got {tuple(seqlens_k.shape)}")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must be [batch={B}, max_pages], got "
                         f"{tuple(block_table.shape)}")
    appending = _check_new_kv(k_new, v_new, k_cache, v_cache, Tq)
    if _values_checked(validate, cu_seqlens_q, seqlens_k, block_table):
        check_attention_paged_values(cu_seqlens_q, seqlens_k, block_table, k_cache.shape[0],
                                     k_cache.shape[1], Tq, causal, max_seqlen_q, appending)
    scale = _scale(sm_scale, D)
    if gather and impl == "reference":
        raise ValueError("gather=True runs the packed-varlen kernels on gathered keys; "
                         "impl='reference' runs no kernel (leave gather None or False)")
    max_q = Tq if max_seqlen_q is None else min(int(max_seqlen_q), Tq)
    page = k_cache.shape[1]
    cap = block_table.shape[1] * page
    tma_pages = False  # TMA can read the caches page by page (the Gluon in-place build)
    if q.device.type == "cuda":
        from .kernels.prefill_gluon import tma_ready
        tma_pages = tma_ready(k_cache) and tma_ready(v_cache)
    call = Call("prefill_paged", q.device, q.dtype, D, causal, seqlen_q=max_q, seqlen_k=cap,
                page_size=page, tma_pages=tma_pages)
    if impl == "reference":
        return scale, _resolve(impl, call), False
    if gather is None:
        from .kernels.paged_gather import buffer_rows
        rows = buffer_rows(B, block_table.shape[1], page)
        gather = dispatch.paged_gather(
            call, 2 * rows * k_cache.shape[2] * D * k_cache.element_size(), impl)
    if gather:  # then the varlen kernels run the call: their backend, their rule
        varlen = Call("prefill_varlen", q.device, q.dtype, D, causal, seqlen_q=max_q,
                      seqlen_k=cap)
        return scale, _check_grid(_resolve(impl, varlen), B, Hq), True
    return scale, _check_grid(_resolve(impl, call), 1, Hq), False


def check_attention_paged(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table,
                          max_seqlen_q=None, causal=False, sm_scale=None, *, impl="auto",
                          validate=None, gather=None, k_new=None, v_new=None) -> None:
    """Every check :func:`attention_paged` runs, and nothing else (ValueError / TypeError)."""
    _paged_call(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q,
                causal, sm_scale, impl, validate, gather, k_new, v_new)


def attention_paged(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table,
                    max_seqlen_q: int | None = None, causal: bool = False,
                    sm_scale: float | None = None, *, return_lse: bool = False,
                    impl: str = "auto", validate: bool | None = None,
                    gather: bool | None = None, k_new=None, v_new=None):
    """Chunked prefill: packed chunks of new queries against a paged KV cache.

    Every key of sequence b, the chunk's own included, is read at positions
    [0, seqlens_k[b]) of the cache, reached through block_table[b]: key j is row
    j % page_size of page block_table[b, j // page_size] (the layout :func:`decode`
    reads). The chunk's own K/V are either in the cache already (appended by the caller)
    or given as k_new / v_new, which the call writes there first.

    Args:
        q: [Tq, Hq, D] packed queries, float16 / bfloat16 (float32 for the interpreter
           and the reference), last dimension contiguous.
        k_cache, v_cache: paged [num_pages, page_size, Hkv, D], q's dtype and device, any
           page_size >= 1; Hq must be a multiple of Hkv (GQA).
        cu_seqlens_q: int32 [batch + 1], starting at 0, non-decreasing, ending at Tq;
           sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (0 rows: nothing
           computed for it).
        seqlens_k: int32 [batch], keys of each sequence, the chunk's own included, at most
           block_table.shape[1] * page_size.
        block_table: int32 [batch, max_pages], page indices; only the entries covering
           seqlens_k[b] keys are read. Index tensors may be views with any strides.
        max_seqlen_q: the longest chunk, or an upper bound, or None (the grid is then
           bounded by Tq and the batch size, no host read).
        causal: bool; bottom-right aligned per sequence: query i of a chunk of Lq rows
           sees keys j <= seqlens_k[b] - Lq + i (so seqlens_k[b] >= Lq is required).
        sm_scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the LSE, natural log, float32, [Hq, Tq] (as
           :func:`attention_varlen`; ``merge_states(..., lse_layout="heads_first")``).
        impl: "auto", "triton", "gluon" or "reference" (see the module docstring).
        validate: read the index tensors on the host and check their values: True,
           False, or None (the default: where free, i.e. CPU tensors, or with
           WSATTN_VALIDATE=1). A default call on CUDA tensors never synchronises, so it
           can be captured in a CUDA graph.
        gather: True copies each sequence's keys and values out of the cache into one
           packed buffer first (``kernels/paged_gather.py``: one launch, no host read)
           and runs the packed-varlen kernels on it, exactly as :func:`attention_varlen`
           on those keys (impl then names the varlen backend). The buffer holds batch x
           block_table width x page_size rows of K and of V, freed when the call returns.
           False reads the cache in place: on sm_90 the Gluon kernel's paged build (TMA
           boxes of a page; page sizes that are multiples of 8 and tile or are tiled by
           its 128-row key tile, each page's rows packed), the same bits as the Gluon
           varlen kernel on the keys gathered with the same bounds (max_seqlen_q, and the
           block table's width in keys, pick the same build: short query chunks and packs
           of short sequences its one-consumer build); else the Triton paged kernel. None (the
           default): ``dispatch.paged_gather`` decides from the device, the page size,
           max_seqlen_q and the buffer's size (in place by the Gluon kernel from 64-row
           pages, 16-row at D128, or for chunks of at most 1024 queries, else the
           gather).
        k_new, v_new: None, or the chunk's keys and values [Tq, Hkv, D] (k_cache's
           dtype and device, last dim contiguous; row cu_seqlens_q[b] + i is sequence b's
           key seqlens_k[b] - q_len_b + i, so seqlens_k[b] >= q_len_b). They are written
           into k_cache / v_cache in place before the attention reads them
           (``kernels/paged_append.py``: one launch for both, no host read; the
           reference writes them by indexing), so the cache holds them after the call.

    A query whose sequence has no key (seqlens_k[b] = 0, not causal) gets out 0 and
    LSE -inf, the empty-part convention of :func:`merge_states` and of
    :func:`attention_varlen`.

    Returns:
        out [Tq, Hq, D] in q's dtype, or (out, lse).

    Example:
        >>> q = torch.randn(5, 4, 64); kc = vc = torch.randn(3, 16, 2, 64)
        >>> cu = torch.tensor([0, 5], dtype=torch.int32)
        >>> lens = torch.tensor([40], dtype=torch.int32)
        >>> bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
        >>> out, lse = attention_paged(q, kc, vc, cu, lens, bt, causal=True, return_lse=True,
        ...                            impl="reference")
        >>> out.shape, lse.shape
        (torch.Size([5, 4, 64]), torch.Size([4, 5]))
    """
    _flag("return_lse", return_lse)
    scale, impl, gather = _paged_call(q, k_cache, v_cache, cu_seqlens_q, seqlens_k,
                                      block_table, max_seqlen_q, causal, sm_scale, impl,
                                      validate, gather, k_new, v_new)
    # the kernel reads index tensors with unit stride: strided views become small copies
    cu_q, lens_k, table = (t.contiguous() for t in (cu_seqlens_q, seqlens_k, block_table))
    if q.numel() == 0:
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    if impl == "reference":
        if k_new is not None:
            reference.append_paged_kv(k_new, v_new, k_cache, v_cache, cu_q, lens_k, table)
        out, lse = reference.attention_paged(q, k_cache, v_cache, cu_q, lens_k, table, causal,
                                             scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    from .kernels import paged_append, paged_gather, prefill_gluon, prefill_paged, prefill_triton
    from .target import target_of
    ops._interpreter_ready(q.device)  # the interpreter work-arounds, as for the other ops
    if k_new is not None:  # into the caller's cache itself, before any kernel reads it
        if q.device.type == "cuda":  # what the attention launch would refuse, refused first
            prefill_triton.tile_family(target_of(q.device), q.shape[2], "paged prefill")
        paged_append.append_kv(k_new, v_new, k_cache, v_cache, cu_q, lens_k, table)
    max_q = None if max_seqlen_q is None else min(int(max_seqlen_q), q.shape[0])
    qk, kc, vc = _run_kernels(impl, q.device, q, k_cache, v_cache)
    if gather:
        k, v, cu_k, max_k = paged_gather.gather_kv(kc, vc, lens_k, table)
        out, lse = ops.prefill(qk, k, v, cu_q, cu_k, q.shape[0] if max_q is None else max_q,
                               max_k, causal, scale, impl)
        return _finish(out, lse, q.dtype, return_lse)
    # in place: the pages read where they are, by TMA (Gluon) or by pointer (Triton)
    run = prefill_gluon.prefill_paged if impl == "gluon" else prefill_paged.prefill_paged
    out, lse = run(qk, kc, vc, cu_q, lens_k, table, max_q, causal, scale)
    return _finish(out, lse, q.dtype, return_lse)


# --------------------------------------------------------------------------- merge

def merge_states(outputs, lses, *, lse_layout: str = "outputs", impl: str = "auto"):
    """Merge P partial attention states computed over disjoint key sets.

    Args:
        outputs: [P, ..., D] tensor, or a sequence of P tensors [..., D]; each part is
            normalized by its own softmax denominator. float16/bfloat16/float32, any D.
        lses: float32, natural-log LSE of each part (or a sequence of P tensors), laid
            out as ``lse_layout`` says:
            "outputs" (default): [P, ...], shaped like outputs without D (what
                :func:`decode` returns);
            "heads_first": the layout :func:`attention` and :func:`attention_varlen`
                return: [P, B, H, S] for outputs [P, B, S, H, D], [P, H, T] for
                outputs [P, T, H, D].
        impl: "auto", "triton" or "reference".

    Rules, kept by the kernel and the reference alike:
        * a part with LSE -inf is empty and contributes nothing, whatever its output
          holds (NaN included); all parts empty gives out 0, LSE -inf;
        * NaN propagates: a NaN LSE in any part makes that row's out and LSE NaN, and a
          NaN in a non-empty part's output makes those elements NaN;
        * +inf is not a valid LSE (an infinite softmax denominator): a row holding one
          gives out and LSE NaN, never a silently dropped part.

    Returns:
        (out [..., D] in outputs' dtype, lse float32 in ``lse_layout`` without P), merged
        in the fixed order p = 0..P-1 so the result does not depend on timing.

    Example:
        >>> o = torch.randn(2, 3, 64); s = torch.tensor([[0.5, -float("inf"), 1.0], [0.1, 0.2, 0.3]])
        >>> out, lse = merge_states(o, s, impl="reference")
        >>> out.shape, lse.shape
        (torch.Size([3, 64]), torch.Size([3]))
    """
    _check_impl(impl)
    if impl == "gluon":
        raise ValueError("impl='gluon' has no merge_states kernel; use 'triton' or 'auto'")
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    for name, x in (("outputs", outputs), ("lses", lses)):
        if isinstance(x, (list, tuple)):
            if not x:
                raise ValueError(f"{name} must hold at least one part, got an empty sequence")
            for i, t in enumerate(x):
                _tensor(f"{name}[{i}]", t)
                # torch.stack would promote mixed dtypes (and fail on shapes or devices
                # without naming the part)
                for what in ("dtype", "shape", "device"):
                    if getattr(t, what) != getattr(x[0], what):
                        raise ValueError(f"{name}[{i}] must have {name}[0]'s {what} "
                                         f"({getattr(x[0], what)}), got {getattr(t, what)}")
    if isinstance(outputs, (list, tuple)):
        outputs = torch.stack(list(outputs))
    if isinstance(lses, (list, tuple)):
        lses = torch.stack(list(lses))
    _tensor("outputs", outputs, None)
    _tensor("lses", lses, None)
    if outputs.dim() < 2:
        raise ValueError(f"outputs must be [P, ..., D], got shape {tuple(outputs.shape)}")
    if outputs.shape[0] == 0:
        raise ValueError(f"outputs must hold at least one part (P >= 1), got shape "
                         f"{tuple(outputs.shape)}")
    if outputs.shape[-1] == 0:
        raise ValueError(f"outputs' head dim (last dimension) must be positive, got shape "
                         f"{tuple(outputs.shape)}")
    if lse_layout == "heads_first":
        if outputs.dim() not in (4, 5):
            raise ValueError("lse_layout='heads_first' takes outputs [P, B, S, H, D] or "
                             f"[P, T, H, D], got shape {tuple(outputs.shape)}")
        want = tuple(outputs.shape[:-3]) + (outputs.shape[-2], outputs.shape[-3])
        if tuple(lses.shape) != want:
            raise ValueError(f"lses must be {want} ([P, ..., H, S], the layout attention "
                             f"returns) to match outputs {tuple(outputs.shape)}, got "
                             f"{tuple(lses.shape)}")
        lses = lses.transpose(-1, -2)
    if tuple(lses.shape) != tuple(outputs.shape[:-1]):
        raise ValueError(f"lses must be [P, ...] = {tuple(outputs.shape[:-1])} to match outputs "
                         f"{tuple(outputs.shape)}, got {tuple(lses.shape)}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32 (LSE is kept in fp32), got {lses.dtype}")
    if outputs.dtype not in KERNEL_DTYPES:
        raise TypeError(f"outputs dtype must be float16, bfloat16 or float32, got {outputs.dtype}")
    _same(("outputs", "lses"), (outputs, lses), "device")
    call = Call("merge", outputs.device, outputs.dtype, outputs.shape[-1])
    impl = dispatch.resolve(impl, call)
    lead = outputs.shape[1:-1]
    if impl == "reference":
        out, lse = reference.merge_states(outputs, lses)
        out, lse = out.to(outputs.dtype), lse.to(torch.float32)
    else:
        from . import ops
        P, D = outputs.shape[0], outputs.shape[-1]
        (o,) = _run_kernels(impl, outputs.device, outputs)
        out, lse = ops.merge_states(o.reshape(P, -1, D).contiguous(),
                                    lses.reshape(P, -1).contiguous())
        out, lse = out.reshape(*lead, D).to(outputs.dtype), lse.reshape(lead)
    if lse_layout == "heads_first":
        lse = lse.transpose(-1, -2)
    return out, lse
