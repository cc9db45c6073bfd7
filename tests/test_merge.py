"""The LSE merge through ``wsattn.merge_states(impl="triton")`` against the float64 reference.

Runs through the Triton interpreter with no GPU; the ``kernel_device`` fixture (from
test_decode.py, which explains why it is needed) makes that independent of import order.
"""

import pytest
import torch

import wsattn
from wsattn import reference

from conftest import assert_close, assert_lse_close
from test_decode import kernel_device  # noqa: F401  (fixture)

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]


def _parts(P, lead, D, dtype, device, seed, empty_frac=0.25):
    """P random partial states over `lead` rows; about empty_frac of them empty (-inf),
    with NaN in the output of every empty part (it must not leak), and the first row
    empty in every part."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(P, *lead, D, generator=g)
    lse = torch.randn(P, *lead, generator=g) * 4
    empty = torch.rand(P, *lead, generator=g) < empty_frac
    empty.view(P, -1)[:, 0] = True
    lse[empty] = float("-inf")
    o_clean = o.to(dtype)
    o_dirty = o_clean.clone()
    o_dirty[empty] = float("nan")
    return o_dirty.to(device), o_clean, lse.to(device)


# (P, lead shape, D): one part, many parts, odd row counts, extra leading dims as the
# sequence-parallel code passes them ([P, B, Hq] rows).
SHAPES = {
    "P1-N17-D64": (1, (17,), 64),
    "P3-N1-D64": (3, (1,), 64),
    "P3-N127-D64": (3, (127,), 64),
    "P8-B2xH3-D128": (8, (2, 3), 128),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,lead,D", list(SHAPES.values()), ids=list(SHAPES))
def test_merge_matches_reference(kernel_device, P, lead, D, dtype):
    o, o_clean, lse = _parts(P, lead, D, dtype, kernel_device, seed=P * 1000 + D)
    out, out_lse = wsattn.merge_states(o, lse, impl="triton")
    ref, ref_lse = reference.merge_states(o_clean, lse.cpu())
    assert out.shape == (*lead, D) and out.dtype == dtype
    assert out_lse.shape == lead and out_lse.dtype == torch.float32
    assert_close(out, ref, dtype)
    assert_lse_close(out_lse, ref_lse, dtype)
    first = out.reshape(-1, D)[0]
    assert torch.equal(first.cpu(), torch.zeros_like(first.cpu())), "all-empty row must give 0"
    assert out_lse.reshape(-1)[0].item() == float("-inf")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_all_empty_gives_zero_and_minus_inf(kernel_device, dtype):
    """Every part empty in every row: (0, -inf) everywhere, no NaN."""
    o = torch.full((4, 5, 64), float("nan"), dtype=dtype, device=kernel_device)
    lse = torch.full((4, 5), float("-inf"), device=kernel_device)
    out, out_lse = wsattn.merge_states(o, lse, impl="triton")
    assert torch.equal(out.cpu(), torch.zeros(5, 64, dtype=dtype))
    assert torch.isneginf(out_lse).all()


def test_merge_of_split_attention_equals_whole(kernel_device):
    """Attention over three disjoint key blocks (one empty), merged, equals attention over all."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 5, 4, 64, generator=g)
    k, v = torch.randn(1, 40, 4, 64, generator=g), torch.randn(1, 40, 4, 64, generator=g)
    parts = [reference.attention(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 13), (13, 40))]
    outs = [p[0].float() for p in parts] + [torch.zeros(1, 5, 4, 64)]
    lses = [p[1].transpose(1, 2).float() for p in parts] + [torch.full((1, 5, 4), float("-inf"))]
    out, lse = wsattn.merge_states([t.to(kernel_device) for t in outs],
                                   [t.to(kernel_device) for t in lses], impl="triton")
    whole, whole_lse = reference.attention(q, k, v)
    assert_close(out, whole, torch.float32)
    assert_lse_close(lse, whole_lse.transpose(1, 2), torch.float32)


def test_merge_is_deterministic(kernel_device):
    """Two runs on the same input are bit-identical (fixed order p = 0..P-1)."""
    o, _, lse = _parts(6, (33,), 64, torch.float16, kernel_device, seed=9)
    a = wsattn.merge_states(o, lse, impl="triton")
    b = wsattn.merge_states(o, lse, impl="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_into_strided_views_in_place(kernel_device, dtype):
    """merge_into(acc, part) on strided [B, S, H, D] views (the second half of the rows, as
    overlapped SP prefill passes them) == merge_states of the two, bit for bit; rows
    outside the view are untouched; empty parts give no NaN."""
    import importlib
    merge = importlib.import_module("wsattn.kernels.merge")
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 2, 9, 3, 64
    acc = torch.randn(B, S, H, D, generator=g).to(dtype).to(kernel_device)
    acc_lse = (torch.randn(B, H, S, generator=g) * 3).to(kernel_device)
    part = torch.randn(B, S - 4, H, D, generator=g).to(dtype).to(kernel_device)
    part_lse = (torch.randn(B, H, S - 4, generator=g) * 3).to(kernel_device)
    acc_lse[0, 1, 6] = float("-inf")
    part_lse[0, 1, 2] = float("-inf")  # row (0, 6, 1): both empty -> (0, -inf)
    part_lse[1, 0, 0] = float("-inf")
    before, before_lse = acc.clone(), acc_lse.clone()
    want, want_lse = wsattn.merge_states(
        torch.stack([acc[:, 4:], part]),
        torch.stack([acc_lse[:, :, 4:].transpose(1, 2), part_lse.transpose(1, 2)]), impl="triton")
    merge.merge_into(acc[:, 4:], acc_lse[:, :, 4:], part, part_lse)
    assert torch.equal(acc[:, :4], before[:, :4]) and torch.equal(acc_lse[:, :, :4], before_lse[:, :, :4])
    assert torch.equal(acc[:, 4:], want)
    assert torch.equal(acc_lse[:, :, 4:], want_lse.transpose(1, 2))
    assert acc_lse[0, 1, 6].item() == float("-inf") and not acc.isnan().any()
