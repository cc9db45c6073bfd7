"""Bad input is refused by the public API with an error naming the argument, before
any kernel runs (these run with impl="triton" on CPU tensors, where a kernel launch
outside the interpreter would itself fail, so an error from validation is the only pass)."""

import math
import re

import pytest
import torch

import wsattn
from wsattn.target import interpreting


def _qkv(B=1, Sq=8, Sk=8, Hq=4, Hkv=2, D=64, dtype=torch.float16):
    return (torch.randn(B, Sq, Hq, D, dtype=dtype), torch.randn(B, Sk, Hkv, D, dtype=dtype),
            torch.randn(B, Sk, Hkv, D, dtype=dtype))


def _raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match):
        fn(*a, **kw)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_attention_bad_shapes(impl):
    q, k, v = _qkv()
    _raises(ValueError, r"q must be 4-D", wsattn.attention, q[0], k, v, impl=impl)
    _raises(ValueError, r"multiple of the number of KV heads", wsattn.attention,
            q, *_qkv(Hkv=3)[1:], impl=impl)
    _raises(ValueError, r"k and v must have the same shape", wsattn.attention, q, k, v[:, :4], impl=impl)
    _raises(ValueError, r"q_len <= kv_len", wsattn.attention, *_qkv(Sq=9, Sk=8), causal=True, impl=impl)
    _raises(TypeError, r"dtype", wsattn.attention, q, k.float(), v, impl=impl)
    _raises(ValueError, r"contiguous last dimension", wsattn.attention,
            q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, impl=impl)
    _raises(ValueError, r"sm_scale", wsattn.attention, q, k, v, sm_scale=-1.0, impl=impl)
    _raises(TypeError, r"q must be a torch.Tensor", wsattn.attention, q.numpy(), k, v, impl=impl)


def test_kernel_only_checks():
    q, k, v = _qkv(D=48)
    _raises(ValueError, r"head dim .* one of \(64, 128, 256\)", wsattn.attention, q, k, v, impl="triton")
    q, k, v = _qkv(dtype=torch.float64)
    _raises(TypeError, r"q dtype must be one of", wsattn.attention, q, k, v, impl="triton")
    _raises(ValueError, r"impl must be one of", wsattn.attention, *_qkv(), impl="cuda")


# Under the interpreter CPU tensors are valid for impl="triton", so there is no error to check.
@pytest.mark.skipif(interpreting(), reason="checks the message given when the interpreter is off")
def test_cpu_tensor_with_triton_outside_interpreter():
    _raises(ValueError, r"TRITON_INTERPRET=1", wsattn.attention, *_qkv(), impl="triton")


def test_gluon_refused_off_sm90():
    cc = "cpu" if not torch.cuda.is_available() else "sm_%d%d" % torch.cuda.get_device_capability()
    if cc == "sm_90":  # there impl="gluon" is valid; the sm90 Gluon tests cover that case
        pytest.skip("this machine is sm_90, where impl='gluon' runs")
    _raises(ValueError, "(?i)" + re.escape(cc), wsattn.attention, *_qkv(), impl="gluon")


def test_varlen_bad_cu_seqlens():
    q, k, v = (torch.randn(10, 4, 64, dtype=torch.float16) for _ in range(3))
    good = torch.tensor([0, 3, 10], dtype=torch.int32)
    f = wsattn.attention_varlen
    _raises(TypeError, r"cu_seqlens_q must be int32", f, q, k, v, good.long(), good, impl="triton")
    _raises(ValueError, r"cu_seqlens_k must be non-decreasing", f, q, k, v, good,
            torch.tensor([0, 7, 3], dtype=torch.int32), impl="triton")
    _raises(ValueError, r"cu_seqlens_q\[-1\] must equal the number of packed tokens \(10\)", f,
            q, k, v, torch.tensor([0, 3, 9], dtype=torch.int32), good, impl="triton")
    _raises(ValueError, r"cu_seqlens_q\[0\] must be 0", f, q, k, v,
            torch.tensor([1, 3, 10], dtype=torch.int32), good, impl="triton")
    _raises(ValueError, r"same length", f, q, k, v, good, torch.tensor([0, 10], dtype=torch.int32),
            impl="triton")
    _raises(ValueError, r"sequence 0 has q_len 5 > kv_len 3", f, q, k, v,
            torch.tensor([0, 5, 10], dtype=torch.int32), good, causal=True, impl="triton")
    _raises(ValueError, r"max_seqlen_q=2 is shorter", f, q, k, v, good, good, max_seqlen_q=2,
            impl="triton")


