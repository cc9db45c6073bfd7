"""`wsattn bench gemv`: every GEMV of a decode step at real model shapes, wsattn's fused
kernel against cuBLAS, in TB/s of weights read and as a fraction of the copy ceiling.

Per model (Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B; shapes from :mod:`wsattn.bench.step`'s
configs through :class:`~wsattn.models.ModelConfig`), per M in {1, 8, 64}, bf16:

* ``qkv``: [M, hidden] x [q + 2 kv, hidden]^T with FlashNorm (``norm_eps``), through the
  plain GEMV for its weight-streaming rate; in the step this projection runs fused, which
  is benchmarked as ``qkv_rope``;
* ``qkv_rope``: the fused kernel the step runs (:func:`wsattn.kernels.qkv_rope.qkv_rope_append`)
  on the same FlashNorm-folded weights: projection, 1/rms(x), the model's bias (Qwen2) and
  per-head QK-norm (Qwen3), RoPE with the model's frequencies (Llama-3 scaling included), q
  written out and k/v appended at position ``QKV_CTX - 1`` to a paged cache (page size 16)
  of M sequences, through a step-owned split-K workspace, as the runner calls it. Checked
  on q and the appended k/v slots against float64. Its ``cublas`` peer is the same
  product alone (``F.linear``, no norm, RoPE or append: the row's note says so). TB/s
  counts the same W bytes as ``qkv`` (their copies rotate as below; the cache slots
  written are the same every call); ``--qkv-settings`` adds columns of its launch
  settings (:class:`~wsattn.kernels.qkv_rope.QkvRopeSettings`);
* ``o``: [M, q] x [hidden, q]^T + residual;
* ``gate_up``: [M, hidden] x [2 ffn, hidden]^T, FlashNorm, SiLU(gate) * up;
* ``down``: [M, ffn] x [hidden, ffn]^T + residual;
* ``lm_head``: [M, hidden] x [vocab, hidden]^T with FlashNorm.

Implementations: ``wsattn`` (:func:`wsattn.kernels.gemv.gemv` with its epilogue, PDL
on: back-to-back launches overlap as in a step), ``wsattn-nopdl`` (the kernel on its own)
and ``cublas`` (``torch.nn.functional.linear``, no epilogue). Each output is checked
against a float64 reference before it is timed. The weights are held in several copies
and each call reads the next one, so the copies together exceed the 50 MB L2 several
times over and a replay reads HBM, not L2 (``copies`` and ``calls`` are in the row).
TB/s counts the bytes of W only; ``frac_copy`` divides by the copy ceiling of the same
run; ``target_met`` says whether a wsattn row reaches 90 % of it (reported, never
asserted).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from ..engine.kv_cache import PAGE_SIZE  # the engine's page
from .cases import DTYPES, tbps
from .report import fmt, status_text
from .timing import _sync, release

M_VALUES = (1, 8, 64)
KERNELS = ("qkv", "o", "gate_up", "down", "lm_head")  # the plain GEMVs
FUSED = ("qkv_rope",)  # the step's fused QKV + RoPE + append, on the qkv weights
ALL_KERNELS = KERNELS + FUSED  # what the command line runs by default
DENSE_MLP = ("gate_up", "down")  # absent from a mixture-of-experts model without dense layers
QKV_CTX = 4096  # tokens per sequence: the append writes position QKV_CTX - 1
IMPLS = ("wsattn", "wsattn-nopdl", "cublas")
TARGET_FRAC = 0.90  # of the copy ceiling, per GEMV on its own (the issue's target)
L2_BYTES = 50 << 20  # H200
FRESH_BYTES = 4 * L2_BYTES  # the weight copies a rotation cycles through, at least

ROW_FIELDS = ("op", "impl", "case", "model", "kernel", "dtype", "M", "N", "K", "NOUT",
              "epilogue", "w_bytes", "copies", "status", "reason", "note", "rel_err", "tol",
              "check_passed", "median_ms", "q20_ms", "q80_ms", "reps", "calls", "timing",
              "tbps", "frac_copy", "target_frac", "target_met", "ratio_cublas")


@dataclass(frozen=True)
class GemvCase:
    """One GEMV of a decode step: x [M, K] @ W [N, K]^T, then the epilogue."""
    model: str
    kernel: str  # one of KERNELS
    M: int
    N: int  # rows of W (2 F with silu_mul)
    K: int
    norm: bool  # FlashNorm: 1/rms(x) applied in the epilogue
    residual: bool
    silu_mul: bool
    dtype: str = "bf16"
    fresh_bytes: int = FRESH_BYTES  # the weight copies together span at least this
    op: str = "gemv"

    @property
    def nout(self) -> int:
        return self.N // 2 if self.silu_mul else self.N

    @property
    def epilogue(self) -> str:
        parts = [p for p, on in (("norm", self.norm), ("silu_mul", self.silu_mul),
                                 ("residual", self.residual)) if on]
        return "+".join(parts) or "none"

    @property
    def id(self) -> str:
        return f"gemv-{self.model}-{self.kernel}-M{self.M}-N{self.N}-K{self.K}-{self.dtype}"

    def w_bytes(self) -> int:
        return self.N * self.K * DTYPES[self.dtype].itemsize

    def copies(self) -> int:
        """Weight copies to cycle through so that they span at least ``fresh_bytes``."""
        return max(1, math.ceil(self.fresh_bytes / self.w_bytes()))


@dataclass(frozen=True, kw_only=True)
class QkvRopeCase(GemvCase):
    """The step's fused QKV launch: x [M, K] @ Wqkv [N, K]^T with N = (heads + 2 kv_heads)
    * head_dim, then FlashNorm, bias, QK-norm, RoPE, q out and k/v appended to a paged
    cache of M sequences at position ``ctx - 1``. ``eps`` is the model's RMSNorm eps
    (FlashNorm and QK-norm alike, as the runner passes them); ``rope`` a RopeConfig."""
    heads: int
    kv_heads: int
    head_dim: int
    rope: object  # wsattn.models.config.RopeConfig
    eps: float
    bias: bool = False
    qk_norm: bool = False
    ctx: int = QKV_CTX
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        if self.N != (self.heads + 2 * self.kv_heads) * self.head_dim:
            raise ValueError(f"N = {self.N} must be (heads + 2 kv_heads) * head_dim = "
                             f"{(self.heads + 2 * self.kv_heads) * self.head_dim}")
        if not self.norm or self.residual or self.silu_mul:
            raise ValueError("a qkv_rope case has FlashNorm and no residual or silu_mul")

    @property
    def epilogue(self) -> str:
        parts = [p for p, on in (("norm", self.norm), ("bias", self.bias),
                                 ("qk_norm", self.qk_norm)) if on]
        return "+".join(parts + ["rope", "append"])


def qkv_rope_case(model: str, cfg, M: int, dtype: str = "bf16", **kw) -> QkvRopeCase:
    """The fused QKV case of ``cfg`` (a ModelConfig) at M rows (``kw``: ctx, page_size,
    fresh_bytes)."""
    return QkvRopeCase(model, "qkv_rope", M, cfg.q_size + 2 * cfg.kv_size, cfg.hidden, True,
                       False, False, dtype, heads=cfg.heads, kv_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, rope=cfg.rope, eps=float(cfg.rms_eps),
                       bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, **kw)


def model_gemvs(model: str, cfg, M: int, dtype: str = "bf16") -> list[GemvCase]:
    """The five GEMVs of one decode step of ``cfg`` (a ModelConfig) at M rows, with the
    fused QKV case after the plain one (not for a whole-projection QK-norm, which the
    fused kernel does not compute); for a mixture-of-experts model without dense layers
    the three that are dense there (QKV, o, LM head) and the fused QKV case."""
    h, q, kv, f = cfg.hidden, cfg.q_size, cfg.kv_size, cfg.ffn
    spec = {"qkv": (q + 2 * kv, h, True, False, False),
            "o": (h, q, False, True, False),
            "gate_up": (2 * f, h, True, False, True),
            "down": (h, f, False, True, False),
            "lm_head": (cfg.vocab, h, True, False, False)}
    # a mixture-of-experts model's dense MLP runs only in its dense layers (none at
    # Qwen3-30B-A3B); its expert projections are `wsattn bench moe`'s
    kernels = [k for k in KERNELS if k not in DENSE_MLP or _has_dense_mlp(cfg)]
    cases = [GemvCase(model, k, M, *spec[k], dtype) for k in kernels]
    if not cfg.qk_norm_whole:
        cases.insert(1, qkv_rope_case(model, cfg, M, dtype))
    return cases


def gemv_cases(models=None, m_values=M_VALUES, kernels=KERNELS, dtype="bf16") -> list[GemvCase]:
    from .step import MODELS, model_config

    if models is None:
        models = [m for m in MODELS if not model_config(m).is_moe]
    cases = []
    for name in models:
        cfg = model_config(name)
        mine = [c for M in m_values for c in model_gemvs(name, cfg, M, dtype)
                if c.kernel in kernels]
        if not mine and cfg.is_moe:
            raise ValueError(f"gemv: {name} is a mixture-of-experts model without a dense "
                             f"layer: of --kernels {' '.join(kernels)} it has none (its "
                             "expert projections are `wsattn bench moe`'s; its attention "
                             "projections and LM head are dense GEMVs here)")
        cases += mine
    return cases


def _has_dense_mlp(cfg) -> bool:
    """Whether some layer of ``cfg`` runs the dense gate/up and down projections."""
    return not cfg.is_moe or len(cfg.moe_layers) < cfg.layers


# --------------------------------------------------------------------------- GPU work

def reference(case: GemvCase, x, w, residual, eps: float) -> torch.Tensor:
    """float64 epilogue(x @ w^T), on x's device: [M, NOUT]."""
    x64, w64 = x.double(), w.double()
    if case.norm:
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = x64 @ w64.t()
    if case.silu_mul:
        g, u = y[:, :case.nout], y[:, case.nout:]
        y = torch.nn.functional.silu(g) * u
    if case.residual:
        y = y + residual.double()
    return y


