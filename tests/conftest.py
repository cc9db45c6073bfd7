"""Shared test machinery: tolerances, the relative-error check, hardware markers."""

from __future__ import annotations

import os

import pytest
import torch

# One table of tolerances on ||out - ref|| / ||ref|| against the float64 reference.
# fp32 through tl.dot is tf32 on the GPU (about 3e-4); fp16 rounds P to 11 bits, bf16 to 8.
TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (NaN never passes)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(out64).any():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, what="out", tol=None):
    tol = TOL[dtype] if tol is None else tol
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} ({dtype})"


def assert_lse_close(lse, ref, dtype):
    """LSE compared where finite; -inf (empty rows) must match exactly."""
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    assert not torch.isnan(lse).any(), "lse has NaN"
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), fin), "lse -inf pattern differs from the reference"
    err = (lse[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= LSE_TOL[dtype] * max(1.0, ref[fin].abs().max().item() if fin.any() else 1.0), \
        f"lse: max abs error {err:.3e} ({dtype})"


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an unwritten element fails."""
    monkeypatch.setenv("WSATTN_POISON", "1")


def _cc():
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def pytest_collection_modifyitems(config, items):
    cc = _cc()
    ngpu = torch.cuda.device_count() if cc is not None else 0
    for item in items:
        if "gpu" in item.keywords and cc is None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none on this machine"))
        if "sm90" in item.keywords and cc != 90:
            item.add_marker(pytest.mark.skip(reason=f"needs an sm_90 GPU; this machine has "
                                                    f"{'none' if cc is None else f'sm_{cc}'}"))
        if "multi_gpu" in item.keywords and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; this machine has {ngpu}"))


def interpreter_or_gpu_device():
    """Where a kernel test runs: the GPU if there is one, else the CPU via the interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


@pytest.fixture(autouse=True, scope="session")
def _interpreter_work_arounds():
    """Interpreted kernels and compiles share test processes (xdist workers): without this
    a decode test's interpreted tl.max / tl.sum left triton.language.core patched and every
    later compile on that worker failed (wsattn/_triton_compat.py). A fixture, not an
    import-time call: children spawned by the multi-process tests import this module and
    must not import triton before they set TRITON_INTERPRET."""
    from wsattn._triton_compat import patch_interpreter
    patch_interpreter()
