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


def _simulate(W, B, Hq, D, dtype, device, steps, seed, start_epoch=0):
    se = importlib.import_module("wsattn.kernels.state_exchange")
    R = B * Hq
    nprog = se.num_programs(R, D)
    data = torch.full((W,) + se.buffer_shape(W, R, D), float("nan"), device=device)
    flags = torch.zeros((W, W, nprog), dtype=se.FLAG_DTYPE, device=device)
    epochs = torch.full((W, nprog), start_epoch, dtype=se.FLAG_DTYPE, device=device)
    flags += start_epoch
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
        assert (epochs == start_epoch + step + 1).all() and (flags == start_epoch + step + 1).all()


@pytest.mark.parametrize("W,B,Hq,D", [(2, 3, 4, 64), (3, 2, 24, 64), (4, 1, 8, 128)],
                         ids=["W2-B3-H4-D64", "W3-B2-H24-D64-two-programs", "W4-B1-H8-D128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_exchange_merge_equals_merge_states(kernel_device, W, B, Hq, D, dtype):
    _simulate(W, B, Hq, D, dtype, kernel_device, steps=3, seed=W * 100 + D)


def test_exchange_epochs_do_not_wrap(kernel_device):
    """Past 2**31 steps (weeks of serving) the int64 epochs keep counting and the parity
    stays 0/1: an int32 counter would wrap negative there."""
    _simulate(2, 2, 4, 64, torch.float16, kernel_device, steps=2, seed=9, start_epoch=2**31 - 1)


@pytest.mark.parametrize("W", [2, 8])
def test_sm90_ptx_orders_the_signal_after_the_stores(W):
    """Compile-only (sm_90): the flag is raised with a release at system scope (after a CTA
    barrier), waited for with acquire loads at system scope, 64-bit; the peer stores are
    128-bit vectors (rows padded to D + 4)."""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from wsattn.kernels.state_exchange import exchange_merge_kernel as k
    sig = {"o_ptr": "*bf16", "lse_ptr": "*fp32", "seqlens_ptr": "*i32", "out_ptr": "*bf16",
           "out_lse_ptr": "*fp32", "data_ptr": "*fp32", "flag_ptr": "*i64", "epoch_ptr": "*i64",
           "peer_data_off_ptr": "*i64", "peer_flag_off_ptr": "*i64", "R": "i32", "HQ": "i32",
           "RANK": "constexpr", "W": "constexpr", "D": "constexpr", "BLOCK_R": "constexpr",
           "NPROG": "constexpr", "PHASES": "constexpr"}
    attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in ("o_ptr", "out_ptr", "data_ptr", "flag_ptr")}
    src = ASTSource(k, sig, constexprs={"RANK": 1, "W": W, "D": 128, "BLOCK_R": 32, "NPROG": 16,
                                        "PHASES": 3}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    release = [m.start() for m in re.finditer(r"atom\.global\.sys\.release\.exch\.b64", ptx)]
    assert len(release) == W
    assert len(re.findall(r"ld\.global\.sys\.acquire\.b64", ptx)) >= W
    acquire = re.search(r"ld\.global\.sys\.acquire\.b64", ptx).start()
    assert min(release) < acquire, "waits for peers before signalling them: deadlock"
    before = [m.start() for m in re.finditer(r"st\.global\.v4\.b32", ptx[:min(release)])]
    assert len(before) >= W, "the peer stores (vectorized) come before the first signal"
    assert not re.search(r"st\.global", ptx[min(release):acquire]), "a store after a signal"
    assert "bar.sync" in ptx[max(before):min(release)], "no CTA barrier between stores and signal"
