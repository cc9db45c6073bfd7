"""What gets measured: the wsattn kernels through the public API, and the peers present
(SDPA here; FlashAttention-4 and FlashInfer in :mod:`wsattn.bench.peers`).

A runner turns (case, inputs) into a :class:`Prepared`: ``first()`` makes the call whose
output is checked against the reference, ``fn`` the call that is timed, ``canon`` puts the
output in wsattn's layout. Availability is learnt by calling: a wsattn impl that refuses
the call raises ValueError (the Gluon kernel on a GPU it does not serve), an SDPA backend
that cannot take the shape raises RuntimeError; both become :class:`NotAvailable`.

Only the public API is used (``wsattn.attention``, ``wsattn.decode``, ``wsattn.reference``),
so the benchmark runs whatever state the kernels are in.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

import wsattn
from wsattn import reference

from .cases import DTYPES

from wsattn.testing import TOL  # the one table the tests use too


class NotAvailable(Exception):
    """The implementation cannot run this case here (the reason is the message)."""


# --------------------------------------------------------------------------- inputs

@dataclass
class Inputs:
    """One case's tensors in wsattn's layout, plus peer layouts built on first use."""
    case: object
    tensors: dict
    scale: float
    peer: dict = field(default_factory=dict)

    def __getattr__(self, name):
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_inputs(case, device, seed: int = 0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if case.op == "prefill":
        t = {"q": randn(case.B, case.N, case.H, case.D),
             "k": randn(case.B, case.N, case.HKV, case.D),
             "v": randn(case.B, case.N, case.HKV, case.D)}
    else:
        if case.page_size is None:
            shape = (case.B, case.L, case.HKV, case.D)
            block_table = None
        else:
            pages_per_seq = -(-case.L // case.page_size)
            n_pages = case.B * pages_per_seq
            shape = (n_pages, case.page_size, case.HKV, case.D)
            # pages scattered at random over the pool, as in a long-running server
            perm = torch.randperm(n_pages, generator=g, device=device)
            block_table = perm.view(case.B, pages_per_seq).to(torch.int32)
        t = {"q": randn(case.B, case.HQ, case.D),
             "k_cache": randn(*shape), "v_cache": randn(*shape),
             "seqlens": torch.full((case.B,), case.L, dtype=torch.int32, device=device),
             "block_table": block_table}
    return Inputs(case, t, 1.0 / math.sqrt(case.D))


# --------------------------------------------------------------------------- the check

@dataclass(frozen=True)
class Check:
    rel_err: float
    tol: float
    where: str  # which slice was compared

    @property
    def passed(self) -> bool:
        return self.rel_err <= self.tol


def _heads(hq, hkv):
    """The first and last KV heads and every query head of their groups."""
    kv = sorted({0, hkv - 1})
    g = hq // hkv
    return kv, [h * g + i for h in kv for i in range(g)]


def _accumulate(acc, out, ref):
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isinf(out).any():
        acc[0] = math.inf
    else:
        acc[0] += (out - ref).norm().item() ** 2
    acc[1] += ref.norm().item() ** 2


def check_output(inputs: Inputs, out: torch.Tensor) -> Check:
    """Compare ``out`` (wsattn layout) with the float64 reference on a slice: the first and
    last batch elements, the first and last KV heads with their query heads, and (prefill)
    the first and last 128 query rows, computed on the output's device."""
    case = inputs.case
    acc = [0.0, 0.0]
    bsel = sorted({0, case.B - 1})
    if case.op == "prefill":
        kv, qh = _heads(case.H, case.HKV)
        m = min(case.N, 128)
        windows = sorted({(0, m), (case.N - m, case.N)})
        for b in bsel:
            for a, e in windows:
                # rows a:e of a causal square attention see keys :e; with bottom-right
                # alignment the reference puts query a+i at key position a+i as well
                kend = e if case.causal else case.N
                ref, _ = reference.attention(inputs.q[b:b + 1, a:e][:, :, qh],
                                             inputs.k[b:b + 1, :kend][:, :, kv],
                                             inputs.v[b:b + 1, :kend][:, :, kv],
                                             case.causal, inputs.scale)
                _accumulate(acc, out[b:b + 1, a:e][:, :, qh], ref)
        where = f"batch {bsel}, q heads {qh}, rows {windows}"
    else:
        kv, qh = _heads(case.HQ, case.HKV)
        idx = torch.tensor(bsel, device=inputs.q.device)
        if inputs.block_table is None:
            k, v = inputs.k_cache[idx], inputs.v_cache[idx]
        else:
            bt = inputs.block_table[idx]
            k = reference.gather_paged_kv(inputs.k_cache, bt, case.L)
            v = reference.gather_paged_kv(inputs.v_cache, bt, case.L)
        ref, _ = reference.decode(inputs.q[idx][:, qh], k[:, :, kv], v[:, :, kv],
                                  inputs.seqlens[idx], None, inputs.scale)
        _accumulate(acc, out[idx][:, qh], ref)
        where = f"batch {bsel}, q heads {qh}"
    rel = math.inf if math.isinf(acc[0]) else math.sqrt(acc[0]) / max(math.sqrt(acc[1]), 1e-30)
    return Check(rel, TOL[case.dtype], where)


