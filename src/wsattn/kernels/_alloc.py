"""Output allocation shared by every launcher.

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
