"""The tile table of a packed (varlen) prefill launch, built on the device.

A varlen launch cannot size its grid to the pack's real tiles without reading
cu_seqlens on the host (a synchronisation). Padding every sequence to the longest one
does not need that, but on a pack of mixed lengths most of its CTAs have nothing to do
(a 16k-token pack of 11 sequences of 225-3851 tokens: 341 row blocks a head, 133 real),
and on the warp-specialized kernel each of them still takes an SM's whole shared memory
to start and leave. The number of real tiles is bounded by shapes the host knows:

    sum_b cdiv(len_b, BLOCK_M) <= cdiv(Tq, BLOCK_M) + n_seq

so a grid of that many tiles a head holds them all with at most one spare a sequence,
and one small kernel writes which (sequence, head, row block) each CTA takes:

    tiles[t]             sequence b of tile t, or -1 for a spare
    tiles[n_tiles + t]   head * 65536 + row block (0 for a spare)

in the order the plain grid walks them: sequence by sequence, a sequence's heads in
turn, a head's row blocks fastest (causal: from the last, which has the most keys).

``longest_first=True`` (constexpr LONGEST_FIRST) orders the sequences by their key count
(with a cached prefix, the longest tiles; in plain prefill, the longest sequence), most
first (ties in pack order), each sequence's tiles in the same order as above. CTAs start
roughly in table order, so a long sequence packed last no longer leaves its heaviest
tiles to the end of the launch while most SMs idle; a sequence's tiles stay together,
so its K/V stays hot in L2 as before. Any order is correct (each tile is computed once,
on its own): the switch moves only when tiles start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._intmath import cdiv

# Tiles a program of the table kernel writes, and sequences it reads at a time (a loop
# covers any count): its [PIDS, SEQS] match tile at 4 warps compiles for sm_90 in 56
# registers, no spills (128 x 64 spilled at 255).
PIDS = 64
SEQS = 32
WARPS = 4
CODE_BASE = 65536  # head * CODE_BASE + row block: both must stay below it
_CODE = tl.constexpr(CODE_BASE)


# n_seq and n_tiles change with every pack: not specialized (a value of 1 or a multiple of
# 16 would each be another build)
@triton.jit(do_not_specialize=["n_seq", "n_tiles"])
def _varlen_tiles_kernel(cu_q, tiles, n_seq, n_tiles, Hq, BLOCK_M: tl.constexpr,
                         CAUSAL: tl.constexpr, PIDS: tl.constexpr, SEQS: tl.constexpr,
                         LONGEST_FIRST: tl.constexpr = False, cu_k=None,
                         KEY_COUNTS: tl.constexpr = False):
    # grid (cdiv(n_tiles, PIDS),): tiles t of this program, found in the running prefix of
    # the sequences' tile counts (Hq * their row blocks), SEQS sequences at a time
    t = tl.program_id(0) * PIDS + tl.arange(0, PIDS)  # [PIDS]
    seq = tl.zeros([PIDS], dtype=tl.int32)
    rank = tl.zeros([PIDS], dtype=tl.int32)  # t's place among its sequence's tiles
    blocks = tl.zeros([PIDS], dtype=tl.int32)  # its sequence's row blocks
    found = tl.zeros([PIDS], dtype=tl.int32)
    carry = tl.zeros([], dtype=tl.int32)  # tiles of the sequences before this chunk
    for c in range(0, n_seq, SEQS):
        i = c + tl.arange(0, SEQS)  # [SEQS]
        live = i < n_seq
        length = tl.load(cu_q + i + 1, mask=live, other=0) - tl.load(cu_q + i, mask=live,
                                                                     other=0)
        nb = tl.where(live, (length + BLOCK_M - 1) // BLOCK_M, 0)
        if LONGEST_FIRST:
            # the tiles of every sequence j placed before i: more keys (its heaviest tile
            # is the longest), or as many and earlier in the pack (a strict order, so the
            # ranges still tile [0, total))
            key = _key_count(cu_k, i, live, KEY_COUNTS)
            excl = tl.zeros([SEQS], dtype=tl.int32)
            for c2 in range(0, n_seq, SEQS):
                j = c2 + tl.arange(0, SEQS)  # [SEQS]
                live_j = j < n_seq
                len_j = tl.load(cu_q + j + 1, mask=live_j, other=0) - \
                    tl.load(cu_q + j, mask=live_j, other=0)
                key_j = _key_count(cu_k, j, live_j, KEY_COUNTS)
                nb_j = tl.where(live_j, (len_j + BLOCK_M - 1) // BLOCK_M, 0)
                before = (key_j[None, :] > key[:, None]) | \
                    ((key_j[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
                excl += tl.sum(tl.where(before, nb_j[None, :] * Hq, 0), 1)
            incl = excl + nb * Hq
        else:
            incl = tl.cumsum(nb * Hq, 0) + carry  # [SEQS]: tiles up to and including i
            excl = incl - nb * Hq
        hit = (excl[None, :] <= t[:, None]) & (t[:, None] < incl[None, :])  # [PIDS, SEQS]
        seq += tl.sum(tl.where(hit, i[None, :], 0), 1)
        rank += tl.sum(tl.where(hit, t[:, None] - excl[None, :], 0), 1)
        blocks += tl.sum(tl.where(hit, nb[None, :], 0), 1)
        found += tl.sum(hit.to(tl.int32), 1)
        carry += tl.sum(nb * Hq, 0)
    real = found > 0
    nb = tl.maximum(blocks, 1)
    h = rank // nb
    m = rank % nb
    if CAUSAL:
        m = nb - 1 - m
    mine = t < n_tiles
    tl.store(tiles + t, tl.where(real, seq, -1), mask=mine)
    tl.store(tiles + n_tiles + t, tl.where(real, h * _CODE + m, 0), mask=mine)


@triton.jit
def _key_count(cu_k, i, live, KEY_COUNTS: tl.constexpr):
    # sequence i's keys: cu_k[i] itself (KEY_COUNTS: the paged build's seqlens_k), or the
    # difference of the running counts
    if KEY_COUNTS:
        return tl.load(cu_k + i, mask=live, other=0)
    return tl.load(cu_k + i + 1, mask=live, other=0) - tl.load(cu_k + i, mask=live, other=0)


def tile_bound(Tq: int, n_seq: int, block_m: int, max_seqlen_q: int | None = None) -> int:
    """Row blocks a head that hold every real tile of a pack of n_seq sequences and Tq
    tokens: cdiv(Tq, block_m) + n_seq, or fewer when every sequence is at most
    max_seqlen_q long (n_seq * cdiv(max_seqlen_q, block_m))."""
    bound = cdiv(Tq, block_m) + n_seq
    if max_seqlen_q is not None:
        bound = min(bound, n_seq * cdiv(max_seqlen_q, block_m))
    return bound


def table_fits(Tq: int, Hq: int, block_m: int) -> bool:
    """The table's codes hold heads and row blocks below CODE_BASE."""
    return Hq < CODE_BASE // 2 and cdiv(Tq, block_m) < CODE_BASE


