"""Shared test machinery: tolerances, the relative-error check, hardware markers."""

from __future__ import annotations

import os

import pytest
import torch

from wsattn.testing import DTYPES, assert_lse_close, rel_err  # noqa: F401  (the one table)
from wsattn.testing import LSE_TOL as _LSE_TOL, TOL as _TOL
from wsattn.testing import assert_close as _assert_close


def pytest_configure(config):
    """Import every kernel module at start-up, in the environment pytest was started with.
    Triton reads TRITON_INTERPRET inside @triton.jit, at import: a module first imported
    inside a test that monkeypatches TRITON_INTERPRET=1 would hold interpreter functions
    for the rest of the process, and the sm_90 compile-only tests that run later in that
    worker would fail on them (seen under pytest -n 2). A hook, not module-level code:
    the sp tests' spawned ranks import this file too and set TRITON_INTERPRET after."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    import importlib
    for name in ("decode_triton", "gemv", "merge", "moe", "prefill_paged", "qkv_rope"):
        importlib.import_module(f"wsattn.kernels.{name}")


# keyed by torch dtype for the tests' convenience; the values live in wsattn.testing
TOL = {DTYPES[k]: v for k, v in _TOL.items()}
LSE_TOL = {DTYPES[k]: v for k, v in _LSE_TOL.items()}


def assert_close(out, ref, dtype, what="out", tol=None):
    _assert_close(out, ref, dtype, what, tol)


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


SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))


# The environment stamp and timing the benchmark modules' row tests build rows from.
BENCH_STAMP = {"gpu": "none", "commit": "abc", "date": "2026-11-30T12:00:00Z", "torch": "x",
               "triton": "y"}


def bench_timing(ms):
    """A graph-replay Timing of median ``ms`` (q20/q80 at -/+10 %), for row tests."""
    from wsattn.bench.timing import Timing
    return Timing(median_ms=ms, q20_ms=ms * 0.9, q80_ms=ms * 1.1, reps=20, method="graph",
                  calls=7)


class CountingTimer:
    """The runner tests' timer: calls each function it times once and counts them (``calls``,
    also ``n``); every sample is ``timing``'s median, one round (``samples``) for
    ``time_interleaved``."""
    samples = 1

    def __init__(self, timing):
        self.timing, self.calls = timing, 0

    @property
    def n(self):
        return self.calls

    def __call__(self, fn):
        self.calls += 1
        fn()
        return self.timing

    def prepare(self, fn):
        self.calls += 1
        fn()

        def sample():
            return self.timing.median_ms
        sample.method, sample.calls = self.timing.method, self.timing.calls
        return sample


# The bench modules' stand-in for cuda_timer inside an interpreter child (source the child
# prepends to its own): runs fn `calls` times, as a graph replay of several calls would,
# counts the measurements in `.n` and returns a fixed Timing reporting `reported` calls.
CHILD_TIMER = r"""
from wsattn.bench.timing import Timing
class FakeTimer:
    samples = 3  # rounds of time_interleaved
    def __init__(s, calls=1, reported=3):
        s.n, s.calls, s.reported = 0, calls, reported
    def __call__(s, fn):
        for _ in range(s.calls):
            fn()
        s.n += 1
        return Timing(1.0, 0.9, 1.1, 20, "graph", s.reported)
    def prepare(s, fn):  # as a capture would: the calls once, then samples of 1 ms
        for _ in range(s.calls):
            fn()
        s.n += 1
        sample = lambda: 1.0
        sample.method, sample.calls = "graph", s.reported
        return sample
"""


def interpreter_child(code: str, *args: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Run ``code`` (with ``args`` as sys.argv[1:]) in a fresh Python with TRITON_INTERPRET=1
    (Triton reads it when a kernel is decorated, i.e. at import, so only a new process gets
    interpreter builds whatever this one imported) and WSATTN_POISON=1; return the JSON of
    the last line it printed that starts with "RESULT ". A failing child fails the test with
    its output."""
    import json
    import subprocess
    import sys
    full = dict(os.environ, TRITON_INTERPRET="1", WSATTN_POISON="1", **(env or {}))
    full["PYTHONPATH"] = SRC + os.pathsep + full.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"child {list(args)[:2]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


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


def rewrite_checkpoint(folder, edit):
    """Load a checkpoint folder's model.safetensors, let ``edit`` change the tensor dict in
    place, and save it back (the bad-checkpoint tests)."""
    import safetensors.torch as safetensors_torch
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def assert_matches_generate(where: str, hf: dict, b: int, tokens: list, tol: float):
    """Sequence b of a kernel step's run against transformers (the children of
    test_runner_vs_transformers and test_moe_kernels_vs_transformers): every step's logits
    within tol of transformers' teacher-forced ones on the kernels' tokens, the tokens
    generate's (else the first step where they part, with transformers' top-2 gap and the
    largest logit difference there), and generate's own logits within tol."""
    for s, err in enumerate(hf["tf_err"][b]):
        assert err <= tol, f"{where} step {s}: logits rel err {err:.2e}"
    if hf["tokens"][b] != tokens:
        s = next(s for s, (a, c) in enumerate(zip(hf["tokens"][b], tokens)) if a != c)
        pytest.fail(f"{where}: tokens part at step {s} (transformers {hf['tokens'][b][s]}, "
                    f"kernels {tokens[s]}); transformers' top-2 gap there "
                    f"{hf['gap'][b][s]:.2e}, the largest logit difference "
                    f"{hf['diff'][b][s]:.2e}")
    # same tokens, so generate's own logits (its KV-cache decode) are comparable
    for s, err in enumerate(hf["gen_err"][b]):
        assert err <= tol, f"{where} step {s}: generate logits {err:.2e}"
