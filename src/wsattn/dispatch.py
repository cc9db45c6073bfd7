"""Which implementation runs a call: ``impl="auto"`` is resolved here and nowhere else.

Each backend states what it supports (``supports(call) -> reason or None``); the policy
ranks the supported ones for the call's device and shape from measurements, and the
first that supports the call wins. The API (:mod:`wsattn.api`), the custom ops and
:mod:`wsattn.sp` all ask :func:`resolve`.

Backends:
  "gluon"     - the sm_90 warp-specialized Gluon prefill (fixed length and varlen, fp16/bf16,
                D 64/128; paged prefill reading the cache's pages in place by TMA, or on
                its gathered keys, see paged_gather).
  "triton"    - the Triton kernels: prefill (fixed, varlen and over a paged cache),
                split-KV decode, merge;
                any CUDA GPU, and CPU tensors through the interpreter (TRITON_INTERPRET=1).
  "reference" - plain PyTorch in float64, any device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .target import interpreting

IMPLS = ("auto", "triton", "gluon", "reference")
OPS = ("prefill", "prefill_varlen", "prefill_paged", "decode", "merge")


@dataclass(frozen=True)
class Call:
    """What the policy needs to know about a call (host metadata only, no device reads)."""
    op: str                      # one of OPS
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    causal: bool = False
    seqlen_q: int = 0            # fixed-length prefill: Sq; varlen: max_seqlen_q (or Tq)
    seqlen_k: int = 0            # fixed-length prefill: Sk; varlen: max_seqlen_k (or Tk)
    page_size: int = 0           # paged prefill: the cache's page size
    tma_pages: bool = False      # paged prefill: each page's rows packed and 16-byte aligned


# --------------------------------------------------------------------------- backends

def _gluon_supports(call: Call) -> str | None:
    if call.op not in ("prefill", "prefill_varlen", "prefill_paged"):
        return f"the Gluon kernel has no {call.op} path (prefill only)"
    from .kernels import prefill_gluon
    if not prefill_gluon.device_supported(call.device):
        try:
            prefill_gluon.check_device(call.device)
        except ValueError as e:  # its message names the device's compute capability
            return str(e)
        return f"the Gluon kernel does not run on {call.device}"
    if call.dtype not in prefill_gluon.GLUON_DTYPES:
        return f"the Gluon kernel takes float16 or bfloat16, got {call.dtype}"
    if call.head_dim not in prefill_gluon.GLUON_HEAD_DIMS:
        return f"the Gluon kernel takes head dim 64 or 128, got {call.head_dim}"
    if call.op == "prefill" and call.seqlen_k == 0:  # varlen: rows with no key get 0, -inf
        return "the Gluon kernel needs at least one key (kv_len > 0)"
    if call.op == "prefill_paged":
        block_n = prefill_gluon.settings_for(call.head_dim, call.causal).BLOCK_N
        if not prefill_gluon.paged_supported(call.page_size, block_n):
            return (f"the Gluon kernel reads pages in place at page sizes that are multiples "
                    f"of 8 and tile or are tiled by {block_n} rows, got page_size "
                    f"{call.page_size} (gather=True runs it on gathered keys)")
        if not call.tma_pages:
            return ("the Gluon kernel reads pages in place by TMA: k_cache and v_cache need "
                    "each page's rows packed ([page_size, Hkv, D] contiguous) and 16-byte "
                    "aligned (gather=True runs it on gathered keys)")
    return None


def _triton_supports(call: Call) -> str | None:
    if call.device.type != "cuda" and not (interpreting() and call.device.type == "cpu"):
        return (f"the Triton kernels run on CUDA tensors, got tensors on {call.device}; set "
                "TRITON_INTERPRET=1 to run them through the interpreter on the CPU, or use "
                "impl='reference'")
    return None


def _reference_supports(call: Call) -> str | None:
    return None


SUPPORTS = {"gluon": _gluon_supports, "triton": _triton_supports,
            "reference": _reference_supports}


# --------------------------------------------------------------------------- policy

# Prefill on sm_90, measured side by side on H200 (bf16, 16k tokens a batch; bench
# results in benchmarks/results/): the Triton kernel is faster than the Gluon kernel up
# to these query lengths, keyed by (head dim, causal); longer calls go to Gluon. It was so
# at N = 1024 causal against the two- and three-consumer builds (D64 192 vs 271 TFLOP/s,
# D128 314 vs 354), until the Gluon kernel's one-consumer build (prefill_gluon.
# ONE_CONSUMER_UP_TO: 64-row tiles, two or three CTAs an SM) took those calls: x the
# Triton kernel side by side at N = 1024 in three bench processes
# (bench_prefill_peers_process*_dc1c467), D128 causal 1.03-1.10, D64 causal 1.07-1.10;
# D128 non-causal (the two-consumer build) 1.26-1.31; non-causal N = 256 on the
# one-consumer build 107-131 us against the Triton kernel's 135-145. So no fixed-length
# shape stays with Triton.
TRITON_FASTER_UP_TO: dict[tuple[int, bool], int] = {}
# Varlen: a pack whose longest query and key sequences (Call.seqlen_q / seqlen_k:
# max_seqlen_q / _k, else Tq / Tk) both fit prefill_gluon.VARLEN_ONE_CONSUMER_UP_TO goes
# to Gluon, whose launcher runs its one-consumer build there: on 16k-token packs of
# lengths 64-1024 (`wsattn bench varlen --varlen-heads gqa --varlen-lengths 64 1024`,
# GQA 32/8) 1.44-1.62x the Triton kernel that this table gave those packs before; so do
# packs whose longest query chunk is at most prefill_gluon.ONE_CONSUMER_CHUNK_UP_TO (64)
# rows, whatever their keys (causal chunk 64 against 2k-32k keys: 1.03-1.26x the Triton
# kernel; without a mask not timed). Other varlen calls take this table on the longest
# query sequence in place of Sq. Causal query chunks of 128, 256 and 1024 against 2k-32k
# keys before them (`wsattn
# bench chunked --chunked-chunk 128 / 256 / 1024`, 16k chunk tokens or 128 chunks, GQA
# 32/8, contiguous keys) ran on the Gluon kernel's default build 1.04-1.32x the Triton
# kernel (D64 chunk 256 over 32k: 1.00), so causal packs have no entry. D64 non-causal
# chunks of 65 to 1024 queries stay on Triton (the one-tile Gluon launch tied or trailed
# it at N = 1024, fixed length; chunks against long keys without a mask unmeasured).
VARLEN_TRITON_FASTER_UP_TO = {(64, False): 1024}
# The Gluon varlen build reached the ladder's sanitizer gate (with the
# warp-specialize dispatch waiver of the other Gluon builds; ladder_sm90_library.md)
# and, on the H200, ran 1.10-1.28x the Triton varlen kernel on a 16k-token pack of
# lengths drawn from 64-8192 (`wsattn bench varlen --varlen-heads gqa`, GQA 32/8: D128
# causal 433 vs 384 TFLOP/s, full 547 vs 414; D64 causal 318 vs 289, full 422 vs 363).


# Paged prefill (chunked prefill over a paged cache): read the cache in place (the Gluon
# kernel's paged build, TMA boxes of a page; elsewhere the Triton paged kernel), or gather
# each sequence's keys into a packed buffer first (kernels/paged_gather.py, one launch)
# and run the varlen rule above on it. On H200 (`wsattn bench chunked`: B 8 chunks of
# 2048, prefix 0-32k, GQA 32/8, bf16, causal; x the Gluon varlen kernel on the same keys
# contiguous, one run): at pages of 64 the Gluon in-place build ran 0.978-1.045x (8 of 8
# shapes >= 0.95), the gather 0.909-0.982x; at pages of 16 (a tile is eight TMA boxes)
# the in-place build ran 0.893-0.978x, the gather 0.919-0.980x, ahead at 7 of 8 shapes.
# Hence in place from PAGED_IN_PLACE_FROM_PAGE rows a page where the Gluon kernel takes the
# call, else the gather. Measured at chunks of 2048 first; for chunks the varlen rule gives
# to the Triton kernel (VARLEN_TRITON_FASTER_UP_TO), "auto" gathers, so they run on it. The
# in-place build is the one prefill_varlen would pick for the same keys packed (short
# query chunks: the one-consumer build). The Triton in-place kernel ran 0.51-0.87x
# contiguous, so without the Gluon kernel the gather is taken too. The buffer is transient
# but sized from host metadata (batch x block-table width x page_size rows of K and V;
# 1.14 GB at the largest shape there), so the gather is taken up to this many bytes of it
# and the call reads in place above.
# At D128 the in-place build later led at pages of 16 too: five processes of the same
# table (`chunked_process{1,2,3}_*_9021183`, `chunked_process{4,5}_*_6330ad4`, in git history), the two
# columns side by side in each, gathered / in place 0.93-1.11 (prefix 2k one process at
# 0.93, the other 19 cells 0.99-1.11; prefix 32k 1.020-1.029 in all five); at D64 the
# gather still led at prefix 0 and 32k (0.95-0.99 in 9 of 10). Pages of 32 at D128, one
# process: in place ahead at 4 of 4 (`chunked_pages_32_128_*`). Hence the threshold by
# head dim (notes/prefill_triton.md, "Where the chunked table stands").
PAGED_IN_PLACE_FROM_PAGE = {64: 64, 128: 16}
# Shorter chunks read smaller pages in place too: the gather copies every key of a
# sequence once a call whatever the chunk, so its share of the call grows as the chunk
# shrinks. Causal chunks of 256 / 1024 over 2k / 8k keys at pages of 16 (`wsattn bench
# chunked --chunked-chunk 256 / 1024`, one run, both head dims): in place 0.99-1.22x /
# 1.02-1.05x the gathered call (7 of 8 shapes ahead, one at 0.99), where at
# chunks of 2048 the gather led at 7 of 8.
PAGED_IN_PLACE_CHUNK_UP_TO = 1024
PAGED_GATHER_MAX_BYTES = 2 << 30


def paged_gather(call: Call, buffer_bytes: int, impl: str = "auto") -> bool:
    """Whether a paged prefill call gathers its keys first (``attention_paged``'s
    gather=None) when ``impl`` ("auto", "triton" or "gluon") runs it: not where the Gluon
    kernel reads its pages in place (pages of PAGED_IN_PLACE_FROM_PAGE[head_dim] rows or
    more, or chunks of at most PAGED_IN_PLACE_CHUNK_UP_TO queries; for "auto" also a chunk the
    varlen rule gives to Gluon); otherwise on CUDA while the gather buffer stays within
    PAGED_GATHER_MAX_BYTES, and always for impl="gluon" (its other route)."""
    if call.device.type != "cuda":
        return False
    in_place = (call.page_size >= PAGED_IN_PLACE_FROM_PAGE.get(call.head_dim, 64)
                or call.seqlen_q <= PAGED_IN_PLACE_CHUNK_UP_TO)
    if impl in ("auto", "gluon") and in_place and _gluon_supports(call) is None:
        # "auto": in place where the varlen rule would run the gathered call on Gluon
        if impl == "gluon" or ranking(replace(call, op="prefill_varlen"))[0] == "gluon":
            return False
    return impl == "gluon" or buffer_bytes <= PAGED_GATHER_MAX_BYTES


def ranking(call: Call) -> tuple[str, ...]:
    """Backends in the order the policy prefers them for this call."""
    if call.device.type != "cuda":
        # CPU: the kernels only under the interpreter (a test mode), else the reference
        return ("triton", "reference") if interpreting() else ("reference",)
    if call.op == "prefill_varlen":
        from .kernels import prefill_gluon
        if prefill_gluon.varlen_one_consumer(call.head_dim, call.causal, call.seqlen_q,
                                             call.seqlen_k):
            # short sequences, or a short query chunk: the one-consumer build
            return ("gluon", "triton")
    if call.op in ("prefill", "prefill_varlen"):
        # the length tables (TRITON_FASTER_UP_TO, VARLEN_TRITON_FASTER_UP_TO)
        table = TRITON_FASTER_UP_TO if call.op == "prefill" else VARLEN_TRITON_FASTER_UP_TO
        limit = table.get((call.head_dim, bool(call.causal)), 0)
        return ("triton", "gluon") if call.seqlen_q <= limit else ("gluon", "triton")
    if call.op == "prefill_paged":  # in place (a gathered call is ranked as varlen)
        return ("gluon", "triton")
    return ("triton",)


def reason(impl: str, call: Call) -> str | None:
    """None when ``impl`` can run ``call``, else why not."""
    return SUPPORTS[impl](call)


def resolve(impl: str, call: Call) -> str:
    """The concrete backend for ``impl`` ("auto" or a backend name): raises ValueError
    naming the reason when the named backend cannot run the call."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        why = reason(impl, call)
        if why is not None:
            raise ValueError(why if why.startswith("impl=") else
                             f"impl={impl!r} cannot run this {call.op} call: {why}")
        return impl
    for name in ranking(call):
        if reason(name, call) is None:
            return name
    return "reference"