def _inputs(case: GemvCase, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[case.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    x = randn(case.M, case.K)
    w0 = randn(case.N, case.K, scale=case.K ** -0.5)
    ws = [w0] + [w0.clone() for _ in range(case.copies() - 1)]  # distinct HBM pages
    residual = randn(case.M, case.nout) if case.residual else None
    return x, ws, residual


def _calls(case, impl, x, ws, residual, eps, out, settings=None):
    """(first: the checked call on copy 0, fn: the timed call cycling through the copies);
    ``settings`` (a GemvSettings) replaces the kernel's defaults."""
    import torch.nn.functional as F

    from wsattn.kernels.gemv import gemv

    if impl == "cublas":
        def call(w):
            return F.linear(x, w)
    else:
        pdl = impl == "wsattn"

        def call(w):
            # out separate from residual: an in-place update would grow the stream every replay
            return gemv(x, w, norm_eps=eps if case.norm else None, residual=residual,
                        silu_mul=case.silu_mul, out=out, pdl=pdl, settings=settings)
    state = {"i": 0}

    def fn():
        # each captured call reads the next copy, so a replay of many calls streams HBM
        w = ws[state["i"] % len(ws)]
        state["i"] += 1
        return call(w)

    return (lambda: call(ws[0])), fn


def qkv_rope_reference(case: QkvRopeCase, x, w, bqkv, q_norm, k_norm, inv_freq, positions):
    """float64 (q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D]) of the fused kernel's contract,
    on x's device: (x @ w^T) / rms(x) with w FlashNorm-folded, + bias, per-head RMSNorm of
    q and k, RoPE as transformers applies it."""
    from wsattn.models.reference import apply_rope, inv_rms, rms_norm

    H, HKV, D = case.heads, case.kv_heads, case.head_dim
    x64 = x.double()
    qkv = (x64 @ w.double().t()) * inv_rms(x64, case.eps)
    if bqkv is not None:
        qkv = qkv + bqkv.double()
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (HKV, D)), v.unflatten(-1, (HKV, D))
    if q_norm is not None:
        q = rms_norm(q, q_norm.double(), case.eps)
        k = rms_norm(k, k_norm.double(), case.eps)
    # the angle is an fp32 product, as transformers and the kernel form it (at position
    # 4095 a float64 product differs by up to ~1e-4 rad); cos/sin of it in float64
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # [M, D/2]
    emb = torch.cat((ang, ang), dim=-1)
    return apply_rope(q, emb.cos(), emb.sin()), apply_rope(k, emb.cos(), emb.sin()), v


def _inv_freq(case: QkvRopeCase, device):
    from wsattn.rope import rope_inv_freq

    r = case.rope
    scaling = None if r.type == "default" else {
        "rope_type": r.type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
        "high_freq_factor": r.high_freq_factor,
        "original_max_position_embeddings": r.original_max_positions}
    return rope_inv_freq(case.head_dim, r.theta, scaling, device=device)


def _qkv_inputs(case: QkvRopeCase, device, seed=0) -> dict:
    """Random inputs of a fused case: x, the folded weight copies, bias / QK-norm weights
    where the model has them, the model's frequencies, and a paged cache of M sequences
    (pages in shuffled order) appended at position ctx - 1 of each."""
    from wsattn.models.flashnorm import fold_columns

    g = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[case.dtype]

    def randn(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    M, D = case.M, case.head_dim
    attn_norm = 1 + 0.1 * randn(case.K, dtype=torch.float32)
    w0 = fold_columns(randn(case.N, case.K, scale=case.K ** -0.5), attn_norm)
    pages = -(-case.ctx // case.page_size)
    order = torch.randperm(M * pages, generator=torch.Generator().manual_seed(seed))
    inp = dict(x=randn(M, case.K), ws=[w0] + [w0.clone() for _ in range(case.copies() - 1)],
               bqkv=randn(case.N, scale=0.5) if case.bias else None,
               q_norm=(1 + 0.3 * randn(D)) if case.qk_norm else None,
               k_norm=(1 + 0.3 * randn(D)) if case.qk_norm else None,
               inv_freq=_inv_freq(case, device),
               positions=torch.full((M,), case.ctx - 1, dtype=torch.int32, device=device),
               block_table=order.to(torch.int32).view(M, pages).to(device),
               k_cache=torch.zeros(M * pages, case.page_size, case.kv_heads, D, dtype=dt,
                                   device=device))
    inp["v_cache"] = torch.zeros_like(inp["k_cache"])
    return inp


def _qkv_slots(case: QkvRopeCase, inp):
    """(page, offset) [M] of each row's appended k/v."""
    pos = inp["positions"].long()
    rows = torch.arange(case.M, device=pos.device)
    return inp["block_table"][rows, pos // case.page_size].long(), pos % case.page_size


def _qkv_calls(case: QkvRopeCase, impl, inp, settings=None):
    """(first, fn, check, note) of a fused case: ``first`` the checked call on copy 0 (q or
    the product; the appended slots are set to NaN before it, so each implementation must
    write them itself), ``fn`` the timed call cycling through the weight copies (the same
    cache slots each time), ``check(y) -> (rel_err, tol, detail)``."""
    import torch.nn.functional as F

    from wsattn.kernels import qkv_rope as kq
    from wsattn.target import target_of
    from wsattn.testing import TOL, rel_err

    x, ws = inp["x"], inp["ws"]
    page, off = _qkv_slots(case, inp)
    if impl == "cublas":
        def call(w):
            return F.linear(x, w)

        def check(y):
            return rel_err(y, x.double() @ ws[0].double().t()), TOL[case.dtype], None

        note = "F.linear of x and Wqkv only: no FlashNorm, bias, QK-norm, RoPE or cache append"
        first = lambda: call(ws[0])  # noqa: E731
    else:
        if settings is None:
            s = kq.default_settings(target_of(x.device), rows=case.M, hidden=case.K,
                                    heads=case.heads + 2 * case.kv_heads,
                                    head_dim=case.head_dim, dtype=x.dtype,
                                    qk_norm=case.qk_norm)
            note = f"default settings {_qkv_spec(s)}"
        else:
            note = None
        # the step owns its workspace (what a graph captures must not move): so does the bench
        workspace = kq.qkv_rope_workspace(x.device, case.M, case.heads, case.kv_heads,
                                          case.head_dim, settings, hidden=case.K,
                                          dtype=x.dtype)
        q_out = torch.full((case.M, case.heads, case.head_dim), float("nan"), dtype=x.dtype,
                           device=x.device)
        pdl = impl == "wsattn"

        def call(w):
            return kq.qkv_rope_append(
                x, w, bqkv=inp["bqkv"], q_norm=inp["q_norm"], k_norm=inp["k_norm"],
                norm_eps=case.eps, qk_eps=case.eps if case.qk_norm else None,
                inv_freq=inp["inv_freq"], positions=inp["positions"], k_cache=inp["k_cache"],
                v_cache=inp["v_cache"], block_table=inp["block_table"], q_out=q_out, pdl=pdl,
                settings=settings, workspace=workspace)

        def first():
            inp["k_cache"][page, off] = float("nan")
            inp["v_cache"][page, off] = float("nan")
            return call(ws[0])

        def check(y):
            q, k, v = qkv_rope_reference(case, x, ws[0], inp["bqkv"], inp["q_norm"],
                                         inp["k_norm"], inp["inv_freq"], inp["positions"])
            errs = (rel_err(y, q), rel_err(inp["k_cache"][page, off], k),
                    rel_err(inp["v_cache"][page, off], v))
            return max(errs), TOL[case.dtype], "rel_err q/k/v " + "/".join(
                f"{e:.1e}" for e in errs)
    state = {"i": 0}

    def fn():
        w = ws[state["i"] % len(ws)]
        state["i"] += 1
        return call(w)

    return first, fn, check, note


SETTINGS_FIELDS = ("BLOCK_N", "BLOCK_K", "split_k", "use_dot", "num_warps", "num_stages")


def parse_settings(specs) -> dict:
    """``--gemv-settings`` values, each "BLOCK_N,BLOCK_K,split_k,use_dot,num_warps,num_stages"
    (use_dot 0 or 1), as {implementation name: GemvSettings}: the sweep's extra columns."""
    from wsattn.kernels.gemv import GemvSettings

    out = {}
    for spec in specs or ():
        parts = spec.split(",")
        if len(parts) != len(SETTINGS_FIELDS) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--gemv-settings {spec!r}: expected six integers "
                             f"{','.join(SETTINGS_FIELDS)}, e.g. 32,128,1,0,4,4")
        v = [int(p) for p in parts]
        if v[3] not in (0, 1):
            raise ValueError(f"--gemv-settings {spec!r}: use_dot must be 0 or 1, got {v[3]}")
        out[f"wsattn[{spec}]"] = GemvSettings(*v[:3], bool(v[3]), *v[4:])
    return out


QKV_SETTINGS_FIELDS = ("BLOCK_K", "split_k", "num_warps", "num_stages", "use_dot")  # QkvRopeSettings'


def _qkv_spec(s) -> str:
    """The spec that builds s: four integers, and ",0" for the FMA path (use_dot=False);
    "gemv" for the two-launch path, "gemv-rope" for the GEMV-epilogue path."""
    from wsattn.kernels.qkv_rope import GemvRopeSettings, TwoLaunchSettings
    if isinstance(s, TwoLaunchSettings):
        return TWO_LAUNCH_SPEC
    if isinstance(s, GemvRopeSettings):
        if s.gemv is None:
            return GEMV_ROPE_SPEC
        g = s.gemv
        return f"{GEMV_ROPE_SPEC}:" + ",".join(str(int(v)) for v in (
            g.BLOCK_N, g.BLOCK_K, g.split_k, g.use_dot, g.num_warps, g.num_stages))
    return ",".join(str(getattr(s, f)) for f in QKV_SETTINGS_FIELDS[:4]) + (
        "" if s.use_dot else ",0")


TWO_LAUNCH_SPEC = "gemv"  # --qkv-settings' name of TwoLaunchSettings()
GEMV_ROPE_SPEC = "gemv-rope"  # and of GemvRopeSettings()


def parse_qkv_settings(specs) -> dict:
    """``--qkv-settings`` values, each "BLOCK_K,split_k,num_warps,num_stages[,use_dot]"
    (use_dot 1, the default, or 0: the FMA path, at most 8 rows), "gemv" (the two-launch
    path: the projection by gemv, then a (row, head) kernel; TwoLaunchSettings) or
    "gemv-rope" (gemv's kernel with RoPE and the append in its epilogue; per-head QK-norm
    only where K splits, an error row elsewhere; GemvRopeSettings) or
    "gemv-rope:BLOCK_N,BLOCK_K,split_k,use_dot,num_warps,num_stages" (that path with these
    projection settings, as --gemv-settings spells them; BLOCK_N must divide the head
    dim), as
    {"wsattn[qkv:SPEC]": QkvRopeSettings}: extra columns of the qkv_rope cases only (PDL
    off). BLOCK_K must also divide the model's hidden size; a column where it does not, or
    whose build does not fit the GPU, is an error row, not a stopped run."""
    import dataclasses

    from wsattn.kernels.qkv_rope import GemvRopeSettings, QkvRopeSettings, TwoLaunchSettings

    assert tuple(f.name for f in dataclasses.fields(QkvRopeSettings)) == QKV_SETTINGS_FIELDS
    out = {}
    for spec in specs or ():
        if spec.strip() == TWO_LAUNCH_SPEC:
            out[f"wsattn[qkv:{TWO_LAUNCH_SPEC}]"] = TwoLaunchSettings()
            continue
        if spec.strip() == GEMV_ROPE_SPEC:
            out[f"wsattn[qkv:{GEMV_ROPE_SPEC}]"] = GemvRopeSettings()
            continue
        if spec.strip().startswith(GEMV_ROPE_SPEC + ":"):
            inner = spec.strip()[len(GEMV_ROPE_SPEC) + 1:]
            try:
                (g,) = parse_settings([inner]).values()
            except ValueError as e:
                raise ValueError(f"--qkv-settings {spec!r}: {e}") from None
            s = GemvRopeSettings(gemv=g)
            out[f"wsattn[qkv:{_qkv_spec(s)}]"] = s
            continue
        parts = spec.split(",")
        if len(parts) not in (4, 5) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--qkv-settings {spec!r}: expected four integers "
                             f"{','.join(QKV_SETTINGS_FIELDS[:4])} and optionally use_dot "
                             f"(0 or 1), e.g. 128,4,8,4 or 64,4,8,4,0, or "
                             f"{TWO_LAUNCH_SPEC!r} or {GEMV_ROPE_SPEC!r}")
        block_k, split_k, warps, stages = (int(p) for p in parts[:4])
        use_dot = int(parts[4]) if len(parts) == 5 else 1
        if use_dot not in (0, 1):
            raise ValueError(f"--qkv-settings {spec!r}: use_dot must be 0 or 1, got {use_dot}")
        if block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"--qkv-settings {spec!r}: BLOCK_K must be a power of two >= 16 "
                             f"(tl.dot's K side), got {block_k}")
        if split_k < 1:
            raise ValueError(f"--qkv-settings {spec!r}: split_k must be >= 1, got {split_k}")
        if warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"--qkv-settings {spec!r}: num_warps must be 1, 2, 4, 8 or 16, "
                             f"got {warps}")
        if stages < 1:
            raise ValueError(f"--qkv-settings {spec!r}: num_stages must be >= 1, got {stages}")
        s = QkvRopeSettings(block_k, split_k, warps, stages, bool(use_dot))
        out[f"wsattn[qkv:{_qkv_spec(s)}]"] = s
    return out


def _applies(case, settings) -> bool:
    """A sweep column runs on the cases its settings are for: QkvRopeSettings,
    TwoLaunchSettings and GemvRopeSettings on the fused case, GemvSettings on the plain
    GEMVs; the default columns run everywhere."""
    if settings is None:
        return True
    from wsattn.kernels.qkv_rope import GemvRopeSettings, QkvRopeSettings, TwoLaunchSettings

    return (isinstance(settings, (QkvRopeSettings, TwoLaunchSettings, GemvRopeSettings))
            == isinstance(case, QkvRopeCase))


def _check(case, impl, y, x, w, residual, eps):
    from wsattn.testing import TOL, rel_err

    ref = reference(case, x, w, residual, eps)
    if impl == "cublas":  # the peer computes the plain product; compare with that
        ref = x.double() @ w.double().t()
    return rel_err(y, ref), TOL[case.dtype]


def make_row(stamp: dict, case: GemvCase, impl: str, status: str, *, reason=None, note=None,
             rel_err=None, tol=None, timing=None, copy_tbps=None) -> dict:
    """One row; every row has the keys of ROW_FIELDS (None where they do not apply)."""
    row = dict(stamp)
    row.update({k: None for k in ROW_FIELDS})
    row.update(op=case.op, impl=impl, case=case.id, model=case.model, kernel=case.kernel,
               dtype=case.dtype, M=case.M, N=case.N, K=case.K, NOUT=case.nout,
               epilogue=case.epilogue if impl != "cublas" else "none",
               w_bytes=case.w_bytes(), copies=case.copies(), status=status, reason=reason,
               note=note, rel_err=rel_err, tol=tol,
               check_passed=None if rel_err is None else rel_err <= tol,
               target_frac=TARGET_FRAC)
    if timing is not None:
        row.update(median_ms=timing.median_ms, q20_ms=timing.q20_ms, q80_ms=timing.q80_ms,
                   reps=timing.reps, calls=timing.calls, timing=timing.method,
                   tbps=tbps(case.w_bytes(), timing.median_ms))
        if copy_tbps:
            row["frac_copy"] = row["tbps"] / copy_tbps
            if impl.startswith("wsattn"):
                row["target_met"] = "met" if row["frac_copy"] >= TARGET_FRAC else "missed"
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """ratio_cublas (time of cublas / time of this row) on the timed wsattn rows, in place."""
    peer = {r["case"]: r for r in rows if r.get("impl") == "cublas" and r["status"] == "ok"}
    for r in rows:
        p = peer.get(r.get("case"))
        if r.get("impl", "").startswith("wsattn") and r["status"] == "ok" and p:
            r["ratio_cublas"] = p["median_ms"] / r["median_ms"]
    return rows


