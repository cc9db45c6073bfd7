"""Gate 4: numerics against the float64 reference over many randomly drawn valid shapes.

Outputs are allocated NaN-poisoned (WSATTN_POISON=1 is set while the gate runs), so an
element the kernel never writes fails; any NaN fails; the error is ||out - ref|| / ||ref||
against a per-dtype tolerance. Where the reference holds +-inf (an LSE of an empty key
set) the kernel must hold the same value, and the finite part is compared as usual.
Outputs a spec names as LSEs (``RunSpec.lse_outputs``) are held to the tests' LSE rule
instead: the largest |lse - ref| over max(1, |ref|) against LSE_TOL. A norm-wide relative
error over a whole LSE tensor would let every softmax denominator be 2 % off at fp16.
"""

from __future__ import annotations

import os
import random

import torch

# The one table the tests and the benchmark also use (wsattn.testing); re-exported here.
from ..testing import LSE_TOL, TOL, lse_err, rel_err

__all__ = ["TOL", "LSE_TOL", "compare", "compare_lse", "within", "run_numerics"]


def _pairs(out, ref):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        raise ValueError(f"runner returned {len(outs)} outputs, reference {len(refs)}")
    return list(zip(outs, refs))


def copy_inputs(x):
    """A deep copy of a runner's inputs (tensors cloned; containers rebuilt)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: copy_inputs(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(copy_inputs(v) for v in x)
    return x


def compare(out, ref, skip=()) -> tuple[float, str]:
    """Worst relative error over the outputs (inf on NaN or a mismatched inf pattern);
    outputs whose index is in skip (the LSEs: compare_lse) are left out."""
    worst, why = 0.0, ""
    for i, (o, r) in enumerate(_pairs(out, ref)):
        if i in skip:
            continue
        o, r = o.detach().double().cpu(), r.detach().double().cpu()
        if o.shape != r.shape:
            return float("inf"), f"output {i} has shape {tuple(o.shape)}, reference {tuple(r.shape)}"
        if torch.isnan(o).any():
            return float("inf"), f"output {i} holds {int(torch.isnan(o).sum())} NaN"
        fin = torch.isfinite(r)
        if not torch.equal(o[~fin], r[~fin]) or torch.isinf(o[fin]).any():
            return float("inf"), f"output {i}: the +-inf entries differ from the reference"
        err = rel_err(o, r)
        if err > worst:
            worst, why = err, f"output {i}"
    return worst, why


def compare_lse(out, ref, lse_outputs) -> tuple[float, str]:
    """Worst lse_err over the outputs at the indices lse_outputs (0.0 with none)."""
    worst, why = 0.0, ""
    pairs = _pairs(out, ref)
    for i in lse_outputs:
        o, r = pairs[i]
        if o.shape != r.shape:
            return float("inf"), f"output {i} has shape {tuple(o.shape)}, reference {tuple(r.shape)}"
        err = lse_err(o, r)
        if not err <= worst:
            worst, why = err, f"output {i} (LSE)"
    return worst, why


def within(out, ref, dtype, lse_outputs=()) -> tuple[bool, str, float]:
    """(whether out matches ref within the dtype's tolerances, what failed, the outputs'
    relative error): compare against TOL, compare_lse against LSE_TOL."""
    err, where = compare(out, ref, skip=lse_outputs)
    limit = TOL.get(dtype, TOL["bf16"])  # a spec's own dtype names: the loosest
    if not err <= limit:
        return False, f"relative error {err:.3e} > {limit:.0e} ({where})", err
    lerr, lwhere = compare_lse(out, ref, lse_outputs)
    llimit = LSE_TOL.get(dtype, LSE_TOL["bf16"])
    if not lerr <= llimit:
        return False, f"LSE error {lerr:.3e} > {llimit:.0e} ({lwhere})", err
    return True, "", err


def run_numerics(spec, device: str, n_shapes: int, small: bool, seed: int = 0,
                 dtypes=None, progress=None) -> dict:
    """Run ``spec.run`` on ``n_shapes`` random shapes per dtype; never raises."""
    run = spec.run
    dtypes = tuple(dtypes or (run.interpreter_dtypes if device == "cpu" else run.dtypes))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    old = os.environ.get("WSATTN_POISON")
    os.environ["WSATTN_POISON"] = "1"
    worst = {"err": 0.0, "shape": None, "dtype": None, "tol": None}
    checked = 0
    try:
        for dtype in dtypes:
            for _ in range(n_shapes):
                shape = run.draw_shape(rng, small)
                label = f"{run.describe(shape)} {dtype}"
                try:
                    inputs = run.build(shape, dtype, device, gen)
                    # the reference first, on a copy: a kernel that writes its inputs (a
                    # cache it appends to) must not change what it is compared with
                    ref = run.reference(copy_inputs(inputs))
                    out = run.run(inputs)
                    ok, why, err = within(out, ref, dtype, run.lse_outputs)
                except Exception as e:
                    return {"ok": False, "checked": checked, "shape": label,
                            "error": f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                checked += 1
                limit = TOL.get(dtype, TOL["bf16"])  # a spec's own dtype names: the loosest
                if err / limit > (worst["err"] / worst["tol"] if worst["tol"] else -1):
                    worst = {"err": err, "shape": label, "dtype": dtype, "tol": limit}
                if not ok:
                    return {"ok": False, "checked": checked, "shape": label, "worst": worst,
                            "error": f"{label}: {why}"}
                if progress:
                    progress()
    finally:
        if old is None:
            os.environ.pop("WSATTN_POISON", None)
        else:
            os.environ["WSATTN_POISON"] = old
    return {"ok": True, "checked": checked, "worst": worst, "dtypes": list(dtypes)}
