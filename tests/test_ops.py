"""The kernels as torch.library custom ops: torch.compile traces the public API through
them with no graph break (fullgraph=True), and opcheck finds the fake (meta)
implementations consistent with the real ones. Runs through the Triton interpreter on CPU."""

import pytest
import torch

import wsattn
from wsattn import ops

from test_decode import kernel_device  # noqa: F401  (fixture: cuda, or cpu + interpreter builds)


def _prefill_inputs(device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 17, 4, 64, generator=g, dtype=torch.float16)
    k = torch.randn(1, 17, 2, 64, generator=g, dtype=torch.float16)
    v = torch.randn(1, 17, 2, 64, generator=g, dtype=torch.float16)
    return q.to(device), k.to(device), v.to(device)


def _decode_inputs(device):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 64, generator=g, dtype=torch.float16)
    kc = torch.randn(2, 40, 2, 64, generator=g, dtype=torch.float16)
    vc = torch.randn(2, 40, 2, 64, generator=g, dtype=torch.float16)
    seqlens = torch.tensor([40, 9], dtype=torch.int32)
    return q.to(device), kc.to(device), vc.to(device), seqlens.to(device)


def test_compile_fullgraph_through_every_op(kernel_device):
    """One compiled graph around prefill, decode and merge_states, equal to eager."""
    q, k, v = _prefill_inputs(kernel_device)
    dq, kc, vc, seqlens = _decode_inputs(kernel_device)

    def step(q, k, v, dq, kc, vc, seqlens):
        o, lse = wsattn.attention(q, k, v, causal=True, return_lse=True, impl="triton")
        d, dl = wsattn.decode(dq, kc, vc, seqlens, return_lse=True, impl="triton",
                              validate=False)
        m, ml = wsattn.merge_states(torch.stack([d, d]), torch.stack([dl, dl]), impl="triton")
        return o.float().sum() + lse.sum() + m.float().sum() + ml.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = (q, k, v, dq, kc, vc, seqlens)
    assert torch.equal(compiled(*args), step(*args))


@pytest.mark.parametrize("op", ["prefill", "decode", "merge_states"])
def test_opcheck(op, kernel_device):
    """torch.library.opcheck: schema, fake tensor and dispatch consistency of each op."""
    if op == "prefill":
        q, k, v = _prefill_inputs(kernel_device)
        args = (q, k, v, None, None, 0, 0, True, 0.125, "triton")
    elif op == "decode":
        dq, kc, vc, seqlens = _decode_inputs(kernel_device)
        args = (dq.unsqueeze(1), kc, vc, seqlens, None, 0.125, 0)
    else:
        g = torch.Generator().manual_seed(2)
        outs = torch.randn(3, 5, 64, generator=g, dtype=torch.float16).to(kernel_device)
        lses = torch.randn(3, 5, generator=g).to(kernel_device)
        lses[1, 2] = float("-inf")
        args = (outs, lses)
    torch.library.opcheck(getattr(ops, op + "_op"), args)


def test_eager_calls_skip_the_dispatcher(kernel_device, monkeypatch):
    """Eager calls go straight to the launchers (the dispatcher cost 120-315 us of host
    time per call on H200); only a torch.compile trace uses the custom ops."""
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the custom-op dispatcher")
    for name in ("prefill_op", "decode_op", "merge_states_op"):
        monkeypatch.setattr(ops, name, refuse)
    q, k, v = _prefill_inputs(kernel_device)
    dq, kc, vc, seqlens = _decode_inputs(kernel_device)
    o, lse = wsattn.attention(q, k, v, causal=True, return_lse=True, impl="triton")
    d, dl = wsattn.decode(dq, kc, vc, seqlens, return_lse=True, impl="triton")
    m, ml = wsattn.merge_states(torch.stack([d, d]), torch.stack([dl, dl]), impl="triton")
    ref = wsattn.attention(q, k, v, causal=True, impl="reference")
    # fp16 output over 17 keys: rounding alone is ~1e-3, a wrong result is O(1)
    assert (o.float() - ref.float()).abs().max() < 1e-2
    # two equal parts merge back to the part (exact in fp32; the margin only absorbs the
    # fp16 round trip, a wrong merge is off by O(1))
    assert torch.allclose(m.float(), d.float(), atol=1e-3)


def test_inputs_that_require_grad_keep_the_clear_backward_error(kernel_device):
    """The fast eager path must not silently drop gradients: with an input that requires
    grad the call goes through the custom op, and backward() says there is no formula."""
    q, k, v = _prefill_inputs(kernel_device)
    q.requires_grad_(True)
    o, _ = wsattn.attention(q, k, v, causal=True, return_lse=True, impl="triton")
    assert o.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        o.float().sum().backward()
    with torch.no_grad():  # inference: the fast path, nothing to record
        assert not wsattn.attention(q, k, v, causal=True, impl="triton").requires_grad
