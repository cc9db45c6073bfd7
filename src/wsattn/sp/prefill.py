"""Sequence-parallel prefill by all-gather: gather K/V, then attend.

Each rank holds a shard of Q, K and V (zig-zag or contiguous, see sharding.py). The
K/V shards (only the KV heads, so GQA moves Hkv/Hq of what Q would) are all-gathered
in one collective, put back in global order with views and one copy, and each local
Q chunk attends to the prefix of the global K/V it can see:

    local Q chunk with global index c (of n equal chunks of Sq) sits at key positions
    [P + c*Cq, P + (c+1)*Cq), P = Sk - Sq the cached prefix; under the causal mask it
    sees keys [0, P + (c+1)*Cq): earlier chunks in full, its own diagonally, later none.

One attention call over K[:, :P + (c+1)*Cq] gives exactly that, because the kernel's
causal mask is bottom-right aligned. So no keys of future chunks are read, the
diagonal costs what it costs in a single-GPU kernel, and the LSE comes back for free.
This path is the reference and the fallback of the overlapped one (overlap.py).

No host synchronisation with check=False (all shapes and offsets are static or device
values), so the forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import numbers
import zlib

import torch

import wsattn

from .. import api
from . import checks
from .comm import all_gather_flat, rank_and_size, resolve_group
from .sharding import local_chunks, reorder_gathered, varlen_global_index

__all__ = ["prefill", "prefill_varlen"]


def validate_fixed(op, q, k, v, causal, zigzag, group, rank, W, check, timeout_s,
                   global_seqlen=None, sm_scale=None, impl="auto", extra=None, more=None):
    """Local checks, then (check=True) the cross-rank agreement; same error on every rank.

    With check=True the local checks include everything :func:`wsattn.attention` would
    refuse for this rank's shard (``api.check_attention``), so an error on one rank is
    agreed on instead of leaving the peers blocked in the K/V exchange. ``more`` (a
    callable) adds the caller's own checks at the end, ``extra`` its agreed fields."""
    def local():
        for n, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{n} must be a 4-D tensor [B, S_local, heads, D], got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            checks.check_device(n, t, group)
        checks.flag("causal", causal)
        checks.flag("zigzag", zigzag)
        checks.flag("check", check)
        if global_seqlen is not None and (isinstance(global_seqlen, bool) or not isinstance(
                global_seqlen, int) or global_seqlen < 1):
            raise ValueError(f"global_seqlen must be None or a positive int, got "
                             f"{global_seqlen!r}")
        if k.shape != v.shape:
            raise ValueError(f"k and v shards must have the same shape, got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        if q.dtype != k.dtype or k.dtype != v.dtype:
            raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
            raise ValueError(f"k must be [B={q.shape[0]}, S_local, Hkv, D={q.shape[3]}], got "
                             f"{tuple(k.shape)}")
        if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
            raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
        n_loc = 2 if zigzag else 1
        for n, s in (("q", q.shape[1]), ("k", k.shape[1])):
            if s == 0 or s % n_loc:
                raise ValueError(f"the {n} shard holds {s} tokens; zig-zag needs an even, nonzero "
                                 f"count (two equal chunks per rank): pad the global sequence to a "
                                 f"multiple of 2 * world_size = {2 * W} or pass zigzag=False"
                                 if zigzag else f"the {n} shard must hold at least one token")
        if causal and q.shape[1] > k.shape[1]:
            raise ValueError(f"causal attention needs q_len <= kv_len, got q shard {q.shape[1]} "
                             f"> k shard {k.shape[1]} tokens")
        if global_seqlen is not None and q.shape[1] * W != global_seqlen:
            raise ValueError(f"the process group has {W} ranks, but a q shard of {q.shape[1]} "
                             f"tokens is 1/{global_seqlen / q.shape[1]:g} of the global "
                             f"{global_seqlen}: the shards were cut for another group size")
        if check:
            # Everything wsattn.attention would refuse for this shard (dtype, head dim,
            # strides, sm_scale, impl): the calls below take its chunks and the gathered
            # (contiguous) K/V, which pass exactly when the shard does.
            api.check_attention(q, k, v, causal, sm_scale, impl=impl)
            if more is not None:
                more()

    err = checks.local_error(local)
    if not check:
        if err:
            raise ValueError(f"wsattn.sp.{op}: {err}")
        return
    shape = lambda t, i: t.shape[i] if err is None else -1  # noqa: E731 (shapes may be invalid)
    fields = {"batch": shape(q, 0), "q shard length": shape(q, 1), "k shard length": shape(k, 1),
              "query heads": shape(q, 2), "kv heads": shape(k, 2), "head dim": shape(q, 3),
              "dtype": checks.DTYPE_CODE.get(q.dtype, 0) if err is None else -1,
              "causal": int(causal) if err is None else -1,
              "zigzag": int(zigzag) if err is None else -1, "world size": W,
              "sm_scale": checks.scale_field(sm_scale)}
    fields.update(extra or {})
    checks.agree(op, group, rank, W, fields, err, same=tuple(fields), timeout_s=timeout_s)


def _kernel_impl(impl):
    """The merge's impl for an attention impl: merges have no Gluon kernel, so "gluon"
    (which names the attention calls' kernel, passed to them unchanged) merges on "auto"."""
    return impl if impl in ("triton", "reference") else "auto"


def prefill(q, k, v, causal: bool = True, sm_scale: float | None = None, *, group=None,
            zigzag: bool = True, impl: str = "auto", check: bool = True,
            timeout_s: float | None = None, global_seqlen: int | None = None):
    """Attention of the local Q shard over the K/V of the whole sequence, gathered.

    Args:
        q: [B, Sq/W, Hq, D] this rank's query shard (zig-zag: chunks r and 2W-1-r of
           Sq/(2W) tokens each, concatenated; contiguous: tokens [r*Sq/W, (r+1)*Sq/W)).
        k, v: [B, Sk/W, Hkv, D] this rank's K/V shard in the same layout (Sk >= Sq when
           causal: the first Sk - Sq keys are a cached prefix).
        causal: bottom-right aligned causal mask over the global sequence.
        group: the process group (default: the world); its ranks hold the shards in
           rank order.
        zigzag: the shards are zig-zag (head-tail); False for contiguous.
        impl: the kernel, as for :func:`wsattn.attention`.
        check: exchange shard metadata first so that bad input raises the same error on
           every rank (reads a tensor on the host: turn off for CUDA-graph capture).
        timeout_s: how long the metadata exchange waits for peers before raising.
        global_seqlen: the global query length, if known: then a group whose size does
           not match the shards (cut for another rank count) is an error.

    Returns:
        (out [B, Sq/W, Hq, D] in q's dtype, lse fp32 [B, Hq, Sq/W], natural log), both in
        the local shard's token order.

    Example (under torchrun, one shard per rank):
        >>> out, lse = wsattn.sp.prefill(q_shard, k_shard, v_shard, causal=True)
    """
    group = resolve_group(group)
    rank, W = rank_and_size(group)
    validate_fixed("prefill", q, k, v, causal, zigzag, group, rank, W, check, timeout_s,
                   global_seqlen, sm_scale, impl)
    B, Sq_loc, Hq, D = q.shape
    Sk_loc = k.shape[1]
    kv = all_gather_flat(torch.stack([k, v]), W, group)  # [W, 2, B, Sk/W, Hkv, D]
    kv = reorder_gathered(kv, 2, zigzag)  # [2, B, Sk, Hkv, D] in global order
    k_all, v_all = kv[0], kv[1]
    if not causal:
        return wsattn.attention(q, k_all, v_all, False, sm_scale, return_lse=True, impl=impl)
    prefix = W * (Sk_loc - Sq_loc)
    chunks = local_chunks(W, rank, zigzag)
    cq = Sq_loc // len(chunks)
    outs, lses = [], []
    for h, c in enumerate(chunks):
        end = prefix + (c + 1) * cq  # keys this chunk can see, all of them before `end`
        o, l = wsattn.attention(q[:, h * cq:(h + 1) * cq], k_all[:, :end], v_all[:, :end], True,
                                sm_scale, return_lse=True, impl=impl)
        outs.append(o)
        lses.append(l)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


# --------------------------------------------------------------------------- varlen

def _validate_varlen(q, k, v, cu_q, cu_k, causal, zigzag, group, rank, W, check, timeout_s,
                     max_q=None, max_k=None, sm_scale=None, impl="auto"):
    """Local checks, then (check=True) the cross-rank agreement. With check=True the local
    checks include everything :func:`wsattn.attention_varlen` would refuse for this
    rank's packed shard (``api.check_attention_varlen``, offsets read on the host).
    Returns the local sequence lengths (lq, lk) when they were read."""
    n_loc = 2 if zigzag else 1
    lq = lk = None

    def local():
        nonlocal lq, lk
        for n, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{n} must be a 3-D tensor [T_local, heads, D], got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            checks.check_device(n, t, group)
        for n, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
                got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"{n} must be a 1-D int32 tensor [B + 1] of local offsets, "
                                 f"got {got}")
            if t.device != q.device:
                raise ValueError(f"{n} is on {t.device}, q on {q.device}")
        checks.flag("causal", causal)
        checks.flag("zigzag", zigzag)
        for n, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if m is not None and (isinstance(m, bool) or not isinstance(m, numbers.Integral)
                                  or m < 0):
                raise TypeError(f"{n} must be a non-negative int or None (the longest GLOBAL "
                                f"sequence), got {type(m).__name__} {m!r}")
        if k.shape != v.shape:
            raise ValueError(f"k and v shards must have the same shape, got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        if q.dtype != k.dtype or k.dtype != v.dtype:
            raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if k.shape[2] != q.shape[2] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"k must be [T_local, Hkv, D={q.shape[2]}] with Hq={q.shape[1]} a "
                             f"multiple of Hkv, got {tuple(k.shape)}")
        if cu_q.numel() != cu_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (B + 1)")
        if not check:
            return
        # Everything wsattn.attention_varlen would refuse for this shard (dtype, head dim,
        # strides, offsets, sm_scale, impl). The max lengths are global (W x local), so
        # they are checked below instead.
        api.check_attention_varlen(q, k, v, cu_q, cu_k, None, None, causal, sm_scale,
                                   impl=impl, validate=True)
        a, b = cu_q.tolist(), cu_k.tolist()
        lq = [y - x for x, y in zip(a, a[1:])]
        lk = [y - x for x, y in zip(b, b[1:])]
        for i, (x, y) in enumerate(zip(lq, lk)):
            if x % n_loc or y % n_loc:
                raise ValueError(f"sequence {i}'s shard holds {x} query / {y} key tokens; zig-zag "
                                 f"needs even counts: pad each sequence to a multiple of 2 * "
                                 f"world_size = {2 * W} or pass zigzag=False")
        for n, m, lens in (("max_seqlen_q", max_q, lq), ("max_seqlen_k", max_k, lk)):
            if m is not None and m < W * max(lens, default=0):
                raise ValueError(f"{n}={m} is shorter than the longest global sequence "
                                 f"({W} x {max(lens)} local tokens)")

    err = checks.local_error(local)
    if not check:
        if err:
            raise ValueError(f"wsattn.sp.prefill_varlen: {err}")
        return
    ok = err is None
    fields = {"packed q tokens": q.shape[0] if ok else -1, "packed k tokens": k.shape[0] if ok else -1,
              "batch": cu_q.numel() - 1 if ok else -1,
              "cu_seqlens_q checksum": zlib.crc32(str(lq).encode()) if ok else -1,
              "cu_seqlens_k checksum": zlib.crc32(str(lk).encode()) if ok else -1,
              "query heads": q.shape[1] if ok else -1, "kv heads": k.shape[1] if ok else -1,
              "head dim": q.shape[2] if ok else -1,
              "dtype": checks.DTYPE_CODE.get(q.dtype, 0) if ok else -1,
              "causal": int(causal) if ok else -1, "zigzag": int(zigzag) if ok else -1,
              "sm_scale": checks.scale_field(sm_scale)}
    checks.agree("prefill_varlen", group, rank, W, fields, err, same=tuple(fields),
                 timeout_s=timeout_s)
    return lq, lk


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, causal: bool = True,
                   sm_scale: float | None = None, *, group=None, zigzag: bool = True,
                   impl: str = "auto", check: bool = True, timeout_s: float | None = None):
    """All-gather prefill over packed variable-length sequences, each sharded on its own.

    Args:
        q: [Tq/W, Hq, D] packing every sequence's local query shard (in the layout of
           :func:`wsattn.sp.sharding.shard_varlen`); k, v: [Tk/W, Hkv, D] likewise.
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1] offsets of the LOCAL shards (the same
           on every rank, since every rank holds 1/W of each sequence).
        max_seqlen_q, max_seqlen_k: the longest GLOBAL sequence (read from cu_seqlens on
           the host when omitted; give them, with check=False, for CUDA-graph capture).

    Returns:
        (out [Tq/W, Hq, D], lse fp32 [Hq, Tq/W]) in the local packed order.

    With causal=True, each (sequence, local chunk) becomes one sequence of a single
    varlen call whose keys are the prefix it can see; the gathered keys are packed per
    chunk, which costs about one extra copy of K/V (the chunks' prefixes overlap).
    """
    group = resolve_group(group)
    rank, W = rank_and_size(group)
    lens = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, zigzag, group, rank, W,
                            check, timeout_s, max_seqlen_q, max_seqlen_k, sm_scale, impl)
    if max_seqlen_q is None or max_seqlen_k is None:
        lq, lk = lens if lens else (None, None)
        if lq is None:
            a, b = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            lq = [y - x for x, y in zip(a, a[1:])]
            lk = [y - x for x, y in zip(b, b[1:])]
        max_seqlen_q = W * max(lq, default=0) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = W * max(lk, default=0) if max_seqlen_k is None else max_seqlen_k
    Tq_loc, Tk_loc = q.shape[0], k.shape[0]
    kv = all_gather_flat(torch.stack([k, v], dim=1), W, group)  # [W, Tk/W, 2, Hkv, D]
    kv = kv.flatten(0, 1)  # rows of every rank's shard, rank-major
    src = varlen_global_index(cu_seqlens_k, Tk_loc, W, zigzag)  # global packed order -> row
    cu_k_glob = cu_seqlens_k * W
    if not causal:
        kv = kv.index_select(0, src)
        return wsattn.attention_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_k_glob,
                                       max(max_seqlen_q // W, 1), max_seqlen_k, False, sm_scale,
                                       return_lse=True, impl=impl, validate=check)
    chunks = local_chunks(W, rank, zigzag)
    n = len(chunks)
    dev = q.device
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_kl = cu_seqlens_k.to(torch.int64)
    cq = (cu_q[1:] - cu_q[:-1]) // n  # [B] local chunk length of each sequence
    prefix = W * ((cu_kl[1:] - cu_kl[:-1]) - (cu_q[1:] - cu_q[:-1]))  # [B]
    # the local chunks' global indices (r, 2W-1-r) built on the device: no host copy
    c = torch.arange(n, device=dev, dtype=torch.int64) * (2 * W - 1 - 2 * rank) + rank
    # One "sequence" per (sequence, local chunk), in the order q already packs them.
    q_starts = (cu_q[:-1, None] + torch.arange(n, device=dev)[None, :] * cq[:, None]).flatten()
    cu_q_chunks = torch.cat([q_starts, cu_q[-1:]]).to(torch.int32)
    ends = (prefix[:, None] + (c[None, :] + 1) * cq[:, None]).flatten()  # keys each chunk sees
    cu_k_chunks = torch.cat([ends.new_zeros(1), torch.cumsum(ends, 0)])
    # sum of ends, from shapes alone: static, so no host read of cu_seqlens is needed.
    if zigzag:
        total = (2 * W + 1) * Tq_loc // 2 + 2 * W * (Tk_loc - Tq_loc)
    else:
        total = (rank + 1) * Tq_loc + W * (Tk_loc - Tq_loc)
    t = torch.arange(total, device=dev)
    j = torch.searchsorted(cu_k_chunks, t, right=True) - 1
    glob = cu_k_glob.to(torch.int64)[j // n] + (t - cu_k_chunks[j])
    kv = kv.index_select(0, src[glob])  # [total, 2, Hkv, D]
    return wsattn.attention_varlen(q, kv[:, 0], kv[:, 1], cu_q_chunks, cu_k_chunks.to(torch.int32),
                                   max(max_seqlen_q // (W * n), 1), max_seqlen_k, True, sm_scale,
                                   return_lse=True, impl=impl, validate=check)
