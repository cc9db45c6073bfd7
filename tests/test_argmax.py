"""Greedy decoding's two-stage argmax (wsattn.kernels.argmax): torch's indices exactly
(lowest index on ties, the first NaN first, a row of -inf at 0), through the interpreter
on CPU (fp32 / fp16) and on the GPU (bf16 too); the sm_90 builds; bad input by name."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from conftest import interpreter_child

CHILD = textwrap.dedent(r'''
    import torch
    from wsattn.kernels.argmax import CHUNK, argmax

    def cases(dt, gen):
        for V in (1, 2, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5):
            for B in (1, 3):
                x = torch.randn(B, V, generator=gen).to(dt)
                yield x
                if V > 1:
                    y = x.clone(); y[:, 0] = 9; y[:, -1] = 9; yield y  # tie across chunks
                    z = x.clone(); z[:, -1] = float("nan"); z[:, V // 2] = float("nan")
                    yield z  # the first NaN wins
                    u = x.clone(); u[:, 1] = float("inf"); u[:, -1] = float("nan")
                    yield u  # NaN beats inf
                yield torch.full((B, V), float("-inf"), dtype=dt)
                yield x.clone().fill_(0.25)  # all equal: index 0

    out = {}
    for dt in (torch.float32, torch.float16):
        gen = torch.Generator().manual_seed(0)
        wrong = []
        n = 0
        for x in cases(dt, gen):
            n += 1
            a = argmax(x)
            if a.dtype != torch.int64 or not torch.equal(a, x.argmax(-1)):
                wrong.append([list(x.shape), a.tolist(), x.argmax(-1).tolist()])
        # a strided row view (last dim contiguous) and an empty batch
        big = torch.randn(4, 2 * CHUNK + 3, generator=gen).to(dt)
        view = big[::2, : CHUNK + 9]
        if not torch.equal(argmax(view), view.argmax(-1)):
            wrong.append(["view"])
        out[str(dt)] = {"checked": n, "wrong": wrong,
                        "empty": list(argmax(torch.zeros(0, 5, dtype=dt)).shape)}
    print("RESULT " + __import__("json").dumps(out))
''')


def test_interpreter_equals_torch_argmax():
    r = interpreter_child(CHILD)
    for dt, res in r.items():
        assert res["checked"] >= 60 and res["wrong"] == [], (dt, res)
        assert res["empty"] == [0], (dt, res)


@pytest.mark.parametrize("args, error, match", [
    (dict(logits=torch.zeros(3)), ValueError, r"logits must be a \[B, V\] tensor"),
    (dict(logits=[[1.0]]), ValueError, r"logits must be a \[B, V\] tensor"),
    (dict(logits=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "logits dtype"),
    (dict(logits=torch.zeros(2, 0)), ValueError, "no entries"),
    (dict(logits=torch.zeros(3, 2).t()), ValueError, "contiguous last dimension"),
    (dict(logits=torch.zeros(2, 3)), ValueError, "runs on CUDA tensors"),
    # int32 (c + 1) * CHUNK of the last chunk must not wrap (a meta tensor: no 4 GB row)
    (dict(logits=torch.empty(1, 2 ** 31 - 100, dtype=torch.float16, device="meta")),
     ValueError, r"int32 indices take at most 2\*\*31 - 1 - 4096"),
], ids=["1d", "list", "float64", "empty-vocab", "strided", "cpu", "vocab-near-2**31"])
def test_bad_input_refused_by_name(monkeypatch, args, error, match):
    from wsattn.kernels.argmax import argmax
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(error, match=match):
        argmax(**args)


def test_sm90_builds_without_spills():
    """Both stages compile for sm_90 with no local memory; the first stage reads the
    logits 16 bytes at a time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from test_gemv import _ptxas_usage
    from wsattn.kernels import argmax as am
    for kernel in ("chunk", "row"):
        s = am.compile_spec(90, kernel=kernel)
        k = triton.compile(ASTSource(s["fn"], s["signature"], s["constexprs"], s["attrs"]),
                           target=GPUTarget("cuda", 90, 32), options=s["options"])
        assert sum(_ptxas_usage(k)[1:]) == 0, kernel
        if kernel == "chunk":
            assert re.search(r"ld\.global(\.nc)?\.v4", k.asm["ptx"]), "16-byte loads of whole chunks"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, V", [(1, 128256), (8, 151936), (64, 32000), (3, 4097)])
def test_gpu_equals_torch_argmax(dtype, B, V):
    """Random logits, a tie across the row, NaNs, a -inf row: the same int64 indices as
    torch, and what generate's greedy sampling returns on CUDA."""
    from wsattn.engine.generate import sample
    from wsattn.kernels.argmax import argmax
    g = torch.Generator(device="cuda").manual_seed(B + V)
    x = torch.randn(B, V, device="cuda", generator=g).to(dtype)
    x[0, 5] = x[0, V - 2] = 1e4 if dtype != torch.float16 else 6e4
    if B > 2:
        x[1, [V // 3, V - 1]] = float("nan")
        x[2] = float("-inf")
    want = x.argmax(-1)
    got = argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(argmax(x), got)  # reruns
    assert torch.equal(sample(x), want)
