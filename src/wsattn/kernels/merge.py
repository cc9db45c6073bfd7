"""The LSE merge of partial attention states, written once.

A partial state over a key subset is (o_i, lse_i): the output normalized by its own
softmax denominator and the natural-log LSE of its scores. Parts over disjoint key sets
merge as

    L = M + ln(sum_i exp(L_i - M)),   O = sum_i exp(L_i - L) O_i,   M = max_i L_i,

with L in fp32. An empty part (lse_i = -inf) contributes nothing, whatever its output
holds; all parts empty gives (0, -inf), never NaN. A NaN or +inf lse_i is an invalid
state: the row's O and L become NaN (never a silently dropped part), as in the reference.

``merge_step`` folds one part into a running (acc, m, den), ``merge_parts`` folds a
block of parts of one row at once (the same formula as vector operations over the
block), and ``merge_finish`` turns the state into (O, L). They are the only place the
formula lives: the ``merge_states`` kernel below and the split-KV decode combine
(decode_triton.py) call them, and sequence-parallel prefill/decode call
:func:`merge_states`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..testing import dtype_name
from ._alloc import empty
from ._intmath import cdiv, next_pow2


@triton.jit
def merge_step(acc, m, den, o_i, lse_i):
    """Fold part i into the running state; returns the new (acc, m, den).

    acc [R, D] fp32: sum of exp(lse_j - m) * o_j so far; m [R] fp32: running max of
    lse (-inf before any non-empty part); den [R] fp32: sum of exp(lse_j - m).
    o_i [R, D] (any float dtype), lse_i [R] fp32. Start from (0, -inf, 0).
    """
    m_new = tl.maximum(m, lse_i)  # [R]
    # max drops a NaN operand; keep it, so that an invalid part poisons the row for good
    m_new = tl.where((m != m) | (lse_i != lse_i), float("nan"), m_new)
    # A row that has seen only empty parts keeps m = -inf; shift by 0 there so that
    # exp(-inf - (-inf)) never forms a NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)  # [R] rescales what is accumulated; 0 while empty
    w = tl.exp(lse_i - m_safe)  # [R] weight of part i; 0 when empty, NaN when +inf/NaN
    # where, not a multiply by w = 0: an empty part's o_i may hold anything.
    contrib = tl.where((w > 0.0)[:, None], w[:, None] * o_i.to(tl.float32), 0.0)  # [R, D]
    acc = acc * alpha[:, None] + contrib
    den = den * alpha + w
    return acc, m_new, den


@triton.jit
def merge_parts(acc, m, den, o_blk, lse_blk):
    """Fold a block of S parts of one row into the running state; returns (acc, m, den).

    acc [1, D], m [1], den [1] as in merge_step; o_blk [S, D] (any float dtype), lse_blk
    [S] fp32, rows past the real parts given lse -inf (empty: their o is never used).
    The result is merge_step's over the block's parts in any order, up to rounding: the
    block's weights are summed by a reduction (fixed by the build, so reruns give the same
    bits). Empty, NaN and +inf parts behave as in merge_step.
    """
    nan_in = tl.sum((lse_blk != lse_blk).to(tl.int32), axis=0) > 0
    m_new = tl.maximum(m, tl.max(lse_blk, axis=0))  # [1]
    # a NaN part (or state) poisons the row for good, as in merge_step
    m_new = tl.where((m != m) | nan_in, float("nan"), m_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)  # [1]
    w = tl.exp(lse_blk - tl.sum(m_safe, axis=0))  # [S]: 0 when empty, NaN when +inf/NaN
    contrib = tl.where((w > 0.0)[:, None], w[:, None] * o_blk.to(tl.float32), 0.0)  # [S, D]
    acc = acc * alpha[:, None] + tl.sum(contrib, axis=0)[None, :]
    den = den * alpha + tl.sum(w, axis=0)
    return acc, m_new, den


@triton.jit
def merge_finish(acc, m, den):
    """(acc [R, D], m [R], den [R]) -> (out [R, D] fp32, lse [R] fp32); empty rows give
    (0, -inf), rows that folded in a NaN or +inf LSE give (NaN, NaN)."""
    seen = den > 0.0  # [R]
    invalid = den != den  # [R] NaN: only an invalid part makes den NaN
    out = tl.where(seen[:, None], acc / tl.where(seen, den, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
    out = tl.where(invalid[:, None], float("nan"), out)
    lse = tl.where(invalid, float("nan"), lse)
    return out, lse


@triton.jit
def _merge_states_kernel(o_ptr, lse_ptr, out_ptr, out_lse_ptr, N, P,
                         stride_op, stride_on, stride_lp,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: BLOCK_R rows x D, the P parts folded in the order p = 0..P-1; BLOCK_D is
    # D rounded up to a power of two (tl.arange needs one), the extra columns masked
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    live = rows < N
    live_d = live[:, None] & (cols < D)[None, :]  # [BLOCK_R, BLOCK_D]
    o_rows = o_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :]  # [BLOCK_R, BLOCK_D]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    lse_rows = lse_ptr + rows  # [BLOCK_R]
    for p in range(0, P):
        lse_p = tl.load(lse_rows, mask=live, other=float("-inf"))  # [BLOCK_R]
        o_p = tl.load(o_rows, mask=live_d, other=0.0)  # [BLOCK_R, BLOCK_D]
        acc, m, den = merge_step(acc, m, den, o_p, lse_p)
        # step the pointers rather than forming p * stride, which can pass 2**31 elements
        o_rows += stride_op
        lse_rows += stride_lp
    out, lse = merge_finish(acc, m, den)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live_d)
    tl.store(out_lse_ptr + rows, lse, mask=live)


def _block_rows(D: int) -> int:
    # about 4K fp32 accumulator elements per program: 32 registers a thread at 4 warps
    return max(1, min(64, 4096 // D))


def merge_states(outputs: torch.Tensor, lses: torch.Tensor):
    """Merge P partial attention states over disjoint key sets (input validated by api.py).

    Args:
        outputs: [P, N, D] float16 / bfloat16 / float32, last dimension contiguous;
            part p of row n normalized by its own softmax denominator; any D >= 1.
        lses: [P, N] float32, natural-log LSE of each part; -inf marks an empty part.

    Returns:
        (out [N, D] in outputs' dtype, lse [N] float32), merged in the fixed order
        p = 0..P-1 (deterministic); rows whose parts are all empty give (0, -inf).

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> o = torch.randn(3, 5, 64); s = torch.randn(3, 5); s[1] = -float("inf")
        >>> out, lse = merge_states(o, s)   # out [5, 64], lse [5]
    """
    P, N, D = outputs.shape
    lses = lses.contiguous()
    out = empty((N, D), outputs.dtype, outputs.device)
    out_lse = empty((N,), torch.float32, outputs.device)
    if N == 0:
        return out, out_lse
    block_d = next_pow2(D)
    block_r = _block_rows(block_d)
    _merge_states_kernel[(cdiv(N, block_r),)](
        outputs, lses, out, out_lse, N, P,
        outputs.stride(0), outputs.stride(1), lses.stride(0),
        D=D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out, out_lse


@triton.jit
def _merge_into_kernel(acc_ptr, acc_lse_ptr, part_ptr, part_lse_ptr, N, S, H,
                       sa_b, sa_s, sa_h, sla_b, sla_h, sla_s,
                       sp_b, sp_s, sp_h, slp_b, slp_h, slp_s,
                       D: tl.constexpr, BLOCK_R: tl.constexpr):
    # rows n = (b * S + s) * H + h of [B, S, H, D] outputs with [B, H, S] LSEs, any strides
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = n < N
    n = n.to(tl.int64)
    h = n % H
    s = (n // H) % S
    b = n // (H * S)
    cols = tl.arange(0, D)
    a_rows = acc_ptr + (b * sa_b + s * sa_s + h * sa_h)[:, None] + cols[None, :]
    p_rows = part_ptr + (b * sp_b + s * sp_s + h * sp_h)[:, None] + cols[None, :]
    a_lse = acc_lse_ptr + b * sla_b + h * sla_h + s * sla_s
    p_lse = part_lse_ptr + b * slp_b + h * slp_h + s * slp_s
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, m, den = merge_step(acc, m, den, tl.load(a_rows, mask=live[:, None], other=0.0),
                             tl.load(a_lse, mask=live, other=float("-inf")))
    acc, m, den = merge_step(acc, m, den, tl.load(p_rows, mask=live[:, None], other=0.0),
                             tl.load(p_lse, mask=live, other=float("-inf")))
    out, lse = merge_finish(acc, m, den)
    # in place: each program reads its rows before it writes them, and no other does
    tl.store(a_rows, out.to(acc_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(a_lse, lse, mask=live)


def merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
               part_lse: torch.Tensor) -> None:
    """acc <- merge(acc, part), in place, for attention-shaped states (used where partial
    results arrive one at a time, as in overlapped sequence-parallel prefill).

    acc, part: [B, S, H, D] (views with any strides, last dimension contiguous, D a power
    of 2); acc_lse, part_lse: fp32 [B, H, S] views. Merged in the order (acc, part),
    with the same arithmetic as :func:`merge_states`, and no stacked copy of the parts.
    """
    B, S, H, D = acc.shape
    N = B * S * H
    if N == 0:
        return
    block_r = _block_rows(D)
    _merge_into_kernel[(cdiv(N, block_r),)](
        acc, acc_lse, part, part_lse, N, S, H,
        acc.stride(0), acc.stride(1), acc.stride(2),
        acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
        part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        D=D, BLOCK_R=block_r, num_warps=4)


def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16", settings=None) -> dict:
    """What ``triton.compile`` needs to build the merge_states kernel for compute capability cc.

    Returns a dict:
        "fn":         the @triton.jit kernel (``_merge_states_kernel``),
        "signature":  {argument name: Triton type string}, every argument, constexprs
                      typed "constexpr" (pointers "*bf16" etc., integers "i32"),
        "constexprs": {argument name: value} (D = head_dim, BLOCK_R),
        "attrs":      {(argument index,): [["tt.divisibility", 16]]} for the pointers and
                      the part/row strides, as a real launch specializes them,
        "options":    {"num_warps": 4}.
    Use: ``triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
    attrs=s["attrs"]), target=GPUTarget("cuda", cc, 32), options=s["options"])``. ``settings`` is unused
    (the merge has no tunables beyond BLOCK_R); it is accepted for a uniform call.
    """
    t = dtype_name(dtype)  # Triton's type string is the same name
    sig = {"o_ptr": f"*{t}", "lse_ptr": "*fp32", "out_ptr": f"*{t}", "out_lse_ptr": "*fp32",
           "N": "i32", "P": "i32", "stride_op": "i32", "stride_on": "i32", "stride_lp": "i32",
           "D": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    aligned = ("o_ptr", "lse_ptr", "out_ptr", "out_lse_ptr", "stride_op", "stride_on")
    return {"fn": _merge_states_kernel, "signature": sig,
            "constexprs": {"D": head_dim, "BLOCK_R": _block_rows(next_pow2(head_dim)),
                           "BLOCK_D": next_pow2(head_dim)},
            "attrs": {(_merge_states_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                      for n in aligned},
            "options": {"num_warps": 4}}
