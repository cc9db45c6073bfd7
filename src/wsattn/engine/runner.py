"""The kernel step: a model's decode step as fused Triton launches, one CUDA graph per
batch bucket, PDL between the launches; prefill of packed chunks through cuBLAS and
:func:`wsattn.attention_varlen` / :func:`wsattn.attention_paged`.

:class:`KernelStep` implements the engine's :class:`~wsattn.engine.generate.Step`
contract over FlashNorm-folded weights (:mod:`wsattn.models.flashnorm`). The kernels live
in :mod:`wsattn.kernels`; this module only wires them.

Decode, one token per sequence, on a static batch of ``bucket`` rows (h is the residual
stream [bucket, hidden] in the model dtype; every norm is FlashNorm, the norm weight
folded into the next projection and only ``1/rms`` applied in the kernel)::

    h = embed[tokens]                                    torch index_select (into a static buffer)
    positions = seqlens - 1                              torch sub (once a step)
    per layer (5 library calls; 5 Triton launches, 6 when decode splits the keys):
        q = qkv_rope_append(h, wqkv, norm_eps, bqkv, q/k_norm, rope, -> k/v pages)   1 launch
        a = wsattn.decode(q, k_pages[l], v_pages[l], seqlens, block_table)     1 (+1 combine)
        h = gemv(a, wo, residual=h, out=h)                                     1 (+1 split-K finish)
        act = gemv(h, w_gate_up, norm_eps, silu_mul=True)                      1 (+1)
        h = gemv(act, w_down, residual=h, out=h)                               1 (+1)
    logits = gemv(h, lm_head, norm_eps)                  (+ one cast to fp32 for 16-bit models)

From ``CUBLAS_WIDE_ROWS`` rows on sm_90 the o and down projections are one cuBLAS
``h.addmm_(a, wo.t())`` each instead (measured faster there; the note at the constant).

In a mixture-of-experts layer (``i in cfg.moe_layers``: every MoE family) the two MLP
GEMVs are the MoE kernels of :mod:`wsattn.kernels.moe` (7 library calls, 9 Triton
launches a layer, 10 when decode splits the keys)::

        wts, ids = route(h, router, top_k, renormalize=norm_topk, norm_eps)   2 (logits, top-k)
        g = group(ids, experts, block)                                        1
        act = moe_gate_up(h, w_gate_up, g, norm_eps)                          1
        h = moe_down_combine(act, w_down, g, wts, out=h, residual=h)          2 (down, combine)

At bucket 1 (``moe_one_token``) the grouping is ``one_token_grouping`` (no launch), and
with ``moe_topk_in_gate_up`` the top-k launch goes too: ``route_logits`` computes the
logits only, and the gate/up launch given ``route=`` selects each block's expert from
them and writes the ids and weights the down projection and combine read (7 Triton
launches a MoE layer, 8 with decode's split combine).

A shared expert adds, around the combine: before it, ``gemv(h, w_shared_gate_up,
norm_eps, silu_mul=True)``, and where it is gated (Qwen2-MoE) ``gemv(h, shared_gate,
norm_eps)`` (one output column) with ``act *= sigmoid(gate)`` (two torch ops); after it,
``gemv(act, w_shared_down, residual=h, out=h)``. dots1's shared experts are ungated and
its router (sigmoid, score-correction bias, group-limited top-k, routed scale) runs in
the same route launches, their switches constexprs of the top-k code.

``block`` (rows a grouping block) is the kernels' default for the bucket's row count, a
Python int fixed per bucket; every grouping tensor has a static upper-bound size
(``blocks_max``) and the active block count stays on the device, so the step still
captures in one graph. The launchers allocate their outputs (routing weights and ids,
the grouping, act, the per-pair down rows); during capture those come from the graph's
private pool at fixed addresses, as decode's output does. h is read by route and
gate_up and written by the combine, which the stream (or PDL's wait) orders after them;
the combine reads and writes each residual element in the same program.

Router precision: the route kernel accumulates the logits in fp32 and never rounds them
or the chosen weights to the model dtype. transformers computes the router logits in the
model dtype (bf16 logits before the fp32 softmax) and Qwen3-MoE rounds the chosen
weights back to it (Mixtral keeps them fp32), so in bf16 a near-tie can route
differently from transformers and the weights differ by up to one bf16 rounding; in fp32
the two agree (the CPU tests are fp32). The decode kernels select on the fp32 logits,
whose order the probabilities share up to their rounding; exact ties go to the lower
expert index here (torch.topk's order is unspecified). Prefill routes the same way (fp32
logits, then :func:`wsattn.models.moe.select` with ``stable=True``, the kernels' tie
rule), so a prompt's tokens and later decode steps follow one convention.

OLMoE's QK-norm spans the whole q/k projection (``cfg.qk_norm_whole``): a program of the
fused QKV kernel sees only its heads, so there ``qkv_rope_append(qk_norm_whole=True)`` runs
the projection as a GEMV and then one kernel for the norm, RoPE and the append (two
launches for the one call).

The split-K finishes launch only where the GEMV settings split K (on the GPU, at shapes
whose column blocks do not fill the SMs; never in the interpreter) and the combine only
where decode splits the keys; :attr:`KernelStep.launches` counts the library calls.

Batch buckets: a batch of B rows runs at the smallest bucket >= B. The rows past B repeat
row 0 (its token, its length, its block-table row): they compute what row 0 computes and
write row 0's k/v, the same bytes to the same cache slot, so the cache stays as an
unpadded step leaves it without a spare page in the pool; their logits are dropped.

CUDA graphs (GPU, ``graphs=True`` by default there): the first decode at a bucket runs the
step eagerly once (compiles the kernels, sizes the workspaces), then captures it into a
graph over static buffers (tokens, seqlens, block table of the cache's full width, the
residual stream, q, the MLP activation, logits); every later decode at that bucket copies
its inputs into those buffers and replays. Before the first capture the fused QKV
kernel's split-K workspace (shared per device, grown on demand) is sized for every
bucket, so no capture allocates it and no replay reads a freed one.

Prefill (never captured): projections and the MLP as torch matmuls (M is large, cuBLAS
is at its best), the same FlashNorm / QK-norm / RoPE arithmetic as the kernels in fp32,
k/v scattered into the pages through the block table, then attention of each chunk:
``wsattn.attention_varlen`` on the chunk itself when every sequence starts at 0, else
``wsattn.attention_paged`` over each sequence's cached prefix + chunk (causal,
bottom-right aligned, so the chunk's token i sees keys 0..start+i). A MoE layer's MLP in prefill:
fp32 router logits, the reference routing (:func:`wsattn.models.moe.select`), the pairs
sorted by expert on the device, gate/up and down as two ``torch._grouped_mm`` calls over
the per-expert row offsets (bf16 on CUDA, any dtype on the CPU; elsewhere, e.g. fp16 on
CUDA, one matmul pair per touched expert, which reads the per-expert counts on the host:
one synchronisation per MoE layer and chunk), the product in the model dtype, then the
per-pair fp32 results times the routing weight added onto the residual in slot order (the
decode kernels' arithmetic).

Where it runs: CUDA (fp16/bf16; graphs and PDL on sm_90+) or the CPU through the Triton
interpreter (``TRITON_INTERPRET=1``; fp32 or fp16; eager, no graphs, no PDL).
"""

from __future__ import annotations

import collections
import math

import torch
import torch.nn.functional as F

from .. import api, ops
from ..kernels.gemv import MAX_M as GEMV_MAX_M, gemv
from ..kernels.moe import MAX_E as MOE_MAX_E, default_block, group, moe_down_combine, \
    moe_gate_up, one_token_grouping, one_token_tables, route, route_logits
from ..kernels.qkv_rope import (GemvRopeSettings, TwoLaunchSettings, qkv_rope_append,
                                 qkv_rope_workspace)
from ..models import moe as moe_math
from ..models.config import HEAD_DIMS, ModelConfig
from ..models.weights import Weights
from ..rope import rope_inv_freq
from ..target import interpreting
from .generate import BUCKETS

__all__ = ["KernelStep", "PDL_FAMILIES", "PDL_VARIANTS"]

# The kernel families `pdl=` can turn on one by one (an A/B of where PDL pays): the fused
# QKV launch(es), decode attention with its split combine, every GEMV (o, gate/up, down,
# LM head, their split-K finish), and the MoE kernels (route, group, grouped, combine).
# pdl=None turns every family on where the GPU has PDL, the GEMVs with the release gemv
# picks by rows (gemv.PDL_LATE_BELOW_M). H200, one CUDA graph a step (wsattn bench step,
# pdl[...] columns side by side; notes/decode_step.md): qkv_rope and decode gained 1.4 %
# at Llama-3.2-1B B1 and were even at Llama-3.1-8B B1; the MoE kernels 3-8 % a layer; the
# GEMVs 1.8-2.3 % at B1 with the late release (8B 4.471 -> 4.389 ms), 2-6 % at B8 and
# 2-4 % at B64 with the early one.
PDL_FAMILIES = ("qkv_rope", "decode", "gemv", "moe")
# A/B variants `pdl=` also takes in place of a family: the GEMVs with PDL and the release
# forced after their weight stream ("gemv:late") or right after their wait ("gemv:early")
# in every bucket, instead of by rows; the QKV call with PDL on the two-launch path (gemv,
# then the (row, head) epilogue kernel) where the default takes the GEMV-epilogue path
# ("qkv_rope:two-launch"; the same where the default takes two launches anyway), or on the
# GEMV-epilogue path where the default takes two launches ("qkv_rope:gemv-rope": where
# its grid rule keeps two launches, e.g. Llama-3.1-8B at one row; refused at construction
# for QK-norm over the whole projection, OLMoE's, which that path does not take).
# "gemv:kernel-wide": the GEMVs with PDL as "gemv", and the o and down projections on the
# GEMV kernel at every row count (the default hands them to cuBLAS from CUBLAS_WIDE_ROWS
# rows on sm_90; below). "moe:topk-launch": the MoE kernels with PDL as "moe", and at
# bucket 1 the router's top-k in its own launch (KernelStep's moe_topk_in_gate_up off).
# "moe:gluon": the MoE kernels with PDL as "moe", and the grouped gate/up and down on the
# sm_90 warp-specialized Gluon kernel (kernels/moe_gluon.py: its own grouping blocks, no
# PDL of its own, no top-k inside it, so the top-k keeps its launch); opt-in, since that
# kernel measured 0.74-0.95x the Triton one per layer (notes/moe.md); refused at
# construction where the Gluon kernel cannot run.
# Measured and removed (notes/decode_step.md): decode loading its first K/V tile before
# the wait, and the QKV projection GEMV's late release.
PDL_VARIANTS = {"gemv:late": "gemv", "gemv:early": "gemv", "gemv:kernel-wide": "gemv",
                "qkv_rope:two-launch": "qkv_rope", "qkv_rope:gemv-rope": "qkv_rope",
                "moe:topk-launch": "moe", "moe:gluon": "moe"}
# Rows from which the o and down projections (a plain product plus the residual, no norm
# or SiLU epilogue) run as one cuBLAS addmm into the residual on sm_90, 16-bit: fp32
# accumulate and the residual added before the one rounding, as gemv does, but no PDL
# across that launch. Where the GEMV kernel's 33-64-row rule starts: at 64 rows alone
# (H200) 1B o 9.0 / down 17.9 us against cuBLAS's 6.2 / 13.6, 8B 15.8 / 41.7 against
# 12.1 / 35.6; in the step at B64 ctx 1k, same process, 1B 1.841 -> 1.765 ms/token, 8B
# 7.428 -> 7.186 (notes/decode_step.md). Other targets keep the GEMV kernel (unmeasured).
CUBLAS_WIDE_ROWS = 33

