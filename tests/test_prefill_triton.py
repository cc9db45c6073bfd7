"""The Triton prefill kernel through the public API, on CPU via the Triton interpreter.

How Triton 3.6 reads TRITON_INTERPRET: inside ``@triton.jit``, i.e. when a module is
imported, for the kernel module and for Triton's own standard library alike; wsattn's
dispatch reads it again at call time. The kernel module rebuilds its kernel as the kind
the launch needs and avoids the standard library's jit helpers, so setting the variable
with monkeypatch here works whether or not triton was imported before (these tests pass
both with the variable set in the environment and without it).
"""

import math

import numpy as np
import pytest
import torch

import wsattn
from wsattn import reference
from wsattn.kernels import prefill_triton
from wsattn._triton_compat import patch_interpreter
from wsattn.kernels.prefill_triton import PrefillSettings

from conftest import assert_close, assert_lse_close

D = 64  # the interpreter's cost grows with D; 128/256 run in the GPU tests


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    patch_interpreter()


DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]

# (B, Sq, Sk, Hq, Hkv, causal, dtype): odd lengths, q_len < kv_len, GQA 4:1 and 8:1;
# each shape runs in one dtype to keep the interpreter's time down.
F16, F32 = torch.float16, torch.float32
FIXED = [
    (2, 1, 1, 4, 4, True, F16),
    (2, 1, 300, 4, 1, True, F32),
    (2, 17, 17, 4, 1, False, F32),
    (2, 17, 17, 8, 1, True, F16),
    (1, 17, 127, 4, 2, True, F16),
    (1, 127, 127, 4, 1, False, F16),
    (1, 127, 127, 2, 2, True, F32),
    (1, 300, 300, 2, 1, True, F16),
    (1, 300, 300, 2, 1, True, F32),
    (1, 33, 300, 2, 2, False, F16),
]


def _fixed_id(c):
    B, Sq, Sk, Hq, Hkv, causal, dtype = c
    s = f"S{Sq}" if Sq == Sk else f"Sq{Sq}-Sk{Sk}"
    return (f"B{B}-{s}-H{Hq}-HKV{Hkv}-D{D}-{'causal' if causal else 'full'}-"
            f"{'fp16' if dtype == F16 else 'fp32'}")


def _inputs(B, Sq, Sk, Hq, Hkv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("case", FIXED, ids=_fixed_id)
def test_attention_matches_reference(case):
    B, Sq, Sk, Hq, Hkv, causal, dtype = case
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, dtype, seed=Sq * 1000 + Sk)
    out, lse = wsattn.attention(q, k, v, causal=causal, return_lse=True, impl="triton")
    ref, ref_lse = reference.attention(q, k, v, causal, 1 / math.sqrt(D))
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)


# Launch variants the API does not pick on the CPU: pointer loads (sm_80), BLOCK_M != BLOCK_N.
SETTINGS = [
    pytest.param(PrefillSettings(32, 32, 4, 1, use_tma=False), False, id="pointers-full"),
    pytest.param(PrefillSettings(32, 32, 4, 1, use_tma=False), True, id="pointers-causal"),
    pytest.param(PrefillSettings(64, 32, 4, 1, use_tma=True), True, id="tma-M64-N32-causal"),
    pytest.param(PrefillSettings(16, 64, 4, 1, use_tma=False), True, id="pointers-M16-N64-causal"),
    pytest.param(PrefillSettings(16, 64, 4, 1, use_tma=True), False, id="tma-M16-N64-full"),
    # 3-D host descriptors over [B, S, H * D]: B = 2 and odd lengths check that the boxes
    # clip at each batch element's end (no rows of the next one read or written)
    pytest.param(PrefillSettings(32, 32, 4, 1, use_tma=True, host_desc=True), True,
                 id="hostdesc-causal"),
    pytest.param(PrefillSettings(64, 32, 4, 1, use_tma=True, host_desc=True), False,
                 id="hostdesc-M64-N32-full"),
]


@pytest.mark.parametrize("settings,causal", SETTINGS)
def test_settings_variants_match_reference(settings, causal):
    q, k, v = _inputs(2, 45, 77, 4, 1, torch.float16, seed=7)
    out, lse = prefill_triton.prefill(q, k, v, None, None, 0, 0, causal, 0.1, settings=settings)
    ref, ref_lse = reference.attention(q, k, v, causal, 0.1)
    assert_close(out, ref, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)


def test_host_descriptors_fall_back_when_heads_are_not_packed():
    """k laid out [B, H, S, D] and seen as [B, S, H, D] has no (H, D) row to view as
    [B, S, H * D]: the kernel makes its own per-head descriptors instead."""
    q, k, v = _inputs(2, 33, 50, 4, 2, torch.float16, seed=5)
    k_bhsd = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not prefill_triton._packed_heads(k_bhsd) and prefill_triton._packed_heads(q)
    s = PrefillSettings(32, 32, 4, 1, use_tma=True, host_desc=True)
    out, lse = prefill_triton.prefill(q, k_bhsd, v, None, None, 0, 0, True, 0.1, settings=s)
    ref, ref_lse = reference.attention(q, k, v, True, 0.1)
    assert_close(out, ref, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)


def test_misaligned_input_falls_back_to_pointer_loads():
    """A q view whose base is not 16-byte aligned cannot be a TMA base: pointers instead."""
    q, k, v = _inputs(1, 17, 17, 2, 2, torch.float16, seed=3)
    q_odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    assert q_odd.data_ptr() % 16
    out = wsattn.attention(q_odd, k, v, causal=True, impl="triton")
    ref, _ = reference.attention(q, k, v, True, 1 / math.sqrt(D))
    assert_close(out, ref, torch.float16)