def varlen_tile_table(cu_seqlens_q: torch.Tensor, n_tiles: int, Hq: int, block_m: int,
                      causal: bool, longest_first: bool = False,
                      cu_seqlens_k: torch.Tensor | None = None,
                      key_counts: bool = False) -> torch.Tensor:
    """int32 [2, n_tiles] on cu_seqlens_q's device (see the module docstring): one launch,
    nothing read on the host. n_tiles: Hq * tile_bound(...) (any bound at least the real
    count works; the surplus entries are spares). longest_first: the sequences by key
    count (cu_seqlens_k; None: the query counts), most first (module docstring).
    key_counts: cu_seqlens_k holds each sequence's key count, not the running sum."""
    n_seq = cu_seqlens_q.numel() - 1
    tiles = torch.empty((2, n_tiles), dtype=torch.int32, device=cu_seqlens_q.device)
    if n_tiles:
        # the default build passes no LONGEST_FIRST: it stays the build it was
        order = {}
        if longest_first:
            order = {"LONGEST_FIRST": True,
                     "cu_k": cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k}
            if cu_seqlens_k is not None and key_counts:
                order["KEY_COUNTS"] = True
        _varlen_tiles_kernel[(cdiv(n_tiles, PIDS),)](
            cu_seqlens_q, tiles, n_seq, n_tiles, Hq, BLOCK_M=block_m, CAUSAL=bool(causal),
            PIDS=PIDS, SEQS=SEQS, num_warps=WARPS, **order)
    return tiles
