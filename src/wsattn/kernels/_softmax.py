"""The online-softmax step shared by the Triton prefill kernels (fixed-length / varlen in
prefill_triton.py, paged in prefill_paged.py), written once.

A kernel module that uses these imports all three and lists them in its ``_JIT_NAMES``,
so that ``_rebuild.rebuild`` rebuilds them in that module's namespace, where the
interpreter build swaps the two combine functions for Triton's own (see _rebuild.py).
"""

import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _softmax_step(s, m_i, l_i, acc, offs_m, offs_n, seqlen_k, diag, qk_scale,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """One key tile's raw scores s [BLOCK_M, BLOCK_N] into the running max m_i (log2
    units), sum l_i and accumulator acc [BLOCK_M, D] (rescaled here). Returns
    (p [BLOCK_M, BLOCK_N], the new m_i, l_i, acc); the caller adds p @ V to acc.
    MASK: apply the key bound offs_n < seqlen_k (and, with CAUSAL, bottom-right: row i
    sees keys j <= i + diag); callers set it only on the last / diagonal tiles."""
    if MASK:
        visible = offs_n[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        # a row with no visible key so far keeps m = -inf; subtracting 0 instead
        # makes its exp2 terms 0 rather than exp2(-inf - -inf) = NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s - m_sub[:, None]
    else:
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine) * qk_scale)
        m_sub = m_new
        s = s * qk_scale - m_sub[:, None]
    p = tl.math.exp2(s)  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_sub)  # [BLOCK_M] rescale of what came before
    l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc
