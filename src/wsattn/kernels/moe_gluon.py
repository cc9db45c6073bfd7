"""sm_90 Gluon warp-specialized grouped expert kernel for MoE decode (gate/up and down).

The grouped projections of wsattn.kernels.moe (same Grouping, same outputs: act by grouped
row, fp32 per-pair down rows for moe.py's combine kernel) written as a Hopper kernel:

  - a 1-warp TMA producer partition streams one expert's weight tiles, [BLOCK_N, BLOCK_K]
    boxes of a descriptor over the [E * N, K] view of the weight (expert e's rows start at
    e * N), through a STAGES-deep shared-memory ring (ready / empty mbarriers); gate/up
    loads the gate box and the up box (rows e * 2F + n0 and e * 2F + F + n0) on one
    barrier;
  - one consumer warpgroup (the default partition) gathers the block's activation rows
    (x rows through sorted_pairs for gate/up, act rows for down; padding rows zero) into
    shared memory one K tile at a time, each tile's loads issued two iterations before its
    wgmma, and runs wgmma with the weight tile as A (M = BLOCK_N = 64 output rows) and
    the activations as B (N = MMA_N = max(8, block) grouped rows): swap-AB, so the few
    tokens sit on the MMA's narrow side.

Work items: one program per (grouping block, BLOCK_N tile of the output), the static grid
(blocks_max, cdiv(N, BLOCK_N)) of the Triton path; a program whose block lies past
num_active_blocks returns before any shared memory, barrier or partition exists, so
producer and consumer always agree on the work (none, or every K tile).

Epilogues: gate/up applies the FlashNorm scale (sum of squares from the gathered x tiles)
and silu(gate) * up in fp32 and rounds once into act; down multiplies by the pair's
routing weight and writes fp32 rows by pair index. moe.py's combine kernel then adds a
token's k rows in slot order: deterministic, no atomics.

VERIFIED_ON_GPU is True since its sm90 tests passed on an H200
(benchmarks/results/gluon_moe_gpu_tests_H200_*.log); set it to False to refuse the
kernel again (impl="gluon" then raises, naming why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..testing import DTYPE_NAMES
from ._alloc import empty
from ._gluon_host import cuda_cc as _cc, nvmma_layout as _layout, tma_descriptor as _descriptor
from ._intmath import cdiv

GLUON_CC = 90  # wgmma, TMA and setmaxnreg as used here exist on sm_90 only
# True once the kernel has passed its GPU numerics (the sm90 tests of
# tests/test_moe_gluon.py); False refuses impl="gluon".
VERIFIED_ON_GPU = True
GLUON_DTYPES = (torch.float16, torch.bfloat16)
OTHER_KERNELS = "impl='triton' (the default) runs everywhere the MoE kernels run"
WG_M = 64  # output rows of a warpgroup's wgmma (M = 64)
_WG_M = gl.constexpr(WG_M)


# --------------------------------------------------------------------------- kernels

@gluon.jit
def _producer(w_desc, w_smem, u_smem, ready, empty_bars, eob_ptr, NOUT, K,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GATE_UP: gl.constexpr):
    """TMA warp: the block's expert's weight tiles [BLOCK_N, BLOCK_K] for this program's
    output rows, every K tile in order, into the ring (gate and up boxes on one barrier)."""
    ex = gl.load(eob_ptr + gl.program_id(0))
    n0 = gl.program_id(1) * BLOCK_N
    if GATE_UP:
        row = ex * (2 * NOUT) + n0  # the gate rows; the up rows follow F = NOUT later
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes
    else:
        row = ex * NOUT + n0
        nbytes: gl.constexpr = w_desc.block_type.nbytes
    for i in range(gl.cdiv(K, BLOCK_K)):
        s = i % STAGES
        # a fresh barrier's "previous phase" passes at once: the first STAGES waits
        mbarrier.wait(empty_bars.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(w_desc, [row, i * BLOCK_K], ready.index(s),
                                        w_smem.index(s))
        if GATE_UP:
            tma.async_copy_global_to_shared(w_desc, [row + NOUT, i * BLOCK_K], ready.index(s),
                                            u_smem.index(s))


@gluon.jit
def _load_rows(x_ptr, xoff, m_live, k0, K, x_layout: gl.constexpr, BLOCK_K: gl.constexpr):
    """The block's activation tile [MMA_N, BLOCK_K] at K offset k0 (zeros on padding rows
    and past K)."""
    k = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))  # [BLOCK_K]
    mask = gl.expand_dims(m_live, 1) & gl.expand_dims(k < K, 0)
    return gl.load(x_ptr + (gl.expand_dims(xoff, 1) + gl.expand_dims(k, 0)), mask=mask,
                   other=0.0)


@gluon.jit
def _consumer(x_ptr, pairs_ptr, wts_ptr, out_ptr, w_smem, u_smem, x_smem, ready, empty_bars,
              NOUT, K, eps, stride_xt, stride_ot, TOP_K: gl.constexpr, BLOCK: gl.constexpr,
              MMA_N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, GATE_UP: gl.constexpr, NORM: gl.constexpr):
    """The consumer warpgroup: gather, swap-AB wgmma over every K tile, epilogue."""
    b = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    # the x tile: 8 contiguous elements a thread along K, BLOCK_K // 8 threads a row
    TPW_K: gl.constexpr = BLOCK_K // 8
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [4, 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, MMA_N, 16])
    # output tile [BLOCK_N, MMA_N] with the weight-row (contiguous) axis across lanes
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])

    j = gl.arange(0, MMA_N, layout=gl.SliceLayout(1, x_layout))  # [MMA_N] rows of the tile
    pair = gl.load(pairs_ptr + b * BLOCK + j, mask=j < BLOCK, other=-1)  # -1: padding
    m_live = pair >= 0
    if GATE_UP:
        xrow = gl.where(m_live, pair // TOP_K, 0)  # the pair's token
    else:
        xrow = b * BLOCK + j  # act is by grouped row
    xoff = xrow.to(gl.int64) * stride_xt  # [MMA_N]

    acc_g = gl.zeros([BLOCK_N, MMA_N], gl.float32, acc_layout)
    acc_u = gl.zeros([BLOCK_N, MMA_N], gl.float32, acc_layout)
    ss = gl.zeros([MMA_N], gl.float32, gl.SliceLayout(1, x_layout))
    xb = x_smem.permute((1, 0))  # [BLOCK_K, MMA_N]: the B operand
    # activation tiles are loaded two K tiles ahead (two register tiles in flight), so
    # their L2 latency hides behind two iterations' wgmma and barrier waits
    xr = _load_rows(x_ptr, xoff, m_live, 0, K, x_layout, BLOCK_K)  # [MMA_N, BLOCK_K]
    xr_next = _load_rows(x_ptr, xoff, m_live, BLOCK_K, K, x_layout, BLOCK_K)
    for i in range(gl.cdiv(K, BLOCK_K)):
        s = i % STAGES
        x_smem.store(xr)
        fence_async_shared()  # so the wgmma (async proxy) sees the stores
        if NORM:
            xf = xr.to(gl.float32)
            ss += gl.sum(xf * xf, axis=1)
        xr = xr_next
        # zeros past K: the loads of the last iterations read nothing
        xr_next = _load_rows(x_ptr, xoff, m_live, (i + 2) * BLOCK_K, K, x_layout, BLOCK_K)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        tok_g = warpgroup_mma(w_smem.index(s), xb, acc_g, is_async=True)
        if GATE_UP:
            tok_u = warpgroup_mma(u_smem.index(s), xb, acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(tok_g, tok_u))
        else:
            acc_g = warpgroup_mma_wait(0, deps=(tok_g, ))
        mbarrier.arrive(empty_bars.index(s))  # slot s (and x_smem) read

    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))  # [BLOCK_N]
    jo = gl.arange(0, MMA_N, layout=gl.SliceLayout(0, out_layout))  # [MMA_N]
    pair_o = gl.convert_layout(pair, gl.SliceLayout(0, out_layout))
    live_o = pair_o >= 0
    mask = gl.expand_dims(n < NOUT, 1) & gl.expand_dims(live_o, 0)  # [BLOCK_N, MMA_N]
    g = gl.convert_layout(acc_g, out_layout)
    if GATE_UP:
        u = gl.convert_layout(acc_u, out_layout)
        if NORM:
            rstd = gl.rsqrt(gl.convert_layout(ss, gl.SliceLayout(0, out_layout)) / K + eps)
            g = g * gl.expand_dims(rstd, 0)
            u = u * gl.expand_dims(rstd, 0)
        y = g / (1.0 + gl.exp(-g)) * u  # silu(gate) * up, fp32, rounded once below
        rows = (b * BLOCK + jo).to(gl.int64)
        gl.store(out_ptr + (gl.expand_dims(rows * stride_ot, 0) + gl.expand_dims(n, 1)),
                 y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        wt = gl.load(wts_ptr + pair_o, mask=live_o, other=0.0)  # [MMA_N] fp32
        y = g * gl.expand_dims(wt, 0)
        rows = pair_o.to(gl.int64)
        gl.store(out_ptr + (gl.expand_dims(rows * stride_ot, 0) + gl.expand_dims(n, 1)), y,
                 mask=mask)


@gluon.jit
def grouped_kernel(w_desc, x_ptr, pairs_ptr, eob_ptr, nact_ptr, wts_ptr, out_ptr, NOUT, K, eps,
                   stride_xt, stride_ot, TOP_K: gl.constexpr, BLOCK: gl.constexpr,
                   MMA_N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, GATE_UP: gl.constexpr, NORM: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):
    """grid (blocks_max, cdiv(NOUT, BLOCK_N)). w_desc: [E * W_ROWS, K] with box
    [BLOCK_N, BLOCK_K], W_ROWS = 2 * NOUT (gate/up: NOUT = F, K = H) or NOUT (down:
    NOUT = H, K = F). GATE_UP: x = hidden states [T, H], out = act [rows, F] by grouped
    row. Down: x = act [rows, F], out = fp32 [T * k, H] by pair, times wts [T * k]."""
    gl.static_assert(BLOCK_N == _WG_M, "one consumer warpgroup: BLOCK_N = 64 (wgmma M)")
    gl.static_assert(MMA_N >= BLOCK and MMA_N >= 8, "the MMA's N covers the block's rows")
    if gl.program_id(0) >= gl.load(nact_ptr):
        # a block past the active ones: leave before any barrier or partition exists, so
        # no partition can wait on another
        return
    dtype: gl.constexpr = w_desc.dtype
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    if GATE_UP:
        u_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    else:
        u_smem = w_smem  # unused: the down projection has one weight tile a stage
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([MMA_N, BLOCK_K], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [MMA_N, BLOCK_K], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (x_ptr, pairs_ptr, wts_ptr, out_ptr, w_smem, u_smem, x_smem, ready,
                     empty_bars, NOUT, K, eps, stride_xt, stride_ot, TOP_K, BLOCK, MMA_N,
                     BLOCK_N, BLOCK_K, STAGES, GATE_UP, NORM)),
        (_producer, (w_desc, w_smem, u_smem, ready, empty_bars, eob_ptr, NOUT, K, BLOCK_N,
                     BLOCK_K, STAGES, GATE_UP)),
    ], [1], [PRODUCER_REGS])


# --------------------------------------------------------------------------- settings

SMEM_LIMIT = 232448  # 227 KB of shared memory per block on sm_90
STAGE_BUDGET = 160 * 1024  # weight ring bytes: deep enough to keep ~1 us of HBM in flight


@dataclass(frozen=True)
class GluonMoeSettings:
    """Launch settings of the Gluon grouped kernel (data; see settings_for).

    block: the grouping's rows a block (group()'s block; MMA_N = max(8, block) rows of
    the B operand, rows past the block zero). BLOCK_N: weight rows a program, = 64 (one
    consumer warpgroup's wgmma M). BLOCK_K: K a tile (128 = 256 bytes of a 16-bit row).
    STAGES: weight ring depth. PRODUCER_REGS: the TMA warp's setmaxnreg target.
    """
    block: int
    BLOCK_N: int = WG_M
    BLOCK_K: int = 128
    STAGES: int = 4
    PRODUCER_REGS: int = 24

    @property
    def mma_n(self) -> int:
        return max(8, self.block)

    def smem_bytes(self, gate_up: bool, elem: int = 2) -> int:
        tiles = 2 if gate_up else 1
        return elem * self.BLOCK_K * (self.STAGES * tiles * self.BLOCK_N + self.mma_n)

    def check(self, gate_up: bool = True) -> None:
        """Raise ValueError for settings the kernel cannot be built with."""
        from .moe import DOT_BLOCKS, FMA_BLOCKS
        if self.block not in FMA_BLOCKS + DOT_BLOCKS:
            raise ValueError(f"GluonMoeSettings.block must be one of {FMA_BLOCKS + DOT_BLOCKS} "
                             f"(group()'s blocks), got {self.block!r}")
        if self.BLOCK_N != WG_M:
            raise ValueError(f"GluonMoeSettings.BLOCK_N must be {WG_M} (one consumer "
                             f"warpgroup's wgmma M), got {self.BLOCK_N}")
        if self.BLOCK_K not in (64, 128, 256):
            raise ValueError(f"GluonMoeSettings.BLOCK_K must be 64, 128 or 256, got {self.BLOCK_K}")
        if not 2 <= self.STAGES <= 8:
            raise ValueError(f"GluonMoeSettings.STAGES must be in 2..8, got {self.STAGES}")
        if self.PRODUCER_REGS % 8 or not 24 <= self.PRODUCER_REGS <= 256:
            raise ValueError("GluonMoeSettings.PRODUCER_REGS: setmaxnreg takes a multiple of 8 "
                             f"in 24..256, got {self.PRODUCER_REGS}")
        if self.smem_bytes(gate_up) > SMEM_LIMIT:
            raise ValueError(f"GluonMoeSettings {self} needs {self.smem_bytes(gate_up)} bytes of "
                             f"shared memory; sm_90 has {SMEM_LIMIT}")


def default_block(T: int, top_k: int, num_experts: int) -> int:
    """Grouping rows a block for the Gluon path: 1 for one token (k distinct experts, one
    row each, MMA N = 8 with 7 zero rows); else 16 up to 16 pairs an expert on average,
    32 above. Padding costs only MMA work and zero rows, not weight bytes, while a block
    smaller than an expert's pairs makes another program stream its weights again: so
    larger blocks than the Triton FMA path's 4."""
    if T == 1:
        return 1
    return 16 if T * top_k / num_experts <= 16 else 32


def settings_for(T: int, top_k: int, num_experts: int, gate_up: bool,
                 block: int | None = None, **overrides) -> GluonMoeSettings:
    """Default settings: STAGES as deep as STAGE_BUDGET allows (5 for gate/up's two 16 KB
    boxes a stage, 6 for down's one, the cap). Unmeasured on a GPU."""
    if block is None:
        block = default_block(T, top_k, num_experts)
    tiles = 2 if gate_up else 1
    stages = max(2, min(6, STAGE_BUDGET // (tiles * WG_M * 128 * 2)))
    s = GluonMoeSettings(block=block, STAGES=stages)
    if overrides:
        from dataclasses import replace
        s = replace(s, **overrides)
    s.check(gate_up)
    return s


# --------------------------------------------------------------------------- launcher

def check_device(device) -> None:
    """Raise ValueError naming why impl='gluon' cannot run on this device (or at all yet)."""
    cc = _cc(device)
    if cc == GLUON_CC and VERIFIED_ON_GPU:
        return
    if not VERIFIED_ON_GPU:
        raise ValueError("impl='gluon' (the MoE Gluon grouped kernel) is not enabled: it has "
                         "not passed its GPU numerics (tests/test_moe_gluon.py, sm90); "
                         f"{OTHER_KERNELS}")
    where = "CPU tensors" if cc is None else f"sm_{cc}"
    raise ValueError(f"impl='gluon' (the MoE Gluon grouped kernel) runs on sm_90 (Hopper) "
                     f"only, not on {where}: it needs wgmma and TMA; {OTHER_KERNELS}")


def unsupported_reason(device, dtype) -> str | None:
    """None when the Gluon kernel can take a call on this device in this dtype, else why."""
    try:
        check_device(device)
    except ValueError as e:
        return str(e)
    if dtype not in GLUON_DTYPES:
        return f"impl='gluon' takes float16 or bfloat16, got {dtype}"
    return None


def _check_weight(name, w, N, K):
    """The [E, N, K] weight must view as [E * N, K] for TMA: packed rows, 16-byte strides."""
    E = w.shape[0]
    if w.stride(2) != 1 or w.stride(1) != K or w.stride(0) != N * K:
        raise ValueError(f"impl='gluon' needs {name} contiguous ([E, N, K] viewed as [E*N, K] "
                         f"for TMA), got strides {tuple(w.stride())}")
    if (K * w.element_size()) % 16 or w.data_ptr() % 16:
        raise ValueError(f"impl='gluon' needs {name}'s rows 16-byte aligned for TMA "
                         f"(K={K} elements of {w.element_size()} bytes)")
    return w.view(E * N, K)


def _check_call(x, w, settings, gate_up):
    reason = unsupported_reason(x.device, x.dtype)
    if reason is not None:
        raise ValueError(reason)
    if not isinstance(settings, GluonMoeSettings):
        raise TypeError(f"settings for impl='gluon' must be None or a GluonMoeSettings, got "
                        f"{type(settings).__name__}")
    settings.check(gate_up)


def _launch(x, w2, grouping, wts, out, NOUT, K, eps, norm, s, gate_up):
    name = DTYPE_NAMES[x.dtype]  # fp16 / bf16: the launcher checked it
    desc = _descriptor(w2, (s.BLOCK_N, s.BLOCK_K), name)
    grid = (grouping.sorted_pairs.shape[0] // s.block, cdiv(NOUT, s.BLOCK_N))
    grouped_kernel[grid](desc, x, grouping.sorted_pairs, grouping.expert_of_block,
                         grouping.num_active_blocks, wts, out, NOUT, K, float(eps),
                         x.stride(0), out.stride(0), TOP_K=grouping.top_k, BLOCK=s.block,
                         MMA_N=s.mma_n, BLOCK_N=s.BLOCK_N, BLOCK_K=s.BLOCK_K, STAGES=s.STAGES,
                         GATE_UP=gate_up, NORM=norm, PRODUCER_REGS=s.PRODUCER_REGS,
                         num_warps=4)


def gate_up(x, w_gate_up, grouping, norm_eps=None, settings=None):
    """act [rows_max, F] = silu(x Wg_e^T) * (x Wu_e^T) by grouped row (moe.moe_gate_up's
    contract; inputs validated there). settings: None or a GluonMoeSettings whose block
    is the grouping's. Raises ValueError while the kernel is refused (check_device)."""
    T, H = x.shape
    F = w_gate_up.shape[1] // 2
    if settings is None:
        settings = settings_for(T, grouping.top_k, grouping.num_experts, True,
                                block=grouping.block)
    _check_call(x, w_gate_up, settings, True)
    w2 = _check_weight("w_gate_up", w_gate_up, 2 * F, H)
    if settings.block != grouping.block:
        raise ValueError(f"settings.block={settings.block} differs from the grouping's "
                         f"block={grouping.block}")
    act = empty((grouping.sorted_pairs.shape[0], F), x.dtype, x.device)
    _launch(x, w2, grouping, act, act, F, H, norm_eps or 0.0, norm_eps is not None,
            settings, True)
    return act


def down(act, w_down, grouping, topk_weights, settings=None):
    """fp32 per-pair rows y [T * k, H] = weight[pair] * (act[row] @ Wd_e^T), by pair index
    (moe.moe_down_combine's first half; inputs validated there); every pair row is written
    once. settings as in gate_up."""
    H, F = w_down.shape[1], w_down.shape[2]
    T = topk_weights.shape[0]
    if settings is None:
        settings = settings_for(T, grouping.top_k, grouping.num_experts, False,
                                block=grouping.block)
    _check_call(act, w_down, settings, False)
    w2 = _check_weight("w_down", w_down, H, F)
    if settings.block != grouping.block:
        raise ValueError(f"settings.block={settings.block} differs from the grouping's "
                         f"block={grouping.block}")
    y = empty((T * grouping.top_k, H), torch.float32, act.device)
    _launch(act, w2, grouping, topk_weights, y, H, F, 0.0, False, settings, False)
    return y


def compile_spec(cc: int = 90, kernel: str = "gate_up", *, T: int = 8, H: int = 2048,
                 E: int = 128, top_k: int = 8, F: int = 768, dtype: str = "bf16",
                 norm: bool = True, settings: GluonMoeSettings | None = None) -> dict:
    """What ``triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget(
    "cuda", cc, 32), options=options)`` needs to build the kernel with no GPU.

    kernel: "gate_up" (K = H, NOUT = F) or "down" (K = F, NOUT = H). E and top_k only
    pick the default block (settings_for)."""
    if cc != GLUON_CC:
        raise ValueError(f"cc={cc}: the Gluon grouped kernel builds for sm_90 only (wgmma, "
                         "TMA, setmaxnreg)")
    if kernel not in ("gate_up", "down"):
        raise ValueError(f"kernel must be 'gate_up' or 'down', got {kernel!r}")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16', got {dtype!r}")
    gate_up_ = kernel == "gate_up"
    s = settings if settings is not None else settings_for(T, top_k, E, gate_up_)
    s.check(gate_up_)
    box = (s.BLOCK_N, s.BLOCK_K)
    desc = f"tensordesc<{dtype}[{box[0]},{box[1]}],{_layout(box, dtype)!r}>"
    signature = {"w_desc": desc, "x_ptr": f"*{dtype}", "pairs_ptr": "*i32", "eob_ptr": "*i32",
                 "nact_ptr": "*i32", "wts_ptr": f"*{dtype}" if gate_up_ else "*fp32",
                 "out_ptr": f"*{dtype}" if gate_up_ else "*fp32", "NOUT": "i32", "K": "i32",
                 "eps": "fp32", "stride_xt": "i32", "stride_ot": "i32"}
    constexprs = dict(TOP_K=top_k, BLOCK=s.block, MMA_N=s.mma_n, BLOCK_N=s.BLOCK_N,
                      BLOCK_K=s.BLOCK_K, STAGES=s.STAGES, GATE_UP=gate_up_,
                      NORM=bool(norm) and gate_up_, PRODUCER_REGS=s.PRODUCER_REGS)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return {"fn": grouped_kernel, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": 4}}
