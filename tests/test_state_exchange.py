"""The fused exchange-and-merge kernel of sequence-parallel decode (kernels/state_exchange.py),
with W ranks simulated in one process: every rank's buffers are slices of one
allocation, each rank runs the write phase (stores into its peers' slots, raises their
flags), then each runs the merge phase. Two steps, so both parities and the epoch
counters are exercised. The result must equal ``merge_states`` over the packed states
bit for bit: it is the same arithmetic in the same order. Runs through the Triton
interpreter on CPU; the real cross-GPU run is in test_sp_nccl.py."""

import importlib

import pytest
import torch

import wsattn
from wsattn.sp.decode import pack_state

from test_decode import kernel_device  # noqa: F401  (fixture)


def _simulate(W, B, Hq, D, dtype, device, steps, seed):
    se = importlib.import_module("wsattn.kernels.state_exchange")
    R = B * Hq
    nprog = se.num_programs(R, D)
    data = torch.full((W,) + se.buffer_shape(W, R, D), float("nan"), device=device)
    flags = torch.zeros((W, W, nprog), dtype=torch.int32, device=device)
    epochs = torch.zeros((W, nprog), dtype=torch.int32, device=device)
    d_stride, f_stride = data[0].numel(), flags[0].numel()
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        o = torch.randn(W, B, Hq, D, generator=g).to(dtype)
        lse = torch.randn(W, B, Hq, generator=g) * 3
        lens = torch.randint(0, 3, (W, B), generator=g, dtype=torch.int32)
        lens[:, 0] = 0  # sequence 0 empty on every rank: (0, -inf), no NaN
        if B > 1:
            lens[0, -1] = 5  # the last sequence seen by rank 0 at least
        o, lse, lens = o.to(device), lse.to(device), lens.to(device)
        out = torch.full((W, R, D), float("nan"), device=device, dtype=dtype)
        out_lse = torch.full((W, R), float("nan"), device=device)
        for phase in (1, 2):
            for r in range(W):
                off_d = torch.tensor([(p - r) * d_stride for p in range(W)], dtype=torch.int64,
                                     device=device)
                off_f = torch.tensor([(p - r) * f_stride for p in range(W)], dtype=torch.int64,
                                     device=device)
                se.launch(o[r].reshape(R, D), lse[r].reshape(R), lens[r], out[r], out_lse[r],
                          data[r], flags[r], epochs[r], off_d, off_f, r, W, phases=phase)
        states = torch.stack([pack_state(o[r], lse[r], lens[r] == 0) for r in range(W)])
        want, want_lse = wsattn.merge_states(states[..., :D], states[..., D], impl="triton")
        for r in range(W):
            assert torch.equal(out[r].view(B, Hq, D), want.to(dtype)), (step, r)
            assert torch.equal(out_lse[r].view(B, Hq), want_lse), (step, r)
        assert torch.equal(out_lse[:, :Hq], torch.full((W, Hq), float("-inf"), device=device))
        assert torch.equal(out[:, :Hq].float(), torch.zeros(W, Hq, D, device=device))
        assert (epochs == step + 1).all() and (flags == step + 1).all()


@pytest.mark.parametrize("W,B,Hq,D", [(2, 3, 4, 64), (3, 2, 24, 64), (4, 1, 8, 128)],
                         ids=["W2-B3-H4-D64", "W3-B2-H24-D64-two-programs", "W4-B1-H8-D128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_exchange_merge_equals_merge_states(kernel_device, W, B, Hq, D, dtype):
    _simulate(W, B, Hq, D, dtype, kernel_device, steps=3, seed=W * 100 + D)