def test_merge_parts_must_agree_before_stacking():
    """A list of parts is checked part by part (torch.stack would promote mixed dtypes,
    and fail on shapes or devices without naming the part)."""
    o, l = torch.randn(3, 64), torch.zeros(3)
    _raises(ValueError, r"lses\[1\] must have lses\[0\]'s dtype", wsattn.merge_states,
            [o, o], [l, l.long()], impl="reference")
    _raises(ValueError, r"outputs\[1\] must have outputs\[0\]'s dtype", wsattn.merge_states,
            [o, o.half()], [l, l], impl="reference")
    _raises(ValueError, r"outputs\[1\] must have outputs\[0\]'s shape", wsattn.merge_states,
            [o, o[:2]], [l, l], impl="reference")
    _raises(ValueError, r"lses\[1\] must have lses\[0\]'s device", wsattn.merge_states,
            [o, o], [l, l.to("meta")], impl="reference")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sm_scale_within_fp32_after_log2e(impl):
    """The kernels take sm_scale * log2(e) as an fp32 argument: a scale that overflows it
    (or flushes it to zero) is refused, on every path."""
    q, k, v = _qkv()
    for bad in (1e39, 3e38, 1e-40):
        _raises(ValueError, r"sm_scale .*fp32's normal range", wsattn.attention, q, k, v,
                sm_scale=bad, impl=impl)
    kc = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    _raises(ValueError, r"sm_scale .*fp32's normal range", wsattn.decode, q[:, 0], kc, kc,
            torch.full((1,), 4, dtype=torch.int32), sm_scale=1e39, impl=impl)


def test_triton_refuses_tensors_off_cpu_and_cuda(monkeypatch):
    """Under the interpreter only CPU tensors run on it: a meta tensor is named, not run."""
    from wsattn.target import UnsupportedTargetError, target_of

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UnsupportedTargetError, match="got tensors on meta"):
        target_of(torch.device("meta"))
    q, k, v = (t.to("meta") for t in _qkv())
    _raises(ValueError, r"Triton kernels run on CUDA tensors, got tensors on meta",
            wsattn.attention, q, k, v, impl="triton")


def test_rope_theta_refused_outside_fp32():
    from wsattn.rope import rope_inv_freq

    for bad in (True, float("inf"), 1e39, 0.0, -1.0):
        _raises(ValueError, "theta must be a positive number within fp32's range",
                rope_inv_freq, 64, bad)


def test_merge_bad_input():
    o = torch.randn(2, 3, 64)
    _raises(TypeError, r"lses must be float32", wsattn.merge_states, o, torch.zeros(2, 3, dtype=torch.float64))
    _raises(ValueError, r"lses must be \[P, \.\.\.\] = \(2, 3\)", wsattn.merge_states, o, torch.zeros(3, 2))
    _raises(ValueError, r"at least one part", wsattn.merge_states, [], [])


def test_reference_path_runs_and_returns_lse():
    """impl='reference' works on CPU with the documented shapes and dtype."""
    q, k, v = _qkv(Sq=5, Sk=9)
    out, lse = wsattn.attention(q, k, v, causal=True, return_lse=True, impl="reference")
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 5)
    assert torch.isfinite(lse).all() and not math.isnan(out.float().sum().item())


# With the interpreter (or a GPU) "auto" takes a kernel, not the reference: other tests cover that.
@pytest.mark.skipif(interpreting() or torch.cuda.is_available(), reason="CPU without interpreter only")
def test_auto_on_cpu_takes_reference():
    """impl='auto' on CPU tensors outside the interpreter falls back to the reference (was a ValueError)."""
    q, k, v = _qkv()
    out = wsattn.attention(q, k, v)
    ref = wsattn.attention(q, k, v, impl="reference")
    assert torch.equal(out, ref)


def test_interpreted_stdlib_calls_leave_triton_language_unpatched():
    """An interpreted kernel calling Triton's standard library (tl.max, tl.sum) must leave
    triton.language.core as it found it (Triton 3.6 did not: every later compile in that
    process failed, see wsattn/_triton_compat.py). Run in a child: it sets TRITON_INTERPRET
    before importing triton."""
    import subprocess
    import sys
    code = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from wsattn._triton_compat import patch_interpreter
patch_interpreter()
snapshot = lambda: {n: id(v) for n, v in vars(tl.core).items()}

@triton.jit
def row_stats(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr, tl.max(x, 0) + tl.sum(x, 0))

before = snapshot()
x = torch.arange(16, dtype=torch.float32)
out = torch.empty(1)
row_stats[(1,)](x, out, N=16)
assert out.item() == 15 + 120, out
changed = sorted(n for n, i in snapshot().items() if before.get(n) != i)
assert not changed, changed
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_triton_grid_limit_refused_before_any_launch(monkeypatch):
    """The Triton prefill's grid puts heads on y and sequences on z (at most 65535 each in
    CUDA): more sequences are refused by name in the check, not by the launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(B=65536, Sq=1, Sk=1, Hq=1, Hkv=1)
    _raises(ValueError, r"sequences \(65536\) must each be <= 65535", wsattn.api.check_attention,
            q, k, v, impl="triton")
    cu = torch.arange(65537, dtype=torch.int32)
    _raises(ValueError, r"sequences \(65536\)", wsattn.api.check_attention_varlen,
            q[:, 0], k[:, 0], v[:, 0], cu, cu, impl="triton")
    wsattn.api.check_attention(q[:65535], k[:65535], v[:65535], impl="triton")
