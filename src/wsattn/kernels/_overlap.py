"""Whether tensors share memory, from their metadata alone (no device access).

The launchers refuse an output that overlaps an input other programs still read, an
output whose own elements overlap (a stride-0 or folded view: two programs would write one
address), and two outputs that overlap each other: the kernels would race, or read what
they already wrote, and return a silently wrong result.
"""

import torch


def span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte) that t's elements reach (t non-empty)."""
    lo = hi = t.data_ptr()
    for n, st in zip(t.shape, t.stride()):
        reach = (n - 1) * st * t.element_size()
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b intersect (conservative: two interleaved views
    that touch no common element still count)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same elements in the same order (an exact alias)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_distinct(name: str, t: torch.Tensor,
                   why: str = "two programs would write one address") -> None:
    """ValueError naming ``name`` when t's own elements overlap (see self_overlaps)."""
    if self_overlaps(t):
        raise ValueError(f"{name}'s elements overlap (strides {t.stride()}): {why}")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, each_why: str,
                 pair_why: str) -> None:
    """ValueError unless a key and a value cache about to be written are each free of
    overlapping elements (``each_why``) and apart from each other (``pair_why``)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_distinct(name, c, each_why)
    if overlaps(k_cache, v_cache):
        raise ValueError(f"k_cache and v_cache must not overlap{pair_why}")


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether two of t's elements may share an address: a dimension of size > 1 with
    stride 0, or strides that do not nest (each, in increasing order, at least the reach of
    the dimensions below it). Conservative, like torch's own internal-overlap check."""
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # elements spanned by the smaller dimensions, less one
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False
