"""sm_90 warp-specialized prefill attention in Gluon, fixed-length and varlen.

FlashAttention-3's structure written with Triton 3.6's Gluon pieces: a 1-warp TMA
producer that gives up registers, two (at head dim 64 optionally three:
GluonSettings.CONSUMERS) consumer warpgroups of 64 query rows each running QK^T and PV as
async wgmma, the next QK^T issued before the current softmax, and optional ping-pong
between the consumer warpgroups, and (GluonSettings.persistent; what a call without
settings takes only at head dim 64 without a mask, from ONE_CONSUMER_UP_TO to
PERSISTENT_UP_TO query rows) a persistent longest-first tile schedule; short calls
(ONE_CONSUMER_UP_TO) and short query chunks (ONE_CONSUMER_CHUNK_UP_TO) take one consumer
warpgroup a CTA with two or three CTAs an SM (GluonSettings.ctas_per_sm). The
partitions live in prefill_gluon_parts.py; this module holds the launch settings, the
launchers (prefill, prefill_varlen: one kernel, VARLEN a constexpr) and the qualification
checks that api.py calls.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..target import target_of
from ..testing import DTYPE_NAMES
from . import _alloc
from ._gluon_host import cuda_cc as _cc, nvmma_layout as _layout, tma_descriptor as _descriptor
from ._intmath import cdiv
from .prefill_gluon_parts import ROWS_PER_WG as WG_M, VARLEN_COMPACT, attn_fwd_kernel
from .varlen_tiles import table_fits, tile_bound, varlen_tile_table

GLUON_CC = 90  # wgmma and setmaxnreg exist on sm_90 only
# True once the kernel has passed its GPU numerics (the sm90 tests of
# tests/test_prefill_gluon.py); False keeps impl="auto" on Triton and refuses impl="gluon".
VERIFIED_ON_GPU = True
GLUON_DTYPES = (torch.float16, torch.bfloat16)
GLUON_HEAD_DIMS = (64, 128)
OTHER_KERNELS = "impl='triton' runs on sm_80, sm_90, sm_100 and sm_120"


# --------------------------------------------------------------------------- settings

REGISTER_FILE = 65536  # 32-bit registers per SM
SMEM_LIMIT = 232448  # 227 KB of shared memory per block on sm_90
# Settings that follow from the number of consumer warpgroups (settings_for applies them when
# CONSUMERS is overridden). Registers: 2 * 128 * 240 and 3 * 128 * 160 threads x registers,
# plus the producer (padded to a warpgroup) at 24, fit the register file (FlashAttention-3
# uses 240 and 160 for its 2 and 3 MMA warpgroups; Triton gives the default partition the
# rest, 168 with 3). With 160 registers the unrolled loop's two P sets spill (1 KB of spill
# stores at D=64), the plain loop does not: 3 consumers run without UNROLL.
# One consumer (64 rows) is built for two CTAs an SM: the launch's maxnreg 128 (two CTAs of
# 256 threads fill the register file), of which the producer's warpgroup keeps 24 and the
# consumer gets 232; its shared memory must fit half the SM's.
PER_CONSUMERS = {1: {"BLOCK_M": 64, "CONSUMER_REGS": 232, "ctas_per_sm": 2},
                 2: {"BLOCK_M": 128, "CONSUMER_REGS": 240},
                 3: {"BLOCK_M": 192, "CONSUMER_REGS": 160, "UNROLL": False}}
SM_SMEM = 233472  # 228 KB of shared memory per SM on sm_90, 1 KB of it reserved a CTA
# What persistent=True changes in the defaults (settings_for applies it unless overridden):
# the tile loop keeps a few more values live across each tile, and with UNROLL's two P
# register sets the two-consumer consumers then spill (ptxas -v: 28-32 B of spill stores
# at head dim 128, at the start and end of each tile); without UNROLL nothing spills, and
# UNROLL measured equal within noise at head dim 128 (notes/prefill_gluon.md). ONE_LOOP
# (the D64 causal default) puts 16 B of spills a thread (ptxas -v) inside the persistent key
# loop, where the two-loop build spills 24 B once a tile: off with it (not measured).
PER_PERSISTENT = {"UNROLL": False, "ONE_LOOP": False}
# K/V bytes one section of the persistent schedule may keep in L2 (l2_section): the L2 of
# an H100 or H200 (50 MB), FlashAttention-4's figure for its causal head sections.
L2_SECTION_BYTES = 50 * 2 ** 20


@dataclass(frozen=True)
class GluonSettings:
    """Launch settings of the Gluon kernel: data, computed per head dim, overridable.

    BLOCK_M is the CTA's query rows, CONSUMERS warpgroups x 64 (settings_for derives both
    BLOCK_M and CONSUMER_REGS from CONSUMERS). Shared memory is BLOCK_M * D (Q) +
    2 * STAGES * BLOCK_N * D (K, V ring) elements of 2 bytes. CONSUMER_REGS /
    PRODUCER_REGS are setmaxnreg targets; CONSUMERS * 128 * CONSUMER_REGS + 128 *
    PRODUCER_REGS must fit the 64K-register file (check()).
    """
    BLOCK_M: int = 128
    BLOCK_N: int = 128
    STAGES: int = 2
    PINGPONG: bool = False  # consumer warpgroups take turns issuing GEMMs
    UNROLL: bool = True  # steps in pairs, so P(j), P(j+1) can take two register sets (notes)
    WG_TILES: bool = True  # a warpgroup computes only the K/V tiles its own rows need
    CONSUMER_REGS: int = 240
    PRODUCER_REGS: int = 24
    CONSUMERS: int = 2  # consumer warpgroups of 64 rows; 3 (BLOCK_M = 192) at head dim 64 only,
    # 1 (BLOCK_M = 64) with ctas_per_sm CTAs an SM
    # P to the PV wgmma's operand by one cvt a register pair (no PRMT half swaps; same
    # bits). On: on the H200, side by side in two runs of the 16 bench shapes, 1.00-1.05x
    # the build without it at 31 of 32, 0.99x at one (notes/prefill_gluon.md, "P packed a
    # register pair at a time").
    PACK_P: bool = True
    # The masked key tiles (the diagonal, a partial last tile) in the unmasked tiles' loop
    # body, masked at run time, so a consumer has one copy of the step's code instead of
    # two (ONE_LOOP in prefill_gluon_parts). On in settings_for at D64 causal only, the one
    # shape where it measured faster (notes/prefill_gluon.md, "The masked tiles in the
    # unmasked loop").
    ONE_LOOP: bool = False
    # One CTA per SM walking the tiles longest-first, GQA heads together (PERSISTENT in
    # prefill_gluon_parts); fixed length only. Off in settings_for: on the H200 it gained
    # 4-22 % at N = 1024 and lost 2-10 % from N = 4096 on (notes/prefill_gluon.md); a call
    # without settings takes it where PERSISTENT_UP_TO says.
    persistent: bool = False
    # The persistent schedule's L2 budget for one section's K/V (see l2_section): smaller
    # sections keep fewer heads' K/V live, larger ones balance the CTAs' work better.
    l2_section_bytes: int = L2_SECTION_BYTES
    # Varlen only (fixed-length launches have no table): the grid holds the pack's real
    # tiles (at most one spare a sequence and head), each CTA reading its tile from a table
    # one small kernel writes on the device (kernels/varlen_tiles.py), instead of every
    # sequence padded to the longest; a pack whose codes do not fit the table
    # (varlen_tiles.table_fits) takes the plain grid, as False does. On: on the H200 it
    # took the varlen pack from 0.91-0.94 to 0.95-1.01 of the equal-length batch's TFLOP/s
    # (notes/prefill_gluon.md).
    compact_varlen: bool = True
    # With the table: the pack's sequences by key count, most first (varlen_tiles'
    # longest_first), so a long sequence packed last does not start its heaviest tiles at
    # the end of the launch. On: on the H200's 64-8192 pack it gained 1.4-4.6 % at three of
    # four shapes and was even at D128 causal, the same bits (notes/prefill_gluon.md,
    # "Longest sequence first").
    varlen_longest_first: bool = True
    # Varlen only: a key tile that ends past its sequence loads V through a descriptor of
    # the sequence's own rows, made on the device (BOUNDED_V in prefill_gluon_parts), so a
    # NaN or Inf in the next sequence's values cannot reach this sequence's output through
    # 0 * v (one request's overflow must not turn another's rows NaN). On: on the H200's
    # 64-8192 pack it measured -2.9 to +0.8 % against False (the map made after the
    # tile's K load); False is for packs whose values are known finite
    # (notes/prefill_gluon.md, "A neighbour's non-finite V").
    varlen_bounded_v: bool = True
    # CTAs an SM the build is made for (one consumer only): the launch caps registers at
    # maxnreg = 65536 / (256 * ctas_per_sm) (multiple of 8), the producer's warpgroup keeps
    # 24 and the consumer gets the rest (CONSUMER_REGS), and shared memory must fit a
    # ctas_per_sm-th of the SM's.
    ctas_per_sm: int = 1

    def smem_bytes(self, head_dim: int) -> int:
        return 2 * head_dim * (self.BLOCK_M + 2 * self.STAGES * self.BLOCK_N)

    def check(self, head_dim: int) -> None:
        """Raise ValueError for settings the kernel cannot be built or launched with."""
        n = self.CONSUMERS
        if n not in PER_CONSUMERS:
            raise ValueError(f"CONSUMERS={n}: the Gluon kernel has 1, 2 or 3 consumer "
                             "warpgroups")
        if n == 1 and self.PINGPONG:
            raise ValueError("PINGPONG=True needs CONSUMERS >= 2 (turns between warpgroups)")
        if n == 3 and head_dim != 64:
            raise ValueError(
                f"CONSUMERS=3 needs head_dim 64, got head_dim {head_dim}: three consumer "
                f"warpgroups get {PER_CONSUMERS[3]['CONSUMER_REGS']} registers a thread, "
                "which O (64) + S (64) + P (32) alone fill at head_dim 128 (ptxas spills "
                "~0.9 KB a thread even without UNROLL); use CONSUMERS=2")
        if self.BLOCK_M != WG_M * n:
            raise ValueError(f"BLOCK_M={self.BLOCK_M} must be {WG_M} * CONSUMERS={n}")
        for name in ("CONSUMER_REGS", "PRODUCER_REGS"):
            regs = getattr(self, name)
            if regs % 8 or not 24 <= regs <= 256:
                raise ValueError(f"{name}={regs}: setmaxnreg takes a multiple of 8 in 24..256")
        ctas = self.ctas_per_sm
        if ctas not in (1, 2, 3) or (ctas > 1 and n != 1):
            raise ValueError(f"ctas_per_sm={ctas}: 1, or 2-3 with CONSUMERS=1")
        if ctas > 1 and self.CONSUMER_REGS != self.consumer_regs_of(ctas):
            raise ValueError(f"CONSUMER_REGS={self.CONSUMER_REGS}: with ctas_per_sm={ctas} the "
                             f"consumer gets {self.consumer_regs_of(ctas)} (maxnreg "
                             f"{self.maxnreg()} less the producer's)")
        total = 128 * (n * self.CONSUMER_REGS + self.PRODUCER_REGS)
        if total * ctas > REGISTER_FILE:
            raise ValueError(f"CONSUMERS={n} x 128 x CONSUMER_REGS={self.CONSUMER_REGS} + 128 x "
                             f"PRODUCER_REGS={self.PRODUCER_REGS} = {total} registers a CTA, "
                             f"x {ctas} CTA(s) an SM more than the {REGISTER_FILE} of an SM")
        limit = SMEM_LIMIT if ctas == 1 else SM_SMEM // ctas - 1024
        if self.smem_bytes(head_dim) > limit:
            raise ValueError(f"{self.smem_bytes(head_dim)} bytes of shared memory at head_dim "
                             f"{head_dim} (BLOCK_M={self.BLOCK_M}, STAGES={self.STAGES}, "
                             f"BLOCK_N={self.BLOCK_N}); {ctas} CTA(s) an SM of sm_90 have "
                             f"{limit} each")

    def maxnreg(self, ctas: int | None = None) -> int:
        """The register cap a thread that lets ctas (default ctas_per_sm) CTAs of 256
        threads (one consumer warpgroup and the producer's) share the register file."""
        return REGISTER_FILE // ((ctas or self.ctas_per_sm) * 256) // 8 * 8

    def consumer_regs_of(self, ctas: int) -> int:
        """The one consumer's registers under that cap: the CTA's pool less the producer's."""
        return (self.maxnreg(ctas) * 256 - 128 * self.PRODUCER_REGS) // 128

    def launch_options(self) -> dict:
        """The launch's compile options: 4 warps in the default partition, and for a build
        of several CTAs an SM the register cap (maxnreg) that lets them share it."""
        if self.ctas_per_sm == 1:
            return {"num_warps": 4}
        return {"num_warps": 4, "maxnreg": self.maxnreg()}


def settings_for(head_dim: int, causal: bool = False, **overrides) -> GluonSettings:
    """Default settings per head dim (H200 measurements in notes/prefill_gluon.md).

    Overriding CONSUMERS also applies PER_CONSUMERS (BLOCK_M = 64 * CONSUMERS, registers,
    UNROLL) and persistent=True PER_PERSISTENT, except where those are overridden too.
    Raises ValueError for settings that check() refuses."""
    if head_dim == 64:
        # Three consumer warpgroups (192 query rows, 24 + 4 * 32 KB of shared memory), as
        # FlashAttention-3 does at this head dim; ping-pong between them when not causal.
        # H200, x cuDNN at N 4096/8192/16384: non-causal 1.03/1.08/1.10 (two consumers:
        # 0.95/0.97/1.01), causal 0.84/0.99/1.07 (two: 0.86/0.96/1.03; with ping-pong
        # 0.84/0.97/1.08); notes/prefill_gluon.md.
        # Causal: the masked tiles in the unmasked loop (ONE_LOOP), 1.04-1.06x the build
        # with a masked loop of its own at N 1k-16k on the H200; elsewhere it measured
        # 0.99-1.02x (D128 causal, D64 non-causal) or spilled beside UNROLL (D128, 0.77-0.81x).
        n = overrides.get("CONSUMERS", 3)
        base = GluonSettings(BLOCK_N=128, STAGES=4, CONSUMERS=n, PINGPONG=n == 3 and not causal,
                             ONE_LOOP=causal, **PER_CONSUMERS.get(n, {}))
    else:  # 32 + 3 * 64 KB; with 2 stages ptxas spills in the unrolled loop (0.6x cuDNN)
        # Causal without UNROLL: on the H200 with PACK_P, side by side in two runs, the plain
        # loop ran 1.15-1.16x the unrolled one at N = 1024, 1.05-1.12x at 4k and 1.00-1.03x
        # at 8k / 16k causal, 0.98-1.01x without a mask, where UNROLL stays
        # (notes/prefill_gluon.md, "D128 causal on the plain loop").
        base = GluonSettings(BLOCK_N=128, STAGES=3, UNROLL=not causal)
        n = overrides.get("CONSUMERS", base.CONSUMERS)
        if n != base.CONSUMERS and n in PER_CONSUMERS:
            overrides = {**PER_CONSUMERS[n], **overrides}
    if overrides.get("persistent"):
        overrides = {**PER_PERSISTENT, **overrides}
    s = replace(base, **overrides) if overrides else base
    s.check(head_dim)
    return s


# Fixed-length calls of at most this many query rows at head dim 64 without a mask take
# the persistent schedule by default. H200, side by side at N = 1024 (16 sequences, 16
# heads; the schedules' timing table in notes/prefill_gluon.md, TFLOP/s): persistent 368,
# one tile a CTA 353, the Triton kernel 350, cuDNN 432. Elsewhere at N = 1024 it lost to
# the Triton kernel (D64 causal 229 vs 244, D128 causal 311 vs 316) or tied the one-tile
# launch (D128 non-causal 460 vs 464), and from N = 4096 on it lost 2-10 %
# (notes/prefill_gluon.md).
# Shorter calls take the one-consumer build (ONE_CONSUMER_UP_TO, asked first).
PERSISTENT_UP_TO = {(64, False): 1024}
# Fixed-length calls of at most this many query rows take the one-consumer build:
# 64-row tiles, several CTAs an SM (ONE_CONSUMER), so that the CTAs' fills and tails, which
# a 128- or 192-row CTA pays with both or all three of its warpgroups at once, overlap
# other CTAs' key loops. H200, x cuDNN side by side (notes/prefill_gluon.md, "One consumer,
# several CTAs an SM"): D128 N = 1024 0.806-0.810 against the two-consumer build's
# 0.736-0.744 (two processes), N = 2048 0.852-0.858 against 0.894-0.896; D64 N = 2048
# 0.882-0.900 against the three-consumer build's 0.807-0.828 (in the bench, three process
# pairs: 0.371-0.378 ms against 0.408-0.412), N = 4096 0.922 against 0.969;
# in the bench at N = 1024, x the Triton kernel that ran there before: 1.03-1.10 (D128),
# 1.07-1.10 (D64), three processes. Not D64 non-causal N = 1024 (the persistent walk's):
# 3-5 % ahead of the walk side by side in the script's timing, but in the bench's graph
# replay 358-370 us against the walk's 350-354 in four of five processes (one 338).
# Non-causal, shorter: the builds side by side in the bench (`--impl wsattn
# gluon-one-consumer gluon-multi-consumer`, three processes), us, one consumer against
# what auto ran before: D128 N = 256 107-115 against 123-125, N = 512 173-180 against
# 170-173; D64 N = 256 122-131 against the walk's 161-163, N = 512 196-211 against 207-215.
ONE_CONSUMER_UP_TO = {(128, True): 1024, (128, False): 256, (64, True): 2048,
                      (64, False): 512}
# Its settings per head dim: at D128 two CTAs an SM (a ring of 3 x 64 keys fits half the
# shared memory), at D64 three (maxnreg 80; 128-key tiles do not build under it).
ONE_CONSUMER = {128: {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "UNROLL": False,
                      "ONE_LOOP": False},
                64: {"CONSUMERS": 1, "ctas_per_sm": 3, "CONSUMER_REGS": 136, "BLOCK_N": 64,
                     "STAGES": 3, "UNROLL": False, "ONE_LOOP": False}}


# Packs whose every query and key sequence is at most this many rows take the one-consumer
# build too (ONE_CONSUMER; max_seqlen_q / max_seqlen_k where given, else the pack's token
# counts, bound them): a pack of short sequences is the short fixed-length case many times
# over, each CTA's fill and tail paid at once by all its warpgroups. A short query chunk
# against long keys keeps the default build (the one-consumer build lost from N = 4k on,
# fixed length). H200, `wsattn bench varlen --varlen-heads gqa` (16k tokens, GQA 32/8),
# the one-consumer build x the default build side by side: lengths 64-1024 D128 causal /
# full 1.28 / 1.13, D64 1.69 / 1.40; 64-2048 1.07 / 0.96, 1.40 / 1.02, where the run's two
# columns of the same default build stood 4 % apart, so only D64 causal moves to 2048
# (notes/prefill_gluon.md, "Packs on the one-consumer build").
VARLEN_ONE_CONSUMER_UP_TO = {(128, True): 1024, (128, False): 1024, (64, True): 2048,
                             (64, False): 1024}
# Calls whose (longest) query sequence is at most this many rows take the one-consumer
# build whatever their keys, fixed-length and packed alike: a chunk of a few
# queries against a long prefix is one query tile a (sequence, head), and a 64-row tile
# does a half (D128) or a third (D64) of the default build's MMA and softmax work for the
# same K/V stream. H200, `wsattn bench chunked --chunked-chunk C --chunked-batch 128`
# (GQA 32/8, prefixes 2k / 8k / 32k, contiguous keys), x the Triton varlen kernel that
# the length table gave these chunks: chunk 64, two processes, 1.03-1.26 (12 of 12 ahead;
# the default build 0.69-0.83 at D64, 0.96-1.04 at D128); chunks 1 and 16 0.93-1.08 (5 of
# 12 ahead: even, and over a paged cache it reads the pages in place where the Triton
# kernel gathers them first). From 128 queries the default build leads (chunk 128, two
# processes: 1.04-1.32 against the one-consumer build's 1.05-1.14; notes/prefill_gluon.md,
# "Short chunks against long keys"). Measured causal; without a mask the rule holds by the
# same count of padded rows (the mask touches only the diagonal tile), not timed.
ONE_CONSUMER_CHUNK_UP_TO = 64


def _one_consumer(table: dict, head_dim: int, causal: bool, rows_q: int, rows_k: int) -> bool:
    # the short chunk, or the short-shape table (on the longer of the two sequences)
    if int(rows_q) <= ONE_CONSUMER_CHUNK_UP_TO:
        return True
    return max(int(rows_q), int(rows_k)) <= table.get((head_dim, bool(causal)), 0)


def varlen_one_consumer(head_dim: int, causal: bool, max_seqlen_q: int,
                        max_seqlen_k: int) -> bool:
    """Whether a pack (its longest query and key sequences, or bounds of them) takes the
    one-consumer build by default (VARLEN_ONE_CONSUMER_UP_TO, ONE_CONSUMER_CHUNK_UP_TO); the
    dispatcher's rule, prefill_varlen and prefill_paged ask this."""
    return _one_consumer(VARLEN_ONE_CONSUMER_UP_TO, head_dim, causal, max_seqlen_q,
                         max_seqlen_k)


@functools.lru_cache(maxsize=None)
def _default_settings(head_dim: int, causal: bool, schedule: str = "") -> GluonSettings:
    # asked on every launch: built (and checked) once per (head dim, mask, schedule)
    if schedule == "persistent":
        return settings_for(head_dim, causal, persistent=True)
    if schedule == "one_consumer":
        return settings_for(head_dim, causal, **ONE_CONSUMER[head_dim])
    return settings_for(head_dim, causal)


def one_consumer_settings(head_dim: int, causal: bool) -> GluonSettings:
    """The one-consumer build (ONE_CONSUMER of the head dim), as the launchers make it."""
    return _default_settings(head_dim, bool(causal), "one_consumer")


def varlen_call_settings(head_dim: int, causal: bool, max_seqlen_q: int,
                         max_seqlen_k: int) -> GluonSettings:
    """The settings a packed or paged call without settings builds with, from bounds of its
    longest query and key sequences (varlen_one_consumer's choice; what an evidence check
    must compile to look at the build a call launches)."""
    return _resolve(None, head_dim, causal, varlen_bounds=(max_seqlen_q, max_seqlen_k))


def call_settings(head_dim: int, causal: bool, seqlen_q: int | None = None,
                  seqlen_k: int | None = None) -> GluonSettings:
    """The settings a fixed-length call without settings builds with: the defaults, the
    one-consumer build where ONE_CONSUMER_UP_TO covers the longer of seqlen_q and seqlen_k
    (seqlen_q alone when seqlen_k is None) or ONE_CONSUMER_CHUNK_UP_TO seqlen_q,
    else the persistent schedule where PERSISTENT_UP_TO covers the longer (what an
    evidence check must compile to look at the build a call launches)."""
    return _resolve(None, head_dim, causal, seqlen_q, seqlen_k)


def _resolve(settings: GluonSettings | None, head_dim: int, causal: bool,
             seqlen_q: int | None = None, seqlen_k: int | None = None,
             varlen_bounds: tuple[int, int] | None = None) -> GluonSettings:
    """The settings to build with: the defaults (checked when made; a fixed-length call's
    query and key rows pick the one-consumer build or the persistent schedule, as
    call_settings says; varlen_bounds, a pack's longest query and key sequences, the
    one-consumer build where varlen_one_consumer says), or the caller's, checked here.
    The fixed-length tables were measured with as many keys as queries; a call with more
    keys is a chunk against a prefix, which the longer sequence ranks as the packs' rule
    does."""
    if settings is None:
        key, schedule = (head_dim, bool(causal)), ""
        if varlen_bounds is not None:
            if varlen_one_consumer(head_dim, causal, *varlen_bounds):
                schedule = "one_consumer"
        elif seqlen_q is not None:
            rows_k = seqlen_q if seqlen_k is None else seqlen_k
            if _one_consumer(ONE_CONSUMER_UP_TO, head_dim, causal, seqlen_q, rows_k):
                schedule = "one_consumer"
            elif max(seqlen_q, rows_k) <= PERSISTENT_UP_TO.get(key, 0):
                schedule = "persistent"
        return _default_settings(head_dim, bool(causal), schedule)
    settings.check(head_dim)
    return settings


# --------------------------------------------------------------------------- launcher



def _constexprs(head_dim, group, causal, s: GluonSettings):
    return dict(GROUP=group, BLOCK_M=s.BLOCK_M, BLOCK_N=s.BLOCK_N, D=head_dim, STAGES=s.STAGES,
                CAUSAL=bool(causal), PINGPONG=s.PINGPONG, UNROLL=s.UNROLL,
                CONSUMER_REGS=s.CONSUMER_REGS, PRODUCER_REGS=s.PRODUCER_REGS,
                CONSUMERS=s.CONSUMERS, WG_TILES=s.WG_TILES, PERSISTENT=s.persistent,
                PACK_P=s.PACK_P, ONE_LOOP=s.ONE_LOOP)


def l2_section(n_bh: int, group: int, kv_len: int, head_dim: int, elem_bytes: int,
               budget: int | None = None) -> int:
    """(batch, head) pairs per section of the persistent schedule: as many whole GQA groups
    as have their K and V (2 * kv_len * head_dim elements a KV head) fit budget bytes
    (GluonSettings.l2_section_bytes), at least one group, at most all n_bh pairs."""
    budget = L2_SECTION_BYTES if budget is None else budget
    kv_heads = max(1, budget // (2 * kv_len * head_dim * elem_bytes))
    return min(n_bh, kv_heads * group)


def _refuse_persistent_varlen(s: GluonSettings) -> None:
    """The fixed-length-only settings, refused by name for the varlen and paged builds."""
    if s.persistent:
        raise ValueError("settings.persistent=True: the persistent schedule covers "
                         "fixed-length prefill only (a varlen walk measured slower, "
                         "notes/prefill_gluon.md); use persistent=False for prefill_varlen")


def prefill(q, k, v, causal: bool, sm_scale: float, settings: GluonSettings | None = None):
    """Fixed-length prefill forward on sm_90 (inputs validated by api.py).

    Args:
        q: [B, Sq, Hq, D] fp16/bf16; k, v: [B, Sk, Hkv, D], Hq % Hkv == 0, D in (64, 128).
        causal: bottom-right aligned (query i sees keys j <= i + Sk - Sq).
        sm_scale: softmax scale.

    Returns:
        (out [B, Sq, Hq, D] like q, lse fp32 [B, Hq, Sq], natural log).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    s = _resolve(settings, D, causal, Sq, Sk)
    out = _alloc.empty((B, Sq, Hq, D), q.dtype, q.device)
    lse = _alloc.empty((B, Hq, Sq), torch.float32, q.device)
    if B * Sq * Hq == 0:
        return out, lse
    q, k, v = (t if tma_ready(t) else t.contiguous() for t in (q, k, v))
    name = DTYPE_NAMES[q.dtype]
    q_desc = _descriptor(q.view(B, Sq, Hq * D), [1, WG_M, D], name)
    o_desc = _descriptor(out.view(B, Sq, Hq * D), [1, WG_M, D], name)
    k_desc = _descriptor(k.view(B, Sk, Hkv * D), [1, s.BLOCK_N, D], name)
    v_desc = _descriptor(v.view(B, Sk, Hkv * D), [1, s.BLOCK_N, D], name)
    num_tiles = cdiv(Sq, s.BLOCK_M) * B * Hq
    if s.persistent:  # one CTA per SM at most, walking the tiles (see attn_fwd_kernel)
        grid = min(num_tiles, target_of(q.device).num_sms)
        n_bh = B * Hq
        section = l2_section(n_bh, Hq // Hkv, Sk, D, q.element_size(), s.l2_section_bytes)
    else:  # one CTA per tile
        grid, n_bh, section = num_tiles, None, None
    attn_fwd_kernel[(grid, )](q_desc, k_desc, v_desc, o_desc, lse, Sq, Sk, Hq,
                              sm_scale * math.log2(math.e), None, None, None, None, None, n_bh,
                              section, None, None, None, None, None, None,
                              **s.launch_options(), **_constexprs(D, Hq // Hkv, causal, s))
    return out, lse


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   causal: bool, sm_scale: float, settings: GluonSettings | None = None):
    """Varlen prefill forward on sm_90: sequences packed along the token axis (inputs
    validated by api.py; nothing here reads a device value on the host).

    Args:
        q: [Tq, Hq, D] fp16/bf16; k, v: [Tk, Hkv, D], Hq % Hkv == 0, D in (64, 128).
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] on q's device, unit stride; sequence
            i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] and the k/v rows likewise.
            Empty sequences are fine; a sequence with queries and no keys gets out 0 and
            lse -inf.
        max_seqlen_q: the longest query sequence or an upper bound (None: Tq); the grid has
            cdiv(max_seqlen_q, BLOCK_M) row blocks a (sequence, head) and the ones past
            their sequence's end exit at once under settings.compact_varlen=False; with
            the default True (and a pack the tile table holds) at most
            cdiv(Tq, BLOCK_M) + batch a head, from a tile table built on the device.
            max_seqlen_k: the longest key sequence or an upper bound (None: Tk); the key
            tiles come from each sequence's own length. Without settings, packs whose
            bounds both fall within VARLEN_ONE_CONSUMER_UP_TO take the one-consumer build.
        causal: bottom-right aligned per sequence (query i sees keys j <= i + kv_len -
            q_len; needs q_len <= kv_len).
        sm_scale: softmax scale.

    Returns:
        (out [Tq, Hq, D] like q, lse fp32 [Hq, Tq], natural log).

    Example (an sm_90 GPU):
        >>> q = torch.randn(80, 8, 128, dtype=torch.bfloat16, device="cuda")
        >>> k = v = torch.randn(90, 2, 128, dtype=torch.bfloat16, device="cuda")
        >>> cu_q = torch.tensor([0, 17, 80], dtype=torch.int32, device="cuda")
        >>> cu_k = torch.tensor([0, 17, 90], dtype=torch.int32, device="cuda")
        >>> out, lse = prefill_varlen(q, k, v, cu_q, cu_k, 63, 73, True, 128 ** -0.5)
        >>> out.shape, lse.shape
        (torch.Size([80, 8, 128]), torch.Size([8, 80]))
    """
    Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    s = _resolve(settings, D, causal, varlen_bounds=(_bound(max_seqlen_q, Tq),
                                                     _bound(max_seqlen_k, Tk)))
    _refuse_persistent_varlen(s)
    out, lse, n_seq, max_q = _varlen_outputs(q, cu_seqlens_q, max_seqlen_q)
    if max_q == 0:
        return out, lse
    if Tk == 0:  # every sequence has no keys (no TMA descriptor spans zero rows)
        return out.zero_(), lse.fill_(float("-inf"))
    q, k, v = (t if tma_ready(t.unsqueeze(0)) else t.contiguous() for t in (q, k, v))
    name = DTYPE_NAMES[q.dtype]
    k_desc = _descriptor(k.view(1, Tk, Hkv * D), [1, s.BLOCK_N, D], name)
    v_desc = _descriptor(v.view(1, Tk, Hkv * D), [1, s.BLOCK_N, D], name)
    bounded = s.varlen_bounded_v
    _varlen_launch(q, k_desc, v_desc, out, lse, cu_seqlens_q, cu_seqlens_k, n_seq, max_q, Hkv,
                   causal, sm_scale, s, (v if bounded else None, None, None, None, None),
                   BOUNDED_V=bounded)
    return out, lse


def _bound(max_seqlen: int | None, total: int) -> int:
    """A pack's bound on its longest sequence: the caller's, at most the token total (as
    the dispatcher has it), else the total (no host read of cu_seqlens)."""
    return total if max_seqlen is None else min(int(max_seqlen), total)


def _varlen_outputs(q, cu_seqlens_q, max_seqlen_q):
    """(out, lse, batch, max_q) of a varlen-build launch: max_q 0 where there is nothing
    to compute (no rows, no heads or no sequence)."""
    Tq, Hq, D = q.shape
    out = _alloc.empty((Tq, Hq, D), q.dtype, q.device)
    lse = _alloc.empty((Hq, Tq), torch.float32, q.device)
    n_seq = cu_seqlens_q.numel() - 1
    max_q = _bound(max_seqlen_q, Tq)
    if Tq * Hq == 0 or n_seq <= 0:
        max_q = 0
    return out, lse, n_seq, max_q


def _varlen_launch(q, k_desc, v_desc, out, lse, cu_q, cu_k, n_seq, max_q, Hkv, causal,
                   sm_scale, s, tail, **builds):
    """The varlen build's launch (prefill_varlen, prefill_paged): q / o descriptors, the
    tile table over cu_q with keys counted by cu_k (the paged build: key counts, not their
    running sum) or the plain grid, then the kernel
    with tail = (v_rows, block_table, bt_stride, bt_width, page_stride) and the build's
    constexprs.
    A build given v_rows makes tensor maps on the device (BOUNDED_V, PAGE)."""
    Tq, Hq, D = q.shape
    name = DTYPE_NAMES[q.dtype]
    q_desc = _descriptor(q.view(1, Tq, Hq * D), [1, WG_M, D], name)
    o_desc = _descriptor(out.view(1, Tq, Hq * D), [1, WG_M, D], name)
    tiles, varlen = None, True
    if s.compact_varlen and table_fits(Tq, Hq, s.BLOCK_M):
        num_tiles = tile_bound(Tq, n_seq, s.BLOCK_M, max_q) * Hq
        tiles = varlen_tile_table(cu_q, num_tiles, Hq, s.BLOCK_M, causal,
                                  longest_first=s.varlen_longest_first, cu_seqlens_k=cu_k,
                                  key_counts=bool(builds.get("PAGE")))
        varlen = VARLEN_COMPACT
    else:
        num_tiles = cdiv(max_q, s.BLOCK_M) * n_seq * Hq  # one CTA per tile; surplus ones exit
    if tail[0] is not None and q.is_cuda:
        _alloc.ensure_descriptor_allocator()  # the tensor maps the producer makes
    attn_fwd_kernel[(num_tiles, )](q_desc, k_desc, v_desc, o_desc, lse, 0, 0, Hq,
                                   sm_scale * math.log2(math.e), out, cu_q, cu_k, Tq, max_q,
                                   None, None, tiles, *tail, **s.launch_options(),
                                   VARLEN=varlen, **builds, **_constexprs(D, Hq // Hkv, causal, s))


# Pages the paged build takes: a whole number of 8-row swizzle atoms that tiles a key tile
# or is tiled by it, so a tile is BLOCK_N / min(page, BLOCK_N) boxes of one page each.
def paged_supported(page_size: int, block_n: int) -> bool:
    if page_size <= 0:
        return False
    box = min(page_size, block_n)
    return box % 8 == 0 and block_n % box == 0 and page_size % box == 0


def prefill_paged(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table,
                  max_seqlen_q, causal: bool, sm_scale: float,
                  settings: GluonSettings | None = None):
    """Chunked prefill on sm_90 with the keys read from the paged cache in place (inputs
    validated by api.py; nothing here reads a device value on the host): the varlen
    kernel's paged build (PAGE), the same tiles and order as prefill_varlen over the same
    keys packed, so the same bits.

    Args:
        q: [Tq, Hq, D] packed chunk queries, fp16/bf16, D in (64, 128).
        k_cache, v_cache: [num_pages, page_size, Hkv, D] (each page's rows contiguous, as
            decode writes them), page_size a multiple of 8 that tiles a key tile or is
            tiled by it (paged_supported).
        cu_seqlens_q: int32 [batch + 1]; seqlens_k: int32 [batch], keys of each sequence,
            its chunk included, key j at row j % page_size of page block_table[b, j //
            page_size]; block_table: int32 [batch, width], only the entries covering
            seqlens_k[b] keys read.
        max_seqlen_q, causal, sm_scale, settings: as prefill_varlen (varlen_bounded_v has
            no effect: the last page's V is always bounded).

    Returns:
        (out [Tq, Hq, D] like q, lse fp32 [Hq, Tq], natural log).
    """
    D = q.shape[2]
    num_pages, page, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    # the build as prefill_varlen picks it for the same keys packed: the longest chunk
    # (at most the packed total) and the table's width in keys bound the sequences
    s = _resolve(settings, D, causal, varlen_bounds=(_bound(max_seqlen_q, q.shape[0]),
                                                     block_table.shape[1] * page))
    _refuse_persistent_varlen(s)
    if not paged_supported(page, s.BLOCK_N):
        raise ValueError(f"the paged Gluon build takes page sizes that are multiples of 8 and "
                         f"tile or are tiled by BLOCK_N={s.BLOCK_N}, got {page}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not tma_ready(t):  # [num_pages, page, Hkv, D] read as [num_pages, page, Hkv * D]
            raise ValueError(f"{name}: each page's rows must be contiguous "
                             f"([page_size, Hkv, D] packed) and 16-byte aligned for TMA")
    out, lse, n_seq, max_q = _varlen_outputs(q, cu_seqlens_q, max_seqlen_q)
    if max_q == 0:
        return out, lse
    if not tma_ready(q.unsqueeze(0)):
        q = q.contiguous()
    name = DTYPE_NAMES[q.dtype]
    box = min(page, s.BLOCK_N)
    k_desc = _descriptor(k_cache.view(num_pages, page, Hkv * D), [1, box, D], name)
    v_desc = _descriptor(v_cache.view(num_pages, page, Hkv * D), [1, box, D], name)
    # the kernel and the tile table read each sequence's key count itself (no prefix sum),
    # by index: a strided view becomes a copy (api.py already passes it contiguous)
    _varlen_launch(q, k_desc, v_desc, out, lse, cu_seqlens_q, seqlens_k.contiguous(), n_seq,
                   max_q, Hkv, causal, sm_scale, s,
                   (v_cache, block_table, block_table.stride(0), block_table.shape[1],
                    v_cache.stride(0)), PAGE=page)
    return out, lse


def tma_ready(t) -> bool:
    """Can t [B, S, H, D] be viewed as [B, S, H * D] for TMA (H, D packed; base and batch
    stride 16-byte aligned)? Otherwise the launchers copy q / k / v to a contiguous tensor,
    and a paged cache ([num_pages, page_size, Hkv, D]) cannot be read in place."""
    B, S, H, D = t.shape
    return (t.stride(3) == 1 and t.stride(2) == D and t.stride(1) == H * D
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def compile_spec(cc: int = 90, head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                 settings: GluonSettings | None = None, varlen: bool = False,
                 plain_grid: bool = False, page: int = 0,
                 seqlens: tuple[int, int] | None = None) -> dict:
    """What the evidence ladder needs to compile the kernel with no GPU:
    ``triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32),
    options=options)``. varlen: the packed build (VARLEN; o_ptr, cu_q, cu_k, Tq, max_q are
    arguments), else the fixed-length one (they are None constexprs). settings.persistent:
    n_bh and section are arguments (fixed length only), else None constexprs.
    varlen with settings.compact_varlen (the default): the tile-table build (VARLEN =
    VARLEN_COMPACT, tiles an argument; else a None constexpr); plain_grid=True (or
    compact_varlen=False): the plain grid's build, which packs whose codes do not fit the
    table take. varlen with settings.varlen_bounded_v (the default): the build whose last
    partial key tile loads V through a descriptor made on the device (v_rows an argument;
    else a None constexpr). varlen with page > 0: the paged build of that page
    size (k/v descriptors over the cache's pages; block_table, bt_stride, bt_width,
    page_stride and v_rows arguments). seqlens (fixed length): a call's (Sq, Sk), which
    Triton's launcher specializes on and so builds its own kernel for: a length of 1 becomes
    a constexpr, a multiple of 16 an argument divisible by 16 (None: neither, the build of
    lengths without those properties)."""
    s = _resolve(settings, head_dim, causal)
    if plain_grid:
        s = replace(s, compact_varlen=False)
    if varlen:
        _refuse_persistent_varlen(s)
    qo = f"tensordesc<{dtype}[1,{WG_M},{head_dim}],{_layout([1, WG_M, head_dim], dtype)!r}>"
    if page and not (varlen and paged_supported(page, s.BLOCK_N)):
        raise ValueError(f"page={page}: the paged build is a varlen build of a page size "
                         f"that paged_supported takes")
    rows = min(page, s.BLOCK_N) if page else s.BLOCK_N
    kv_block = [1, rows, head_dim]
    kv = f"tensordesc<{dtype}[1,{rows},{head_dim}],{_layout(kv_block, dtype)!r}>"
    packed = {"o_ptr": f"*{dtype}", "cu_q": "*i32", "cu_k": "*i32", "Tq": "i32", "max_q": "i32"}
    walk = {"n_bh": "i32", "section": "i32"}
    paged = {"block_table": "*i32", "bt_stride": "i32", "bt_width": "i32", "page_stride": "i32"}
    compact = bool(varlen and s.compact_varlen)
    bounded = bool(varlen and s.varlen_bounded_v and not page)
    signature = {"q_desc": qo, "k_desc": kv, "v_desc": kv, "o_desc": qo, "lse_ptr": "*fp32",
                 "Sq": "i32", "Sk": "i32", "Hq": "i32", "qk_scale": "fp32",
                 **(packed if varlen else dict.fromkeys(packed, "constexpr")),
                 **(walk if s.persistent else dict.fromkeys(walk, "constexpr")),
                 "tiles": "*i32" if compact else "constexpr",
                 "v_rows": f"*{dtype}" if bounded or page else "constexpr",
                 **(paged if page else dict.fromkeys(paged, "constexpr"))}
    constexprs = {**_constexprs(head_dim, 1, causal, s),
                  "VARLEN": VARLEN_COMPACT if compact else bool(varlen), "BOUNDED_V": bounded,
                  "PAGE": page}
    if not varlen:
        constexprs.update(dict.fromkeys(packed))
    if not s.persistent:
        constexprs.update(dict.fromkeys(walk))
    if not compact:
        constexprs["tiles"] = None
    if not (bounded or page):
        constexprs["v_rows"] = None
    if not page:
        constexprs.update(dict.fromkeys(paged))
    attrs = {}
    if seqlens is not None:
        if varlen:
            raise ValueError("seqlens: the fixed-length build's (Sq, Sk); a varlen build "
                             "takes its lengths from cu_seqlens")
        for name, n in zip(("Sq", "Sk"), seqlens):
            if n == 1:
                signature[name], constexprs[name] = "constexpr", 1
            elif n % 16 == 0:
                attrs[(attn_fwd_kernel.arg_names.index(name), )] = [["tt.divisibility", 16]]
    return {"fn": attn_fwd_kernel, "signature": signature, "constexprs": constexprs,
            "attrs": attrs, "options": s.launch_options()}


# --------------------------------------------------------------------------- qualification

def device_supported(device) -> bool:
    """True where the Gluon kernel runs: CUDA devices of compute capability 9.0."""
    return VERIFIED_ON_GPU and _cc(device) == GLUON_CC


def check_device(device) -> None:
    """Raise ValueError naming the device's compute capability where the kernel cannot run."""
    cc = _cc(device)
    if cc == GLUON_CC and VERIFIED_ON_GPU:
        return
    if cc == GLUON_CC:
        raise ValueError("impl='gluon' is not enabled on sm_90 yet: the kernel has not passed "
                         f"its GPU numerics (notes/prefill_gluon.md); {OTHER_KERNELS}")
    where = "CPU tensors" if cc is None else f"sm_{cc}"
    raise ValueError(f"impl='gluon' runs on sm_90 (Hopper) only, not on {where}: it needs wgmma "
                     f"and setmaxnreg; {OTHER_KERNELS}, and impl='auto' picks it")


def unsupported_reason(q, k, v, causal, varlen) -> str | None:
    """None when the Gluon kernel qualifies for this call, else a short reason. Fixed
    length: q [B, Sq, Hq, D]; varlen: q [Tq, Hq, D] (prefill_varlen), where a sequence
    with no keys is fine (its rows get out 0, lse -inf)."""
    if q.dtype not in GLUON_DTYPES:
        return f"the Gluon kernel takes float16 or bfloat16, got {q.dtype}"
    if q.shape[-1] not in GLUON_HEAD_DIMS:
        return f"the Gluon kernel takes head dim 64 or 128, got {q.shape[-1]}"
    if not varlen and (q.dim() != 4 or k.shape[1] == 0):
        return "the Gluon kernel needs at least one key (kv_len > 0)"
    return None
