"""Plain PyTorch reference for every wsattn operation.

Runs on any device (CPU included) with no optional dependency and never imports a
kernel. Every function computes in ``compute_dtype`` (float64 by default, which is
what the tests compare against) and returns tensors of that dtype.

Conventions shared with the kernels:

* ``sm_scale`` defaults to ``1 / sqrt(D)``.
* LSE is the natural log of ``sum_j exp(sm_scale * q . k_j)`` over the keys a query
  sees, in float32 in the kernels (``compute_dtype`` here).
* Causal masking is aligned bottom-right: with ``q_len <= kv_len`` query ``i`` sits at
  key position ``i + kv_len - q_len`` and sees keys ``j <= i + kv_len - q_len``
  (chunked prefill over a cached prefix).
* A query that sees no key (an empty KV shard) has output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attention",
    "attention_varlen",
    "decode",
    "attention_paged",
    "append_paged_kv",
    "merge_states",
    "gather_paged_kv",
]


def _scale(sm_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


# Scores are formed for this many (query, key, head) triples at a time at most, so the
# reference never holds a full [Hq, Sq, Sk] matrix (17 GB in float64 at 32k tokens and
# 16 heads): queries are taken in chunks, each chunk exact on its own.
SCORE_ELEMENTS_PER_CHUNK = 1 << 25  # 256 MiB of float64


def _attend(q, k, v, sm_scale, causal, q_pos=None, kv_len=None):
    """Core of every reference: one sequence.

    q [Sq, Hq, D], k/v [Sk, Hkv, D]; q_pos [Sq] are the key positions the queries
    sit at (for the causal mask); kv_len limits the keys seen (default all).
    Returns out [Sq, Hq, D], lse [Hq, Sq].
    """
    Sq, Hq, D = q.shape
    Sk, Hkv, Dv = v.shape
    if kv_len is not None:
        k, v, Sk = k[:kv_len], v[:kv_len], kv_len
    if causal and q_pos is None:
        q_pos = torch.arange(Sq, device=q.device) + (Sk - Sq)
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=1)  # [Sk, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    chunk = max(1, SCORE_ELEMENTS_PER_CHUNK // max(1, Hq * Sk))
    outs, lses = [], []
    for i in range(0, Sq, chunk):
        qc = q[i:i + chunk]
        s = torch.einsum("qhd,khd->hqk", qc, k) * sm_scale  # [Hq, chunk, Sk]
        if causal:
            k_pos = torch.arange(Sk, device=q.device)
            s = s.masked_fill(k_pos[None, None, :] > q_pos[i:i + chunk][None, :, None],
                              float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [Hq, chunk]; -inf where a row sees nothing
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, v))  # rows with no key stay 0
        lses.append(lse)
    if not outs:  # Sq == 0
        return q.new_zeros((0, Hq, Dv)), q.new_zeros((Hq, 0))
    return torch.cat(outs), torch.cat(lses, dim=1)


def attention(q, k, v, causal=False, sm_scale=None, *, compute_dtype=torch.float64):
    """Reference prefill attention.

    q [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D] with Hq % Hkv == 0 and Sq <= Sk when
    causal (bottom-right aligned). Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq]).
    """
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = _scale(sm_scale, q.shape[-1])
    outs, lses = zip(*(_attend(q[b], k[b], v[b], scale, causal) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, sm_scale=None,
                     *, compute_dtype=torch.float64):
    """Reference variable-length prefill over packed sequences.

    q [Tq, Hq, D], k/v [Tk, Hkv, D]; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    of q and cu_seqlens_k[i]:cu_seqlens_k[i+1] of k/v. Returns (out [Tq, Hq, D],
    lse [Hq, Tq]).
    """
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = _scale(sm_scale, q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i]:
            continue
        o, l = _attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], scale, causal)
        out[cq[i]:cq[i + 1]] = o
        lse[:, cq[i]:cq[i + 1]] = l
    return out, lse


def gather_paged_kv(cache, block_table, seqlen_max):
    """Gather a paged cache [num_pages, page_size, Hkv, D] through block_table [B, P]
    into a contiguous [B, seqlen_max, Hkv, D] (rows past a sequence's length are junk
    the caller must not read)."""
    page = cache.shape[1]
    n_pages = -(-seqlen_max // page)
    pages = cache[block_table[:, :n_pages].long()]  # [B, n_pages, page, Hkv, D]
    return pages.flatten(1, 2)[:, :seqlen_max]


def decode(q, k_cache, v_cache, seqlens, block_table=None, sm_scale=None,
           *, compute_dtype=torch.float64):
    """Reference decode attention (one or a few new query tokens per sequence).

    q [B, Hq, D] (one token) or [B, T, Hq, D] (T tokens, e.g. speculative decoding);
    k_cache/v_cache contiguous [B, L_max, Hkv, D] or paged [num_pages, page_size, Hkv, D]
    with block_table [B, max_pages]; seqlens [B] counts the keys of each sequence,
    the T new tokens included, so token t sees keys j <= seqlens[b] - T + t.
    Returns (out shaped like q, lse [B, Hq] or [B, T, Hq]).
    """
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    B, T, Hq, D = q4.shape
    lens = [int(x) for x in seqlens.tolist()]
    if block_table is not None:
        k_cache = gather_paged_kv(k_cache, block_table, max(max(lens), 1))
        v_cache = gather_paged_kv(v_cache, block_table, max(max(lens), 1))
    q4, kc, vc = (t.to(compute_dtype) for t in (q4, k_cache, v_cache))
    scale = _scale(sm_scale, D)
    outs, lses = [], []
    for b in range(B):
        q_pos = torch.arange(T, device=q.device) + (lens[b] - T)
        o, l = _attend(q4[b], kc[b], vc[b], scale, True, q_pos=q_pos, kv_len=lens[b])
        outs.append(o)
        lses.append(l.transpose(0, 1))  # [T, Hq]
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out[:, 0], lse[:, 0]) if single else (out, lse)


def attention_paged(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, causal=False,
                    sm_scale=None, *, compute_dtype=torch.float64):
    """Reference chunked prefill over a paged KV cache.

    q [Tq, Hq, D] packs the new queries (sequence b owns rows cu_seqlens_q[b]:
    cu_seqlens_q[b+1]); k_cache/v_cache [num_pages, page_size, Hkv, D] hold every key of
    sequence b, the chunk's own included, at positions [0, seqlens_k[b]) through
    block_table [B, max_pages]. Causal is bottom-right aligned per sequence: query i of a
    chunk of Lq rows sees keys j <= seqlens_k[b] - Lq + i. A query that sees no key
    (seqlens_k[b] = 0) gets out 0 and LSE -inf. Returns (out [Tq, Hq, D], lse [Hq, Tq]).
    """
    scale = _scale(sm_scale, q.shape[-1])
    cq, lens = cu_seqlens_q.tolist(), [int(x) for x in seqlens_k.tolist()]
    out = torch.zeros(q.shape[:2] + (v_cache.shape[-1],), dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype,
                     device=q.device)
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        # only this sequence's pages, converted after the gather (not the whole cache)
        k = gather_paged_kv(k_cache, block_table[b:b + 1], lens[b])[0].to(compute_dtype)
        v = gather_paged_kv(v_cache, block_table[b:b + 1], lens[b])[0].to(compute_dtype)
        o, l = _attend(q[cq[b]:cq[b + 1]].to(compute_dtype), k, v, scale, causal)
        out[cq[b]:cq[b + 1]] = o
        lse[:, cq[b]:cq[b + 1]] = l
    return out, lse


def append_paged_kv(k_new, v_new, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table):
    """Reference chunk append, in place: row cu_seqlens_q[b] + i of k_new / v_new [Tq, Hkv,
    D] goes to position seqlens_k[b] - Lq_b + i of sequence b's pages (Lq_b its chunk
    length), the layout :func:`attention_paged` reads."""
    cq, lens = cu_seqlens_q.tolist(), [int(x) for x in seqlens_k.tolist()]
    page = k_cache.shape[1]
    for b in range(len(cq) - 1):
        n = cq[b + 1] - cq[b]
        if n == 0:
            continue
        pos = torch.arange(lens[b] - n, lens[b], device=block_table.device)
        pages = block_table[b, pos // page].long().to(k_cache.device)
        slots = (pos % page).to(k_cache.device)
        k_cache[pages, slots] = k_new[cq[b]:cq[b + 1]]
        v_cache[pages, slots] = v_new[cq[b]:cq[b + 1]]


def merge_states(outputs, lses, *, compute_dtype=torch.float64):
    """Merge P partial attention states over disjoint key sets, in order p = 0..P-1.

    outputs [P, ..., D] (each normalized by its own softmax denominator), lses [P, ...].
    Returns (out [..., D], lse [...]):
    lse = m + ln(sum_p exp(lse_p - m)), out = sum_p exp(lse_p - lse) * out_p.
    A part with lse = -inf is empty and contributes nothing, whatever its output holds;
    if every part is empty the result is (0, -inf). A NaN or +inf lse in any part makes
    the row's out and lse NaN (an invalid state is never silently dropped); NaN in a
    non-empty part's output propagates to those elements.
    """
    o = outputs.to(compute_dtype)
    s = lses.to(compute_dtype)
    invalid = (torch.isnan(s) | (s == float("inf"))).any(dim=0)  # [...]
    s = torch.where(invalid[None], float("-inf"), s)  # worked around below, then marked
    m = s.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(s - m_safe)  # exp(-inf) = 0 for empty parts
    total = w.sum(dim=0)
    lse = m_safe + torch.log(total)  # log(0) = -inf when all parts are empty
    scale = torch.where(total > 0, w / torch.where(total > 0, total, 1.0), 0.0)
    # where, not a multiply by 0: an empty part's output may hold NaN
    out = torch.where(scale[..., None] > 0, scale[..., None] * o, 0.0).sum(dim=0)
    nan = torch.tensor(float("nan"), dtype=compute_dtype, device=o.device)
    out = torch.where(invalid[..., None], nan, out)
    lse = torch.where(invalid, nan, lse)
    return out, lse
