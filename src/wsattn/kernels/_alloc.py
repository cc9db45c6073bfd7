"""Output allocation shared by every launcher, and the global memory of device-made TMA
descriptors.

With WSATTN_POISON=1 (the test suite sets it) every output is pre-filled with NaN, so
an element a kernel forgets to write fails the comparison instead of passing on stale
memory that happens to be right.
"""

import os

import torch


def empty(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("WSATTN_POISON") == "1" and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def _scratch(size: int, alignment: int, stream):
    """Global memory for the device-side TMA descriptors (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator():
    """Device-side descriptors need a scratch allocator; keep one the caller set."""
    import triton
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
