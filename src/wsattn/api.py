"""Public API: validate every input, then dispatch to a kernel or the reference.

Everything a caller can get wrong is checked here, before any kernel runs, with an
error that names the argument and what was expected. Kernels may assume valid input.

impl:
  "auto"      - the fastest qualified kernel for the device: Gluon on sm_90 where it
                qualifies, Triton elsewhere on CUDA; the Triton kernels on CPU tensors
                when TRITON_INTERPRET=1; the reference on CPU otherwise.
  "triton"    - the Triton (``tl``) kernels.
  "gluon"     - the warp-specialized Gluon kernel (sm_90 only, prefill only).
  "reference" - the PyTorch reference (float64 inside, returns q's dtype).
"""

from __future__ import annotations

import math
import torch

from . import reference
from .target import interpreting

IMPLS = ("auto", "triton", "gluon", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_HEAD_DIMS = (64, 128, 256)


# --------------------------------------------------------------------------- checks

def _tensor(name, t, ndim=None, what=""):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {what or f'{ndim}-D'}, got shape {tuple(t.shape)}")
    return t


def _last_dim_contiguous(name, t):
    if t.dim() and t.stride(-1) != 1:
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
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _cpu_auto(impl, device):
    """impl="auto" on CPU tensors outside the interpreter means the reference."""
    if impl == "auto" and device.type != "cuda" and not interpreting():
        return "reference"
    return impl


def _check_kernel_inputs(q, impl, head_dim, op):
    """Checks that only the kernels need (the reference takes any float dtype and D)."""
    if impl == "reference":
        if not q.is_floating_point():
            raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
        return
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q dtype must be one of float16, bfloat16, float32 for impl={impl!r}, "
                        f"got {q.dtype}")
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[-1]) must be one of {KERNEL_HEAD_DIMS} for "
                         f"impl={impl!r}, got {head_dim}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"impl={impl!r} runs {op} on CUDA tensors, got tensors on {q.device}; set "
            "TRITON_INTERPRET=1 to run the Triton kernels on the CPU, or use impl='reference'")


def _check_heads(hq, hkv, q_name="q", k_name="k"):
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the number of query heads ({q_name}: {hq}) must be a positive "
                         f"multiple of the number of KV heads ({k_name}: {hkv})")


def _check_cu_seqlens(name, cu, total, validate):
    _tensor(name, cu, 1, "a 1-D int32 tensor [batch + 1]")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold at least 2 offsets (batch + 1), got {cu.numel()}")
    if validate:
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
        if any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {vals}")
        if vals[-1] != total:
            raise ValueError(f"{name}[-1] must equal the number of packed tokens ({total}), "
                             f"got {vals[-1]}")
        return vals
    return None


def _resolve_impl(impl, device, op, gluon_reason=None, gluon_faster=True):
    """Turn "auto" into a concrete impl and refuse "gluon" where it cannot run.
    gluon_faster: False where the Triton kernel measured faster for this call's shape."""
    if impl == "gluon":
        if op != "prefill":
            raise ValueError(f"impl='gluon' has no {op} kernel; use impl='triton' or 'auto'")
        from .kernels import prefill_gluon
        prefill_gluon.check_device(device)
        if gluon_reason is not None:
            raise ValueError(f"impl='gluon' cannot run this call: {gluon_reason}")
        return "gluon"
    if impl != "auto":
        return impl
    if device.type == "cuda":
        if op == "prefill" and gluon_reason is None and gluon_faster:
            from .kernels import prefill_gluon
            if prefill_gluon.device_supported(device):
                return "gluon"
        return "triton"
    return "triton" if interpreting() else "reference"


def _scale(sm_scale, d):
    if sm_scale is None:
        return 1.0 / math.sqrt(d)
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    return float(sm_scale)


def _finish(out, lse, dtype, return_lse):
    out = out.to(dtype)
    lse = lse.to(torch.float32)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- prefill