def run_case(case, impls, timer, stamp, device, copy_tbps, eps=1e-5,
             settings=None) -> list[dict]:
    """Rows of every implementation for one case: check against float64, then time.
    ``settings`` maps extra implementation names (see :func:`parse_settings` and
    :func:`parse_qkv_settings`) to the GemvSettings / QkvRopeSettings they run the kernel
    with (PDL off, as ``wsattn-nopdl``); a column runs only on the cases its settings are
    for (no row elsewhere). ``eps`` is the plain GEMVs' FlashNorm eps; a fused case uses
    its model's."""
    settings = settings or {}
    from .suite import _short

    fused = isinstance(case, QkvRopeCase)
    impls = [i for i in impls if _applies(case, settings.get(i))]
    rows = []
    try:
        data = _qkv_inputs(case, device) if fused else _inputs(case, device)
    except Exception as e:  # out of memory on a smaller GPU, say
        return [make_row(stamp, case, i, "error", reason="inputs: " + _short(e)) for i in impls]
    dt = DTYPES[case.dtype]
    for impl in impls:
        note = None
        try:
            if fused:
                first, fn, check, note = _qkv_calls(case, impl, data, settings.get(impl))
            else:
                x, ws, residual = data
                out = torch.empty(case.M, case.nout, dtype=dt, device=device)
                first, fn = _calls(case, impl, x, ws, residual, eps, out, settings.get(impl))

                def check(y, x=x, w=ws[0], residual=residual, impl=impl):
                    return (*_check(case, impl, y, x, w, residual, eps), None)
            y = first()
            _sync(device)
            err, tol, detail = check(y)
        except Exception as e:  # a broken kernel must not stop the benchmark
            rows.append(make_row(stamp, case, impl, "error", reason=_short(e), note=note))
            continue
        note = "; ".join(p for p in (note, detail) if p) or None
        if not err <= tol:
            rows.append(make_row(stamp, case, impl, "failed", rel_err=err, tol=tol, note=note,
                                 reason=f"relative error {err:.3e} > {tol:.1e}; not timed"))
            continue
        try:
            timing = timer(fn)
        except Exception as e:
            rows.append(make_row(stamp, case, impl, "error", rel_err=err, tol=tol, note=note,
                                 reason="while timing: " + _short(e)))
            continue
        rows.append(make_row(stamp, case, impl, "ok", rel_err=err, tol=tol, timing=timing,
                             copy_tbps=copy_tbps, note=note))
    del data
    release(device)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'case':<44} {'impl':<13} {'W MB':>8} {'median us':>10} {'TB/s':>6} "
            f"{'of copy':>8} {'x cuBLAS':>8} {'90 %':>6} {'rel err':>8}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["op"] == "ceiling":
            lines.insert(0, f"ceiling {r['impl']}: {r['tbps'] or r['tflops']:.2f} "
                            f"{'TB/s' if r['tbps'] else 'TFLOP/s'} ({r['case']})")
            continue
        status = status_text(r)
        lines.append(f"{r['case']:<44} {r['impl']:<13} {r['w_bytes'] / 1e6:>8.1f} "
                     f"{fmt(None if r['median_ms'] is None else r['median_ms'] * 1e3, '.1f'):>10} "
                     f"{fmt(r['tbps'], '.2f'):>6} {fmt(r['frac_copy'], '.3f'):>8} "
                     f"{fmt(r['ratio_cublas'], '.2f'):>8} {r['target_met'] or '-':>6} "
                     f"{fmt(r['rel_err'], '.1e'):>8}  {status[:120]}")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path):
    """TB/s per GEMV and implementation, one panel per (model, M), the copy ceiling dashed."""
    from .plot import MISSING, pyplot, save
    plt = pyplot()
    if plt is None:
        return None, MISSING
    ok = [r for r in rows if r["op"] == "gemv" and r["status"] == "ok"]
    if not ok:
        return None, "no timed rows to plot"
    copy = next((r["tbps"] for r in rows if r["op"] == "ceiling" and r["impl"] == "copy"), None)
    panels = sorted({(r["model"], r["M"]) for r in ok})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    kernels = KERNELS + tuple(k for k in FUSED if any(r["kernel"] == k for r in ok))
    width = 0.8 / max(len(impls), 1)
    for ax, (model, M) in zip(axes.flat, panels):
        for j, impl in enumerate(impls):
            ys = [next((r["tbps"] for r in ok if (r["model"], r["M"], r["kernel"], r["impl"])
                        == (model, M, k, impl)), 0.0) for k in kernels]
            ax.bar([i + j * width for i in range(len(kernels))], ys, width, label=impl)
        if copy:
            ax.axhline(copy, linestyle="--", color="grey", linewidth=1, label="copy ceiling")
            ax.axhline(TARGET_FRAC * copy, linestyle=":", color="grey", linewidth=1,
                       label="90 % of copy")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kernels))], kernels, fontsize=8)
        ax.set_title(f"{model} M={M}", fontsize=9)
        ax.set_ylabel("TB/s of W")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    s = rows[0]
    return save(fig, axes, len(panels),
                f"wsattn bench gemv - {s.get('gpu')} - {s.get('commit')} - {s.get('date')}", path)


