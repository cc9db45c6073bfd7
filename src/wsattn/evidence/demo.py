"""A small demo kernel set for the evidence ladder's own tests and examples.

* ``matmul_ws``: a TMA matmul (device-side ``tl.make_tensor_descriptor``) whose K loop is
  ``tl.range(..., warp_specialize=True)``: forms on sm_90 with num_warps=4 and on sm_100,
  declines on sm_90 with num_warps=8, takes the mma.sync path on sm_120.
* ``broken``: a kernel that does not compile (a dot of mismatched shapes).
* ``racy`` / ``hang``: CPU runners (plain torch) whose output moves between identical runs,
  or which never return on one shape, to exercise the stress gate without a GPU.

Use them as ``wsattn ladder wsattn.evidence.demo:matmul_ws_spec``.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from .spec import KernelSpec, RunSpec


@triton.jit
def matmul_ws_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """C[M, N] = A[M, K] @ B[N, K]^T, one [BLOCK_M, BLOCK_N] tile per program."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_k = tl.cdiv(K, BLOCK_K)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    for k in tl.range(0, num_k, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, b.T, acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


@triton.jit
def broken_kernel(x_ptr, BLOCK: tl.constexpr):
    """Does not compile: a dot of a [BLOCK, BLOCK] by a [2 * BLOCK, BLOCK] tile."""
    offs = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offs[:, None] * BLOCK + offs[None, :])
    b = tl.load(x_ptr + tl.arange(0, 2 * BLOCK)[:, None] * BLOCK + offs[None, :])
    tl.store(x_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b))


# --------------------------------------------------------------------------- matmul runner

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _alloc_scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _draw_matmul_shape(rng, small):
    if small:
        return {"M": rng.choice([1, 17, 64, 100]), "N": rng.choice([8, 24, 64]),
                "K": rng.choice([8, 40, 64, 72])}
    return {"M": rng.choice([1, 17, 127, 300, 1024]), "N": rng.choice([8, 120, 256, 1000]),
            "K": rng.choice([8, 72, 256, 1024])}


def _build_matmul(shape, dtype, device, gen):
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    a = torch.randn(shape["M"], shape["K"], generator=gen).to(dt).to(device)
    b = torch.randn(shape["N"], shape["K"], generator=gen).to(dt).to(device)
    return {"a": a, "b": b}


def _matmul_launcher(num_warps, warp_specialize=True):
    def run(inputs):
        from ..kernels._alloc import empty
        a, b = inputs["a"], inputs["b"]
        M, K = a.shape
        N = b.shape[0]
        c = empty((M, N), a.dtype, a.device)
        triton.set_allocator(_alloc_scratch)
        grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))
        matmul_ws_kernel[grid](a, b, c, M, N, K, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                               WARP_SPECIALIZE=warp_specialize, num_warps=num_warps, num_stages=3)
        return c
    return run


def _matmul_reference(inputs):
    return inputs["a"].double() @ inputs["b"].double().T


def _matmul_compile_spec(num_warps, dtype="fp16"):
    def compile_spec(cc):
        sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
               "M": "i32", "N": "i32", "K": "i32"}
        return {"fn": matmul_ws_kernel, "signature": sig,
                "constexprs": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "WARP_SPECIALIZE": True},
                "options": {"num_warps": num_warps, "num_stages": 3}}
    return compile_spec


def matmul_ws_spec(num_warps: int = 4) -> KernelSpec:
    run = RunSpec(draw_shape=_draw_matmul_shape, build=_build_matmul,
                  run=_matmul_launcher(num_warps), reference=_matmul_reference,
                  dtypes=("fp16", "bf16"), baseline=lambda inp: inp["a"] @ inp["b"].T,
                  baseline_name="torch.matmul",
                  profile_shapes=({"M": 4096, "N": 4096, "K": 4096},))
    return KernelSpec(name=f"demo_matmul_ws_{num_warps}w", compile_spec=_matmul_compile_spec(num_warps),
                      run=run, origin={"kind": "module", "ref": f"wsattn.evidence.demo:matmul_ws_{num_warps}w"},
                      description="TMA matmul, tl.range(warp_specialize=True)")


def matmul_ws_4w():
    return matmul_ws_spec(4)


def matmul_ws_8w():
    return matmul_ws_spec(8)


def broken_spec() -> KernelSpec:
    def compile_spec(cc):
        return {"fn": broken_kernel, "signature": {"x_ptr": "*fp16"}, "constexprs": {"BLOCK": 32},
                "options": {"num_warps": 4}}
    return KernelSpec(name="demo_broken", compile_spec=compile_spec,
                      origin={"kind": "module", "ref": "wsattn.evidence.demo:broken_spec"})


# --------------------------------------------------------------------------- CPU stress demos

def _draw_vec(rng, small):
    return {"N": rng.choice([1, 17, 127, 300])}


def _build_vec(shape, dtype, device, gen):
    return {"x": torch.randn(shape["N"], generator=gen).to(device)}


def _racy_run(inputs):
    """Adds fresh noise on each call: two runs of one input never agree (a stand-in for a race)."""
    x = inputs["x"]
    return x + 1e-3 * torch.rand_like(x)


def _hang_run(inputs):
    """Never returns on N = 127 (a stand-in for a deadlocked launch)."""
    if inputs["x"].numel() == 127:
        time.sleep(3600)
    return inputs["x"] * 2


def _steady_run(inputs):
    return inputs["x"] * 2


def _cpu_spec(name, run, reference):
    return KernelSpec(name=name, run=RunSpec(draw_shape=_draw_vec, build=_build_vec, run=run,
                                             reference=reference, dtypes=("fp32",),
                                             interpreter_dtypes=("fp32",)),
                      unavailable="a CPU runner with no kernel to compile (stress-gate demo)",
                      origin={"kind": "module", "ref": f"wsattn.evidence.demo:{name}_spec"})


def racy_spec():
    return _cpu_spec("racy", _racy_run, lambda inp: inp["x"].double())


def hang_spec():
    return _cpu_spec("hang", _hang_run, lambda inp: inp["x"].double() * 2)


def steady_spec():
    return _cpu_spec("steady", _steady_run, lambda inp: inp["x"].double() * 2)