def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, *,
              return_lse: bool = False, impl: str = "auto"):
    """Prefill attention forward over fixed-length batches.

    Args:
        q: [B, Sq, Hq, D], float16 / bfloat16 (float32 for the interpreter and the
           reference), last dimension contiguous.
        k, v: [B, Sk, Hkv, D], same dtype and device; Hq must be a multiple of Hkv (GQA).
        causal: mask keys after each query, aligned bottom-right: query i sees keys
           j <= i + Sk - Sq (so Sq <= Sk is required), as in chunked prefill.
        sm_scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the log-sum-exp, natural log, float32, [B, Hq, Sq].
        impl: "auto", "triton", "gluon" or "reference" (see module docstring).

    Returns:
        out [B, Sq, Hq, D] in q's dtype, or (out, lse).

    Example:
        >>> q = torch.randn(1, 17, 4, 64); k = v = torch.randn(1, 17, 2, 64)
        >>> out, lse = attention(q, k, v, causal=True, return_lse=True, impl="reference")
        >>> out.shape, lse.shape
        (torch.Size([1, 17, 4, 64]), torch.Size([1, 4, 17]))
    """
    _check_impl(impl)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _tensor(n, t, 4, "4-D [batch, seqlen, heads, head_dim]")
        _last_dim_contiguous(n, t)
    _same(("q", "k", "v"), (q, k, v), "dtype")
    _same(("q", "k", "v"), (q, k, v), "device")
    B, Sq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, Sk, Hkv, D={D}] to match q, got {tuple(k.shape)}")
    _check_heads(Hq, k.shape[2])
    if causal and Sq > k.shape[1]:
        raise ValueError(f"causal attention needs q_len <= kv_len (bottom-right aligned), "
                         f"got q seqlen {Sq} > k seqlen {k.shape[1]}")
    scale = _scale(sm_scale, D)
    impl = _cpu_auto(impl, q.device)
    _check_kernel_inputs(q, impl, D, "attention")
    if impl == "reference":
        out, lse = reference.attention(q, k, v, causal, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from .kernels import prefill_gluon
    impl = _resolve_impl(impl, q.device, "prefill",
                         prefill_gluon.unsupported_reason(q, k, v, causal, varlen=False),
                         prefill_gluon.auto_prefers(q, causal))
    if impl == "reference":
        out, lse = reference.attention(q, k, v, causal, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    out, lse = ops.prefill(q, k, v, None, None, 0, 0, causal, scale, impl)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, causal: bool = False,
                     sm_scale: float | None = None, *, return_lse: bool = False,
                     impl: str = "auto", validate: bool = True):
    """Prefill attention over variable-length sequences packed along the token axis.

    Args:
        q: [Tq, Hq, D] packed queries; k, v: [Tk, Hkv, D] packed keys and values.
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1], starting at 0, non-decreasing,
            ending at Tq / Tk; sequence i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
        max_seqlen_q, max_seqlen_k: the longest sequence (computed from cu_seqlens
            when omitted, which reads them on the host).
        causal: bottom-right aligned per sequence (each q_len <= its kv_len).
        validate: read cu_seqlens on the host to check them (turn off, with the max
            lengths given, for CUDA-graph capture).

    Returns:
        out [Tq, Hq, D], or (out, lse) with lse float32 [Hq, Tq].
    """
    _check_impl(impl)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _tensor(n, t, 3, "3-D [total_tokens, heads, head_dim]")
        _last_dim_contiguous(n, t)
    _same(("q", "k", "v"), (q, k, v), "dtype")
    _same(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
          (q, k, v, cu_seqlens_q, cu_seqlens_k), "device")
    Tq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"k must be [Tk, Hkv, D={D}] to match q, got {tuple(k.shape)}")
    _check_heads(Hq, k.shape[1])
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq, validate or max_seqlen_q is None)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], validate or max_seqlen_k is None)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if cq is not None and ck is not None:
        lq = [b - a for a, b in zip(cq, cq[1:])]
        lk = [b - a for a, b in zip(ck, ck[1:])]
        if causal:
            bad = [i for i, (a, b) in enumerate(zip(lq, lk)) if a > b]
            if bad:
                raise ValueError(f"causal attention needs q_len <= kv_len per sequence; sequence "
                                 f"{bad[0]} has q_len {lq[bad[0]]} > kv_len {lk[bad[0]]}")
        for name, given, lens in (("max_seqlen_q", max_seqlen_q, lq), ("max_seqlen_k", max_seqlen_k, lk)):
            if given is not None and given < max(lens):
                raise ValueError(f"{name}={given} is shorter than the longest sequence ({max(lens)})")
        max_seqlen_q = max(lq) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = max(lk) if max_seqlen_k is None else max_seqlen_k
    scale = _scale(sm_scale, D)
    impl = _cpu_auto(impl, q.device)
    _check_kernel_inputs(q, impl, D, "attention_varlen")
    if impl == "gluon":
        raise ValueError("impl='gluon' takes fixed-length batches only (wsattn.attention); "
                         "use impl='triton' or 'auto' for attention_varlen")
    if impl == "auto":
        impl = "triton" if q.device.type == "cuda" or interpreting() else "reference"
    if impl == "reference":
        out, lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    out, lse = ops.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                           int(max_seqlen_k), causal, scale, impl)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- decode

