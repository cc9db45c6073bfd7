"""FlashAttention-2 style prefill forward in Triton (``tl``), fixed-length and varlen.

One kernel, ``_attn_fwd``, with constexpr switches (causal, varlen, TMA vs pointer
loads, host vs device descriptors); one inner-loop helper, ``_attn_inner``, called twice: over
the key tiles every query row of the block sees (no mask), then over the diagonal /
boundary tiles (``MASK=True``). Online softmax in fp32 with exp2 (the softmax scale is
folded into log2(e)); the LSE is always written (natural log, fp32).

Loads: on sm_90+ each program builds device-side TMA descriptors over its own
(sequence, head) slice ``[seqlen, D]`` (base pointer at the slice, shape = that
sequence's length), so TMA's zero fill stops at the sequence boundary and a tile never
reads the next batch element's rows; the same code serves varlen. sm_80 has no TMA and
uses pointer loads with masks. The interpreter runs either (tests cover both).

Reads top to bottom: jit kernels, launcher (settings, grid, descriptors), ``prefill``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..target import Target, UnsupportedTargetError, target_of
from ..testing import DTYPES, dtype_name
from ._alloc import empty, ensure_descriptor_allocator
from ._rebuild import rebuild
from ._precision import F32_DOT
from ._softmax import _max_combine, _softmax_step, _sum_combine  # noqa: F401 (_JIT_NAMES)
from ._intmath import cdiv

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


# --------------------------------------------------------------------------- jit kernels

@triton.jit
def _attn_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs, lo, hi,
                offs_m, seqlen_k, diag, qk_scale, kv_b, kv_col,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, HOST_DESC: tl.constexpr):
    """Key tiles [lo, hi) into the running (acc, l_i, m_i); m_i is in log2 units.

    k_src/v_src are TMA descriptors of this (sequence, KV head) (USE_TMA), 3-D host
    descriptors over the whole [B, Sk, Hkv * D] tensor read at (kv_b, row, kv_col)
    (HOST_DESC), or base pointers of this (sequence, KV head). MASK: apply the key bound
    (and the causal mask when CAUSAL); the caller only sets it on the diagonal / last
    tiles, so the bulk of the loop has no mask.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0  # [BLOCK_N]
        if HOST_DESC:  # the box clips at this batch element's Sk: zero-filled past it
            k = k_src.load([kv_b, start_n, kv_col]).reshape(BLOCK_N, D)
        elif USE_TMA:
            k = k_src.load([start_n, 0])  # [BLOCK_N, D], zero-filled past seqlen_k
        elif MASK:
            k = tl.load(k_src + offs_n[:, None] * stride_ks + offs_d[None, :],
                        mask=offs_n[:, None] < seqlen_k, other=0.0)
        else:
            k = tl.load(k_src + offs_n[:, None] * stride_ks + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=F32_DOT)  # [BLOCK_M, BLOCK_N] fp32
        p, m_new, l_i, acc = _softmax_step(s, m_i, l_i, acc, offs_m, offs_n, seqlen_k, diag,
                                           qk_scale, MASK, CAUSAL)
        if HOST_DESC:
            v = v_src.load([kv_b, start_n, kv_col]).reshape(BLOCK_N, D)
        elif USE_TMA:
            v = v_src.load([start_n, 0])  # [BLOCK_N, D]
        elif MASK:
            v = tl.load(v_src + offs_n[:, None] * stride_vs + offs_d[None, :],
                        mask=offs_n[:, None] < seqlen_k, other=0.0)
        else:
            v = tl.load(v_src + offs_n[:, None] * stride_vs + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=F32_DOT)  # [BLOCK_M, D]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K,
              stride_qb, stride_qs, stride_qh,
              stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh,
              stride_ob, stride_os, stride_oh,
              stride_lb, stride_lh,
              SEQLEN_Q, SEQLEN_K, sm_scale,
              GROUP: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
              USE_TMA: tl.constexpr, HOST_DESC: tl.constexpr):
    """Grid (row blocks, Hq, B). Fixed: q [B,Sq,Hq,D], lse [B,Hq,Sq]. Varlen: q [Tq,Hq,D]
    (stride_*b = 0), cu_seqlens give each sequence's rows, lse [Hq,Tq] (stride_lb = 0).
    HOST_DESC (fixed length only): Q, K, V, O are 3-D TMA descriptors made on the host over
    [B, S, H * D] with boxes [1, rows, D], so no program builds descriptors of its own."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if CAUSAL:  # heaviest row blocks first, so the grid's tail is short work
        pid_m = tl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start.to(tl.int32)
        k_start = tl.load(CU_K + b).to(tl.int64)
        seqlen_k = tl.load(CU_K + b + 1) - k_start.to(tl.int32)
        if m0 >= seqlen_q:  # the grid covers the longest sequence
            return
    else:
        q_start = 0
        k_start = 0
        seqlen_q = SEQLEN_Q
        seqlen_k = SEQLEN_K
    hk = h // GROUP  # GQA: GROUP query heads share one KV head
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, D)  # [D]
    row_ok = offs_m < seqlen_q

    if not HOST_DESC:  # Q, K, V, O are pointers: this (sequence, head)'s first element
        q_base = Q + b64 * stride_qb + q_start * stride_qs + h * stride_qh
        k_base = K + b64 * stride_kb + k_start * stride_ks + hk * stride_kh
        v_base = V + b64 * stride_vb + k_start * stride_vs + hk * stride_vh
        o_base = O + b64 * stride_ob + q_start * stride_os + h * stride_oh
    if HOST_DESC:
        k_src = K
        v_src = V
        q = Q.load([b, m0, h * D]).reshape(BLOCK_M, D)  # [BLOCK_M, D]
    elif USE_TMA:
        # One descriptor per (sequence, head) slice: its shape is the sequence's own
        # length, so TMA zero-fills (and clips stores) exactly at the boundary. Length 1
        # stands in for an empty KV sequence, whose loop never loads.
        kv_rows = tl.maximum(seqlen_k, 1)
        q_desc = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, D], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, D])
        k_src = tl.make_tensor_descriptor(k_base, shape=[kv_rows, D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[kv_rows, D], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, D])
        q = q_desc.load([m0, 0])  # [BLOCK_M, D]
    else:
        k_src = k_base
        v_src = v_base
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x * scale) = exp2(x * qk_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
    diag = seqlen_k - seqlen_q
    if CAUSAL:
        # Every row of the block sees keys [0, m0 + diag + 1): whole tiles of that need
        # no mask; the rest, up to the last row's horizon, is the diagonal.
        n_full = ((m0 + diag + 1) // BLOCK_N) * BLOCK_N
        n_end = tl.minimum(m0 + BLOCK_M + diag, seqlen_k)
    else:
        n_full = (seqlen_k // BLOCK_N) * BLOCK_N
        n_end = seqlen_k
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                                0, n_full, offs_m, seqlen_k, diag, qk_scale, b, hk * D,
                                D, BLOCK_N, False, CAUSAL, USE_TMA, HOST_DESC)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                                n_full, n_end, offs_m, seqlen_k, diag, qk_scale, b, hk * D,
                                D, BLOCK_N, True, CAUSAL, USE_TMA, HOST_DESC)

    # A row that saw no key (empty KV sequence) gives out 0 and lse -inf, not 0/0.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = (acc / l_safe[:, None]).to(q.dtype)  # [BLOCK_M, D]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + b64 * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=row_ok)
    if HOST_DESC:  # the box clips at this batch element's Sq
        O.store([b, m0, h * D], out.reshape(1, BLOCK_M, D))
    elif USE_TMA:
        o_desc = tl.make_tensor_descriptor(o_base, shape=[seqlen_q, D], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, D])
        o_desc.store([m0, 0], out)
    else:
        tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :], out,
                 mask=row_ok[:, None])


# --------------------------------------------------------------------------- launcher

_JIT_NAMES = ("_max_combine", "_sum_combine", "_softmax_step", "_attn_inner", "_attn_fwd")


def _kernel(interpret: bool):
    """``_attn_fwd`` built for the interpreter or for the compiler, whatever the process
    (why and how: ``_rebuild``)."""
    return rebuild(globals(), _JIT_NAMES, "_attn_fwd", interpret)


@dataclass(frozen=True)
class PrefillSettings:
    """Launch settings of one prefill kernel instance (see ``default_settings``)."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool
    # fixed length only: 3-D host TMA descriptors instead of per-program device-side ones
    # (no descriptor writes and fences at each program's start; needs packed heads)
    host_desc: bool = False


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, 2-byte dtypes. Shared memory
# is about (BLOCK_M + 2 * num_stages * BLOCK_N) * D * 2 bytes (Q + K/V ring); the
# compile-only tests check it against each target's limit.
_TILES = {
    # H100/H200 and B200 (227 KiB smem): two consumer warpgroups of 64 rows each for
    # D <= 128; D = 256 halves the tiles so acc (64 x 256 fp32) stays in registers.
    # Measured on H200 (scripts/device_prefill_sweep.py, notes/prefill_triton.md): a third
    # K/V stage at D = 128 (230 KB of shared memory) +8-14 %; D = 64 best with BLOCK_N 64
    # and 4 stages (+8-20 % over 128 x 128 at 3).
    "big": {64: (128, 64, 8, 4), 128: (128, 128, 8, 3), 256: (64, 64, 4, 2)},
    # A100 (163 KiB smem, mma.sync, cp.async pipelining, no TMA).
    "sm80": {64: (128, 64, 4, 3), 128: (128, 64, 8, 2), 256: (64, 32, 4, 2)},
    # consumer Blackwell sm_120 (99 KiB smem, mma.sync): 8 warps keep D <= 128 free of
    # spills; D = 256 uses pointer loads, whose TMA build spills (see the notes).
    "small": {64: (128, 64, 8, 2), 128: (128, 64, 8, 2), 256: (64, 32, 4, 2)},
}
# Causal with short queries (max_seqlen_q <= SHORT_CAUSAL_Q): 64-row blocks, so twice the
# programs share the triangle's uneven work. H200, D = 128: N = 1024 causal 299 -> 330
# TFLOP/s, N = 4096 425 -> 431; at N = 16384 the 128-row tiles lead, 497 against 475.
# D = 64 (scripts/device_prefill_sweep.py, 16k tokens, 32 heads): N = 1024 265 -> 280
# (x cuDNN 0.835 -> 0.880), N = 4096 357 -> 360; 64 x 128 tiles and 4 stages lost at 1024.
SHORT_CAUSAL_Q = 4096
_SHORT_CAUSAL_TILES = {"big": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}}
_INTERPRETER = PrefillSettings(32, 32, 4, 1, use_tma=True)


