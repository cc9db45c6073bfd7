"""sm_90 Gluon persistent kernel: a dense decode layer's o projection, gate/up and down at
one row, in one launch.

What it replaces: three GEMV launches a layer of the step (o + residual, gate/up with the
FlashNorm scale and SiLU, down + residual; notes/decode_step.md, "What next" item 1),
each with its own ramp, tail and PDL boundary. Here one CTA an SM streams every weight
tile it owns through one TMA ring, and the ring never drains at a phase boundary: the
weights do not depend on the activations, so the TMA loads of the next phase's first
tiles are in flight while the CTA waits at the grid barrier for the activations.

Phases (x is one row; partials fp32, deterministic: every sum runs in a fixed order):

  P0  o:       po[s, n] = sum over K split s of Wo[n, k] a[k]          (S0 splits of QD)
  --- grid barrier
  P1  gate/up: h = bf16(res + po[0] + ... + po[S0-1]); r = rsqrt(mean(h^2) + eps);
               act[f] = bf16(silu(r * Wg[f].h) * (r * Wu[f].h))
  --- grid barrier
  P2  down:    pd[s, n] = sum over K split s of Wd[n, k] act[k]        (S2 splits of F)
  --- grid barrier
  P3  out[n] = bf16(h[n] + pd[0, n] + ... + pd[S2-1, n])                (h recomputed)

The roundings are the three-launch chain's (h and act in the model dtype, one rounding
each); the sums' order differs, so the two agree to fp32 rounding, not bit for bit.

Work: tile t of a phase goes to CTA t mod G (G = the grid, one CTA an SM; the launch is
cooperative, so all G are resident and the spin barrier cannot deadlock). A ring slot is
[BN = 128, BK] of the model dtype: 128 rows of Wo / Wd, or 64 gate rows and their 64 up
rows. The grid barrier is a monotonic int64 counter: each launch adds 3 G, and a CTA
finds its launch's base as the value it reads at the start rounded down to a multiple of
3 G (fewer than G arrivals of its own launch can precede that read), so the counter never
needs a reset between launches.
"""

from __future__ import annotations

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ._gluon_host import tma_descriptor as _descriptor

BN = 128  # rows of a ring slot
HALF = 64  # gate rows (and up rows) of a gate/up slot
BK = 128  # K of a slot: 256 bytes of a 16-bit row
P3_COLS = 32  # outputs a CTA finishes in P3
NUM_WARPS = 8
_P3_COLS = gl.constexpr(P3_COLS)
_NUM_WARPS = gl.constexpr(NUM_WARPS)
SMEM_LIMIT = 232448  # 227 KB a block on sm_90


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _stamp(ts_ptr, i: gl.constexpr, TIMING: gl.constexpr):
    if TIMING:
        gl.store(ts_ptr + gl.program_id(0) * 16 + i, _now())


@gluon.jit
def _fence_acq_rel():
    gl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _grid_barrier(sync_ptr, target, SYNC: gl.constexpr):
    """Every CTA's global writes before it, visible to every CTA after it.
    SYNC 0: release add, acquire spin; 1: release add, relaxed spin, one acq_rel fence;
    2: relaxed add and spin (a timing probe); 3: none (a timing probe, wrong results)."""
    gl.thread_barrier()  # this CTA's stores precede the release below
    if SYNC == 0:
        gl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        while gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
    elif SYNC == 1:
        gl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        while gl.load(sync_ptr, volatile=True) < target:
            pass
        _fence_acq_rel()
    elif SYNC == 2:
        gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        while gl.load(sync_ptr, volatile=True) < target:
            pass
    gl.thread_barrier()