CUDA_DTYPES = (torch.float16, torch.bfloat16)
# the interpreter's bf16 tl.dot multiplies raw bits; fp32 and fp16 are exact there
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def _pdl_families(pdl, has_pdl: bool) -> frozenset:
    """The kernel families PDL is on for: None -> all where the GPU has it, True / False ->
    all / none, else a collection of PDL_FAMILIES (or PDL_VARIANTS) names."""
    if pdl is None or isinstance(pdl, bool):
        return frozenset(PDL_FAMILIES) if (has_pdl if pdl is None else pdl) else frozenset()
    if isinstance(pdl, str) or not hasattr(pdl, "__iter__"):
        raise ValueError(f"pdl must be None, True, False or a collection of {PDL_FAMILIES}, "
                         f"got {pdl!r}")
    names = frozenset(pdl)
    unknown = sorted(str(n) for n in names - set(PDL_FAMILIES) - set(PDL_VARIANTS))
    if unknown:
        raise ValueError(f"pdl: unknown kernel families {unknown}; they are {PDL_FAMILIES} "
                         f"(or the variants {tuple(PDL_VARIANTS)})")
    for family in PDL_FAMILIES:
        same = sorted(n for n in names if n == family or PDL_VARIANTS.get(n) == family)
        if len(same) > 1:
            raise ValueError(f"pdl: {same} name the same kernels ({family}); give one")
    return names


class _Buffers:
    """A bucket's static tensors: what its CUDA graph reads and writes."""

    def __init__(self, cfg, bucket, max_pages, dtype, device, moe_gluon=False):
        i32, dev = torch.int32, device
        self.bucket = bucket
        self.tokens = torch.zeros(bucket, dtype=torch.int64, device=dev)
        self.seqlens = torch.ones(bucket, dtype=i32, device=dev)
        self.positions = torch.zeros(bucket, dtype=i32, device=dev)
        self.block_table = torch.zeros(bucket, max_pages, dtype=i32, device=dev)
        self.h = torch.zeros(bucket, cfg.hidden, dtype=dtype, device=dev)
        self.q = torch.zeros(bucket, cfg.heads, cfg.head_dim, dtype=dtype, device=dev)
        dense = len(cfg.moe_layers) < cfg.layers
        self.act = torch.zeros(bucket, cfg.ffn, dtype=dtype, device=dev) if dense else None
        # rows a grouping block in MoE layers: fixed per bucket, so the grouping's static
        # sizes (and a captured graph's launches) are too
        # (the Gluon grouped kernel's own blocks with moe_gluon)
        block = _gluon_moe().default_block if moe_gluon else default_block
        self.moe_block = block(bucket, cfg.top_k, cfg.experts) if cfg.is_moe else None
        # the one-token grouping's constant tables (KernelStep's moe_one_token), made here,
        # before any capture
        self.moe_tables = (one_token_tables(cfg.top_k, self.moe_block, dev)
                           if cfg.is_moe and bucket == 1 else None)
        # a shared expert's activation and its per-row gate (Qwen2-MoE's; dots1's has none)
        shared = cfg.is_moe and cfg.shared_ffn > 0
        self.shared_act = (torch.zeros(bucket, cfg.shared_ffn, dtype=dtype, device=dev)
                           if shared else None)
        self.shared_gate = (torch.zeros(bucket, 1, dtype=dtype, device=dev)
                            if shared and cfg.shared_gated else None)
        self.logits = torch.zeros(bucket, cfg.vocab, dtype=torch.float32, device=dev)
        # the LM head GEMV writes the model dtype; 16-bit models cast into logits after it
        self.logits_model = (self.logits if dtype == torch.float32 else
                             torch.zeros(bucket, cfg.vocab, dtype=dtype, device=dev))


