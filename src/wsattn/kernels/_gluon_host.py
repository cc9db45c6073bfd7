"""Host-side pieces shared by the Gluon kernels' launchers (prefill_gluon, moe_gluon):
the NVMMA shared layout of a TMA box, the host TMA descriptor, the device's compute
capability. Gluon is imported on first use, so importing a launcher stays cheap."""

from __future__ import annotations

import functools

import torch

from ..target import target_of


def gl_dtype(name):
    from triton.experimental.gluon import language as gl
    return {"fp16": gl.float16, "bf16": gl.bfloat16}[name]


def nvmma_layout(block, dtype_name):
    """The default NVMMA shared layout of a box (list or tuple) of fp16 / bf16."""
    return _nvmma_layout(tuple(block), dtype_name)


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block, dtype_name):
    # Built per launch it cost ~20 us of host time (four per call); a layout is immutable.
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype(dtype_name))


def tma_descriptor(t, block, dtype_name):
    """A host TMA descriptor over the whole of t with box ``block``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block),
                            nvmma_layout(block, dtype_name))


def cuda_cc(device) -> int | None:
    """The compute capability of a CUDA device (90 for sm_90), None for other devices."""
    device = torch.device(device)
    return target_of(device).cc if device.type == "cuda" else None