# (q lengths, k lengths, Hq, Hkv, causal): a length-1 sequence, empty q, mixed lengths.
VARLEN = [
    ([1, 17, 40, 5], [1, 33, 40, 70], 4, 1, True),
    ([1, 17, 40, 5], [9, 17, 45, 5], 4, 1, False),
    ([0, 3, 70], [4, 3, 130], 2, 2, True),
]


def _varlen_id(c):
    lq, lk, Hq, Hkv, causal = c
    return (f"Lq{'_'.join(map(str, lq))}-Lk{'_'.join(map(str, lk))}-H{Hq}-HKV{Hkv}-D{D}-"
            f"{'causal' if causal else 'full'}")


def _cu(lens):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VARLEN, ids=_varlen_id)
def test_attention_varlen_matches_reference(case, dtype):
    lq, lk, Hq, Hkv, causal = case
    g = torch.Generator().manual_seed(sum(lq) + sum(lk))
    q = torch.randn(sum(lq), Hq, D, generator=g).to(dtype)
    k = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype)
    v = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype)
    cu_q, cu_k = _cu(lq), _cu(lk)
    out, lse = wsattn.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                       impl="triton")
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, 1 / math.sqrt(D))
    assert lse.shape == (Hq, sum(lq))
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_rows_without_keys_give_zero_and_minus_inf(use_tma):
    """A sequence with kv_len 0 must give out 0 and lse -inf, not 0/0 = NaN."""
    lq, lk = [3, 17, 2], [0, 20, 0]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lq), 2, D, generator=g).half()
    k = torch.randn(sum(lk), 1, D, generator=g).half()
    v = torch.randn(sum(lk), 1, D, generator=g).half()
    out, lse = prefill_triton.prefill(q, k, v, _cu(lq), _cu(lk), 17, 20, False, 0.125,
                                      settings=PrefillSettings(32, 32, 4, 1, use_tma=use_tma))
    ref, ref_lse = reference.attention_varlen(q, k, v, _cu(lq), _cu(lk), False, 0.125)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.equal(out[20:], torch.zeros_like(out[20:]))
    assert torch.isneginf(lse[:, :3]).all() and torch.isneginf(lse[:, 20:]).all()
    assert_close(out, ref, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)


def test_sm_scale_is_applied():
    q, k, v = _inputs(1, 17, 33, 2, 1, torch.float32, seed=5)
    out, lse = wsattn.attention(q, k, v, causal=True, sm_scale=0.37, return_lse=True, impl="triton")
    ref, ref_lse = reference.attention(q, k, v, True, 0.37)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


# ---------------------------------------------------------------- settings (no kernel run)

def test_default_settings_per_target():
    from wsattn.target import Target, UnsupportedTargetError
    h200 = Target("cuda", 90, 132)
    s = prefill_triton.default_settings(h200, 128, torch.bfloat16, causal=False)
    assert (s.BLOCK_M, s.BLOCK_N, s.num_warps, s.use_tma) == (128, 128, 8, True)
    assert s.host_desc and s.num_stages == 3
    assert prefill_triton.default_settings(h200, 256, torch.bfloat16, True).BLOCK_M == 64
    # causal: 64-row blocks up to SHORT_CAUSAL_Q query rows, 128 past it or unknown
    short = prefill_triton.default_settings(h200, 128, torch.bfloat16, True, max_seqlen_q=1024)
    long_ = prefill_triton.default_settings(h200, 128, torch.bfloat16, True, max_seqlen_q=16384)
    assert (short.BLOCK_M, long_.BLOCK_M) == (64, 128)
    assert prefill_triton.default_settings(h200, 128, torch.bfloat16, True).BLOCK_M == 128
    # and D = 64 (64 x 64 tiles, 3 stages, against 128 x 64 at 4 stages past it)
    short = prefill_triton.default_settings(h200, 64, torch.bfloat16, True, max_seqlen_q=1024)
    long_ = prefill_triton.default_settings(h200, 64, torch.bfloat16, True, max_seqlen_q=16384)
    assert (short.BLOCK_M, short.BLOCK_N, short.num_warps, short.num_stages) == (64, 64, 4, 3)
    assert (long_.BLOCK_M, long_.BLOCK_N, long_.num_warps, long_.num_stages) == (128, 64, 8, 4)
    assert not prefill_triton.default_settings(Target("cuda", 120, 84), 128, torch.bfloat16,
                                               False).host_desc
    assert not prefill_triton.default_settings(Target("cuda", 80, 108), 128, torch.float16, False).use_tma
    with pytest.raises(UnsupportedTargetError, match="sm_75"):
        prefill_triton.default_settings(Target("cuda", 75, 40), 128, torch.float16, False)


def test_compile_spec_and_interpreter_coexist_in_one_process():
    """Triton 3.6 fixes interpreter-vs-compiler when @triton.jit runs; the module must
    still hand the compiler a JITFunction while interpreting, and the interpreter its own."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    assert isinstance(prefill_triton.compile_spec(90, 64, "fp16")["fn"], triton.runtime.JITFunction)
    assert isinstance(prefill_triton._kernel(interpret=True), InterpretedFunction)
    q, k, v = _inputs(1, 5, 5, 2, 2, torch.float16, seed=1)
    out = wsattn.attention(q, k, v, impl="triton")
    assert_close(out, reference.attention(q, k, v, False, 1 / math.sqrt(D))[0], torch.float16)