def tile_family(target: Target, head_dim: int, what: str) -> str:
    """The tile-table family of a GPU target ("sm80", "big" for sm_90/sm_100, "small" for
    the ~100 KB-shared-memory sm_120 parts) for the Triton prefill kernels; refuses head
    dims other than 64/128/256 and targets below sm_80, naming ``what`` kernel."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"{what} supports head dims 64, 128, 256, got {head_dim}")
    if target.cc < 80:
        raise UnsupportedTargetError(f"the Triton {what} kernel needs sm_80 or later, got "
                                     f"{target.name}")
    return "sm80" if target.cc < 90 else "small" if target.cc >= 120 else "big"


def default_settings(target: Target, head_dim: int, dtype: torch.dtype, causal: bool,
                     max_seqlen_q: int = 0) -> PrefillSettings:
    """Launch settings for (target, head dim, dtype, causal, longest query; 0 = unknown).

    The interpreter gets small tiles (quick tests) and the TMA path (the code that runs
    on sm_90, with TMA emulated). fp32 halves BLOCK_N (twice the bytes per tile) and
    takes 8 warps at D = 256. On sm_90/sm_100 fixed-length launches take host TMA
    descriptors (``host_desc``; varlen and unpacked layouts fall back to per-program ones).
    """
    if target.backend == "interpreter":
        return _INTERPRETER
    family = tile_family(target, head_dim, "prefill")
    use_tma = target.has_tma and not (family == "small" and head_dim == 256)
    short = _SHORT_CAUSAL_TILES.get(family, {}).get(head_dim)
    if causal and short and 0 < max_seqlen_q <= SHORT_CAUSAL_Q:
        bm, bn, warps, stages = short
    else:
        bm, bn, warps, stages = _TILES[family][head_dim]
    if dtype == torch.float32:
        bn = max(16, bn // 2)
        stages = min(stages, 2)
        if head_dim == 256:
            warps = 8  # 4 warps spill at 64 x 256 fp32 operands (ptxas, sm_90)
    # host descriptors: measured on H200 only (+1-3 % at N = 16384, +16-35 % at N = 1024,
    # where each program's own descriptor writes and fences weigh most); other families
    # keep theirs
    host_desc = use_tma and family == "big"
    return PrefillSettings(bm, bn, warps, stages, use_tma, host_desc)


def _tma_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned base pointers and row strides."""
    for t in tensors:
        esize = t.element_size()
        if t.data_ptr() % 16 or any((s * esize) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _packed_heads(*tensors) -> bool:
    """[B, S, H, D] tensors whose heads sit side by side in a row (stride(2) == D): then a
    3-D view [B, S, H * D] (row stride stride(1)) serves every head from one host
    descriptor. A [B, H, S, D] layout seen through a transpose does not. TMA alignment is
    prefill()'s check (use_tma is off past it) and out is our own contiguous allocation."""
    return all(t.stride(3) == 1 and t.stride(2) == t.shape[3] for t in tensors)


def _desc3d(t, rows: int):
    """Host TMA descriptor over [B, S, H * D] with a [1, rows, D] box: TMA clips the box
    at each batch element's S, so a tile never reads or writes the next one's rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, S, H, D = t.shape
    return TensorDescriptor(t, shape=[B, S, H * D], strides=[t.stride(0), t.stride(1), 1],
                            block_shape=[1, rows, D])


def _launch(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, sm_scale, s: PrefillSettings,
            interpret: bool):
    varlen = cu_q is not None
    if varlen:
        B, (_, Hq, D), Hkv = cu_q.numel() - 1, q.shape, k.shape[1]
        qs, ks, vs, os_ = ((0,) + tuple(t.stride()[:2]) for t in (q, k, v, out))
        lse_strides = (0, lse.stride(0))  # [Hq, Tq]
    else:
        B, _, Hq, D = q.shape
        Hkv = k.shape[2]
        qs, ks, vs, os_ = (tuple(t.stride()[:3]) for t in (q, k, v, out))
        lse_strides = (lse.stride(0), lse.stride(1))  # [B, Hq, Sq]
    grid = (cdiv(max_q, s.BLOCK_M), Hq, B)
    host_desc = s.use_tma and s.host_desc and not varlen and _packed_heads(q, k, v, out)
    if host_desc:
        q_arg, o_arg = (_desc3d(t, s.BLOCK_M) for t in (q, out))
        k_arg, v_arg = (_desc3d(t, s.BLOCK_N) for t in (k, v))
    else:
        q_arg, k_arg, v_arg, o_arg = q, k, v, out
        if s.use_tma and not interpret:
            ensure_descriptor_allocator()
    _kernel(interpret)[grid](
        q_arg, k_arg, v_arg, o_arg, lse, cu_q, cu_k, *qs, *ks, *vs, *os_, *lse_strides,
        max_q, max_k, sm_scale,
        GROUP=Hq // Hkv, D=D, BLOCK_M=s.BLOCK_M, BLOCK_N=s.BLOCK_N,
        CAUSAL=causal, VARLEN=varlen, USE_TMA=s.use_tma, HOST_DESC=host_desc, num_warps=s.num_warps, num_stages=s.num_stages)




def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                 varlen: bool = False, settings: PrefillSettings | None = None) -> dict:
    """What ``triton.compile`` needs to build this kernel for a GPU target, no GPU needed.

    Args:
        cc: compute capability, e.g. 80, 90, 100, 120.
        head_dim: 64, 128 or 256. dtype: "fp16", "bf16" or "fp32".
        settings: launch settings; default ``default_settings(Target("cuda", cc), ...)``.

    Returns:
        dict with
          "fn": the compiler's ``JITFunction`` of ``_attn_fwd`` (never the interpreter's),
          "signature": {arg name: Triton type}, e.g. "*bf16", "i32", "fp32", "constexpr",
          "constexprs": {arg name: value} for every constexpr argument (and the unused
            cu_seqlens pointers, None, in the fixed-length case),
          "options": {"num_warps", "num_stages"},
          "attrs": {(arg index,): [["tt.divisibility", 16]]} on the pointers and strides,
            as a launch specializes them when they are multiples of 16 (pass it as
            ASTSource's fourth argument),
          "settings": the PrefillSettings used.

    Example:
        >>> from triton.compiler import ASTSource, compile
        >>> from triton.backends.compiler import GPUTarget
        >>> spec = compile_spec(90, 128, "bf16", causal=True)
        >>> src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
        >>> k = compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
        >>> "wgmma" in k.asm["ptx"]
        True
    """
    ty = dtype_name(dtype)  # Triton's type string is the same name
    torch_dtype = DTYPES[ty]
    s = settings or default_settings(Target("cuda", cc, 132), head_dim, torch_dtype, causal)
    fn = _kernel(False)
    ptr = "*" + ty
    host_desc = s.use_tma and s.host_desc and not varlen
    qo, kv = ((f"tensordesc<{ty}[1,{s.BLOCK_M},{head_dim}]>",
               f"tensordesc<{ty}[1,{s.BLOCK_N},{head_dim}]>") if host_desc else (ptr, ptr))
    signature = {"Q": qo, "K": kv, "V": kv, "O": qo, "LSE": "*fp32",
                 "CU_Q": "*i32" if varlen else "constexpr",
                 "CU_K": "*i32" if varlen else "constexpr"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    signature.update({n: "i32" for n in strides})
    signature.update({"SEQLEN_Q": "i32", "SEQLEN_K": "i32", "sm_scale": "fp32"})
    constexprs = {"GROUP": 1, "D": head_dim, "BLOCK_M": s.BLOCK_M, "BLOCK_N": s.BLOCK_N,
                  "CAUSAL": causal, "VARLEN": varlen, "USE_TMA": s.use_tma,
                  "HOST_DESC": host_desc}
    if not varlen:
        constexprs.update({"CU_Q": None, "CU_K": None})
    signature.update({n: "constexpr" for n in constexprs})
    # A launch specializes ints divisible by 16 (0 included: varlen's batch strides)
    # and 16-byte aligned pointers; the strides of the usual shapes all are.
    aligned = ["LSE", *strides] + ([] if host_desc else ["Q", "K", "V", "O"])
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": s.num_warps, "num_stages": s.num_stages},
            "attrs": attrs, "settings": s}


# --------------------------------------------------------------------------- entry point

def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale,
            settings: PrefillSettings | None = None):
    """Prefill attention forward (inputs validated by ``wsattn.api``).

    Args:
        q: fixed [B, Sq, Hq, D] or varlen packed [Tq, Hq, D]; fp16 / bf16 / fp32, last dim
           contiguous; D in (64, 128, 256).
        k, v: [B, Sk, Hkv, D] or [Tk, Hkv, D], Hq a multiple of Hkv (query head h reads
           KV head h // (Hq // Hkv)).
        cu_seqlens_q, cu_seqlens_k: None (fixed) or int32 [B + 1] offsets (varlen).
        max_seqlen_q, max_seqlen_k: longest sequences (varlen; ignored when fixed).
        causal: bottom-right aligned, query i sees keys j <= i + Sk - Sq.
        sm_scale: softmax scale.
        settings: launch settings overriding ``default_settings`` for the device.

    Returns:
        (out shaped like q in q's dtype, lse fp32 natural-log [B, Hq, Sq] or [Hq, Tq]);
        a query that sees no key gets out 0 and lse -inf.

    Example (CPU, TRITON_INTERPRET=1):
        >>> q = torch.randn(1, 17, 4, 64, dtype=torch.float16); k = v = q[:, :, :2]
        >>> out, lse = prefill(q, k.contiguous(), v.contiguous(), None, None, 0, 0, True, 0.125)
        >>> out.shape, lse.shape
        (torch.Size([1, 17, 4, 64]), torch.Size([1, 4, 17]))
    """
    varlen = cu_seqlens_q is not None
    target = target_of(q.device)
    D = q.shape[-1]
    s = settings or default_settings(target, D, q.dtype, causal,
                                     max_seqlen_q=int(max_seqlen_q) if varlen else q.shape[1])
    if s.use_tma and not _tma_ok(q, k, v):
        s = dataclasses.replace(s, use_tma=False)
    out = empty(q.shape, q.dtype, q.device)
    if varlen:
        Tq, Hq = q.shape[0], q.shape[1]
        lse = empty((Hq, Tq), torch.float32, q.device)
        max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    else:
        B, Sq, Hq = q.shape[0], q.shape[1], q.shape[2]
        lse = empty((B, Hq, Sq), torch.float32, q.device)
        max_q, max_k = Sq, k.shape[1]
    if out.numel() == 0 or max_q == 0:
        return out, lse
    if target.backend == "interpreter":
        _launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal, sm_scale,
                s, interpret=True)
    else:
        with torch.cuda.device(q.device):  # the launch and the TMA scratch go to q's GPU
            _launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal,
                    sm_scale, s, interpret=False)
    return out, lse
