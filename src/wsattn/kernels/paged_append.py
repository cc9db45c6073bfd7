"""A packed chunk's new keys and values written into a paged KV cache, on the device.

Chunked prefill appends each sequence's chunk to its cache before the chunk attends to
prefix + chunk: the chunk's token i of sequence b lands at position seqlens_k[b] - Lq_b + i
(Lq_b its chunk length, seqlens_k[b] the keys after the append), row pos % page_size of
page block_table[b, pos // page_size]. ``append_kv`` does it in one launch for K and V
together, with no host read: each program takes ROWS packed rows and finds each row's
sequence by counting the chunk ends cu_seqlens_q[1..B] at or below it, so the call can
be captured in a CUDA graph and needs neither per-token index tensors nor max_seqlen_q.

A row whose position would be negative (seqlens_k[b] shorter than its chunk: invalid
input, refused by ``wsattn.api`` when it validates) writes nothing rather than outside the
sequence's pages.

Reads top to bottom: jit kernel, launcher, compile spec.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..target import target_of
from ..testing import dtype_name
from ._intmath import cdiv
from ._rebuild import rebuild
from ._softmax import _sum_combine  # noqa: F401 (_JIT_NAMES)

ROWS = 32  # packed rows a program writes (every KV head of them, K and V)
# chunk ends a program compares its rows with at a time (one pass up to 128 sequences)
SEQ_CHUNK = 128


@triton.jit
def _append_kernel(KN, VN, KC, VC, CU_Q, SEQLENS_K, BT, TQ, B, HKV,
                   stride_knt, stride_knh, stride_vnt, stride_vnh,
                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   stride_btb,
                   D: tl.constexpr, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr,
                   SEQ_CHUNK: tl.constexpr):
    # program c: packed rows c*ROWS .. c*ROWS + ROWS - 1 of the chunk
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    d = tl.arange(0, D)
    live = t < TQ
    # row t's sequence: the chunk ends cu_seqlens_q[1..B] at or below t (an empty chunk
    # ends where it starts, so it owns no row); ends past B read as past every row
    b = t * 0
    for c0 in range(0, B, SEQ_CHUNK):
        i = c0 + tl.arange(0, SEQ_CHUNK)
        ends = tl.load(CU_Q + 1 + i, mask=i < B, other=TQ)
        b += tl.reduce((ends[None, :] <= t[:, None]).to(tl.int32), 1, _sum_combine)
    q0 = tl.load(CU_Q + b, mask=live, other=0)
    q1 = tl.load(CU_Q + b + 1, mask=live, other=0)
    n_k = tl.load(SEQLENS_K + b, mask=live, other=0)
    pos = n_k - (q1 - q0) + (t - q0)  # the row's position in its sequence
    live = live & (pos >= 0)
    page = tl.load(BT + b.to(tl.int64) * stride_btb + pos // PAGE_SIZE, mask=live,
                   other=0).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)
    k_dst = page * stride_kp + slot * stride_ks  # [ROWS]
    v_dst = page * stride_vp + slot * stride_vs
    t64 = t.to(tl.int64)
    for h in range(HKV):
        k = tl.load(KN + t64[:, None] * stride_knt + h * stride_knh + d[None, :],
                    mask=live[:, None])
        v = tl.load(VN + t64[:, None] * stride_vnt + h * stride_vnh + d[None, :],
                    mask=live[:, None])
        tl.store(KC + k_dst[:, None] + h * stride_kh + d[None, :], k, mask=live[:, None])
        tl.store(VC + v_dst[:, None] + h * stride_vh + d[None, :], v, mask=live[:, None])


_JIT_NAMES = ("_sum_combine", "_append_kernel")


def _kernel(interpret: bool):
    """``_append_kernel`` built for the interpreter or for the compiler, whatever the
    process (why and how: ``_rebuild``)."""
    return rebuild(globals(), _JIT_NAMES, "_append_kernel", interpret)


def append_kv(k_new, v_new, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table) -> None:
    """Write a packed chunk's keys and values into the paged cache, in place (inputs
    validated by ``wsattn.api``: the index values as attention_paged requires them).

    Args:
        k_new, v_new: [Tq, Hkv, D], the cache's dtype, last dim contiguous; sequence b's
            rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
        k_cache, v_cache: [num_pages, page_size, Hkv, D], last dim contiguous.
        cu_seqlens_q: int32 [B + 1] contiguous, the chunks' offsets.
        seqlens_k: int32 [B] contiguous, each sequence's keys after the append.
        block_table: int32 [B, max_pages], last dim contiguous.

    Row cu_seqlens_q[b] + i goes to position seqlens_k[b] - Lq_b + i of sequence b.

    Example (CPU, TRITON_INTERPRET=1):
        >>> kc = torch.zeros(3, 16, 2, 64); vc = torch.zeros(3, 16, 2, 64)
        >>> kn = torch.randn(5, 2, 64); vn = torch.randn(5, 2, 64)
        >>> append_kv(kn, vn, kc, vc, torch.tensor([0, 5], dtype=torch.int32),
        ...           torch.tensor([20], dtype=torch.int32),
        ...           torch.tensor([[2, 0]], dtype=torch.int32))
        >>> torch.equal(kc[2, 15], kn[0]) and torch.equal(vc[0, :4], vn[1:])
        True
    """
    Tq, hkv, D = k_new.shape
    if Tq == 0:
        return
    page = k_cache.shape[1]
    B = block_table.shape[0]
    interpret = target_of(k_cache.device).backend == "interpreter"
    with contextlib.nullcontext() if interpret else torch.cuda.device(k_cache.device):
        _kernel(interpret)[(cdiv(Tq, ROWS),)](
            k_new, v_new, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, Tq, B, hkv,
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            D=D, PAGE_SIZE=page, ROWS=ROWS, SEQ_CHUNK=SEQ_CHUNK, num_warps=4)


def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16",
                 page_size: int = 16) -> dict:
    """What ``triton.compile`` needs to build the append kernel for compute capability cc
    (as paged_gather.compile_spec): {"fn", "signature", "constexprs", "attrs", "options"}."""
    ptr = "*" + dtype_name(dtype)
    fn = _kernel(False)
    signature = {"KN": ptr, "VN": ptr, "KC": ptr, "VC": ptr, "CU_Q": "*i32",
                 "SEQLENS_K": "*i32", "BT": "*i32", "TQ": "i32", "B": "i32", "HKV": "i32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    signature.update({n: "i32" for n in strides})
    constexprs = {"D": head_dim, "PAGE_SIZE": page_size, "ROWS": ROWS,
                  "SEQ_CHUNK": SEQ_CHUNK}
    signature.update({n: "constexpr" for n in constexprs})
    # a launch specializes the tensor pointers and the row strides (multiples of D)
    aligned = ["KN", "VN", "KC", "VC", "CU_Q", "SEQLENS_K", "BT",
               *(n for n in strides if n != "stride_btb")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": 4}, "attrs": attrs}
