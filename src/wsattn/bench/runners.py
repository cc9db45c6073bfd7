"""What gets measured: the wsattn kernels through the public API, and the peers present
(SDPA here; FlashAttention-4 and FlashInfer in :mod:`wsattn.bench.peers`).

A runner turns (case, inputs) into a :class:`Prepared`: ``first()`` makes the call whose
output is checked against the reference, ``fn`` the call that is timed, ``canon`` puts the
output in wsattn's layout. Availability is learnt by calling: a wsattn impl that refuses
the call raises ValueError (the Gluon kernel on a GPU it does not serve), an SDPA backend
that cannot take the shape raises RuntimeError; both become :class:`NotAvailable`.

The wsattn runners use the public API (``wsattn.attention``, ``wsattn.decode``,
``wsattn.reference``), so the benchmark runs whatever state the kernels are in; only the
``triton[SPEC]`` columns (``--decode-settings``) call the decode launcher itself, since the
API takes num_splits alone and a sweep needs every launch setting.

:class:`Rotated` times a decode case whose K/V fits in L2 over copies of its inputs, as
the decode step reads each layer's cache from HBM.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import wsattn
from wsattn import reference

from .cases import DTYPES
from .gemv import FRESH_BYTES

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

    def __init__(self, impl: str, ops=("prefill", "decode"), name: str | None = None):
        self.impl, self.name, self.ops = impl, name or impl, ops

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

        def refusal():
            # the API's own checks, which launch nothing: what they refuse is "not available";
            # an error from the call itself (a bug, a kernel failure) stays an error
            if case.op == "prefill":
                wsattn.api.check_attention(inp.q, inp.k, inp.v, case.causal, impl=impl)
            else:
                wsattn.api.check_decode(inp.q, inp.k_cache, inp.v_cache, inp.seqlens,
                                        inp.block_table, impl=impl, validate=True)

        def checked_first():
            try:
                refusal()
            except (ValueError, TypeError) as e:
                raise NotAvailable(str(e)) from e
            out = first()
            if case.op == "decode" and impl == "triton":  # the target is known to work now
                prepared.note = settings_note(case, inp)
            return out

        prepared = Prepared(checked_first, call)
        return prepared


class GluonBuildRunner(Runner):
    """One build of the Gluon prefill kernel, whatever the length rule would pick: its
    fixed-length launcher with the build's settings (a function of the head dim and mask),
    so builds can be timed side by side with `auto` in one process. The batch is validated
    once through wsattn.attention(impl="gluon") outside the timing."""

    ops = ("prefill",)

    def __init__(self, name: str, settings):
        self.name, self.settings = name, settings

    def prepare(self, case, inp):
        from wsattn.kernels import prefill_gluon as pg

        try:
            settings = self.settings(case.D, case.causal)
        except ValueError as e:  # a build that does not exist at this head dim
            raise NotAvailable(str(e)) from e

        def fn():
            return pg.prefill(inp.q, inp.k, inp.v, case.causal, inp.scale, settings)[0]

        def checked_first():
            try:
                wsattn.attention(inp.q, inp.k, inp.v, causal=case.causal, impl="gluon")
            except ValueError as e:
                raise NotAvailable(str(e)) from e
            return fn()

        return Prepared(checked_first, fn, note=f"settings: {settings}")


def parse_gluon_settings(spec: str, option: str = "--gluon-settings") -> dict:
    """'FIELD=VALUE[,FIELD=VALUE...]' -> GluonSettings overrides for settings_for (ints;
    bool fields take 0/1 or true/false); ValueError naming what is wrong (and the option
    it came from). Whether the build exists at a head dim is settings_for's to say, per
    case."""
    from dataclasses import fields

    from wsattn.kernels.prefill_gluon import GluonSettings
    types = {f.name: f.type for f in fields(GluonSettings)}
    out = {}
    for part in spec.split(","):
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or not name or not value:
            raise ValueError(f"{option}: each SPEC is FIELD=VALUE[,FIELD=VALUE...], "
                             f"got {spec!r}")
        if name not in types:
            raise ValueError(f"{option} {spec!r}: {name!r} is not a GluonSettings "
                             f"field ({', '.join(types)})")
        if name in out:
            raise ValueError(f"{option} {spec!r}: {name} given twice")
        if types[name] in (bool, "bool"):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{option} {spec!r}: {name} takes 0/1 or "
                                 f"true/false, got {value!r}")
            out[name] = value.lower() in ("1", "true")
        else:
            if not value.isdigit():
                raise ValueError(f"{option} {spec!r}: {name} takes a non-negative "
                                 f"int, got {value!r}")
            out[name] = int(value)
    return out


def settings_build(overrides: dict):
    """The build settings_for makes with these overrides, as a GluonBuildRunner's
    function of the head dim and mask."""
    def build(head_dim: int, causal: bool):
        from wsattn.kernels import prefill_gluon as pg
        return pg.settings_for(head_dim, causal, **overrides)
    return build


def one_consumer_build(head_dim: int, causal: bool):
    """The one-consumer build (64-row tiles, several CTAs an SM) at this head dim."""
    from wsattn.kernels import prefill_gluon as pg
    return pg.one_consumer_settings(head_dim, causal)


def multi_consumer_build(head_dim: int, causal: bool):
    """The default build (two consumer warpgroups at D128, three at D64), one tile a CTA."""
    from wsattn.kernels import prefill_gluon as pg
    return pg.settings_for(head_dim, causal)


# --------------------------------------------------------------------------- decode settings

SETTINGS_FIELDS = ("BLOCK_N", "num_warps", "num_stages", "num_splits", "bt_preload")
SETTINGS_SPEC = ",".join(SETTINGS_FIELDS[:4]) + "[,bt_preload]"
SETTINGS_RANGES = {"BLOCK_N": "a power of two in [16, 256]",
                   "num_warps": "a power of two in [1, 16]",
                   "num_stages": "in [1, 8]",
                   "num_splits": "in [0, {max_splits}] (0: the default rule's count)",
                   "bt_preload": "0 or 1"}


def parse_decode_settings(spec: str):
    """'BLOCK_N,num_warps,num_stages,num_splits[,bt_preload]' -> DecodeSettings, or a
    ValueError naming the field and what it takes (BLOCK_N >= 16 because both tl.dot
    operands need 16 rows; num_splits 0: the count the default rule picks for each case at
    this BLOCK_N, so BLOCK_N / warps / stages can be compared at the default's splits;
    bt_preload 0 or 1, default 0)."""
    from wsattn.kernels.decode_triton import MAX_SPLITS, DecodeSettings

    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) not in (4, 5):
        raise ValueError(f"{spec!r} must be {SETTINGS_SPEC} (4 or 5 integers), got "
                         f"{len(parts)} field(s)")
    values = {}
    for name, text in zip(SETTINGS_FIELDS, parts):
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"{spec!r}: {name} must be an integer, got {text!r}") from None
    values.setdefault("bt_preload", 0)
    pow2 = lambda x, hi: 1 <= x <= hi and x & (x - 1) == 0  # noqa: E731
    ok = {"BLOCK_N": values["BLOCK_N"] >= 16 and pow2(values["BLOCK_N"], 256),
          "num_warps": pow2(values["num_warps"], 16),
          "num_stages": 1 <= values["num_stages"] <= 8,
          "num_splits": 0 <= values["num_splits"] <= MAX_SPLITS,
          "bt_preload": values["bt_preload"] in (0, 1)}
    for name in SETTINGS_FIELDS:
        if not ok[name]:
            raise ValueError(f"{spec!r}: {name} must be "
                             f"{SETTINGS_RANGES[name].format(max_splits=MAX_SPLITS)}, got "
                             f"{values[name]}")
    values["bt_preload"] = bool(values["bt_preload"])
    return DecodeSettings(**values)


def format_decode_settings(settings) -> str:
    """The spec parse_decode_settings reads back (bt_preload written only when on)."""
    fields = [settings.BLOCK_N, settings.num_warps, settings.num_stages, settings.num_splits]
    return ",".join(str(x) for x in fields + ([1] if settings.bt_preload else []))


def launched_settings(case, inp, settings=None):
    """(settings, BT_CHUNK) the decode launcher runs ``inp`` with, resolved as
    decode_triton.decode does: default_settings where settings is None, num_splits 0 the
    default rule's count at settings.BLOCK_N (decode_triton.auto_splits), num_splits cut
    to the cache's key tiles."""
    from wsattn.kernels import decode_triton as dt
    from wsattn.target import target_of

    paged = inp.block_table is not None
    page = inp.k_cache.shape[1] if paged else 0
    capacity = inp.block_table.shape[1] * page if paged else inp.k_cache.shape[1]
    if settings is None:
        settings = dt.default_settings(
            target_of(inp.q.device), batch=case.B, kv_heads=case.HKV, head_dim=case.D,
            capacity=capacity, dtype=inp.q.dtype, paged=paged, query_rows=case.HQ // case.HKV,
            page_size=page)
    elif settings.num_splits == 0:
        settings = replace(settings, num_splits=dt.auto_splits(
            case.B, case.HKV, capacity, settings.BLOCK_N, target_of(inp.q.device).num_sms))
    tiles = max(1, -(-capacity // settings.BLOCK_N))
    settings = replace(settings, num_splits=min(settings.num_splits, tiles))
    return settings, (dt.bt_chunk(settings, capacity, page) if paged else 0)


def settings_note(case, inp, asked=None) -> str:
    """What the launch ran with, as a spec for --decode-settings, and where the launcher
    changed or ignored what was asked."""
    settings, chunk = launched_settings(case, inp, asked)
    note = f"launched {format_decode_settings(settings)}"
    if asked is not None and asked.num_splits == 0:
        note += " (num_splits the default rule's)"
    elif asked is not None and settings.num_splits != asked.num_splits:
        note += f" (num_splits cut to the cache's {settings.num_splits} key tiles)"
    if settings.bt_preload and not chunk:
        note += " (bt_preload inactive: contiguous cache, pages of whole tiles, or the " \
                "split's table is too long)"
    return note


class DecodeSettingsRunner(Runner):
    """The Triton decode kernel with explicit DecodeSettings, through its launcher (the
    public API takes num_splits only), after the checks wsattn.decode(validate=True) runs.
    Column ``triton[SPEC]``."""

    ops = ("decode",)

    def __init__(self, settings):
        self.settings = settings
        self.name = f"triton[{format_decode_settings(settings)}]"

    def prepare(self, case, inp):
        from wsattn import api, ops
        from wsattn.kernels import decode_triton

        q4, kc, vc = api._run_kernels("triton", inp.q.device, inp.q.unsqueeze(1),
                                      inp.k_cache, inp.v_cache)

        settings = launched_settings(case, inp, self.settings)[0]  # num_splits 0 resolved

        def call():
            out, _ = decode_triton.decode(q4, kc, vc, inp.seqlens, inp.block_table, inp.scale,
                                          0, settings)
            return out

        def first():
            try:
                api.check_decode(inp.q, inp.k_cache, inp.v_cache, inp.seqlens, inp.block_table,
                                 inp.scale, impl="triton", validate=True)
            except ValueError as e:
                raise NotAvailable(str(e)) from e
            ops._interpreter_ready(inp.q.device)
            out = call()
            prepared.note = settings_note(case, inp, self.settings)
            return out

        prepared = Prepared(first, call, lambda out: out[:, 0].to(inp.q.dtype))
        return prepared


# --------------------------------------------------------------------------- L2 rotation

MAX_COPIES = 128


def rotation_copies(case, fresh_bytes: int = FRESH_BYTES) -> int:
    """Input copies a decode case is timed over so that they span at least fresh_bytes
    (1: the case alone does, as every default case's 0.5-2 GB cache)."""
    if case.op != "decode":
        return 1
    return max(1, min(MAX_COPIES, math.ceil(fresh_bytes / case.bytes_moved())))


def input_copies(inp: Inputs, n: int) -> list[Inputs]:
    """inp and n - 1 clones of its tensors (distinct HBM pages), made once per case and
    shared by the runners."""
    clones = inp.peer.setdefault("l2_copies", [])
    while len(clones) < n - 1:
        clones.append(Inputs(inp.case, {k: t.clone() if isinstance(t, torch.Tensor) else t
                                        for k, t in inp.tensors.items()}, inp.scale))
    return [inp] + clones[:n - 1]


class Rotated(Runner):
    """``inner``, timed with each call on the next copy of the inputs.

    The decode step reads each layer's K/V once, after the layer's weights have pushed it
    out of L2; timing one 2-130 MB cache call after call would read it from the 50 MB L2.
    So a decode case smaller than fresh_bytes is prepared on input_copies and the timed
    call cycles through them (the check runs on copy 0, the suite's inputs); a case that
    spans fresh_bytes alone runs as ``inner`` does."""

    def __init__(self, inner: Runner, fresh_bytes: int = FRESH_BYTES):
        self.inner, self.fresh_bytes = inner, fresh_bytes
        self.name, self.ops = inner.name, inner.ops

    def applies(self, case) -> bool:
        return self.inner.applies(case)

    def prepare(self, case, inp):
        n = rotation_copies(case, self.fresh_bytes)
        if n == 1:
            return self.inner.prepare(case, inp)
        prepared = [self.inner.prepare(case, c) for c in input_copies(inp, n)]
        state = {"i": 0}

        def fn():
            # each captured call reads the next copy, so a graph replay streams HBM
            p = prepared[state["i"] % n]
            state["i"] += 1
            return p.fn()

        head = prepared[0]

        def first():
            out = head.first()
            # the inner note may be set by its first call
            rotated.note = "; ".join(x for x in (head.note, f"timed over {n} input copies "
                                                             f"(past L2)") if x)
            return out

        rotated = Prepared(first, fn, head.canon)
        return rotated


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

    # "wsattn": impl="auto", what a user's call runs and what the prefill targets are about
    return [WsattnRunner("auto", ops=("prefill",), name="wsattn"), WsattnRunner("triton"),
            WsattnRunner("gluon", ops=("prefill",)),
            SdpaRunner("sdpa-cudnn", "CUDNN_ATTENTION"),
            SdpaRunner("sdpa-flash", "FLASH_ATTENTION"), *peer_runners(),
            GluonBuildRunner("gluon-one-consumer", one_consumer_build),
            GluonBuildRunner("gluon-multi-consumer", multi_consumer_build)]


RUNNER_NAMES = tuple(r.name for r in all_runners())
# asked for by name only: the Gluon builds beside the `auto` and `gluon` columns
BUILD_RUNNERS = ("gluon-one-consumer", "gluon-multi-consumer")
DEFAULT_RUNNERS = tuple(n for n in RUNNER_NAMES if n not in BUILD_RUNNERS)