@gluon.jit
def _issue(j, c, G, n0c, n1c, wo_desc, wgu_desc, wd_desc, ring, ready,
           QD: gl.constexpr, H: gl.constexpr, F: gl.constexpr, S0: gl.constexpr,
           S2: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """TMA of the CTA's chunk j (its work in order: P0 tiles, P1 tiles, P2 tiles, each
    tile's K chunks in order) into ring slot j mod STAGES."""
    C0: gl.constexpr = QD // S0 // BK
    C1: gl.constexpr = H // BK
    C2: gl.constexpr = F // S2 // BK
    HALF: gl.constexpr = BN // 2
    s = j % STAGES
    bar = ready.index(s)
    slot = ring.index(s)
    mbarrier.expect(bar, BN * BK * 2)
    if j < n0c:
        i = j // C0
        t = c + i * G
        tma.async_copy_global_to_shared(
            wo_desc, [(t // S0) * BN, (t % S0) * (QD // S0) + (j - i * C0) * BK], bar, slot)
    elif j < n0c + n1c:
        jj = j - n0c
        i = jj // C1
        t = c + i * G
        k = (jj - i * C1) * BK
        tma.async_copy_global_to_shared(wgu_desc, [t * HALF, k], bar, slot.slice(0, HALF))
        tma.async_copy_global_to_shared(wgu_desc, [F + t * HALF, k], bar,
                                        slot.slice(HALF, HALF))
    else:
        jj = j - n0c - n1c
        i = jj // C2
        t = c + i * G
        tma.async_copy_global_to_shared(
            wd_desc, [(t // S2) * BN, (t % S2) * (F // S2) + (jj - i * C2) * BK], bar, slot)


@gluon.jit
def _rows(r0, pl: gl.constexpr, R: gl.constexpr, BK: gl.constexpr):
    """Offsets [R, BK] of x rows r0 .. r0 + R - 1 (BK elements a row)."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, pl))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, pl))
    return gl.expand_dims((r0 + r) * BK, 1) + gl.expand_dims(k, 0)


@gluon.jit
def _fill_x(xs, src_ptr, KR: gl.constexpr, pl: gl.constexpr, R: gl.constexpr,
            BK: gl.constexpr):
    """x smem rows [0, KR) <- src [KR * BK], R rows a load."""
    for r0 in gl.static_range(0, KR, R):
        xs.slice(r0, R).store(gl.load(src_ptr + _rows(r0, pl, R, BK), cache_modifier=".cg"))


@gluon.jit
def _h_rows(res_ptr, po_ptr, offs, H: gl.constexpr, S0: gl.constexpr):
    """bf16(res + po[0] + ... + po[S0-1]) at offs, the sums in fp32 in that order."""
    acc = gl.load(res_ptr + offs, cache_modifier=".cg").to(gl.float32)
    for s in gl.static_range(S0):
        acc += gl.load(po_ptr + s * H + offs, cache_modifier=".cg")
    return acc.to(res_ptr.dtype.element_ty)


@gluon.jit
def _chunk(j, xrow, acc, c, G, n0c, n1c, total, wo_desc, wgu_desc, wd_desc, ring, ready, xc,
           QD: gl.constexpr, H: gl.constexpr, F: gl.constexpr, S0: gl.constexpr,
           S2: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
           wl: gl.constexpr):
    """acc += W chunk j . x row xrow; refills chunk j's slot with chunk j + STAGES."""
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    w = ring.index(s).load(wl)
    gl.thread_barrier()  # slot s read by every warp before the TMA refills it
    if j + STAGES < total:
        _issue(j + STAGES, c, G, n0c, n1c, wo_desc, wgu_desc, wd_desc, ring, ready, QD, H, F,
               S0, S2, STAGES, BN, BK)
    xk = xc.index(xrow).load(gl.SliceLayout(0, wl)).to(gl.float32)
    return acc + gl.sum(w.to(gl.float32) * gl.expand_dims(xk, 0), axis=1)


@gluon.jit
def mlp_kernel(wo_desc, wgu_desc, wd_desc, attn_ptr, res_ptr, out_ptr, po_ptr, act_ptr, pd_ptr,
               sync_ptr, ts_ptr, eps, QD: gl.constexpr, H: gl.constexpr, F: gl.constexpr,
               S0: gl.constexpr, S2: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr,
               BN: gl.constexpr, BK: gl.constexpr, PDL: gl.constexpr,
               TIMING: gl.constexpr = False, SYNC: gl.constexpr = 0,
               BASE_RELAXED: gl.constexpr = False):
    """grid (G,), one CTA an SM, cooperative. wo_desc [H, QD] box [BN, BK]; wgu_desc
    [2F, H] box [BN / 2, BK] (gate rows, then up rows, the norm weight folded in); wd_desc
    [H, F] box [BN, BK]. attn [QD], res / out [H] (out may be res), po [S0, H] and pd
    [S2, H] fp32, act [F]: the model dtype unless named. KC: rows of x's buffer,
    max(QD, H, F) // BK rounded up to a power of two. TIMING: %globaltimer at each phase
    boundary into ts [G, 16]; SYNC: _grid_barrier's variants; BASE_RELAXED: the counter's
    first read a volatile load instead of an acquire."""
    c = gl.program_id(0)
    G = gl.num_programs(0)
    dtype: gl.constexpr = wo_desc.dtype
    HALF: gl.constexpr = BN // 2
    C0: gl.constexpr = QD // S0 // BK
    C1: gl.constexpr = H // BK
    C2: gl.constexpr = F // S2 // BK
    T0: gl.constexpr = H // BN * S0
    T1: gl.constexpr = F // HALF
    T2: gl.constexpr = H // BN * S2
    _stamp(ts_ptr, 0, TIMING)
    m0 = gl.maximum(T0 - c + G - 1, 0) // G  # this CTA's tiles of each phase
    m1 = gl.maximum(T1 - c + G - 1, 0) // G
    m2 = gl.maximum(T2 - c + G - 1, 0) // G
    n0c = m0 * C0
    n1c = m1 * C1
    total = n0c + n1c + m2 * C2

    # 8 contiguous K a thread, the rest of a warp along rows: a weight row's dot product
    # stays in-thread but for a shuffle or two; x broadcasts from shared memory
    wl: gl.constexpr = gl.BlockedLayout([1, 8], [BN // _NUM_WARPS, 32 * _NUM_WARPS // BN],
                                        [_NUM_WARPS, 1], [1, 0])
    R: gl.constexpr = 256 // BK * _NUM_WARPS  # x rows a fill load covers
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BK, BK // 8], [_NUM_WARPS, 1], [1, 0])
    vl: gl.constexpr = gl.BlockedLayout([1], [32], [_NUM_WARPS], [0])

    ring = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], wo_desc.layout)
    # x of the phase, [KC, BK], unswizzled: filled R rows at a time through xs, read a
    # chunk (a row) at a time through xc, the same bytes with a rank-1 layout (index()
    # keeps the layout, whose rank must match the row's)
    xs = gl.allocate_shared_memory(dtype, [KC, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    xc = xs._reinterpret(dtype, [KC, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    gu = gl.allocate_shared_memory(gl.float32, [BN], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    # the weights need nothing from the previous kernel: start the ring before the wait
    for p in gl.static_range(STAGES):
        if p < total:
            _issue(p, c, G, n0c, n1c, wo_desc, wgu_desc, wd_desc, ring, ready, QD, H, F, S0,
                   S2, STAGES, BN, BK)
    _stamp(ts_ptr, 8, TIMING)
    if PDL:
        _gdc_wait()
    _stamp(ts_ptr, 9, TIMING)
    if BASE_RELAXED:
        v0 = gl.load(sync_ptr, volatile=True)
    else:
        v0 = gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    base = v0 - v0 % (3 * G)
    _stamp(ts_ptr, 1, TIMING)

    j = 0
    # ---- P0: o projection partials
    _fill_x(xs, attn_ptr, QD // BK, pl, R, BK)
    gl.thread_barrier()
    for i in range(m0):
        t = c + i * G
        acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, wl))
        for q in range(C0):
            acc = _chunk(j, (t % S0) * C0 + q, acc, c, G, n0c, n1c, total, wo_desc, wgu_desc,
                         wd_desc, ring, ready, xc, QD, H, F, S0, S2, STAGES, BN, BK, wl)
            j += 1
        n = (t // S0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, wl))
        gl.store(po_ptr + (t % S0) * H + n, acc)
    _stamp(ts_ptr, 2, TIMING)
    _grid_barrier(sync_ptr, base + G, SYNC)
    _stamp(ts_ptr, 3, TIMING)

    # ---- P1: h, its FlashNorm scale, gate/up + SiLU
    ssv = gl.zeros([R, BK], gl.float32, pl)
    for r0 in gl.static_range(0, H // BK, R):
        hb = _h_rows(res_ptr, po_ptr, _rows(r0, pl, R, BK), H, S0)
        xs.slice(r0, R).store(hb)
        hf = hb.to(gl.float32)
        ssv += hf * hf
    rstd = gl.rsqrt(gl.sum(gl.sum(ssv, axis=1), axis=0) / H + eps)
    gl.thread_barrier()
    for i in range(m1):
        t = c + i * G
        acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, wl))
        for q in range(C1):
            acc = _chunk(j, q, acc, c, G, n0c, n1c, total, wo_desc, wgu_desc, wd_desc, ring,
                         ready, xc, QD, H, F, S0, S2, STAGES, BN, BK, wl)
            j += 1
        # the slot's first BN / 2 rows are gate rows, the rest their up rows: pair them up
        gu.store(acc)
        gl.thread_barrier()
        g = gu.slice(0, HALF).load(vl) * rstd
        u = gu.slice(HALF, HALF).load(vl) * rstd
        y = g / (1.0 + gl.exp(-g)) * u
        f = t * HALF + gl.arange(0, HALF, layout=vl)
        gl.store(act_ptr + f, y.to(act_ptr.dtype.element_ty))
        gl.thread_barrier()  # gu read before the next tile stores it
    _stamp(ts_ptr, 4, TIMING)
    _grid_barrier(sync_ptr, base + 2 * G, SYNC)
    _stamp(ts_ptr, 5, TIMING)

    # ---- P2: down projection partials
    _fill_x(xs, act_ptr, F // BK, pl, R, BK)
    gl.thread_barrier()
    for i in range(m2):
        t = c + i * G
        acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, wl))
        for q in range(C2):
            acc = _chunk(j, (t % S2) * C2 + q, acc, c, G, n0c, n1c, total, wo_desc, wgu_desc,
                         wd_desc, ring, ready, xc, QD, H, F, S0, S2, STAGES, BN, BK, wl)
            j += 1
        n = (t // S2) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, wl))
        gl.store(pd_ptr + (t % S2) * H + n, acc)
    _stamp(ts_ptr, 6, TIMING)
    _grid_barrier(sync_ptr, base + 3 * G, SYNC)

    # ---- P3: out = h + the down partials
    if PDL:
        _gdc_launch_dependents()
    for n0 in range(c * _P3_COLS, H, G * _P3_COLS):
        n = n0 + gl.arange(0, _P3_COLS, layout=vl)
        o = _h_rows(res_ptr, po_ptr, n, H, S0).to(gl.float32)
        for s in gl.static_range(S2):
            o += gl.load(pd_ptr + s * H + n, cache_modifier=".cg")
        gl.store(out_ptr + n, o.to(out_ptr.dtype.element_ty))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    _stamp(ts_ptr, 7, TIMING)


# --------------------------------------------------------------------------- host

def splits(QD: int, H: int, F: int, G: int, bn: int = BN, bk: int = BK) -> tuple[int, int]:
    """(S0, S2): the o and down K splits in 1..8 that minimise the busiest CTA's chunks
    (its tiles times the chunks a tile), the fewest splits on a tie."""
    def pick(K):
        best = None
        for s in (1, 2, 4, 8):
            if (K // s) % bk or K % s:
                break
            cost = -(-(H // bn * s) // G) * (K // s)
            if best is None or cost < best[0]:
                best = (cost, s)
        return best[1]
    return pick(QD), pick(F)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def smem_bytes(stages: int, KC: int, bn: int = BN, bk: int = BK, elem: int = 2) -> int:
    return stages * bn * bk * elem + KC * bk * elem + bn * 4 + stages * 8


def plan(QD, H, F, G, bn=BN, bk=BK, stages=None):
    """The launch's constexprs for a shape: splits, x rows, ring depth."""
    S0, S2 = splits(QD, H, F, G, bn, bk)
    rows = 256 // bk * NUM_WARPS  # x rows a fill load covers
    for name, v, m in (("QD", QD, bk * S0), ("H", H, bn), ("F", F, bk * S2),
                       ("F", F, bn // 2), ("H", H, P3_COLS), ("QD", QD, bk * rows),
                       ("H", H, bk * rows), ("F", F, bk * rows)):
        if v % m:
            raise ValueError(f"mlp_gluon: {name}={v} must be a multiple of {m}")
    KC = _pow2(max(QD, H, F) // bk)
    if stages is None:
        stages = 12
        while smem_bytes(stages, KC, bn, bk) + 4096 > SMEM_LIMIT:
            stages -= 1
    return dict(QD=QD, H=H, F=F, S0=S0, S2=S2, STAGES=stages, KC=KC, BN=bn, BK=bk)


class MlpWorkspace:
    """The launch's fp32 partials, act and the grid-barrier counter (zeroed once)."""

    def __init__(self, QD, H, F, dtype, device, G=None):
        G = G or torch.cuda.get_device_properties(device).multi_processor_count
        self.po = torch.empty((8, H), dtype=torch.float32, device=device)
        self.pd = torch.empty((8, H), dtype=torch.float32, device=device)
        self.act = torch.empty((F,), dtype=dtype, device=device)
        self.sync = torch.zeros((1,), dtype=torch.int64, device=device)
        self.ts = torch.zeros((G, 16), dtype=torch.int64, device=device)


def mlp_one_row(attn, res, wo, w_gate_up, w_down, eps, *, out=None, ws=None, bn=BN, bk=BK,
                stages=None, grid=None, pdl=True, cooperative=True, timing=False,
                sync=0, base_relaxed=False):
    """out [1, H] = res + down(silu(g) * u), g / u = the FlashNorm-scaled gate/up of
    h = res + o(attn): one launch. attn [1, QD], res [1, H], wo [H, QD], w_gate_up [2F, H]
    (norm weight folded), w_down [H, F]; contiguous, bf16 / fp16, sm_90."""
    H, QD = wo.shape
    F = w_down.shape[1]
    dev = attn.device
    G = grid or torch.cuda.get_device_properties(dev).multi_processor_count
    c = plan(QD, H, F, G, bn, bk, stages)
    if ws is None:
        ws = MlpWorkspace(QD, H, F, attn.dtype, dev, G)
    if out is None:
        out = torch.empty_like(res)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[attn.dtype]
    wo_d = _descriptor(wo, (bn, bk), name)
    wgu_d = _descriptor(w_gate_up, (bn // 2, bk), name)
    wd_d = _descriptor(w_down, (bn, bk), name)
    mlp_kernel[(G,)](wo_d, wgu_d, wd_d, attn, res, out, ws.po, ws.act, ws.pd, ws.sync, ws.ts,
                     float(eps), **c, PDL=pdl, TIMING=timing, SYNC=sync,
                     BASE_RELAXED=base_relaxed,
                     num_warps=NUM_WARPS, launch_pdl=pdl, launch_cooperative_grid=cooperative)
    return out


def compile_spec(QD=2048, H=2048, F=8192, G=132, bn=BN, bk=BK, stages=None, dtype="bf16",
                 pdl=True):
    from ._gluon_host import nvmma_layout as _layout
    const = plan(QD, H, F, G, bn, bk, stages)
    const["PDL"] = pdl
    d = lambda box: f"tensordesc<{dtype}[{box[0]},{box[1]}],{_layout(box, dtype)!r}>"
    sig = {"wo_desc": d((bn, bk)), "wgu_desc": d((bn // 2, bk)), "wd_desc": d((bn, bk)),
           "attn_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
           "po_ptr": "*fp32", "act_ptr": f"*{dtype}", "pd_ptr": "*fp32", "sync_ptr": "*i64",
           "ts_ptr": "*i64", "eps": "fp32"}
    sig.update(dict.fromkeys(const, "constexpr"))
    return {"fn": mlp_kernel, "signature": sig, "constexprs": const,
            "options": {"num_warps": NUM_WARPS}}