def main(args) -> int:
    """Run the GEMV benchmark (a CUDA GPU is checked for by the caller)."""
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .report import exit_status
    from .env import stamp as make_stamp
    from .timing import cuda_timer

    try:  # before the GPU is touched: a mistyped spec costs nothing
        sweep = parse_settings(getattr(args, "gemv_settings", None))
        sweep.update(parse_qkv_settings(getattr(args, "qkv_settings", None)))
    except ValueError as e:
        print(f"wsattn bench gemv: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    timer = cuda_timer(args.warmup_ms, args.rep_ms, args.timing)
    cases = gemv_cases(args.models, args.m, args.kernels, args.dtype)
    impls = list(args.gemv_impl) + list(sweep)
    print(f"wsattn bench gemv on {stamp['gpu']}, torch {stamp['torch']}, triton "
          f"{stamp['triton']}, commit {stamp['commit']}: {len(cases)} GEMVs x {impls}",
          file=sys.stderr)
    rows, copy_tbps = ceil_mod.copy_ceiling_rows(timer, device, stamp)
    for case in tqdm(cases, desc="wsattn bench gemv", file=sys.stderr, dynamic_ncols=True):
        rows += run_case(case, impls, timer, stamp, device, copy_tbps, settings=sweep)
    add_ratios(rows)
    print(format_table(rows))
    write(rows, stamp, args, plot_rows)
    return exit_status(rows, lambda impl: impl.startswith("wsattn"), "gemv")


def json_path(stamp, args):
    """Where --json says the rows go (a directory: the conventional name), None unasked."""
    from pathlib import Path

    from .env import json_name

    if not args.json:
        return None
    path = Path(args.json)
    return (path / json_name(stamp).replace("bench_", f"bench_{args.what}_", 1)
            if path.is_dir() else path)


def write(rows, stamp, args, plot_fn) -> list:
    """JSON where --json says (a directory: the conventional name), the plot where --plot
    says or beside the JSON; nothing unasked."""
    from .report import write_json

    written, path = [], json_path(stamp, args)
    if path is not None:
        path = write_json(rows, path)
        written.append(path)
        print(f"\nJSON rows written to {path}")
    plot_path = args.plot or (path.with_suffix(".png") if path else None)
    if plot_path and not args.no_plot:
        drawn, message = plot_fn(rows, plot_path)
        written += [drawn] if drawn else []
        print(message)
    return written


def add_arguments(group) -> None:
    from .step import MODELS

    group.add_argument("--models", nargs="+", choices=tuple(MODELS), default=None,
                       metavar="MODEL", help=f"model shapes (default all: {' '.join(MODELS)})")
    group.add_argument("--m", nargs="+", type=int, default=list(M_VALUES), metavar="M",
                       help="gemv: rows per GEMV (default 1 8 64)")
    group.add_argument("--kernels", nargs="+", choices=ALL_KERNELS, default=list(ALL_KERNELS),
                       metavar="KERNEL", help=f"gemv: which GEMVs (default all: "
                                              f"{' '.join(ALL_KERNELS)}; qkv_rope is the fused "
                                              "QKV + RoPE + cache append the step runs)")
    group.add_argument("--gemv-impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                       metavar="IMPL", help=f"gemv: implementations (default all: {' '.join(IMPLS)})")
    group.add_argument("--gemv-settings", nargs="+", default=None, metavar="SPEC",
                       help="gemv: extra columns, the kernel (PDL off) with these settings, "
                            "each BLOCK_N,BLOCK_K,split_k,use_dot,num_warps,num_stages")
    group.add_argument("--qkv-settings", nargs="+", default=None, metavar="SPEC",
                       help="gemv: extra columns for the qkv_rope cases, the fused kernel (PDL "
                            "off) with these settings, each BLOCK_K,split_k,num_warps,num_stages"
                            "[,use_dot]; 'gemv' the two-launch path, 'gemv-rope' the "
                            "GEMV-epilogue path, 'gemv-rope:' + a --gemv-settings SPEC that "
                            "path with those projection settings")