class KernelStep:
    """The engine's step through the fused kernels (see the module docstring).

    Args:
        cfg: the :class:`~wsattn.models.config.ModelConfig`.
        weights: folded :class:`~wsattn.models.weights.Weights` (``norms_folded=True``),
            fp16/bf16 on CUDA, fp32/fp16 on the CPU (Triton interpreter).
        cache: the :class:`~wsattn.engine.kv_cache.PagedKVCache` (k/v [layers, num_pages,
            page_size, Hkv, D], the weights' dtype and device). Graphs are captured
            against its tensors: build a new step when the pool is reallocated.
        buckets: increasing batch sizes, each <= 64 (the GEMV kernels' row limit); the
            largest must hold ``cache.max_batch`` when the cache sets one.
        graphs: capture one CUDA graph per bucket (None: on for CUDA; CPU: off, True
            refused).
        pdl: programmatic dependent launch. None: on CUDA sm_90+ for every kernel that
            takes it (where each measured a gain), off elsewhere; True: every kernel that
            takes it (refused off sm_90+); False: none; or a collection of
            ``PDL_FAMILIES`` names: on for those kernel families only (to measure where
            PDL pays), "gemv:late" / "gemv:early" in place of "gemv" forcing where the
            GEMVs release, "gemv:kernel-wide" keeping the o and down projections on the
            GEMV kernel where the step hands them to cuBLAS (``CUBLAS_WIDE_ROWS``),
            "qkv_rope:two-launch" / "qkv_rope:gemv-rope" in place of "qkv_rope" forcing
            the QKV call's path, "moe:gluon" in place of "moe" running the grouped expert
            projections on the sm_90 Gluon kernel (``PDL_VARIANTS``).
        moe_one_token: at bucket 1, group a MoE layer's (token, slot) pairs without the
            grouping kernel (``moe.one_token_grouping``: one block a slot; same bits), one
            launch fewer a MoE layer. On by default: the 48-layer Qwen3-30B-A3B step at B1
            ran 3.378 -> 3.138 ms/token with it (H200, notes/moe.md); False keeps the
            grouping kernel (the A/B, and the bitwise check against it).
        moe_topk_in_gate_up: with moe_one_token at bucket 1, the router's top-k inside the
            grouped gate/up launch (``moe.route_logits`` + ``moe_gate_up(route=)``), one
            launch fewer a MoE layer; the same experts, the weights up to the order of
            the renormalising sum. False (or the ``pdl`` variant "moe:topk-launch")
            keeps the top-k launch.

    Attributes:
        launches: ``collections.Counter`` of library calls by name ("embed", "positions",
            "qkv_rope", "decode", "gemv_o", "gemv_gate_up", "gemv_down", "moe_route",
            "moe_group", "moe_gate_up", "moe_down_combine", "gemv_lm_head",
            "logits_cast"), counted when a step runs eagerly (warm-up and capture
            included, replays not).

    MoE layers (every MoE family; see the module docstring) take router [E, hidden],
    w_gate_up [E, 2 * moe_ffn, hidden], w_down [E, hidden, moe_ffn], the router and
    w_gate_up FlashNorm-folded, E <= 256.

    Raises ValueError naming the argument for anything it does not run: a device other
    than CUDA or the interpreter, a dtype the kernels do not take there, a head dim other
    than 64/128/256, a hidden size not a multiple of 16, more than 256 experts, unfolded
    weights, shapes that do not match cfg, a ``pdl`` that is not one of the above (or
    forces the GEMV-epilogue QKV path on a model with QK-norm over the whole projection).
    """

    name = "kernels"

    def __init__(self, cfg, weights, cache, *, buckets=BUCKETS, graphs=None, pdl=None,
                 moe_one_token=True, moe_prefill_grouped=True, moe_topk_in_gate_up=True):
        # what the fused step does not run, refused by feature before any shape check
        if getattr(cfg, "experts", 0) > MOE_MAX_E:
            raise ValueError(f"step='kernels': {cfg.family} has {cfg.experts} experts; the MoE "
                             f"router kernel takes at most {MOE_MAX_E}")
        if getattr(cfg, "qk_norm_whole", False) and "qkv_rope:gemv-rope" in _pdl_families(
                pdl, has_pdl=True):
            raise ValueError(f"pdl: the variant 'qkv_rope:gemv-rope' (the GEMV-epilogue QKV "
                             f"path) takes no QK-norm over the whole projection, which "
                             f"{cfg.family} has")
        self._check(cfg, weights, cache)
        self.cfg, self.weights, self.cache = cfg, weights, cache
        self.device, self.dtype = weights.embed.device, weights.dtype
        on_cuda = self.device.type == "cuda"
        buckets = tuple(buckets)
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                              for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be increasing positive ints, got {buckets!r}")
        if buckets[-1] > GEMV_MAX_M:
            raise ValueError(f"buckets: {buckets[-1]} rows is above the {GEMV_MAX_M} the GEMV "
                             "kernels take")
        max_batch = getattr(cache, "max_batch", None)
        if max_batch is not None and max_batch > buckets[-1]:
            raise ValueError(f"buckets: the largest ({buckets[-1]}) is below the cache's "
                             f"max_batch ({max_batch})")
        self.buckets = buckets
        if graphs not in (None, True, False):
            raise ValueError(f"graphs must be None, True or False, got {graphs!r}")
        if graphs and not on_cuda:
            raise ValueError("graphs=True needs CUDA tensors (the interpreter has no graphs)")
        self.graphs = on_cuda if graphs is None else graphs
        major = torch.cuda.get_device_capability(self.device)[0] if on_cuda else 0
        has_pdl = major >= 9
        families = _pdl_families(pdl, has_pdl)
        if families and not has_pdl:
            raise ValueError(f"pdl={pdl!r} needs a CUDA GPU of sm_90 or later; the weights "
                             f"are on {self.device}")
        self.pdl_families = families
        # where the o and down projections of CUBLAS_WIDE_ROWS rows or more go to cuBLAS
        self.cublas_wide = major == 9 and self.dtype in (torch.float16, torch.bfloat16)
        if moe_one_token not in (True, False):
            raise ValueError(f"moe_one_token must be True or False, got {moe_one_token!r}")
        self.moe_one_token = moe_one_token
        if moe_topk_in_gate_up not in (True, False):
            raise ValueError(f"moe_topk_in_gate_up must be True or False, got "
                             f"{moe_topk_in_gate_up!r}")
        # the Gluon grouped kernel selects no expert itself: the top-k keeps its launch
        self.moe_gluon = cfg.is_moe and "moe:gluon" in families
        if self.moe_gluon:
            reason = _gluon_moe().unsupported_reason(self.device, self.dtype)
            if reason is not None:
                raise ValueError(f"pdl variant 'moe:gluon': {reason}")
        self.moe_topk_in_gate_up = (moe_topk_in_gate_up and not self.moe_gluon
                                    and "moe:topk-launch" not in families)
        if moe_prefill_grouped not in (True, False):
            raise ValueError(f"moe_prefill_grouped must be True or False, got "
                             f"{moe_prefill_grouped!r}")
        self.moe_prefill_grouped = moe_prefill_grouped

        rope = cfg.rope
        scaling = None if rope.type == "default" else {
            "rope_type": rope.type, "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_positions}
        self.inv_freq = rope_inv_freq(cfg.head_dim, rope.theta, scaling, device=self.device)
        self.eps = float(cfg.rms_eps)
        self.max_pages = cache.k.shape[1] if getattr(cache, "max_pages", None) is None \
            else int(cache.max_pages)
        self.page_size = cache.k.shape[2]
        self.launches: collections.Counter = collections.Counter()
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # the fused QKV kernel's split-K scratch, owned by the step so that what a graph
        # captures never moves: sized for every row count up to the largest bucket
        self._qkv_workspace = qkv_rope_workspace(
            self.device, buckets[-1], cfg.heads, cfg.kv_heads, cfg.head_dim,
            hidden=cfg.hidden, dtype=self.dtype)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check(cfg, weights, cache):
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if not isinstance(weights, Weights):
            raise ValueError(f"weights must be wsattn.models.Weights, got "
                             f"{type(weights).__name__}")
        if not weights.norms_folded:
            raise ValueError("weights must be FlashNorm-folded (wsattn.models.flashnorm.fold): "
                             "the kernels apply only 1/rms, the norm weights must live in "
                             "wqkv, w_gate_up and lm_head")
        dev, dt = weights.embed.device, weights.dtype
        if dev.type == "cuda":
            if dt not in CUDA_DTYPES:
                raise ValueError(f"weights dtype {dt} is not taken by the kernels on CUDA "
                                 f"(float16, bfloat16)")
        elif dev.type == "cpu":
            if not interpreting():
                raise ValueError("step='kernels' on the CPU needs the Triton interpreter "
                                 "(TRITON_INTERPRET=1 before triton is imported); use "
                                 "step='reference' or CUDA tensors")
            if dt not in INTERPRETER_DTYPES:
                raise ValueError(f"weights dtype {dt} is not run by the kernels in the Triton "
                                 "interpreter (float32, float16; its bf16 dot is wrong)")
        else:
            raise ValueError(f"weights are on {dev}; the kernel step runs on CUDA or the CPU "
                             "interpreter")
        if cfg.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {cfg.head_dim} is not supported (the kernels take "
                             f"{HEAD_DIMS})")
        if cfg.hidden % 16:
            raise ValueError(f"hidden size {cfg.hidden} must be a multiple of 16 (the fused "
                             "QKV kernel's K tiles)")
        if len(weights.layers) != cfg.layers or tuple(weights.embed.shape) != (cfg.vocab,
                                                                            cfg.hidden):
            raise ValueError(f"weights ({len(weights.layers)} layers, embed "
                             f"{list(weights.embed.shape)}) do not match cfg ({cfg.layers} "
                             f"layers, vocab {cfg.vocab}, hidden {cfg.hidden})")
        rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        for name, t, shape in (("lm_head", weights.lm_head, (cfg.vocab, cfg.hidden)),):
            if tuple(t.shape) != shape:
                raise ValueError(f"weights.{name} must be {list(shape)}, got {list(t.shape)}")
        moe = tuple(i for i, layer in enumerate(weights.layers) if layer.router is not None)
        if moe != cfg.moe_layers:
            raise ValueError(f"weights have a router in layers {list(moe)}, cfg.moe_layers is "
                             f"{list(cfg.moe_layers)}")
        for i, layer in enumerate(weights.layers):
            if i in cfg.moe_layers:
                # router, experts, a shared expert and the router's bias, as the reference
                # checks them
                moe_math.check_moe_layer(cfg, layer, f"weights.layers[{i}]")
                mlp = ()
            else:
                mlp = (("w_gate_up", (2 * cfg.ffn, cfg.hidden)), ("w_down", (cfg.hidden, cfg.ffn)))
            for name, shape in (("wqkv", (rows, cfg.hidden)),
                                ("wo", (cfg.hidden, cfg.q_size))) + mlp:
                t = getattr(layer, name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"weights.layers[{i}].{name} must be {list(shape)}, got "
                                     f"{list(t.shape)}")
            if (layer.bqkv is not None) != cfg.qkv_bias:
                raise ValueError(f"weights.layers[{i}].bqkv is "
                                 f"{'missing' if cfg.qkv_bias else 'present'} but cfg.qkv_bias="
                                 f"{cfg.qkv_bias}")
            qk = cfg.qk_norm or cfg.qk_norm_whole
            if (layer.q_norm is not None) != qk or (layer.k_norm is not None) != qk:
                raise ValueError(f"weights.layers[{i}].q_norm/k_norm do not match "
                                 f"cfg.qk_norm={cfg.qk_norm}, "
                                 f"cfg.qk_norm_whole={cfg.qk_norm_whole}")
        # a router's score-correction bias is float32 whatever the model dtype (weights.py)
        bad = [n for n, t in weights.tensors()
               if t.dtype != (torch.float32 if n.endswith(".router_bias") else dt)
               or t.device != dev or not t.is_contiguous()]
        if bad:
            raise ValueError(f"weights {bad[:4]} must be contiguous {dt} on {dev} like embed")
        k, v = getattr(cache, "k", None), getattr(cache, "v", None)
        want = (cfg.layers, cfg.kv_heads, cfg.head_dim)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 5 \
                or (k.shape[0], k.shape[3], k.shape[4]) != want or v.shape != k.shape:
            raise ValueError(f"cache k/v must be [layers={cfg.layers}, num_pages, page_size, "
                             f"Hkv={cfg.kv_heads}, D={cfg.head_dim}] tensors, got "
                             f"{getattr(k, 'shape', k)} and {getattr(v, 'shape', v)}")
        if k.dtype != dt or v.dtype != dt or k.device != dev or v.device != dev:
            raise ValueError(f"cache k/v must be {dt} on {dev} (the weights'), got {k.dtype} "
                             f"on {k.device}")
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("cache k/v must be contiguous")

    def _check_index(self, name, t, shape, dtype):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(shape) \
                or any(s is not None and a != s for a, s in zip(t.shape, shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must be {dtype} {want}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{list(getattr(t, 'shape', []))}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, the step on {self.device}")

    # ------------------------------------------------------------------ decode
    @property
    def pdl(self) -> bool:
        """PDL is on for at least one kernel family."""
        return bool(self.pdl_families)

    def _count(self, name):
        self.launches[name] += 1

    def _family_on(self, family: str) -> bool:
        """PDL is on for a kernel family: by its name or one of its PDL_VARIANTS."""
        return any(n == family or PDL_VARIANTS.get(n) == family for n in self.pdl_families)

    def _gemv_launch(self) -> dict:
        """The PDL arguments of every GEMV of the step: on with the gemv family (or one of
        its variants); the release left to gemv (by rows, None) or forced by a variant."""
        on = self.pdl_families.__contains__
        return {"pdl": self._family_on("gemv"),
                "pdl_late": True if on("gemv:late") else False if on("gemv:early") else None}

    def _residual_gemv(self, x, w, h, g):
        """h += x @ w^T in place (the o and down projections): one cuBLAS addmm from
        CUBLAS_WIDE_ROWS rows where the step takes it (``cublas_wide``, unless the
        "gemv:kernel-wide" variant), the GEMV kernel otherwise."""
        if (self.cublas_wide and h.shape[0] >= CUBLAS_WIDE_ROWS
                and "gemv:kernel-wide" not in self.pdl_families):
            h.addmm_(x, w.t())
        else:
            gemv(x, w, residual=h, out=h, **g)

    def _forward(self, buf: _Buffers):
        """The decode step over a bucket's static buffers (what a graph captures)."""
        cfg, w, cache, eps = self.cfg, self.weights, self.cache, self.eps
        h, n = buf.h, buf.bucket
        on = self.pdl_families.__contains__
        pdl_qkv = self._family_on("qkv_rope")
        pdl_decode = self._family_on("decode")
        qkv_settings = (TwoLaunchSettings() if on("qkv_rope:two-launch") else
                        GemvRopeSettings() if on("qkv_rope:gemv-rope") else None)
        g = self._gemv_launch()
        torch.index_select(w.embed, 0, buf.tokens, out=h)
        self._count("embed")
        torch.sub(buf.seqlens, 1, out=buf.positions)
        self._count("positions")
        for i, layer in enumerate(w.layers):
            k_pages, v_pages = cache.k[i], cache.v[i]
            qkv_rope_append(h, layer.wqkv, bqkv=layer.bqkv, q_norm=layer.q_norm,
                            k_norm=layer.k_norm, norm_eps=eps,
                            qk_eps=eps if layer.q_norm is not None else None,
                            inv_freq=self.inv_freq, positions=buf.positions, k_cache=k_pages,
                            v_cache=v_pages, block_table=buf.block_table, q_out=buf.q,
                            pdl=pdl_qkv, workspace=self._qkv_workspace,
                            qk_norm_whole=cfg.qk_norm_whole, settings=qkv_settings)
            self._count("qkv_rope")
            # the launcher through ops (no host checks; PDL, which api.decode does not take)
            attn = ops.decode(buf.q.unsqueeze(1), k_pages, v_pages, buf.seqlens,
                              buf.block_table, 1.0 / math.sqrt(cfg.head_dim), 0,
                              pdl=pdl_decode)[0][:, 0]  # [n, Hq, D]
            self._count("decode")
            self._residual_gemv(attn.view(n, cfg.q_size), layer.wo, h, g)
            self._count("gemv_o")
            if layer.router is not None:
                self._moe(layer, h, buf)
                continue
            gemv(h, layer.w_gate_up, norm_eps=eps, silu_mul=True, out=buf.act, **g)
            self._count("gemv_gate_up")
            self._residual_gemv(buf.act, layer.w_down, h, g)
            self._count("gemv_down")
        gemv(h, w.lm_head, norm_eps=eps, out=buf.logits_model, **g)
        self._count("gemv_lm_head")
        if buf.logits_model is not buf.logits:
            buf.logits.copy_(buf.logits_model)
            self._count("logits_cast")

    def _moe(self, layer, h, buf):
        """A MoE layer's MLP on the residual stream h [bucket, hidden], in place."""
        cfg, eps = self.cfg, self.eps
        pdl = self._family_on("moe")
        one_token = self.moe_one_token and buf.moe_tables is not None
        routed = None
        routing = dict(moe_routing(cfg, layer.router_bias), norm_eps=eps, pdl=pdl)
        if one_token and self.moe_topk_in_gate_up:
            # the top-k runs inside the gate/up launch, which fills routed.ids / .weights
            routed = route_logits(h, layer.router, **routing)
            wts, ids = routed.weights, routed.ids
        else:
            wts, ids = route(h, layer.router, **routing)  # fp32 [n, k], int32 [n, k]
        self._count("moe_route")
        if one_token:
            grouping = one_token_grouping(ids, cfg.experts, buf.moe_block, buf.moe_tables)
        else:
            grouping = group(ids, cfg.experts, buf.moe_block, pdl=pdl)
            self._count("moe_group")
        impl = "gluon" if self.moe_gluon else "triton"
        act = moe_gate_up(h, layer.w_gate_up, grouping, norm_eps=eps, pdl=pdl, route=routed,
                          impl=impl)
        self._count("moe_gate_up")
        if layer.w_shared_gate_up is not None:
            # the shared expert reads h before the combine below adds the routed experts
            # into it: sigmoid(gate) folded into its activation (the down projection is
            # linear), then its down projection added onto h after the combine
            g = self._gemv_launch()
            gemv(h, layer.w_shared_gate_up, norm_eps=eps, silu_mul=True, out=buf.shared_act,
                 **g)
            if layer.shared_gate is not None:
                gemv(h, layer.shared_gate, norm_eps=eps, out=buf.shared_gate, **g)
                buf.shared_act.mul_(torch.sigmoid_(buf.shared_gate))
            self._count("shared_expert")
        # out may be the residual (moe.py: each element read and written by one program)
        moe_down_combine(act, layer.w_down, grouping, wts, out=h, residual=h, pdl=pdl,
                         impl=impl)
        self._count("moe_down_combine")
        if layer.w_shared_gate_up is not None:
            gemv(buf.shared_act, layer.w_shared_down, residual=h, out=h, **g)

    def _bucket(self, B):
        for b in self.buckets:
            if b >= B:
                return b
        raise ValueError(f"a batch of {B} is above the largest bucket ({self.buckets[-1]})")

    def _capture(self, bucket, buf):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(buf)  # warm-up: compiles, fills autotuning caches, allocates
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(buf)
        self._graphs[bucket] = graph
        return graph

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, seqlens: torch.Tensor,
               block_table: torch.Tensor) -> torch.Tensor:
        """One new token per sequence (the :class:`~wsattn.engine.generate.Step` contract).

        tokens: int64 [B]; seqlens: int32 [B], cache length including the new token;
        block_table: int32 [B, max_pages'] with max_pages' <= the cache's max_pages; all on
        the step's device, B <= the largest bucket. Index values are never read on the
        host. Returns float32 [B, vocab] (a new tensor, not the graph's buffer)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(f"tokens must be int64 [B], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                             f"{list(getattr(tokens, 'shape', []))}")
        B = tokens.shape[0]
        self._check_index("tokens", tokens, (B,), torch.int64)
        self._check_index("seqlens", seqlens, (B,), torch.int32)
        self._check_index("block_table", block_table, (B, None), torch.int32)
        width = block_table.shape[1]
        if width > self.max_pages:
            raise ValueError(f"block_table is {width} pages wide; the cache's sequences hold "
                             f"at most {self.max_pages}")
        if B == 0:
            return torch.empty(0, self.cfg.vocab, dtype=torch.float32, device=self.device)
        bucket = self._bucket(B)
        buf = self._buffers.get(bucket)
        if buf is None:
            buf = self._buffers[bucket] = _Buffers(self.cfg, bucket, self.max_pages,
                                                   self.dtype, self.device,
                                                   moe_gluon=self.moe_gluon)
        buf.tokens[:B].copy_(tokens)
        buf.seqlens[:B].copy_(seqlens)
        buf.block_table[:B, :width].copy_(block_table)
        if width < self.max_pages:
            buf.block_table[:B, width:].zero_()
        if B < bucket:  # padding rows repeat row 0 (see the module docstring)
            buf.tokens[B:].copy_(buf.tokens[:1].expand(bucket - B))
            buf.seqlens[B:].copy_(buf.seqlens[:1].expand(bucket - B))
            buf.block_table[B:].copy_(buf.block_table[:1].expand(bucket - B, -1))
        if self.graphs:
            graph = self._graphs.get(bucket)
            if graph is None:
                graph = self._capture(bucket, buf)
            graph.replay()
        else:
            self._forward(buf)
        return buf.logits[:B].clone()

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, start: torch.Tensor,
                block_table: torch.Tensor, *, lengths=None, starts=None) -> torch.Tensor:
        """B sequences' next chunks, packed (the :class:`~wsattn.engine.generate.Step`
        contract): tokens int64 [T]; cu_seqlens int32 [B + 1] (chunk b is
        tokens[cu[b]:cu[b+1]], non-empty); start int32 [B], the tokens each sequence has
        in the cache; block_table int32 [B, max_pages']. Writes the chunks' k/v at
        positions start[b]..start[b]+len_b-1 and returns float32 [B, vocab], the logits at
        each chunk's last token.

        lengths, starts: optional host-side lists of the chunk lengths and the starts (what
        cu_seqlens and start hold), which the caller built them from. Given, no device
        value is read on the host (except, in a MoE model where ``torch._grouped_mm``
        does not take the dtype, each MoE layer's per-expert counts: module docstring);
        omitted, cu_seqlens and start are read once (one synchronisation per chunk;
        prefill is never captured). They decide the attention path and narrow the block
        table to the pages the chunk reaches."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(f"tokens must be int64 [T], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                             f"{list(getattr(tokens, 'shape', []))}")
        T = tokens.shape[0]
        self._check_index("tokens", tokens, (T,), torch.int64)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be int32 [B + 1] with B >= 1, got "
                             f"{list(getattr(cu_seqlens, 'shape', []))}")
        B = cu_seqlens.shape[0] - 1
        self._check_index("cu_seqlens", cu_seqlens, (B + 1,), torch.int32)
        self._check_index("start", start, (B,), torch.int32)
        self._check_index("block_table", block_table, (B, None), torch.int32)
        if (lengths is None) != (starts is None):
            raise ValueError("lengths and starts must be given together (host-side lists) or "
                             "not at all")
        if lengths is None:
            cu = cu_seqlens.tolist()
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            starts = start.tolist()
        lengths, starts = [int(n) for n in lengths], [int(s) for s in starts]
        if len(lengths) != B or len(starts) != B:
            raise ValueError(f"lengths and starts must hold B={B} values, got {len(lengths)} "
                             f"and {len(starts)}")
        if min(lengths) < 1 or sum(lengths) != T:
            raise ValueError(f"the chunk lengths {lengths} must be >= 1 and sum to T={T}")
        cap = block_table.shape[1] * self.page_size
        if min(starts) < 0 or max(s + n for s, n in zip(starts, lengths)) > cap:
            raise ValueError(f"start + chunk length must lie in [1, {cap}] (the block table's "
                             f"capacity), got starts {starts}, lengths {lengths}")
        return self._prefill(tokens, cu_seqlens, block_table, lengths, starts)

    def _prefill(self, tokens, cu_seqlens, block_table, lengths, starts):
        cfg, w, dev, dt = self.cfg, self.weights, self.device, self.dtype
        B, T, P = len(lengths), tokens.shape[0], self.page_size
        # per token: its position (host lists -> one upload, no read back)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(dev)
        angles = pos.float()[:, None] * self.inv_freq  # fp32, as transformers and the kernel
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, D]
        fresh = all(s == 0 for s in starts)
        max_q = max(lengths)
        if fresh:  # each token's cache row, for the index writes below
            seq = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths)).to(dev)
            page = block_table[seq, torch.div(pos, P, rounding_mode="floor")].long()
            slot = pos % P
        else:
            # the chunked-prefill call over the paged cache: each sequence's prefix + chunk
            # (the call appends the chunk). The table narrowed to the pages these lengths
            # reach, so the gathered buffer attention_paged sizes from its width holds
            # these sequences' keys, not the cache's whole capacity.
            kv_lens = [s + n for s, n in zip(starts, lengths)]
            seqlens_k = torch.tensor(kv_lens, dtype=torch.int32).to(dev)
            table = block_table[:, :-(-max(kv_lens) // P)].contiguous()

        x = w.embed[tokens]  # [T, hidden], the residual stream in the model dtype
        for i, layer in enumerate(w.layers):
            qkv = (x @ layer.wqkv.T).float() * _inv_rms(x, self.eps)
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv.float()
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            if cfg.qk_norm_whole:  # OLMoE: over the whole projection, before the heads
                q = q * _inv_rms(q, self.eps) * layer.q_norm.float()
                k = k * _inv_rms(k, self.eps) * layer.k_norm.float()
            q = q.reshape(T, cfg.heads, cfg.head_dim)
            k = k.reshape(T, cfg.kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.kv_heads, cfg.head_dim).to(dt)
            if cfg.qk_norm:
                q = q * _inv_rms(q, self.eps) * layer.q_norm.float()
                k = k * _inv_rms(k, self.eps) * layer.k_norm.float()
            q, k = _rope(q, cos, sin).to(dt), _rope(k, cos, sin).to(dt)
            # impl="auto": the dispatch's rule on the longest chunk (the Gluon varlen build
            # on sm_90 past 1,024 queries, the Triton kernel below and elsewhere)
            if fresh:
                self.cache.k[i][page, slot] = k
                self.cache.v[i][page, slot] = v
                attn = api.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_q, max_q,
                                            causal=True, impl="auto", validate=False)
            else:  # the call appends the chunk (one launch for K and V), then takes
                # dispatch.paged_gather's route: in place by the Gluon kernel on sm_90
                # (PAGED_IN_PLACE_FROM_PAGE), else gathered into packed rows on CUDA
                attn = api.attention_paged(q, self.cache.k[i], self.cache.v[i], cu_seqlens,
                                           seqlens_k, table, max_q, causal=True,
                                           impl="auto", validate=False, k_new=k, v_new=v)
            x = (x.float() + (attn.reshape(T, cfg.q_size) @ layer.wo.T).float()).to(dt)
            if layer.router is not None:
                x = self._moe_prefill(layer, x)
                continue
            gate, up = ((x @ layer.w_gate_up.T).float() * _inv_rms(x, self.eps)).chunk(2, -1)
            act = (F.silu(gate) * up).to(dt)
            x = (x.float() + (act @ layer.w_down.T).float()).to(dt)
        last = x[cu_seqlens[1:].long() - 1]  # [B, hidden]
        return (last @ w.lm_head.T).float() * _inv_rms(last, self.eps)

    def _moe_prefill(self, layer, x):
        """A MoE layer's MLP over T packed tokens x [T, hidden] (model dtype), residual
        included: the decode kernels' arithmetic (the product rounded to the model dtype,
        then the FlashNorm scale, SiLU*up, the routing weight and the slot-order combine in
        fp32; a shared expert after it, as in :meth:`_moe`) with the pairs grouped by
        expert on the device, the two projections by ``torch._grouped_mm`` where it runs
        (no host read), else one matmul pair per touched expert (``moe_prefill_grouped=
        False``, and where ``_grouped_mm`` does not: see :func:`_grouped_mm_ok`)."""
        cfg, dt = self.cfg, self.dtype
        T, k = x.shape[0], cfg.top_k
        scale = _inv_rms(x, self.eps)  # [T, 1] fp32, the FlashNorm scale
        logits = (x.float() @ layer.router.float().T) * scale  # fp32, as the route kernel
        # [T, k] fp32 (no rounding: fp32 logits), int64
        # the decode kernels' tie rule (the lower expert first), so a prompt's tokens and
        # the decode steps after them route exact ties alike
        wts, ids = moe_math.select(cfg, logits, layer.router_bias, stable=True)
        pair_w = wts.reshape(-1)
        order = torch.argsort(ids.reshape(-1), stable=True)  # pairs t*k+j grouped by expert
        tok = torch.div(order, k, rounding_mode="floor")
        counts = torch.bincount(ids.reshape(-1), minlength=cfg.experts)
        if self.moe_prefill_grouped and _grouped_mm_ok(x):
            ends = torch.cumsum(counts, 0, dtype=torch.int32)  # each expert's last row + 1
            xs = x.index_select(0, tok)  # [T*k, hidden], sorted by expert
            h = torch._grouped_mm(xs, layer.w_gate_up.transpose(-2, -1), offs=ends)
            gate, up = (h.float() * scale[tok]).chunk(2, -1)
            act = (F.silu(gate) * up).to(dt)
            ys = torch._grouped_mm(act, layer.w_down.transpose(-2, -1), offs=ends)
            y = torch.empty(T * k, cfg.hidden, dtype=torch.float32, device=x.device)
            y[order] = ys.float() * pair_w[order, None]
        else:
            y = torch.zeros(T * k, cfg.hidden, dtype=torch.float32, device=x.device)
            lo = 0
            for e, count in enumerate(counts.tolist()):  # host read: one sync a layer
                if not count:
                    continue
                pairs, t = order[lo:lo + count], tok[lo:lo + count]
                lo += count
                gate, up = ((x[t] @ layer.w_gate_up[e].T).float() * scale[t]).chunk(2, -1)
                act = (F.silu(gate) * up).to(dt)
                y[pairs] = (act @ layer.w_down[e].T).float() * pair_w[pairs, None]
        acc = x.float()
        for yj in y.view(T, k, cfg.hidden).unbind(1):  # slot order, as the combine kernel
            acc = acc + yj
        if layer.w_shared_gate_up is None:
            return acc.to(dt)
        # the shared expert, as the decode step runs it: sigmoid(gate) in the model dtype
        # folded into its activation, its down projection added after the routed combine
        gate, up = ((x @ layer.w_shared_gate_up.T).float() * scale).chunk(2, -1)
        act = (F.silu(gate) * up).to(dt)
        if layer.shared_gate is not None:
            act = act * torch.sigmoid(((x @ layer.shared_gate.T).float() * scale).to(dt))
        return (acc.to(dt).float() + (act @ layer.w_shared_down.T).float()).to(dt)


def moe_routing(cfg, bias) -> dict:
    """A MoE config's routing as the kernels' ``route`` / ``route_logits`` / ``moe`` take
    it (top_k, renormalize, scoring, score_bias, groups, topk_groups, scale); bias: the
    layer's ``router_bias`` (None where the config has none)."""
    return dict(top_k=cfg.top_k, renormalize=cfg.norm_topk, scoring=cfg.scoring,
                score_bias=bias, groups=cfg.router_groups,
                topk_groups=cfg.router_topk_groups, scale=cfg.routed_scale)


def _gluon_moe():
    """kernels/moe_gluon (imported on use: Gluon is an sm_90 path)."""
    from ..kernels import moe_gluon
    return moe_gluon


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes this prefill's grouped projections: present in
    this torch, and on CUDA only for bf16 on sm_80+ (what its CUDA kernel accepts; fp16
    there falls back to the per-expert loop). On the CPU it takes every dtype."""
    if getattr(torch, "_grouped_mm", None) is None:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def _inv_rms(x, eps):
    """1 / sqrt(mean(x^2) + eps) over the last dim in fp32, keepdim: the FlashNorm scale."""
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, cos, sin):
    """transformers' rotate_half RoPE: x [T, H, D] fp32, cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
