"""One kernel that exchanges decode states between GPUs and merges them.

Sequence-parallel decode ends with every rank holding a partial state (out [R, D],
lse [R]; R = B * Hq rows) that all ranks must merge. As separate steps that is a pack,
an all-gather (a collective, or two barriers around peer copies) and a merge: four to
six launches and two cross-GPU round trips for a few hundred KB. Here it is one launch
and one signal per peer:

1. each program takes BLOCK_R rows, packs them as fp32 [rows, D+4] (rows whose shard is
   empty become (0, -inf)), and stores them straight into slot [parity][rank] of every
   peer's receive buffer (NVLink stores into torch symmetric memory);
2. it raises its flag in every peer's flag array to this step's epoch (a release at
   system scope, after a CTA barrier, so the stores are visible first);
3. it waits until every peer's flag for the same program reaches the epoch (acquire),
   then folds slots 0..W-1 of its own buffer with ``merge_step`` in rank order: the same
   arithmetic, in the same order, as ``merge_states`` over an all-gather, so both
   exchanges give the same bits.

Program i only ever waits for program i of its peers, which never waits on anything
else of its own launch: no grid-wide barrier, and no deadlock however the programs are
scheduled. The epoch is a per-program int64 device counter (graph replays keep counting;
int32 would wrap after 2**31 steps, a few weeks of serving, and then hang or mix parities).
Two parities make reuse safe without a second barrier: the slot written at step e was
last read at step e-2 by the peer, whose step e-1 signal (already waited for) was sent
after that read, because its kernels run in stream order.

PHASES is 3 on a GPU (write + signal, then wait + merge). The CPU tests run the
interpreter with 1 (every simulated rank writes) then 2 (every rank merges), since one
process cannot run W spinning kernels at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._intmath import cdiv
from .merge import _block_rows as block_rows  # the merge kernel's tile: ~4K fp32 a program
from .merge import merge_finish, merge_step


@triton.jit
def exchange_merge_kernel(o_ptr, lse_ptr, seqlens_ptr, out_ptr, out_lse_ptr,
                          data_ptr, flag_ptr, epoch_ptr, peer_data_off_ptr, peer_flag_off_ptr,
                          R, HQ,
                          RANK: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
                          BLOCK_R: tl.constexpr, NPROG: tl.constexpr, PHASES: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, D)  # [D]
    live = rows < R
    epoch = tl.load(epoch_ptr + pid) + 1
    parity = epoch % 2
    # A received row is D outputs and the LSE, padded to D + 4 floats (ROW_PAD) so rows stay
    # 16-byte aligned and the stores over NVLink go out as 128-bit vectors.
    row_off = rows.to(tl.int64)[:, None] * (D + 4) + cols[None, :]  # [BLOCK_R, D]
    lse_off = rows.to(tl.int64) * (D + 4) + D  # [BLOCK_R]
    slot_elems = R.to(tl.int64) * (D + 4)

    if PHASES % 2 == 1:  # write this rank's rows into every peer's slot, then signal
        o = tl.load(o_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=live, other=float("-inf"))
        empty = tl.load(seqlens_ptr + rows // HQ, mask=live, other=0) == 0
        o = tl.where(empty[:, None], 0.0, o)
        lse = tl.where(empty, float("-inf"), lse)
        my_slot = (parity * W + RANK) * slot_elems
        for p in tl.static_range(W):
            # peer buffers are allocations of their own: 16-byte aligned like data_ptr
            peer = data_ptr + tl.multiple_of(tl.load(peer_data_off_ptr + p), 4) + my_slot
            tl.store(peer + row_off, o, mask=live[:, None])
            tl.store(peer + lse_off, lse, mask=live)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        for p in tl.static_range(W):
            flag = flag_ptr + tl.load(peer_flag_off_ptr + p) + RANK * NPROG + pid
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")

    if PHASES >= 2:  # wait for every peer's rows of this block, merge in rank order
        for p in tl.static_range(W):
            seen = tl.atomic_add(flag_ptr + p * NPROG + pid, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(flag_ptr + p * NPROG + pid, 0, sem="acquire", scope="sys")
        # One thread's acquire, then a CTA barrier: every thread's loads below are ordered
        # after the peers' stores. (".cv" asks not to use a cached copy; Triton 3.6 emits a
        # plain ld.global for it on sm_90, the acquire is what the ordering rests on.)
        tl.debug_barrier()
        acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        den = tl.zeros([BLOCK_R], dtype=tl.float32)
        for p in tl.static_range(W):
            slot = data_ptr + (parity * W + p) * slot_elems
            lse_p = tl.load(slot + lse_off, mask=live, other=float("-inf"), cache_modifier=".cv")
            o_p = tl.load(slot + row_off, mask=live[:, None], other=0.0, cache_modifier=".cv")
            acc, m, den = merge_step(acc, m, den, o_p, lse_p)
        out, out_lse = merge_finish(acc, m, den)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(out_lse_ptr + rows, out_lse, mask=live)
        tl.store(epoch_ptr + pid, epoch)


ROW_PAD = 4  # a received row: D outputs, the LSE, 3 floats of padding


def buffer_shape(world_size: int, R: int, D: int) -> tuple[int, ...]:
    """The receive buffer of one rank: [2 parities, W source ranks, R rows, D + 4]."""
    return (2, world_size, R, D + ROW_PAD)


def num_programs(R: int, D: int) -> int:
    return cdiv(R, block_rows(D))


FLAG_DTYPE = torch.int64  # flags and epochs: never wrap


def launch(o, lse, seqlens, out, out_lse, data, flags, epochs, peer_data_off, peer_flag_off,
           rank: int, world_size: int, phases: int = 3):
    """Run the exchange-and-merge for one step (all arguments prepared by the caller).

    o [R, D] (any float dtype), lse [R] fp32, seqlens int32 [B] (R = B * Hq; rows of a
    sequence with seqlens 0 count as empty), out [R, D], out_lse [R] fp32; data: this
    rank's fp32 receive buffer [2, W, R, D+4]; flags: its int64 flags [W, NPROG]; epochs
    int64 [NPROG]; peer_data_off / peer_flag_off int64 [W]: element offsets from data /
    flags to each peer's buffer (0 for this rank)."""
    R, D = o.shape
    B = seqlens.shape[0]
    nprog = num_programs(R, D)
    exchange_merge_kernel[(nprog,)](
        o, lse, seqlens, out, out_lse, data, flags, epochs, peer_data_off, peer_flag_off,
        R, R // B, RANK=rank, W=world_size, D=D, BLOCK_R=block_rows(D), NPROG=nprog,
        PHASES=phases, num_warps=4)
