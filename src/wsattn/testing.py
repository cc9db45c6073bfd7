"""The one table of dtypes and tolerances, and the relative-error check, that the tests,
the evidence ladder and the benchmark share.

Every check compares a kernel's output with the float64 reference by relative error
``||out - ref|| / ||ref||`` (NaN anywhere fails), against a per-dtype tolerance:
fp32 through ``tl.dot`` is tf32 on the GPU (about 3e-4), fp16 rounds P to 11 bits,
bf16 to 8. LSEs are compared by max absolute error where finite, scaled by the LSE's
magnitude, and their -inf pattern must match exactly.
"""

from __future__ import annotations

import torch

# name <-> torch dtype; the names are also Triton's type strings ("*bf16" for a pointer)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

TOL = {"fp32": 2e-3, "fp16": 4e-3, "bf16": 2e-2}
LSE_TOL = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 5e-3}


def dtype_name(dtype) -> str:
    """torch dtype or name -> "fp16" / "bf16" / "fp32" (ValueError for any other)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
    return DTYPE_NAMES[dtype]


def tol(dtype) -> float:
    """Tolerance on the relative error for a torch dtype or its name."""
    return TOL[dtype_name(dtype)]


def lse_tol(dtype) -> float:
    return LSE_TOL[dtype_name(dtype)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives inf (never passes).
    Where both hold the same infinity (an LSE of an empty row) the element counts as equal."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(out64).any():
        return float("inf")
    same_inf = torch.isinf(ref64) & (out64 == ref64)
    if same_inf.any():
        out64, ref64 = out64[~same_inf], ref64[~same_inf]
    if torch.isinf(out64).any() or torch.isinf(ref64).any():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |lse - ref| where ref is finite, relative to max(1, |ref|); inf when the -inf
    pattern differs or lse holds NaN."""
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(lse).any():
        return float("inf")
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), fin) or not torch.equal(lse[~fin], ref[~fin]):
        return float("inf")
    if not fin.any():
        return 0.0
    scale = max(1.0, ref[fin].abs().max().item())
    return (lse[fin] - ref[fin]).abs().max().item() / scale


def assert_close(out, ref, dtype, what="out", tolerance=None):
    t = tol(dtype) if tolerance is None else tolerance
    err = rel_err(out, ref)
    assert err <= t, f"{what}: relative error {err:.3e} > {t:.1e} ({dtype_name(dtype)})"


def assert_lse_close(lse, ref, dtype, what="lse"):
    t = lse_tol(dtype)
    err = lse_err(lse, ref)
    assert err <= t, f"{what}: max error {err:.3e} (relative to max(1, |lse|)) > {t:.0e} " \
                     f"({dtype_name(dtype)}), or its -inf pattern differs from the reference"


def bits_report(a: torch.Tensor, b: torch.Tensor, first: int = 6) -> str:
    """The empty string when a and b hold the same bits (NaN-poisoned slots included,
    which torch.equal calls unequal), else which elements differ: their count, the largest
    difference among them, the first ``first`` indices and the last dimension's indices
    involved (a pattern there, such as one half of a head, points at the arithmetic)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape / dtype {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
    if a.dtype.is_floating_point:  # compare bits, not values (NaN, -0.0)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        ab, bb = a.contiguous().view(bits), b.contiguous().view(bits)
    else:
        ab, bb = a, b
    bad = ab != bb
    n = int(bad.sum())
    if n == 0:
        return ""
    idx = bad.nonzero()
    d = (a.double() - b.double()).abs()[bad]
    d = d[torch.isfinite(d)]
    big = f"{float(d.max()):.3g}" if d.numel() else "nan"
    last = sorted(set(idx[:, -1].tolist())) if idx.shape[1] else []
    return (f"{n} of {a.numel()} elements differ, max |difference| {big}, first at "
            f"{idx[:first].tolist()}, last-dimension indices {last[:32]}"
            + (" ..." if len(last) > 32 else ""))