# --------------------------------------------------------------------------- runners

@dataclass
class Prepared:
    first: Callable  # the checked call (may validate on the host)
    fn: Callable  # the timed call
    canon: Callable = lambda out: out  # output -> wsattn layout
    note: str | None = None


class Runner:
    name = ""
    ops: tuple = ()

    def applies(self, case) -> bool:
        return case.op in self.ops

    def prepare(self, case, inputs: Inputs) -> Prepared:
        raise NotImplementedError


class WsattnRunner(Runner):
    """wsattn.attention / wsattn.decode with impl=<impl>; a ValueError means 'not here'."""

    def __init__(self, impl: str, ops=("prefill", "decode")):
        self.impl, self.name, self.ops = impl, impl, ops

    def prepare(self, case, inp):
        impl = self.impl
        if case.op == "prefill":
            def call():
                return wsattn.attention(inp.q, inp.k, inp.v, causal=case.causal, impl=impl)
            first = call
        else:
            def call(validate=False):  # host-side validation syncs: off while timing
                return wsattn.decode(inp.q, inp.k_cache, inp.v_cache, inp.seqlens, inp.block_table,
                                     impl=impl, validate=validate)

            def first():
                return call(validate=True)

        def checked_first():
            try:
                return first()
            except ValueError as e:
                raise NotAvailable(str(e)) from e

        return Prepared(checked_first, call)


class SdpaRunner(Runner):
    """torch SDPA pinned to one backend with ``torch.nn.attention.sdpa_kernel``.

    Peers get their own layout ([B, H, S, D] contiguous), built once outside the timing.
    Decode: q_len 1 against the whole cache with enable_gqa; if the backend refuses GQA,
    K/V are repeated to Hq heads (noted in the row; bytes are still counted for Hkv)."""

    ops = ("prefill", "decode")

    def __init__(self, name: str, backend_name: str):
        self.name, self.backend_name = name, backend_name

    def applies(self, case):
        return case.op in self.ops and not (case.op == "decode" and case.page_size is not None)

    def _backend(self):
        from torch.nn.attention import SDPBackend
        try:
            return getattr(SDPBackend, self.backend_name)
        except AttributeError:
            raise NotAvailable(f"torch {torch.__version__} has no SDPBackend.{self.backend_name}")

    def prepare(self, case, inp):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = self._backend()
        if "q" not in inp.peer:
            if case.op == "prefill":
                inp.peer.update(q=inp.q.transpose(1, 2).contiguous(),
                                k=inp.k.transpose(1, 2).contiguous(),
                                v=inp.v.transpose(1, 2).contiguous())
            else:
                inp.peer.update(q=inp.q.unsqueeze(2), k=inp.k_cache.transpose(1, 2).contiguous(),
                                v=inp.v_cache.transpose(1, 2).contiguous())
        q, k, v = inp.peer["q"], inp.peer["k"], inp.peer["v"]
        causal = case.causal if case.op == "prefill" else False  # q_len 1 sees the whole cache
        gqa = q.shape[1] != k.shape[1]

        def sdpa(k, v, enable_gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=inp.scale,
                                                      enable_gqa=enable_gqa)

        def attempt(k, v, enable_gqa):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    return sdpa(k, v, enable_gqa)
                except RuntimeError as e:
                    why = "; ".join(str(w.message).splitlines()[0] for w in caught)
                    raise NotAvailable(f"{self.backend_name}: {str(e).splitlines()[0]}"
                                       + (f" ({why})" if why else "")) from e

        canon = (lambda o: o.transpose(1, 2)) if case.op == "prefill" else (lambda o: o[:, :, 0])
        prepared = Prepared(lambda: attempt(k, v, gqa), lambda: sdpa(k, v, gqa), canon)
        if gqa:
            try:
                attempt(k, v, True)
            except NotAvailable as refused:
                group = q.shape[1] // k.shape[1]
                kr = k.repeat_interleave(group, dim=1)
                vr = v.repeat_interleave(group, dim=1)
                prepared = Prepared(lambda: attempt(kr, vr, False), lambda: sdpa(kr, vr, False),
                                    canon, note=f"K/V repeated to {q.shape[1]} heads "
                                                f"(enable_gqa refused: {refused})")
        return prepared


def all_runners() -> list[Runner]:
    # imported here because wsattn.bench.peers imports this module
    from .peers import peer_runners

    return [WsattnRunner("triton"), WsattnRunner("gluon", ops=("prefill",)),
            SdpaRunner("sdpa-cudnn", "CUDNN_ATTENTION"),
            SdpaRunner("sdpa-flash", "FLASH_ATTENTION"), *peer_runners()]


RUNNER_NAMES = tuple(r.name for r in all_runners())
