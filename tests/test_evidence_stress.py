"""Gates 4 and 5 without a GPU: the watchdog, the race check, NaN never passing, and the
numerics gate through the Triton interpreter in a child process."""

from __future__ import annotations

import torch

from wsattn.evidence import demo, numerics, stress
from wsattn.evidence.spec import KernelSpec, RunSpec


def test_watchdog_catches_a_hang_and_names_the_shape():
    r = stress.run_stress(demo.hang_spec(), "cpu", launches=200, timeout=15)
    assert not r["ok"] and r["kind"] == "hang"
    assert r["shape"] == "N127 fp32" and "N127" in r["error"]


def test_output_that_moves_between_identical_runs_is_a_race():
    r = stress.run_stress(demo.racy_spec(), "cpu", launches=200, timeout=60)
    assert not r["ok"] and r["kind"] == "race" and "differ" in r["error"]


def test_steady_kernel_passes_stress():
    r = stress.run_stress(demo.steady_spec(), "cpu", launches=400, timeout=60)
    assert r["ok"] and r["launches"] == 400, r


def test_interpreter_numerics_in_a_child_process():
    """TRITON_INTERPRET is read when a kernel is decorated, so the gate sets it in a child."""
    r = stress.run_interpreter_numerics(demo.matmul_ws_4w(), n_shapes=2, timeout=300)
    assert r["ok"], r
    assert r["checked"] == 2 and r["worst"]["err"] < numerics.TOL["fp16"]


def _vec_spec(run):
    return KernelSpec(name="vec", run=RunSpec(
        draw_shape=lambda rng, small: {"N": rng.choice([1, 17, 300])},
        build=lambda s, dt, dev, gen: {"x": torch.randn(s["N"], generator=gen)},
        run=run, reference=lambda inp: inp["x"].double() * 2, dtypes=("fp32",),
        interpreter_dtypes=("fp32",)))


def test_nan_never_passes():
    def leaves_one_unwritten(inp):
        from wsattn.kernels._alloc import empty
        out = empty(inp["x"].shape, torch.float32, "cpu")  # NaN-poisoned during the gate
        out[1:] = inp["x"][1:] * 2
        return out
    r = numerics.run_numerics(_vec_spec(leaves_one_unwritten), "cpu", n_shapes=4, small=True)
    assert not r["ok"] and "NaN" in r["error"]


def test_wrong_result_fails_with_the_shape():
    r = numerics.run_numerics(_vec_spec(lambda inp: inp["x"] * 2.1), "cpu", n_shapes=4, small=True)
    assert not r["ok"] and "relative error" in r["error"] and r["shape"].startswith("N")


def test_inf_pattern_must_match():
    ref = torch.tensor([0.5, float("-inf")], dtype=torch.float64)
    assert numerics.compare(torch.tensor([0.5, float("-inf")]), ref)[0] == 0.0
    assert numerics.compare(torch.tensor([0.5, 0.0]), ref)[0] == float("inf")