def check_decode_values(seqlens, block_table, num_pages, page, T, capacity):
    """Value checks of seqlens (in [T, capacity]) and of the block-table pages a sequence
    uses (in [0, num_pages)), computed where the tensors live with one host read (a Python
    loop over a large block table took milliseconds per call); the first offending entry
    is looked up only when there is one. Also used by wsattn.sp.decode (T = 0)."""
    lens_bad = (seqlens < T) | (seqlens > capacity)
    if block_table is not None:
        used = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                < (seqlens[:, None] + page - 1) // page)
        pages_bad = used & ((block_table < 0) | (block_table >= num_pages))
        flags = torch.stack([lens_bad.any(), pages_bad.any()]).tolist()
    else:
        flags = [bool(lens_bad.any()), False]
    if flags[0]:
        b = int(lens_bad.nonzero()[0, 0])
        raise ValueError(f"seqlens[{b}]={int(seqlens[b])} must lie in [{T}, {capacity}] (at "
                         f"least the {T} new token(s), at most the cache's "
                         f"{'block table' if block_table is not None else 'L_max'} capacity)")
    if flags[1]:
        b, j = (int(x) for x in pages_bad.nonzero()[0])
        raise ValueError(f"block_table[{b}] holds page {int(block_table[b, j])}, outside "
                         f"[0, {num_pages}) (num_pages of k_cache)")


