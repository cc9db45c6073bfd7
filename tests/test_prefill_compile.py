"""Compile-only checks of the Triton prefill kernel for GPU targets (no GPU needed).

Each test compiles the library's own kernel through ``prefill_triton.compile_spec`` with
its default settings for the target, then reads the PTX: wgmma and TMA bulk tensor copies
on sm_90, mma.sync and no wgmma on sm_80. Registers and spills come from the bundled
ptxas (``-v``), since ``CompiledKernel.n_regs`` is only filled in when a driver loads the
binary; they are attached to the test report (``record_property``) and printed.
"""

import os
import re
import subprocess
import tempfile

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from wsattn.kernels import prefill_triton

# Shared memory a block may use (opt-in maximum), per target.
SMEM_LIMIT = {80: 166912, 90: 232448, 100: 232448, 120: 101376}


def _compile(cc, head_dim=128, dtype="bf16", causal=False, varlen=False, settings=None):
    spec = prefill_triton.compile_spec(cc, head_dim, dtype, causal, varlen, settings)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=spec["options"])


def _ptxas_usage(kernel):
    """(registers, spill store bytes, spill load bytes) as ptxas -v reports them."""
    ptx = kernel.asm["ptx"]
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    name = "ptxas-blackwell" if arch.startswith(("sm_10", "sm_11", "sm_12")) else "ptxas"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", "-o", os.devnull, f.name],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return regs, stores, loads


def _report(record_property, what, kernel):
    regs, stores, loads = _ptxas_usage(kernel)
    record_property(f"{what}.registers", regs)
    record_property(f"{what}.spill_bytes", stores + loads)
    record_property(f"{what}.shared_bytes", kernel.metadata.shared)
    print(f"{what}: {regs} registers, spills {stores}/{loads} bytes (store/load), "
          f"shared {kernel.metadata.shared} bytes, {kernel.metadata.num_warps} warps")
    return regs, stores + loads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_sm90_default_uses_wgmma_and_tma(head_dim, causal, record_property):
    kernel = _compile(90, head_dim, "bf16", causal)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx, "K/V/Q should arrive by TMA on sm_90"
    assert "ttg.warp_specialize" not in kernel.asm["ttgir"]  # no automatic warp specialization
    regs, spills = _report(record_property, f"sm90-D{head_dim}-{'causal' if causal else 'full'}",
                           kernel)
    assert kernel.metadata.shared <= SMEM_LIMIT[90]
    if head_dim == 128:
        assert spills == 0, f"D=128 on sm_90 spills {spills} bytes ({regs} registers)"


def test_sm80_uses_mma_sync_and_pointer_loads(record_property):
    kernel = _compile(80, 128, "fp16", causal=True)
    ptx = kernel.asm["ptx"]
    assert "mma.sync" in ptx
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    _report(record_property, "sm80-D128-causal", kernel)
    assert kernel.metadata.shared <= SMEM_LIMIT[80]


def test_sm90_varlen_uses_tma(record_property):
    kernel = _compile(90, 128, "bf16", causal=True, varlen=True)
    assert "cp.async.bulk.tensor" in kernel.asm["ptx"]
    assert "wgmma.mma_async" in kernel.asm["ptx"]
    _report(record_property, "sm90-D128-causal-varlen", kernel)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_host_descriptors_build_no_descriptor_in_the_kernel(causal, record_property):
    """host_desc (the sm_90 default): Q/K/V/O arrive as 3-D host descriptors, so the PTX
    has TMA but no tensormap writes or fences (each program's cost in the varlen path)."""
    s = prefill_triton.PrefillSettings(128, 128, 8, 3, use_tma=True, host_desc=True)
    kernel = _compile(90, 128, "bf16", causal=causal, settings=s)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "tensormap" not in ptx
    regs, spills = _report(record_property, f"sm90-D128-{'causal' if causal else 'full'}-hostdesc",
                           kernel)
    assert spills == 0
    own = prefill_triton.PrefillSettings(128, 128, 8, 3, use_tma=True, host_desc=False)
    assert "tensormap" in _compile(90, 128, "bf16", causal=causal, settings=own).asm["ptx"]
    assert _compile(90, 128, "bf16", causal=causal, varlen=True).asm["ptx"].count("tensormap")


@pytest.mark.parametrize("cc,head_dim", [(90, 256)], ids=["sm90-D256"])
def test_default_settings_fit_shared_memory(cc, head_dim, record_property):
    kernel = _compile(cc, head_dim, "bf16", causal=True)
    _report(record_property, f"sm{cc}-D{head_dim}-causal", kernel)
    assert kernel.metadata.shared <= SMEM_LIMIT[cc]


def test_launch_build_keeps_constexpr_parameters():
    """The kernel rebuilt for launches lost its tl.constexpr annotations, so on the GPU
    VARLEN compiled as a run-time value and every fixed-length launch failed (CU_Q=None)."""
    from wsattn.kernels import prefill_triton
    launched = prefill_triton._kernel(False)
    assert launched.constexprs == prefill_triton._attn_fwd.constexprs
    assert "VARLEN" in [launched.arg_names[i] for i in launched.constexprs]
