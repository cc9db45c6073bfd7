"""Benchmark shapes (as in shared/FACTS.md, so the figures compare) and their work counts.

Prefill: 16k tokens per batch (B = 16384 / N), hidden 2048 (H = 2048 / D), D in 128 and
64, N from 1k to 16k, causal and not. Decode: one query token, Hq 32, Hkv 8, D 128, a
full cache of L keys per sequence, contiguous or paged (page 16 or 64). Decode at the
decode step's shapes (``wsattn bench decode --step-shapes``): the attention heads of
Llama-3.2-1B, Llama-3.1-8B and Qwen3-30B-A3B at the contexts and batches the step
benchmark runs, contiguous and paged with the engine's page of 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.kv_cache import PAGE_SIZE

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENS_PER_BATCH = 16384
HIDDEN = 2048


@dataclass(frozen=True)
class PrefillCase:
    B: int
    N: int  # query and key length
    H: int  # query heads
    HKV: int
    D: int
    causal: bool
    dtype: str = "bf16"
    op: str = "prefill"

    @property
    def id(self) -> str:
        kv = f"-HKV{self.HKV}" if self.HKV != self.H else ""
        return (f"prefill-B{self.B}-N{self.N}-H{self.H}{kv}-D{self.D}-"
                f"{'causal' if self.causal else 'full'}-{self.dtype}")

    @property
    def seqlen(self) -> int:
        return self.N

    def flops(self) -> float:
        """4*B*H*N*N*D (QK^T and PV), halved when causal."""
        f = 4.0 * self.B * self.H * self.N * self.N * self.D
        return f / 2 if self.causal else f

    def shape_fields(self) -> dict:
        return {"B": self.B, "Sq": self.N, "Sk": self.N, "Hq": self.H, "Hkv": self.HKV,
                "D": self.D, "L": None, "page_size": None}


@dataclass(frozen=True)
class DecodeCase:
    B: int
    L: int  # keys per sequence (the cache is full)
    HQ: int
    HKV: int
    D: int
    page_size: int | None  # None: contiguous cache [B, L, HKV, D]
    dtype: str = "bf16"
    op: str = "decode"

    @property
    def layout(self) -> str:
        return "contiguous" if self.page_size is None else f"paged{self.page_size}"

    @property
    def id(self) -> str:
        return (f"decode-B{self.B}-L{self.L}-HQ{self.HQ}-HKV{self.HKV}-D{self.D}-"
                f"{self.layout}-{self.dtype}")

    @property
    def seqlen(self) -> int:
        return self.L

    @property
    def causal(self) -> bool:
        return True  # the new token sees every cached key (bottom-right aligned)

    def contiguous(self) -> "DecodeCase":
        return DecodeCase(self.B, self.L, self.HQ, self.HKV, self.D, None, self.dtype)

    def bytes_moved(self) -> float:
        """K and V read once, plus q read and out written (the block table is not counted)."""
        elt = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        kv = 2 * self.B * self.L * self.HKV * self.D * elt
        return float(kv + 2 * self.B * self.HQ * self.D * elt)

    def shape_fields(self) -> dict:
        return {"B": self.B, "Sq": 1, "Sk": self.L, "Hq": self.HQ, "Hkv": self.HKV,
                "D": self.D, "L": self.L, "page_size": self.page_size}


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def tbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


PREFILL_LENGTHS = (1024, 4096, 8192, 16384)
PREFILL_DIMS = (128, 64)


def prefill_lengths_error(lengths, head_dims) -> str | None:
    """Why --prefill-seqlens / --prefill-dims cannot make prefill cases, or None: a length
    must divide the batch's TOKENS_PER_BATCH tokens (B = 16384 / N sequences), a head dim
    the HIDDEN width (H = 2048 / D heads)."""
    bad = [n for n in lengths or () if n < 1 or TOKENS_PER_BATCH % n]
    if bad:
        return (f"--prefill-seqlens: {bad} do not divide the batch's {TOKENS_PER_BATCH} "
                "tokens (powers of two up to 16384)")
    bad = [d for d in head_dims or () if d < 1 or HIDDEN % d]
    if bad:
        return f"--prefill-dims: {bad} do not divide the hidden width {HIDDEN}"
    return None


def prefill_cases(quick: bool = False, dtype: str = "bf16", lengths=None,
                  head_dims=None) -> list[PrefillCase]:
    """The prefill shapes: 16k tokens a batch, hidden 2048, causal and not, at each length
    and head dim (default PREFILL_LENGTHS x PREFILL_DIMS; quick: N 1k / 4k at D128);
    lengths and head_dims replace the defaults (prefill_lengths_error names a bad one)."""
    why = prefill_lengths_error(lengths, head_dims)
    if why:
        raise ValueError(why)
    head_dims = tuple(head_dims or ((128,) if quick else PREFILL_DIMS))
    lengths = tuple(lengths or ((1024, 4096) if quick else PREFILL_LENGTHS))
    return [PrefillCase(TOKENS_PER_BATCH // n, n, HIDDEN // d, HIDDEN // d, d, causal, dtype)
            for d in head_dims for causal in (False, True) for n in lengths]


def decode_cases(quick: bool = False, dtype: str = "bf16") -> list[DecodeCase]:
    sizes = ((64, 8192),) if quick else ((64, 8192), (8, 65536), (1, 131072))
    pages = (None, 16) if quick else (None, 16, 64)
    return [DecodeCase(b, l, 32, 8, 128, p, dtype) for b, l in sizes for p in pages]


# The decode step's attention (wsattn.bench.step): (Hq, Hkv, D) per model (the MoE
# model's 4 KV heads give half the programs a split of the dense models' 8), (B, L) from a
# single chat turn to a long document (B=32 one of the engine's mid-size buckets), and the
# engine's page size. These caches are 2-270 MB,
# where the default cases' are 0.5-2 GB: the split rule was tuned on the latter.
STEP_HEADS = {"llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128),
              "qwen3-30b-a3b": (32, 4, 128)}
STEP_SIZES = ((1, 1024), (1, 4096), (8, 4096), (32, 4096), (64, 1024), (1, 32768))
STEP_QUICK_SIZES = ((1, 4096), (8, 4096))
STEP_PAGE_SIZE = PAGE_SIZE  # the engine's


def step_decode_cases(quick: bool = False, dtype: str = "bf16") -> list[DecodeCase]:
    """Every (model heads, (B, L), layout) of the decode step: contiguous, and on the
    engine's pages."""
    sizes = STEP_QUICK_SIZES if quick else STEP_SIZES
    return [DecodeCase(b, l, hq, hkv, d, p, dtype)
            for hq, hkv, d in STEP_HEADS.values() for b, l in sizes
            for p in (None, STEP_PAGE_SIZE)]