def decode(q, k_cache, v_cache, seqlens, block_table=None, sm_scale: float | None = None, *,
           num_splits: int | None = None, return_lse: bool = False, impl: str = "auto",
           validate: bool = True):
    """Decode attention: a few new query tokens per sequence against a KV cache.

    Args:
        q: [B, Hq, D] (one new token) or [B, T, Hq, D] (T tokens, e.g. speculative
           decoding; token t sees keys j <= seqlens[b] - T + t).
        k_cache, v_cache: contiguous [B, L_max, Hkv, D], or paged
           [num_pages, page_size, Hkv, D] when block_table is given.
        seqlens: int32 [B], keys per sequence including the T new ones (T <= seqlens[b]).
        block_table: int32 [B, max_pages], page indices of each sequence (paged cache).
        num_splits: split-KV count per sequence (default: chosen from B, the length
           and the SM count so that B=1 with a long context still fills the GPU).
        validate: read seqlens and block_table on the host to check their values (turn
           off for CUDA-graph capture).

    Returns:
        out shaped like q, or (out, lse) with lse float32 [B, Hq] or [B, T, Hq].
    """
    _check_impl(impl)
    _tensor("q", q, (3, 4), "[B, Hq, D] or [B, T, Hq, D]")
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(n, t, None)
        _last_dim_contiguous(n, t)
    _tensor("k_cache", k_cache, 4, "4-D ([B, L_max, Hkv, D] or paged [num_pages, page_size, Hkv, D])")
    _tensor("seqlens", seqlens, 1, "a 1-D int32 tensor [B]")
    _same(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), "dtype")
    names, tens = ["q", "k_cache", "v_cache", "seqlens"], [q, k_cache, v_cache, seqlens]
    if block_table is not None:
        _tensor("block_table", block_table, 2, "a 2-D int32 tensor [B, max_pages]")
        names.append("block_table")
        tens.append(block_table)
    _same(tuple(names), tuple(tens), "device")
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    B, T, Hq, D = q4.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache head dim must be D={D} to match q, got {tuple(k_cache.shape)}")
    _check_heads(Hq, k_cache.shape[2], "q", "k_cache")
    if seqlens.dtype != torch.int32:
        raise TypeError(f"seqlens must be int32, got {seqlens.dtype}")
    if seqlens.shape[0] != B:
        raise ValueError(f"seqlens must be [B={B}], got {tuple(seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"a contiguous k_cache must be [B={B}, L_max, Hkv, D], got "
                             f"{tuple(k_cache.shape)} (pass block_table for a paged cache)")
        capacity = k_cache.shape[1]
    else:
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must be [B={B}, max_pages], got {tuple(block_table.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[1]
    if validate:
        check_decode_values(seqlens, block_table, k_cache.shape[0], k_cache.shape[1], T,
                             capacity)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    scale = _scale(sm_scale, D)
    impl = _cpu_auto(impl, q.device)
    _check_kernel_inputs(q, impl, D, "decode")
    impl = "reference" if impl == "reference" else _resolve_impl(impl, q.device, "decode")
    if impl == "reference":
        out, lse = reference.decode(q, k_cache, v_cache, seqlens, block_table, scale)
        return _finish(out, lse, q.dtype, return_lse)
    from . import ops
    out, lse = ops.decode(q4, k_cache, v_cache, seqlens, block_table, scale, num_splits or 0)
    if q.dim() == 3:
        out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- merge

def merge_states(outputs, lses, *, impl: str = "auto"):
    """Merge P partial attention states computed over disjoint key sets.

    Args:
        outputs: [P, ..., D] tensor, or a sequence of P tensors [..., D]; each part is
            normalized by its own softmax denominator. float16/bfloat16/float32.
        lses: [P, ...] float32 (or a sequence of P tensors [...]): natural-log LSE of each
            part; -inf marks an empty part, which contributes nothing.
        impl: "auto", "triton" or "reference".

    Returns:
        (out [..., D] in outputs' dtype, lse [...] float32), merged in the fixed order
        p = 0..P-1 so the result does not depend on timing. All parts empty gives
        (0, -inf), never NaN.

    Example:
        >>> o = torch.randn(2, 3, 64); s = torch.tensor([[0.5, -float("inf"), 1.0], [0.1, 0.2, 0.3]])
        >>> out, lse = merge_states(o, s, impl="reference")
        >>> out.shape, lse.shape
        (torch.Size([3, 64]), torch.Size([3]))
    """
    _check_impl(impl)
    if impl == "gluon":
        raise ValueError("impl='gluon' has no merge_states kernel; use 'triton' or 'auto'")
    if isinstance(outputs, (list, tuple)):
        if not outputs:
            raise ValueError("outputs must hold at least one part")
        outputs = torch.stack(list(outputs))
    if isinstance(lses, (list, tuple)):
        if not lses:
            raise ValueError("lses must hold at least one part")
        lses = torch.stack(list(lses))
    _tensor("outputs", outputs, None)
    _tensor("lses", lses, None)
    if outputs.dim() < 2:
        raise ValueError(f"outputs must be [P, ..., D], got shape {tuple(outputs.shape)}")
    if tuple(lses.shape) != tuple(outputs.shape[:-1]):
        raise ValueError(f"lses must be [P, ...] = {tuple(outputs.shape[:-1])} to match outputs "
                         f"{tuple(outputs.shape)}, got {tuple(lses.shape)}")
    if lses.dtype != torch.float32:
        raise TypeError(f"lses must be float32 (LSE is kept in fp32), got {lses.dtype}")
    if outputs.dtype not in KERNEL_DTYPES:
        raise TypeError(f"outputs dtype must be float16, bfloat16 or float32, got {outputs.dtype}")
    _same(("outputs", "lses"), (outputs, lses), "device")
    dev = outputs.device
    if impl == "auto":
        impl = "triton" if dev.type == "cuda" or interpreting() else "reference"
    if impl == "triton" and dev.type != "cuda" and not interpreting():
        raise ValueError(f"impl='triton' needs CUDA tensors, got {dev}; set TRITON_INTERPRET=1 "
                         "or use impl='reference'")
    lead = outputs.shape[1:-1]
    if impl == "reference":
        out, lse = reference.merge_states(outputs, lses)
        return out.to(outputs.dtype), lse.to(torch.float32)
    from . import ops
    P, D = outputs.shape[0], outputs.shape[-1]
    out, lse = ops.merge_states(outputs.reshape(P, -1, D).contiguous(),
                                lses.reshape(P, -1).contiguous())
    return out.reshape(*lead, D), lse.reshape(lead)
