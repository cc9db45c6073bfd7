"""The library's own kernels, registered by name for the ladder and the card ledger.

Each entry calls a kernel module's ``compile_spec(cc, ...)`` for gates 0-2 and runs the
public API (``wsattn.attention(..., impl="triton")``, ``wsattn.decode``,
``wsattn.merge_states``) against ``wsattn.reference`` for gates 3-7. Registration is
defensive: a kernel module or function that is missing gives a spec marked unavailable
(a failed gate 1 naming the reason), never an import error.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch

from .spec import KernelSpec, RunSpec, unavailable

_DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _dtype(d):
    return _DT[d] if isinstance(d, str) else d


# --------------------------------------------------------------------------- prefill

def _draw_prefill(causal, varlen, head_dim):
    def draw(rng, small):
        D = 64 if small else head_dim
        hkv = rng.choice([1, 2])
        group = rng.choice([1, 2, 4] if small else [1, 4, 8])
        lens = [1, 17, 40] if small else [1, 17, 127, 300, 1000]
        if varlen:
            n = rng.choice([1, 2, 3])
            sq = [rng.choice(lens) for _ in range(n)]
            sk = [s + (rng.choice([0, 0, 23]) if causal else rng.choice([0, 23])) for s in sq]
            return {"Sq": sq, "Sk": sk, "Hq": hkv * group, "Hkv": hkv, "D": D}
        sq = rng.choice(lens)
        sk = sq + rng.choice([0, 0, 23])
        return {"B": rng.choice([1, 2]), "Sq": sq, "Sk": sk, "Hq": hkv * group, "Hkv": hkv, "D": D}
    return draw


def _describe_lens(name, lens):
    # a long pack by its count, total and range, so a label stays a line
    if len(lens) <= 10:
        return name + "+".join(map(str, lens))
    return f"{name}{len(lens)}seqs{sum(lens)}tok{min(lens)}to{max(lens)}"


def _describe_prefill(shape):
    s = shape
    seq = (f"{_describe_lens('Sq', s['Sq'])}-{_describe_lens('Sk', s['Sk'])}"
           if isinstance(s["Sq"], list) else f"B{s['B']}-Sq{s['Sq']}-Sk{s['Sk']}")
    return f"{seq}-H{s['Hq']}-HKV{s['Hkv']}-D{s['D']}"


def _build_prefill(shape, dtype, device, gen):
    dt = _dtype(dtype)
    rnd = lambda *sz: torch.randn(*sz, generator=gen).to(dt).to(device)
    s = shape
    if isinstance(s["Sq"], list):
        cq = torch.tensor([0] + list(_cumsum(s["Sq"])), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + list(_cumsum(s["Sk"])), dtype=torch.int32, device=device)
        # max_q / max_k: host integers for a baseline that needs them (FlashAttention-2's
        # varlen call); the library's own calls bound the pack on the device
        return {"q": rnd(sum(s["Sq"]), s["Hq"], s["D"]), "k": rnd(sum(s["Sk"]), s["Hkv"], s["D"]),
                "v": rnd(sum(s["Sk"]), s["Hkv"], s["D"]), "cu_q": cq, "cu_k": ck,
                "max_q": max(s["Sq"]), "max_k": max(s["Sk"])}
    return {"q": rnd(s["B"], s["Sq"], s["Hq"], s["D"]), "k": rnd(s["B"], s["Sk"], s["Hkv"], s["D"]),
            "v": rnd(s["B"], s["Sk"], s["Hkv"], s["D"])}


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def _prefill_runner(causal, impl, build=None):
    def run(inp):
        import wsattn
        if build:  # Gluon varlen builds that are kernel settings, not API choices: the
            # plain grid (the fallback of packs the tile table cannot hold), the one-consumer
            # build (settings by head dim)
            from ..kernels import prefill_gluon
            q = inp["q"]
            over = build(q.shape[-1]) if callable(build) else build
            s = prefill_gluon.settings_for(q.shape[-1], causal, **over)
            return prefill_gluon.prefill_varlen(q, inp["k"], inp["v"], inp["cu_q"], inp["cu_k"],
                                                None, None, causal, 1.0 / math.sqrt(q.shape[-1]),
                                                settings=s)
        if impl == "gluon" and "cu_q" not in inp:  # varlen goes through the API below
            # Straight to the kernel: the API refuses impl="gluon" until the kernel has passed
            # its GPU numerics, which is the evidence this ladder gathers. Shapes drawn here
            # are valid for it (fixed length, D 64/128, fp16/bf16, GQA).
            from ..kernels import prefill_gluon
            q = inp["q"]
            return prefill_gluon.prefill(q, inp["k"], inp["v"], causal, 1.0 / math.sqrt(q.shape[-1]))
        if "cu_q" in inp:
            return wsattn.attention_varlen(inp["q"], inp["k"], inp["v"], inp["cu_q"], inp["cu_k"],
                                           causal=causal, return_lse=True, impl=impl)
        return wsattn.attention(inp["q"], inp["k"], inp["v"], causal=causal, return_lse=True, impl=impl)
    return run


def _prefill_reference(causal):
    def ref(inp):
        from .. import reference
        if "cu_q" in inp:
            return reference.attention_varlen(inp["q"], inp["k"], inp["v"], inp["cu_q"], inp["cu_k"], causal)
        return reference.attention(inp["q"], inp["k"], inp["v"], causal)
    return ref


def _sdpa_prefill(causal):
    def run(inp):
        import torch.nn.functional as F
        q, k, v = (t.transpose(1, 2) for t in (inp["q"], inp["k"], inp["v"]))
        # SDPA's causal mask is top-left aligned: the profile shapes keep Sq == Sk.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return run


def _fa2_varlen_prefill(causal):
    """torch's FlashAttention-2 varlen forward (aten::_flash_attention_forward with
    cu_seqlens: bottom-right causal, GQA), the packed-prefill peer issue 16 names."""
    def run(inp):
        q = inp["q"]
        return torch.ops.aten._flash_attention_forward(
            q, inp["k"], inp["v"], inp["cu_q"], inp["cu_k"], inp["max_q"], inp["max_k"], 0.0,
            causal, False, scale=1.0 / math.sqrt(q.shape[-1]))[0]
    return run


# The varlen entries' profile packs (gate 7), keys as many as queries: 16,384 tokens, one
# sequence of each power of two from 1 to 8,192 and one of 63 (the packs serving sends
# mix lengths; every tile edge is met); the one-consumer entry's build is the one packs of
# short sequences take (VARLEN_ONE_CONSUMER_UP_TO), so its pack holds those: 12,280 tokens
# of 17-1,024.
_VARLEN_PROFILE_LENS = (8192, 4096, 2048, 1024, 512, 256, 128, 64, 63, 1)
_VARLEN_SHORT_PROFILE_LENS = (1024, 768, 512, 300, 256, 129, 64, 17) * 4


def _varlen_profile_shape(one_consumer):
    lens = list(_VARLEN_SHORT_PROFILE_LENS if one_consumer else _VARLEN_PROFILE_LENS)
    return {"Sq": lens, "Sk": list(lens), "Hq": 16, "Hkv": 16, "D": 128}


# Sanitizers slow kernels 10-100x: two small shapes, odd lengths (not multiples of a tile,
# S = 1), GQA, and both head dims (the Gluon kernel is a different build at D=64).
_SANITIZER_PREFILL = {
    False: ({"B": 1, "Sq": 17, "Sk": 40, "Hq": 4, "Hkv": 2, "D": 128},
            {"B": 2, "Sq": 1, "Sk": 127, "Hq": 2, "Hkv": 1, "D": 64}),
    True: ({"Sq": [17, 1], "Sk": [40, 1], "Hq": 4, "Hkv": 2, "D": 128},
           {"Sq": [127], "Sk": [127], "Hq": 2, "Hkv": 1, "D": 64}),
}


# The Gluon entries' further shapes: the builds the launcher picks past the one-consumer
# rules (the two-consumer D128 and three-consumer D64 defaults, and D64 non-causal's
# persistent schedule in between), so the sanitizer gate runs what long calls run, not
# only the short calls' one-consumer builds (H 2 and one sequence: racecheck's cost grows
# with every shared-memory access)
_SANITIZER_GLUON_DEFAULTS = {
    (False, False): ({"B": 1, "Sq": 300, "Sk": 300, "Hq": 2, "Hkv": 1, "D": 128},
                     {"B": 1, "Sq": 600, "Sk": 600, "Hq": 2, "Hkv": 1, "D": 64},
                     {"B": 1, "Sq": 1100, "Sk": 1100, "Hq": 2, "Hkv": 1, "D": 64}),
    (True, False): ({"B": 1, "Sq": 1100, "Sk": 1100, "Hq": 2, "Hkv": 1, "D": 128},
                    {"B": 1, "Sq": 2100, "Sk": 2100, "Hq": 2, "Hkv": 1, "D": 64}),
    (False, True): ({"Sq": [700, 400], "Sk": [700, 400], "Hq": 2, "Hkv": 1, "D": 128},
                    {"Sq": [700, 400], "Sk": [700, 400], "Hq": 2, "Hkv": 1, "D": 64}),
}


def _gluon_prefill_builds(causal):
    """The Gluon builds a fixed-length sanitizer shape launches: the call's own settings,
    which take the one-consumer build for short shapes (ONE_CONSUMER_UP_TO) and the
    persistent schedule for somewhat longer D64 non-causal ones (PERSISTENT_UP_TO), specialized on
    the shape's lengths as the launcher does (a length of 1 is a constant: in the
    one-consumer D64 build that moves the dispatch bytes), each a build with its own
    shared-memory layout and so its own warp-dispatch bytes."""
    def builds(shape):
        from ..kernels import prefill_gluon
        return [{"head_dim": shape["D"],
                 "settings": prefill_gluon.call_settings(shape["D"], causal, shape["Sq"],
                                                         shape["Sk"]),
                 "seqlens": (shape["Sq"], shape["Sk"])}]
    return builds


def _gluon_varlen_builds(causal, one_consumer=False):
    """The Gluon varlen build a sanitizer pack launches, each with its own warp-dispatch
    bytes: ONE_CONSUMER of its head dim with one_consumer (the entry's own settings), else
    what the API picks (no max_seqlen, so the pack's token counts bound it): the
    one-consumer build where VARLEN_ONE_CONSUMER_UP_TO covers them, the default otherwise."""
    def builds(shape):
        from ..kernels import prefill_gluon as pg
        D = shape["D"]
        return [{"head_dim": D, "settings": pg.one_consumer_settings(D, causal) if one_consumer
                 else pg.varlen_call_settings(D, causal, sum(shape["Sq"]), sum(shape["Sk"]))}]
    return builds


def _prefill_entry(name, module, causal=False, varlen=False, impl="triton", only_ccs=None,
                   plain=False, one_consumer=False):
    kwargs = {"head_dim": 128, "dtype": "bf16", "causal": causal}
    build = {}
    if varlen:
        kwargs["varlen"] = True
    if plain:
        kwargs["plain_grid"] = True
        build["compact_varlen"] = False
    if one_consumer:  # varlen: the build packs of short sequences take
        from ..kernels import prefill_gluon
        kwargs["settings"] = prefill_gluon.one_consumer_settings(128, causal)
        build = lambda head_dim: prefill_gluon.ONE_CONSUMER[head_dim]  # noqa: E731
    run = RunSpec(lse_outputs=(1,), draw_shape=_draw_prefill(causal, varlen, 128), build=_build_prefill,
                  run=_prefill_runner(causal, impl, build),
                  reference=_prefill_reference(causal),
                  dtypes=("bf16", "fp16"), interpreter=impl == "triton",
                  baseline=_fa2_varlen_prefill(causal) if varlen else _sdpa_prefill(causal),
                  baseline_name="torch FlashAttention-2 varlen (aten::_flash_attention_forward)"
                  if varlen else "torch SDPA (cuDNN/flash)",
                  profile_shapes=(_varlen_profile_shape(one_consumer),) if varlen else (
                      {"B": 4, "Sq": 4096, "Sk": 4096, "Hq": 16, "Hkv": 16, "D": 128},),
                  sanitizer_shapes=_SANITIZER_PREFILL[varlen] + (
                      _SANITIZER_GLUON_DEFAULTS.get((causal, varlen), ())
                      if impl == "gluon" and not (plain or one_consumer) else ()),
                  describe=_describe_prefill,
                  sanitizer_builds=None if impl != "gluon" or plain else
                  _gluon_varlen_builds(causal, one_consumer) if varlen else
                  _gluon_prefill_builds(causal))
    desc = f"{'Gluon' if impl == 'gluon' else 'Triton'} prefill, D=128 bf16" + \
        (", causal" if causal else "") + (", varlen" if varlen else "") + \
        (", plain grid (no tile table)" if plain else "") + \
        (", one-consumer build (64-row tiles, several CTAs an SM)" if one_consumer else "")
    return name, module, "compile_spec", kwargs, run, desc, only_ccs


# --------------------------------------------------------------------------- paged prefill

def _draw_paged(rng, small):
    hkv = rng.choice([1, 2])
    group = rng.choice([1, 4] if small else [1, 4, 7])
    n = rng.choice([1, 2, 3])
    chunks = [rng.choice([1, 5, 17] if small else [1, 17, 64, 65, 300]) for _ in range(n)]
    prefix = [rng.choice([0, 3, 23] if small else [0, 15, 100, 1000]) for _ in range(n)]
    return {"Lq": chunks, "P": prefix, "Hq": hkv * group, "Hkv": hkv,
            "D": 64 if small else 128, "page": rng.choice([16, 64])}


def _describe_paged(s):
    return (f"Lq{'+'.join(map(str, s['Lq']))}-P{'+'.join(map(str, s['P']))}-H{s['Hq']}"
            f"-HKV{s['Hkv']}-D{s['D']}-page{s['page']}")


def _build_paged(shape, dtype, device, gen):
    """Packed chunk queries; every sequence's keys (prefix + its chunk) in a paged cache
    whose pages are shuffled, unused slots NaN (a wrong page or slot read shows); the
    same keys contiguous for the baseline."""
    dt = _dtype(dtype)
    s = shape
    rnd = lambda *sz: torch.randn(*sz, generator=gen).to(dt)  # noqa: E731
    lens_k = [p + c for p, c in zip(s["P"], s["Lq"])]
    page, per = s["page"], max(1, math.ceil(max(lens_k) / s["page"]))
    B = len(lens_k)
    k_cat, v_cat = rnd(sum(lens_k), s["Hkv"], s["D"]), rnd(sum(lens_k), s["Hkv"], s["D"])
    kc = torch.full((B * per + 1, page, s["Hkv"], s["D"]), float("nan"), dtype=dt)
    vc = kc.clone()
    bt = torch.randperm(B * per + 1, generator=gen)[:B * per].to(torch.int32).reshape(B, per)
    start = 0
    for b, L in enumerate(lens_k):
        for j in range(L):
            kc[bt[b, j // page], j % page] = k_cat[start + j]
            vc[bt[b, j // page], j % page] = v_cat[start + j]
        start += L
    cq = torch.tensor([0] + list(_cumsum(s["Lq"])), dtype=torch.int32)
    ck = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return {"q": to(rnd(sum(s["Lq"]), s["Hq"], s["D"])), "kc": to(kc), "vc": to(vc),
            "cu_q": to(cq), "lens_k": to(torch.tensor(lens_k, dtype=torch.int32)),
            "bt": to(bt), "k": to(k_cat), "v": to(v_cat), "cu_k": to(ck),
            "max_q": max(s["Lq"]), "max_k": max(lens_k)}


def _paged_run(inp, gather=False):
    import wsattn
    return wsattn.attention_paged(inp["q"], inp["kc"], inp["vc"], inp["cu_q"], inp["lens_k"],
                                  inp["bt"], inp["max_q"], causal=True, return_lse=True,
                                  impl="triton", gather=gather)


def _paged_reference(inp):
    from .. import reference
    return reference.attention_paged(inp["q"], inp["kc"], inp["vc"], inp["cu_q"],
                                     inp["lens_k"], inp["bt"], causal=True)


def _paged_contiguous(inp):
    """The same attention with the keys contiguous (the Triton varlen kernel): the
    chunked-prefill target is >= 0.95x of it."""
    import wsattn
    return wsattn.attention_varlen(inp["q"], inp["k"], inp["v"], inp["cu_q"], inp["cu_k"],
                                   inp["max_q"], inp["max_k"], causal=True, impl="triton")


def _build_paged_append(shape, dtype, device, gen):
    """_build_paged's inputs with each chunk's own keys taken out of the cache (its slots
    NaN) and given as k_new / v_new, packed as q is: the call must append them before it
    reads them. Every run writes the same rows again, so reruns see the same cache."""
    from .. import reference
    inp = _build_paged(shape, dtype, "cpu", gen)
    cu_k = inp["cu_k"].tolist()
    rows = torch.cat([torch.arange(cu_k[b + 1] - lq, cu_k[b + 1])
                      for b, lq in enumerate(shape["Lq"])])
    inp["k_new"], inp["v_new"] = inp["k"][rows].contiguous(), inp["v"][rows].contiguous()
    nan = torch.full_like(inp["k_new"], float("nan"))
    reference.append_paged_kv(nan, nan, inp["kc"], inp["vc"], inp["cu_q"], inp["lens_k"],
                              inp["bt"])
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in inp.items()}


def _paged_append_run(inp):
    import wsattn
    return wsattn.attention_paged(inp["q"], inp["kc"], inp["vc"], inp["cu_q"], inp["lens_k"],
                                  inp["bt"], inp["max_q"], causal=True, return_lse=True,
                                  impl="triton", gather=False, k_new=inp["k_new"],
                                  v_new=inp["v_new"])


def _paged_append_reference(inp):
    # from the keys contiguous: the cache's chunk slots hold NaN until a run appends them
    from .. import reference
    return reference.attention_varlen(inp["q"], inp["k"], inp["v"], inp["cu_q"], inp["cu_k"],
                                      causal=True)


def _paged_gluon_run(inp, one_consumer=False):
    # the Gluon kernel's paged build, called as the kernel (attention_paged takes it with
    # gather=False, or by default per dispatch.paged_gather: notes/prefill_triton.md): the build
    # the launcher picks, or with one_consumer the one-consumer build whatever the shape
    from ..kernels import prefill_gluon as pg
    q = inp["q"]
    D = q.shape[-1]
    settings = pg.one_consumer_settings(D, True) if one_consumer else None
    return pg.prefill_paged(q, inp["kc"], inp["vc"], inp["cu_q"], inp["lens_k"], inp["bt"],
                            inp["max_q"], True, D ** -0.5, settings=settings)


def _gluon_paged_builds(one_consumer=False):
    """The Gluon paged build a sanitizer shape launches (its page size, its head dim's
    settings), each with its own warp-dispatch bytes: ONE_CONSUMER with one_consumer, else
    what the launcher picks from the longest chunk and the block table's width in keys
    (_build_paged sizes the table to the longest sequence)."""
    def builds(shape):
        from ..kernels import prefill_gluon as pg
        D, page = shape["D"], shape["page"]
        width = math.ceil(max(p + c for p, c in zip(shape["P"], shape["Lq"])) / page)
        return [{"head_dim": D, "page": page, "settings": pg.one_consumer_settings(D, True)
                 if one_consumer else
                 pg.varlen_call_settings(D, True, max(shape["Lq"]), width * page)}]
    return builds


def _paged_gluon_contiguous(inp):
    """The same attention with the keys contiguous through the Gluon varlen kernel (the
    0.95 target of the paged build is against it)."""
    import wsattn
    return wsattn.attention_varlen(inp["q"], inp["k"], inp["v"], inp["cu_q"], inp["cu_k"],
                                   inp["max_q"], inp["max_k"], causal=True, impl="gluon")


def _paged_entry(kind="in_place"):
    # in_place: the Triton paged kernel; gather: the keys copied out of the cache into a
    # packed buffer (paged_gather.py), then the Triton varlen kernel (the compile gates
    # build the gather kernel, the run and the sanitizer gates cover both launches);
    # gluon: the Gluon varlen kernel's paged build reading the pages in place, the build
    # the launcher picks (its sanitizer shapes take the one-consumer build at both head
    # dims and the default one at D128); gluon_one_consumer: its one-consumer build
    gluon = kind in ("gluon", "gluon_one_consumer")
    one = kind == "gluon_one_consumer"
    run = RunSpec(lse_outputs=(1,), draw_shape=_draw_paged, build=_build_paged,
                  run=functools.partial(_paged_gluon_run, one_consumer=one) if gluon else
                  functools.partial(_paged_run, gather=kind == "gather"),
                  reference=_paged_reference, dtypes=("bf16", "fp16"), interpreter=not gluon,
                  baseline=_paged_gluon_contiguous if gluon else _paged_contiguous,
                  baseline_name=f"wsattn {'Gluon ' if gluon else ''}varlen prefill over the "
                                "same keys, contiguous",
                  profile_shapes=({"Lq": [2048] * 8, "P": [8192] * 8, "Hq": 32, "Hkv": 8,
                                   "D": 128, "page": 16},),
                  sanitizer_shapes=({"Lq": [17, 1], "P": [23, 0], "Hq": 4, "Hkv": 2, "D": 128,
                                     "page": 16},
                                    {"Lq": [65], "P": [3], "Hq": 2, "Hkv": 1, "D": 64,
                                     "page": 64}) + (
                      # the Gluon launcher's default build takes this one
                      ({"Lq": [65], "P": [1000], "Hq": 2, "Hkv": 1, "D": 128, "page": 16},)
                      if gluon else ()),
                  describe=_describe_paged,
                  sanitizer_builds=_gluon_paged_builds(one) if gluon else None)
    if one:
        from ..kernels import prefill_gluon
        return ("prefill_gluon_paged_one_consumer", "wsattn.kernels.prefill_gluon",
                "compile_spec",
                {"head_dim": 128, "dtype": "bf16", "causal": True, "varlen": True,
                 "page": 16, "settings": prefill_gluon.one_consumer_settings(128, True)},
                run,
                "Gluon chunked prefill over a paged cache read in place by TMA, the "
                "one-consumer build (64-row tiles, several CTAs an SM; short query chunks "
                "take it), D=128 bf16, causal, page 16", (90,))
    if gluon:
        return ("prefill_gluon_paged", "wsattn.kernels.prefill_gluon", "compile_spec",
                {"head_dim": 128, "dtype": "bf16", "causal": True, "varlen": True,
                 "page": 16}, run,
                "Gluon chunked prefill over a paged cache read in place by TMA (the varlen "
                "build's PAGE), D=128 bf16, causal, page 16", (90,))
    if kind == "gather":
        return ("prefill_paged_gather", "wsattn.kernels.paged_gather", "compile_spec",
                {"head_dim": 128, "dtype": "bf16", "page_size": 16}, run,
                "chunked prefill over a paged cache through gathered keys (the gather "
                "kernel, then the Triton varlen kernel), D=128 bf16, causal", None)
    return ("prefill_paged", "wsattn.kernels.prefill_paged", "compile_spec",
            {"head_dim": 128, "dtype": "bf16", "causal": True, "page_size": 16}, run,
            "Triton chunked prefill over a paged cache, D=128 bf16, causal", None)


def _paged_append_entry():
    # the append kernel (paged_append.py, what the compile gates build), then the Triton
    # paged kernel reading the cache it wrote; the baseline is the same attention over
    # contiguous keys, so gate 7 says what appending inside the call costs
    run = RunSpec(lse_outputs=(1,), draw_shape=_draw_paged, build=_build_paged_append, run=_paged_append_run,
                  reference=_paged_append_reference, dtypes=("bf16", "fp16"),
                  baseline=_paged_contiguous,
                  baseline_name="wsattn varlen prefill over the same keys, contiguous",
                  profile_shapes=({"Lq": [2048] * 8, "P": [8192] * 8, "Hq": 32, "Hkv": 8,
                                   "D": 128, "page": 16},),
                  sanitizer_shapes=({"Lq": [17, 1], "P": [23, 0], "Hq": 4, "Hkv": 2, "D": 128,
                                     "page": 16},
                                    {"Lq": [65], "P": [3], "Hq": 2, "Hkv": 1, "D": 64,
                                     "page": 64}),
                  describe=_describe_paged)
    return ("prefill_paged_append", "wsattn.kernels.paged_append", "compile_spec",
            {"head_dim": 128, "dtype": "bf16", "page_size": 16}, run,
            "chunked prefill that appends its chunk's K/V to the paged cache (the append "
            "kernel, then the Triton paged kernel), D=128 bf16, causal", None)


# --------------------------------------------------------------------------- decode

_DECODE_PAGE = 16  # the paged entries' default page: shorter than every decode tile


def _draw_decode(paged, head_dim, page=_DECODE_PAGE):
    def draw(rng, small):
        hkv = rng.choice([1, 2])
        group = rng.choice([1, 4] if small else [1, 4, 8])
        lens = [1, 17, 60] if small else [1, 17, 127, 300, 2000]
        B = rng.choice([1, 2, 3])
        shape = {"B": B, "L": [rng.choice(lens) for _ in range(B)], "Hq": hkv * group,
                 "Hkv": hkv, "D": 64 if small else head_dim, "paged": paged}
        return {**shape, "page": page} if paged else shape
    return draw


def _describe_decode(s):
    page = s.get("page", _DECODE_PAGE)
    return f"B{s['B']}-L{'+'.join(map(str, s['L']))}-H{s['Hq']}-HKV{s['Hkv']}-D{s['D']}" + \
        (("-paged" if page == _DECODE_PAGE else f"-paged{page}") if s["paged"] else "")


def _build_decode(shape, dtype, device, gen):
    dt = _dtype(dtype)
    s = shape
    rnd = lambda *sz: torch.randn(*sz, generator=gen).to(dt).to(device)
    B, L = s["B"], max(s["L"])
    seqlens = torch.tensor(s["L"], dtype=torch.int32, device=device)
    q = rnd(B, s["Hq"], s["D"])
    if not s["paged"]:
        return {"q": q, "k": rnd(B, L, s["Hkv"], s["D"]), "v": rnd(B, L, s["Hkv"], s["D"]),
                "seqlens": seqlens, "bt": None}
    page = s.get("page", _DECODE_PAGE)
    per = math.ceil(L / page)
    perm = torch.randperm(B * per, generator=gen).to(torch.int32)
    bt = perm.reshape(B, per).to(device)
    return {"q": q, "k": rnd(B * per, page, s["Hkv"], s["D"]), "v": rnd(B * per, page, s["Hkv"], s["D"]),
            "seqlens": seqlens, "bt": bt}


def _decode_run(inp):
    import wsattn
    return wsattn.decode(inp["q"], inp["k"], inp["v"], inp["seqlens"], inp["bt"], return_lse=True,
                         impl="triton")


def _decode_reference(inp):
    from .. import reference
    return reference.decode(inp["q"], inp["k"], inp["v"], inp["seqlens"], inp["bt"])


def _sdpa_decode(inp):
    import torch.nn.functional as F
    from .. import reference
    k, v = inp["k"], inp["v"]
    if inp["bt"] is not None:  # the peer reads a contiguous cache: it pays nothing for paging
        L = int(inp["seqlens"].max())
        k, v = (reference.gather_paged_kv(t, inp["bt"], L) for t in (k, v))
    q = inp["q"].unsqueeze(2)  # [B, Hq, 1, D]
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=q.shape[1] != k.shape[2])


def _decode_entry(name, paged, page=_DECODE_PAGE):
    """Decode on a contiguous cache or on pages of ``page`` tokens (16: pages shorter than
    every tile; 64: the engine's, one page a tile at D128 and two at D64)."""
    extra = {"page": page} if paged else {}
    run = RunSpec(lse_outputs=(1,), draw_shape=_draw_decode(paged, 128, page), build=_build_decode,
                  run=_decode_run,
                  reference=_decode_reference, dtypes=("bf16", "fp16"), baseline=_sdpa_decode,
                  baseline_name="torch SDPA" + (" (contiguous cache)" if paged else ""),
                  profile_shapes=({"B": 8, "L": [65536] * 8, "Hq": 32, "Hkv": 8, "D": 128,
                                   "paged": paged, **extra},),
                  # the third and fourth: one sequence of one KV head splits 33 and 128
                  # ways, the combine over one tile of 64 splits and over two
                  sanitizer_shapes=tuple({**sh, "paged": paged, **extra} for sh in (
                      {"B": 2, "L": [17, 60], "Hq": 4, "Hkv": 1, "D": 128},
                      {"B": 1, "L": [1], "Hq": 2, "Hkv": 2, "D": 64},
                      {"B": 1, "L": [2100], "Hq": 8, "Hkv": 1, "D": 128},
                      {"B": 1, "L": [20000], "Hq": 8, "Hkv": 1, "D": 128}) + (
                      # pages of 64 under D64's 128-key tiles: the block-table preload
                      ({"B": 2, "L": [300, 130], "Hq": 4, "Hkv": 1, "D": 64},)
                      if page != _DECODE_PAGE else ())),
                  describe=_describe_decode)
    title = "Triton split-KV decode, D=128 bf16" + (f", pages of {page}" if paged else "")
    return (name, "wsattn.kernels.decode_triton", "compile_spec",
            {"head_dim": 128, "dtype": "bf16", "paged": paged,
             **({"page_size": page} if paged else {})}, run, title, None)


# --------------------------------------------------------------------------- merge

def _draw_merge(rng, small):
    return {"P": rng.choice([1, 2, 3, 8]), "N": rng.choice([1, 17, 127] if small else [1, 17, 127, 300, 4096]),
            "D": 64 if small else 128}


def _build_merge(shape, dtype, device, gen):
    P, N, D = shape["P"], shape["N"], shape["D"]
    o = torch.randn(P, N, D, generator=gen).to(_dtype(dtype)).to(device)
    lse = torch.randn(P, N, generator=gen) * 3
    lse[torch.rand(P, N, generator=gen) < 0.2] = float("-inf")  # empty shards, some rows all empty
    return {"o": o, "lse": lse.to(device)}


def _merge_run(inp):
    import wsattn
    return wsattn.merge_states(inp["o"], inp["lse"], impl="triton")


def _merge_reference(inp):
    from .. import reference
    return reference.merge_states(inp["o"], inp["lse"])


def _merge_eager(inp):
    o, s = inp["o"].float(), inp["lse"]
    m = s.max(0).values
    w = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    tot = w.sum(0)
    return (w[..., None] * o).sum(0) / tot.clamp_min(1e-30)[..., None]


def _merge_entry():
    run = RunSpec(lse_outputs=(1,), draw_shape=_draw_merge, build=_build_merge, run=_merge_run, reference=_merge_reference,
                  dtypes=("bf16", "fp16", "fp32"), interpreter_dtypes=("fp16", "fp32"),
                  baseline=_merge_eager, baseline_name="torch eager (fp32)",
                  profile_shapes=({"P": 8, "N": 32768, "D": 128},),
                  sanitizer_shapes=({"P": 3, "N": 17, "D": 128}, {"P": 1, "N": 1, "D": 64}),
                  describe=lambda s: f"P{s['P']}-N{s['N']}-D{s['D']}")
    return ("merge_states", "wsattn.kernels.merge", "compile_spec", {"head_dim": 128, "dtype": "bf16"},
            run, "LSE merge of partial states, D=128 bf16", None)


# --------------------------------------------------------------------------- decode step
# The fused decode-step kernels (kernels/gemv.py, qkv_rope.py, moe.py), each run through
# its launcher with pdl=None (on for CUDA sm_90+, as the engine launches them), against a
# float64 reference written here from the math in the launchers' docstrings (no kernel
# internals). compile_spec builds with PDL only where the target has it (sm_90+): the
# griddepcontrol instructions are sm_90 PTX, and the build the ladder reads should be the
# one the launcher would run there.

class _ByTarget:
    """A compile_spec argument that depends on the target: fn(cc) -> value."""

    def __init__(self, fn):
        self.fn = fn


_PDL_BY_TARGET = _ByTarget(lambda cc: cc >= 90)


def _rnd(gen, dt, device, *size, scale=1.0):
    return (torch.randn(*size, generator=gen) * scale).to(dt).to(device)


def _rms_scale64(x64, eps):
    return torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


# gemv: y [M, NOUT] = epilogue(x [M, K] @ w^T); N in a shape is NOUT (F with silu_mul)

_GEMV_EPS = 1e-5
_GEMV_VARIANTS = {  # (norm, silu_mul, residual)
    "norm_silu": (True, True, False),   # gate/up: FlashNorm'd mlp_norm, SiLU(gate) * up
    "residual": (False, False, True),   # o_proj / down_proj onto the residual stream
}


def _draw_gemv(rng, small):
    # N 34000 at 33-64 rows: the unsplit deep-pipeline settings (64 or 128 columns)
    return {"M": rng.choice([1, 3, 8] if small else [1, 3, 8, 17, 64]),
            "N": rng.choice([80, 300] if small else [896, 2048, 5000, 34000]),
            "K": rng.choice([96, 200] if small else [1000, 2048, 4096])}


def _draw_gemv_splitk(rng, small):
    # on the GPU: few output columns, long K, so that the default settings split K
    # (checked by the runner; every pair here splits on a GPU of 46+ SMs)
    return {"M": rng.choice([1, 3, 8] if small else [1, 3, 8, 17, 64]),
            "N": rng.choice([80, 100] if small else [100, 512, 896]),
            "K": rng.choice([200, 333] if small else [2100, 4096, 4864])}


def _describe_gemv(s):
    return f"M{s['M']}-N{s['N']}-K{s['K']}"


def _build_gemv(variant):
    norm, silu, residual = _GEMV_VARIANTS[variant]

    def build(shape, dtype, device, gen):
        M, N, K = shape["M"], shape["N"], shape["K"]
        dt = _dtype(dtype)
        inp = {"x": _rnd(gen, dt, device, M, K),
               "w": _rnd(gen, dt, device, 2 * N if silu else N, K, scale=K ** -0.5),
               "norm_eps": _GEMV_EPS if norm else None, "silu_mul": silu,
               "residual": _rnd(gen, dt, device, M, N) if residual else None}
        return inp
    return build


def _gemv_run(split):
    def run(inp):
        from ..kernels import gemv as G
        from ..target import target_of
        x = inp["x"]
        M, K = x.shape
        N = inp["w"].shape[0] // (2 if inp["silu_mul"] else 1)
        settings = None
        if split:
            target = target_of(x.device)
            if target.backend == "interpreter":
                # the interpreter's defaults never split: 32-wide K tiles in 3 splits
                settings = G.GemvSettings(BLOCK_N=32, BLOCK_K=32, split_k=3,
                                          use_dot=M > G.FMA_MAX_M, num_warps=4, num_stages=1)
            elif G.default_settings(target, M=M, N=N, K=K, dtype=x.dtype,
                                    silu_mul=inp["silu_mul"]).split_k < 2:
                raise ValueError(f"M{M}-N{N}-K{K} does not split K on {target.name} with "
                                 f"{target.num_sms} SMs: this entry is the split-K path")
        return G.gemv(x, inp["w"], norm_eps=inp["norm_eps"], residual=inp["residual"],
                      silu_mul=inp["silu_mul"], settings=settings)
    return run


def _gemv_reference(inp):
    x64, w64 = inp["x"].double(), inp["w"].double()
    y = x64 @ w64.T
    if inp["norm_eps"] is not None:
        y = y * _rms_scale64(x64, inp["norm_eps"])
    if inp["silu_mul"]:
        F = w64.shape[0] // 2
        y = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
    if inp["residual"] is not None:
        y = y + inp["residual"].double()
    return y


def _gemv_torch(inp):
    """The peer: cuBLAS through F.linear, then the same epilogue in eager torch."""
    import torch.nn.functional as F
    x = inp["x"]
    y = F.linear(x, inp["w"])
    if inp["norm_eps"] is not None:
        y = y * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + inp["norm_eps"]).to(y.dtype)
    if inp["silu_mul"]:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    if inp["residual"] is not None:
        y = y + inp["residual"]
    return y


def _gemv_entry(name, variant, split=False):
    norm, silu, residual = _GEMV_VARIANTS[variant]
    if split:  # Qwen2.5-0.5B down_proj (hidden 896, FFN 4864): split in 2 on 132 SMs
        at = {"M": 1, "N": 896, "K": 4864}
        profile = ({"M": 1, "N": 896, "K": 4864}, {"M": 8, "N": 512, "K": 4096})
        # the first: one row, the FMA path's row fold over two K splits on sm_90
        sanitizer = ({"M": 1, "N": 100, "K": 2100}, {"M": 3, "N": 100, "K": 2100},
                     {"M": 17, "N": 100, "K": 1000})
    elif silu:  # Llama-3.2-1B gate/up (hidden 2048, FFN 8192); 8B for the profile
        at = {"M": 1, "N": 8192, "K": 2048}
        profile = ({"M": 1, "N": 14336, "K": 4096}, {"M": 8, "N": 14336, "K": 4096})
        # the first: one row, the FMA path's row fold on sm_90; the last: 33-64 rows
        # unsplit on sm_90 (64 columns, 3 stages)
        sanitizer = ({"M": 1, "N": 77, "K": 200}, {"M": 3, "N": 77, "K": 200},
                     {"M": 9, "N": 40, "K": 136}, {"M": 40, "N": 17000, "K": 128})
    else:  # Llama-3.2-1B down_proj; 8B for the profile
        at = {"M": 1, "N": 2048, "K": 8192}
        profile = ({"M": 1, "N": 4096, "K": 14336}, {"M": 8, "N": 4096, "K": 14336})
        # the first: one row, the FMA path's row fold (ragged N and K tiles); the fourth: 33-64
        # rows unsplit on sm_90 (128 columns, 8 warps, 4 stages)
        sanitizer = ({"M": 1, "N": 1990, "K": 1096}, {"M": 3, "N": 77, "K": 200},
                     {"M": 9, "N": 40, "K": 136}, {"M": 64, "N": 34000, "K": 128})
    run = RunSpec(draw_shape=_draw_gemv_splitk if split else _draw_gemv,
                  build=_build_gemv(variant), run=_gemv_run(split), reference=_gemv_reference,
                  dtypes=("bf16", "fp16"), interpreter_dtypes=("fp16", "fp32"),
                  baseline=_gemv_torch, baseline_name="torch F.linear (cuBLAS) + eager epilogue",
                  profile_shapes=profile, sanitizer_shapes=sanitizer, describe=_describe_gemv)
    kwargs = {**at, "dtype": "bf16", "norm": norm, "residual": residual, "silu_mul": silu,
              "pdl": _PDL_BY_TARGET}
    what = {"norm_silu": "FlashNorm + SiLU*up", "residual": "+ residual"}[variant]
    desc = (f"Triton decode GEMV {what}, M=1 N={at['N']} K={at['K']} bf16"
            + (", split-K (main kernel; the finish kernel runs in gates 3-7)" if split else ""))
    return name, "wsattn.kernels.gemv", "compile_spec", kwargs, run, desc, None


# qkv_rope: q [M, Hq, D] and k/v appended to a paged cache at each row's position

_QKV_PAGE = 16
_QKV_FAMILIES = {  # (bias, qk_norm, qk_norm over the whole projection); all with the
    "qwen3": (False, True, False),  # FlashNorm'd input norm
    "qwen2": (True, False, False),
    "olmoe": (False, True, True),  # two launches: gemv, then norm + RoPE + append
}


def _draw_qkv(rng, small):
    hkv = rng.choice([1, 2] if small else [1, 2, 4, 8])
    return {"M": rng.choice([1, 3] if small else [1, 3, 8, 17, 64]),
            "K": rng.choice([64, 96] if small else [512, 1040, 2048, 4096]),
            "Hq": hkv * rng.choice([1, 2] if small else [1, 2, 4]), "Hkv": hkv,
            "D": 64 if small else rng.choice([64, 128, 256]),
            "L": rng.choice([1, 17, 40] if small else [1, 17, 300, 2000])}


def _describe_qkv(s):
    return f"M{s['M']}-K{s['K']}-H{s['Hq']}-HKV{s['Hkv']}-D{s['D']}-L{s['L']}-paged"


def _build_qkv(family, fused=False, gemv_rope=False):
    bias, qk_norm, whole = _QKV_FAMILIES[family]

    def build(shape, dtype, device, gen):
        from ..rope import rope_inv_freq
        dt = _dtype(dtype)
        M, K, Hq, Hkv, D, L = (shape[k] for k in ("M", "K", "Hq", "Hkv", "D", "L"))
        N = (Hq + 2 * Hkv) * D
        per = math.ceil(L / _QKV_PAGE)
        pages = M * per + 3  # spare pages no row writes
        bt = torch.randperm(pages, generator=gen)[:M * per].to(torch.int32).view(M, per)
        pos = torch.randint(0, L, (M,), generator=gen, dtype=torch.int32)
        kc = torch.randn(pages, _QKV_PAGE, Hkv, D, generator=gen).to(dt)
        vc = torch.randn(pages, _QKV_PAGE, Hkv, D, generator=gen).to(dt)
        page, off = bt[torch.arange(M), pos.long() // _QKV_PAGE].long(), pos.long() % _QKV_PAGE
        kc[page, off] = float("nan")  # the slots the kernel must write: poisoned
        vc[page, off] = float("nan")
        inp = {"x": _rnd(gen, dt, device, M, K), "wqkv": _rnd(gen, dt, device, N, K, scale=K ** -0.5),
               "bqkv": _rnd(gen, dt, device, N, scale=0.5) if bias else None,
               "q_norm": (1 + 0.3 * torch.randn(Hq * D if whole else D, generator=gen)).to(dt)
               .to(device) if qk_norm else None,
               "k_norm": (1 + 0.3 * torch.randn(Hkv * D if whole else D, generator=gen)).to(dt)
               .to(device) if qk_norm else None, "qk_norm_whole": whole,
               "qk_eps": 1e-6 if qk_norm else None, "norm_eps": 1e-6,
               "inv_freq": rope_inv_freq(D, 1000000.0).to(device),
               "positions": pos.to(device), "block_table": bt.to(device),
               "k_cache": kc.to(device), "v_cache": vc.to(device),
               "page": page.to(device), "off": off.to(device), "Hq": Hq,
               "fused": fused, "gemv_rope": gemv_rope}
        # the cache before any launch: every element but the rows' slots must keep it
        inp["k_before"], inp["v_before"] = inp["k_cache"].clone(), inp["v_cache"].clone()
        keep = torch.ones(pages, _QKV_PAGE, dtype=torch.bool)
        keep[page, off] = False
        inp["keep"] = keep.to(device)
        return inp
    return build


def _qkv_outputs(q, k_cache, v_cache, inp):
    """(q, k written, v written, number of cache elements changed outside the slots)."""
    page, off, keep = inp["page"], inp["off"], inp["keep"]
    changed = sum(int((c.view(torch.int8) != b.view(torch.int8))[keep].sum())
                  for c, b in ((k_cache, inp["k_before"]), (v_cache, inp["v_before"])))
    return (q, k_cache[page, off], v_cache[page, off],
            torch.tensor([float(changed)], dtype=torch.float64))


def _qkv_call(inp):
    """The kernel call alone (what the profile gate times)."""
    from ..kernels.qkv_rope import GemvRopeSettings, fused_settings, qkv_rope_append
    from ..target import target_of
    settings = GemvRopeSettings() if inp.get("gemv_rope") else None
    if inp.get("fused"):  # the fused kernel, not the sm_90 default
        x = inp["x"]
        settings = fused_settings(target_of(x.device), rows=x.shape[0], hidden=x.shape[1],
                                  heads=inp["wqkv"].shape[0] // inp["k_cache"].shape[3],
                                  head_dim=inp["k_cache"].shape[3], dtype=x.dtype)
    return qkv_rope_append(inp["x"], inp["wqkv"], bqkv=inp["bqkv"], q_norm=inp["q_norm"],
                           k_norm=inp["k_norm"], norm_eps=inp["norm_eps"],
                           qk_eps=inp["qk_eps"], inv_freq=inp["inv_freq"],
                           positions=inp["positions"], k_cache=inp["k_cache"],
                           v_cache=inp["v_cache"], block_table=inp["block_table"],
                           qk_norm_whole=inp["qk_norm_whole"],
                           settings=settings)


def _qkv_run(inp):
    # the outputs include a host-side count of cache bytes changed outside the slots
    return _qkv_outputs(_qkv_call(inp), inp["k_cache"], inp["v_cache"], inp)


def _rope64(t, cos, sin):
    half = t.shape[-1] // 2
    rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)  # transformers' rotate_half
    return t * cos + rot * sin


def _qkv_reference(inp):
    """float64: FlashNorm scale, bias, RMSNorm per head (QK-norm) or over the whole q / k
    projection (OLMoE), RoPE over (i, i + D/2) with the fp32 angle position * inv_freq, as
    transformers computes q, k, v."""
    x = inp["x"].double()
    M, Hq = x.shape[0], inp["Hq"]
    Hkv, D = inp["k_cache"].shape[2], inp["k_cache"].shape[3]
    qkv = (x @ inp["wqkv"].double().T) * _rms_scale64(x, inp["norm_eps"])
    if inp["bqkv"] is not None:
        qkv = qkv + inp["bqkv"].double()
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if inp["qk_norm_whole"]:
        q = q * _rms_scale64(q, inp["qk_eps"]) * inp["q_norm"].double()
        k = k * _rms_scale64(k, inp["qk_eps"]) * inp["k_norm"].double()
    q, k, v = q.reshape(M, Hq, D), k.reshape(M, Hkv, D), v.reshape(M, Hkv, D)
    if inp["q_norm"] is not None and not inp["qk_norm_whole"]:
        q = q * _rms_scale64(q, inp["qk_eps"]) * inp["q_norm"].double()
        k = k * _rms_scale64(k, inp["qk_eps"]) * inp["k_norm"].double()
    ang = (inp["positions"].float()[:, None] * inp["inv_freq"][None, :]).double()
    emb = torch.cat((ang, ang), dim=-1)[:, None, :]  # [M, 1, D]
    q, k = _rope64(q, emb.cos(), emb.sin()), _rope64(k, emb.cos(), emb.sin())
    return q, k, v, torch.zeros(1, dtype=torch.float64)


def _qkv_torch(inp):
    """The peer: the same step in eager torch at the input dtype (F.linear, norms, RoPE,
    an index_put into the paged cache)."""
    import torch.nn.functional as F
    x, dt = inp["x"], inp["x"].dtype
    M, Hq = x.shape[0], inp["Hq"]
    Hkv, D = inp["k_cache"].shape[2], inp["k_cache"].shape[3]
    rs = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + inp["norm_eps"])
    qkv = F.linear(x, inp["wqkv"]) * rs.to(dt)  # the bias adds after the norm scale
    if inp["bqkv"] is not None:
        qkv = qkv + inp["bqkv"]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if inp["qk_norm_whole"]:
        q = F.rms_norm(q, (Hq * D,), inp["q_norm"], inp["qk_eps"])
        k = F.rms_norm(k, (Hkv * D,), inp["k_norm"], inp["qk_eps"])
    q, k, v = q.reshape(M, Hq, D), k.reshape(M, Hkv, D), v.reshape(M, Hkv, D)
    if inp["q_norm"] is not None and not inp["qk_norm_whole"]:
        q = F.rms_norm(q, (D,), inp["q_norm"], inp["qk_eps"])
        k = F.rms_norm(k, (D,), inp["k_norm"], inp["qk_eps"])
    ang = inp["positions"].float()[:, None] * inp["inv_freq"][None, :]
    emb = torch.cat((ang, ang), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    q, k = _rope64(q, cos, sin), _rope64(k, cos, sin)
    inp["k_cache"][inp["page"], inp["off"]] = k
    inp["v_cache"][inp["page"], inp["off"]] = v
    return q


def _qkv_entry(name, family, fused=False, gemv_rope=False):
    bias, qk_norm, whole = _QKV_FAMILIES[family]
    if family == "qwen3":  # Qwen3-8B: hidden 4096, 32 q heads, 8 kv heads, D 128
        at = {"hidden": 4096, "q_heads": 32, "kv_heads": 8}
        profile = ({"M": 1, "K": 4096, "Hq": 32, "Hkv": 8, "D": 128, "L": 4096},
                   {"M": 8, "K": 4096, "Hq": 32, "Hkv": 8, "D": 128, "L": 4096})
    elif family == "olmoe":  # OLMoE-1B-7B: hidden 2048, 16 q heads, 16 kv heads, D 128
        at = {"hidden": 2048, "q_heads": 16, "kv_heads": 16}
        profile = ({"M": 1, "K": 2048, "Hq": 16, "Hkv": 16, "D": 128, "L": 4096},
                   {"M": 8, "K": 2048, "Hq": 16, "Hkv": 16, "D": 128, "L": 4096})
    else:  # Qwen2.5-7B: hidden 3584, 28 q heads, 4 kv heads, D 128
        at = {"hidden": 3584, "q_heads": 28, "kv_heads": 4}
        profile = ({"M": 1, "K": 3584, "Hq": 28, "Hkv": 4, "D": 128, "L": 4096},
                   {"M": 8, "K": 3584, "Hq": 28, "Hkv": 4, "D": 128, "L": 4096})
    run = RunSpec(draw_shape=_draw_qkv, build=_build_qkv(family, fused, gemv_rope),
                  run=_qkv_run, timed=_qkv_call, reference=_qkv_reference, dtypes=("bf16", "fp16"),
                  interpreter_dtypes=("fp16", "fp32"), baseline=_qkv_torch,
                  baseline_name="torch eager (F.linear, norms, RoPE, index_put), input dtype",
                  profile_shapes=profile,
                  # K 512 / 1024 split K in 2 on the GPU (counters, fence, last-arriving sum;
                  # on the GEMV-epilogue path the finish kernel, two row blocks at 17 rows)
                  sanitizer_shapes=({"M": 3, "K": 512, "Hq": 4, "Hkv": 2, "D": 128, "L": 40},
                                    {"M": 1, "K": 1024, "Hq": 2, "Hkv": 1, "D": 64, "L": 1},
                                    {"M": 17, "K": 1024, "Hq": 2, "Hkv": 1, "D": 64, "L": 40}),
                  describe=_describe_qkv)
    kwargs = {"head_dim": 128, "dtype": "bf16", **at, "norm": True, "bias": bias,
              "qk_norm": qk_norm and not whole, "paged": True, "page_size": _QKV_PAGE,
              "pdl": _PDL_BY_TARGET}
    if whole:  # gates 0-2 read the second launch, the norm + RoPE + append kernel
        kwargs["qk_norm_whole"] = True
    if fused:  # the fused kernel with its own settings (not sm_90's default)
        kwargs["fused"] = True
    if gemv_rope:  # the GEMV-epilogue path at every shape (sm_90's default picks by grid)
        from ..kernels.qkv_rope import GemvRopeSettings
        kwargs["settings"] = GemvRopeSettings()
    norm = "QK-norm" if qk_norm else "bias"
    if whole:
        what = "whole-projection QK-norm (gemv, then norm + RoPE + paged append)"
    elif fused:
        what = f"fused QKV + {norm} + RoPE + paged append"
    elif gemv_rope:
        what = "QKV GEMV with bias, RoPE and the paged append in its epilogue"
    else:  # the path default_settings picks: on sm_90 the GEMV epilogue or two launches
        what = f"QKV + {norm} + RoPE + paged append (the default path)"
    desc = (f"Triton {what} "
            f"({family}, K={at['hidden']} Hq={at['q_heads']} Hkv={at['kv_heads']} D=128 bf16)")
    return name, "wsattn.kernels.qkv_rope", "compile_spec", kwargs, run, desc, None


# moe: the whole block, route -> group -> gate_up -> down + combine, through moe()

_MOE_E, _MOE_K, _MOE_EPS = 16, 4, 1e-6


def _draw_moe(rng, small):
    return {"T": rng.choice([1, 3, 8] if small else [1, 3, 8, 33, 64]),
            "H": rng.choice([64, 96] if small else [1000, 2048]),
            "F": rng.choice([24, 40] if small else [200, 768])}


def _describe_moe(s):
    return f"T{s['T']}-H{s['H']}-F{s['F']}-E{_MOE_E}-top{_MOE_K}"


def _build_moe(shape, dtype, device, gen):
    T, H, F = shape["T"], shape["H"], shape["F"]
    dt = _dtype(dtype)
    return {"x": _rnd(gen, dt, device, T, H),
            "router_w": _rnd(gen, dt, device, _MOE_E, H, scale=H ** -0.5),
            "w_gate_up": _rnd(gen, dt, device, _MOE_E, 2 * F, H, scale=H ** -0.5),
            "w_down": _rnd(gen, dt, device, _MOE_E, H, F, scale=F ** -0.5),
            "residual": _rnd(gen, dt, device, T, H)}


def _moe_run(inp, impl="triton"):
    from ..kernels.moe import moe
    return moe(inp["x"], inp["router_w"], inp["w_gate_up"], inp["w_down"], top_k=_MOE_K,
               renormalize=True, norm_eps=_MOE_EPS, residual=inp["residual"], impl=impl)


def _moe_reference(inp):
    """float64 Qwen3-MoE block: RMSNorm (folded), softmax router, the top 4 by a stable
    descending sort, renormalised; residual + sum of w_j * down(silu(gate) * up)."""
    x = inp["x"].double()
    xn = x * _rms_scale64(x, _MOE_EPS)
    p = torch.softmax(xn @ inp["router_w"].double().T, dim=-1)
    w, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    w, ids = w[:, :_MOE_K], ids[:, :_MOE_K]
    w = w / w.sum(-1, keepdim=True)
    return _add_experts(inp["residual"].double().clone(), xn, w, ids, inp)


def _add_experts(out, xn, w, ids, inp):
    """out += each token's chosen experts' w * down(silu(gate) * up) [T, k] (ids, w), in
    xn's dtype (the expert weights cast to it), one index_add_ an expert, ascending."""
    dt, F = xn.dtype, inp["w_down"].shape[2]
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = xn[t] @ inp["w_gate_up"][e].to(dt).T
        y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ inp["w_down"][e].to(dt).T
        out.index_add_(0, t, (w[t, j, None] * y).to(out.dtype))
    return out


def _moe_torch(inp):
    """The peer: transformers' eager Qwen3-MoE block at the input dtype (fp32 router
    softmax, torch.topk, a loop over the touched experts; the host reads which ones)."""
    import torch.nn.functional as F
    x, dt = inp["x"], inp["x"].dtype
    xn = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + _MOE_EPS)).to(dt)
    p = torch.softmax(F.linear(xn, inp["router_w"]).float(), dim=-1)
    w, ids = torch.topk(p, _MOE_K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dt)
    return _add_experts(inp["residual"].clone(), xn, w, ids, inp)


def _draw_moe_token(rng, small):
    return {**_draw_moe(rng, small), "T": 1}


def _moe_token_run(inp):
    """One token as the decode step's bucket 1 runs it: router logits, no grouping kernel,
    the top-k inside the grouped gate/up launch, then down + combine."""
    from ..kernels import moe as M
    x = inp["x"]
    rt = M.route_logits(x, inp["router_w"], top_k=_MOE_K, renormalize=True, norm_eps=_MOE_EPS)
    from ..target import target_of
    block = M.default_settings(target_of(x.device), T=1, top_k=_MOE_K, num_experts=_MOE_E,
                               dtype=x.dtype).block
    g = M.one_token_grouping(rt.ids, _MOE_E, block, M.one_token_tables(_MOE_K, block, x.device))
    act = M.moe_gate_up(x, inp["w_gate_up"], g, norm_eps=_MOE_EPS, route=rt)
    return M.moe_down_combine(act, inp["w_down"], g, rt.weights, residual=inp["residual"])


def _moe_gluon_builds(shape):
    """The Gluon builds moe(impl="gluon") launches for a shape: gate/up and down, each with
    the block and settings its T picks (compile_spec's defaults for T, E and top_k)."""
    return [{"kernel": kernel, "T": shape["T"], "H": shape["H"], "F": shape["F"]}
            for kernel in ("gate_up", "down")]


def _moe_token_entry():
    """One token through route_logits + moe_gate_up(route=): the top-k selected inside
    the grouped gate/up launch (the decode step's bucket-1 path)."""
    run = RunSpec(draw_shape=_draw_moe_token, build=_build_moe, run=_moe_token_run,
                  reference=_moe_reference, dtypes=("bf16", "fp16"),
                  interpreter_dtypes=("fp16", "fp32"), baseline=_moe_torch,
                  baseline_name="torch eager MoE block (transformers-style)",
                  profile_shapes=({"T": 1, "H": 2048, "F": 768},),
                  sanitizer_shapes=({"T": 1, "H": 136, "F": 40}, {"T": 1, "H": 64, "F": 48}),
                  describe=_describe_moe)
    kwargs = {"kernel": "gate_up", "T": 1, "H": 2048, "E": _MOE_E, "top_k": _MOE_K, "F": 768,
              "dtype": "bf16", "norm": True, "route": True, "renormalize": True,
              "pdl": _PDL_BY_TARGET}
    return ("moe_token", "wsattn.kernels.moe", "compile_spec", kwargs, run,
            f"MoE block for one token, the top-k inside the grouped gate/up launch "
            f"(router logits, gate/up, down + combine), E={_MOE_E} top {_MOE_K}, H=2048 "
            f"F=768 bf16; gates 0-2 on that gate/up build", None)


def _moe_entry(name="moe", impl="triton"):
    """The MoE block through moe(impl=...): "triton" (every target) or "gluon" (the sm_90
    warp-specialized grouped gate/up and down; route, group and combine stay Triton)."""
    gluon = impl == "gluon"
    run = RunSpec(draw_shape=_draw_moe, build=_build_moe,
                  run=functools.partial(_moe_run, impl=impl), reference=_moe_reference,
                  dtypes=("bf16", "fp16"), interpreter_dtypes=("fp16", "fp32"),
                  interpreter=not gluon,
                  baseline=_moe_torch, baseline_name="torch eager MoE block (transformers-style)",
                  profile_shapes=({"T": 1, "H": 2048, "F": 768}, {"T": 8, "H": 2048, "F": 768}),
                  # T 3 and T 33: blocks of 16 (tl.dot), the default block at both
                  sanitizer_shapes=({"T": 3, "H": 136, "F": 40}, {"T": 33, "H": 64, "F": 48}),
                  sanitizer_builds=_moe_gluon_builds if gluon else None,
                  describe=_describe_moe)
    # gates 0-2 read the grouped gate/up kernel (the weight stream); gates 3-7 run all five
    kwargs = {"kernel": "gate_up", "T": 1, "H": 2048, "E": _MOE_E, "top_k": _MOE_K, "F": 768,
              "dtype": "bf16", "norm": True}
    if not gluon:
        kwargs.update(residual=True, renormalize=True, pdl=_PDL_BY_TARGET)
    what = "Gluon warp-specialized grouped gate/up and down" if gluon else "Triton"
    return (name, f"wsattn.kernels.moe{'_gluon' if gluon else ''}", "compile_spec", kwargs, run,
            f"MoE block, {what} (route, group, gate/up, down + combine), E={_MOE_E} top "
            f"{_MOE_K}, H=2048 F=768 bf16; gates 0-2 on the grouped gate/up kernel",
            (90,) if gluon else None)


# moe with DeepSeek-V3 / dots1 routing: sigmoid scores, a score-correction bias for the
# choice, 4 groups of 4 experts with the 2 best kept, top 4 renormalised and scaled

_DS_GROUPS, _DS_TOPK_GROUPS, _DS_SCALE = 4, 2, 2.5


def _build_moe_ds(shape, dtype, device, gen):
    inp = _build_moe(shape, dtype, device, gen)
    # float32 whatever the model dtype (as transformers keeps e_score_correction_bias);
    # large enough to move choices against sigmoid scores of spread ~0.25
    inp["score_bias"] = _rnd(gen, torch.float32, device, _MOE_E, scale=0.1)
    return inp


def _ds_kwargs(inp):
    return dict(top_k=_MOE_K, renormalize=True, norm_eps=_MOE_EPS, scoring="sigmoid",
                score_bias=inp["score_bias"], groups=_DS_GROUPS,
                topk_groups=_DS_TOPK_GROUPS, scale=_DS_SCALE)


def _moe_ds_run(inp):
    from ..kernels.moe import moe
    return moe(inp["x"], inp["router_w"], inp["w_gate_up"], inp["w_down"],
               residual=inp["residual"], **_ds_kwargs(inp))


def _moe_ds_token_run(inp):
    """One token as the decode step's bucket 1 runs it, the top-k inside gate/up."""
    from ..kernels import moe as M
    from ..target import target_of
    x = inp["x"]
    rt = M.route_logits(x, inp["router_w"], **_ds_kwargs(inp))
    block = M.default_settings(target_of(x.device), T=1, top_k=_MOE_K, num_experts=_MOE_E,
                               dtype=x.dtype).block
    g = M.one_token_grouping(rt.ids, _MOE_E, block, M.one_token_tables(_MOE_K, block, x.device))
    act = M.moe_gate_up(x, inp["w_gate_up"], g, norm_eps=_MOE_EPS, route=rt)
    return M.moe_down_combine(act, inp["w_down"], g, rt.weights, residual=inp["residual"])


def _ds_route64(logits64, bias):
    """DeepSeek-V3 routing in float64 with the kernels' tie rule (stable sorts: the lower
    expert, the lower group first): (weights [T, k], ids [T, k])."""
    from ..models.moe import choice_keys, sigmoid_weights
    s = torch.sigmoid(logits64)
    keys = choice_keys(s, bias, _DS_GROUPS, _DS_TOPK_GROUPS, stable=True)
    ids = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, :_MOE_K]
    return sigmoid_weights(s, ids, True, _DS_SCALE), ids


def _moe_ds_block(inp, dt):
    """The block at dt (float64 for the reference, the input dtype for the torch
    baseline): RMSNorm (folded), DeepSeek-V3 routing, residual + the chosen experts."""
    wide = torch.float64 if dt == torch.float64 else torch.float32
    x = inp["x"].to(wide)
    xn = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _MOE_EPS)).to(dt)
    logits = xn.to(wide) @ inp["router_w"].to(wide).T  # float32 at least, as transformers
    w, ids = _ds_route64(logits.double(), inp["score_bias"])
    return _add_experts(inp["residual"].to(dt).clone(), xn, w.to(wide), ids, inp)


def _moe_ds_entry(name, token):
    """moe() (or, token, the bucket-1 path: route_logits + the top-k inside gate/up) with
    DeepSeek-V3 routing; gates 0-2 on the build that holds the routing: the route kernel,
    or the route= gate/up kernel."""
    run = RunSpec(draw_shape=_draw_moe_token if token else _draw_moe, build=_build_moe_ds,
                  run=_moe_ds_token_run if token else _moe_ds_run,
                  reference=lambda inp: _moe_ds_block(inp, torch.float64),
                  dtypes=("bf16", "fp16"), interpreter_dtypes=("fp16", "fp32"),
                  baseline=lambda inp: _moe_ds_block(inp, inp["x"].dtype),
                  baseline_name="torch eager MoE block (DeepSeek-V3 routing)",
                  profile_shapes=({"T": 1, "H": 2048, "F": 768},) if token else
                  ({"T": 1, "H": 2048, "F": 768}, {"T": 8, "H": 2048, "F": 768}),
                  sanitizer_shapes=({"T": 1, "H": 136, "F": 40}, {"T": 1, "H": 64, "F": 48})
                  if token else
                  ({"T": 3, "H": 136, "F": 40}, {"T": 33, "H": 64, "F": 48}),
                  describe=_describe_moe)
    kwargs = {"kernel": "gate_up" if token else "route", "T": 1 if token else 8, "H": 2048,
              "E": _MOE_E, "top_k": _MOE_K, "F": 768, "dtype": "bf16", "norm": True,
              "route": token, "renormalize": True, "scoring": "sigmoid", "score_bias": True,
              "groups": _DS_GROUPS, "topk_groups": _DS_TOPK_GROUPS, "pdl": _PDL_BY_TARGET}
    what = ("for one token, the top-k inside the grouped gate/up launch" if token
            else "(route, group, gate/up, down + combine)")
    return (name, "wsattn.kernels.moe", "compile_spec", kwargs, run,
            f"MoE block {what} with DeepSeek-V3 routing (sigmoid, score bias, "
            f"{_DS_GROUPS} groups {_DS_TOPK_GROUPS} kept, scale {_DS_SCALE}), E={_MOE_E} top "
            f"{_MOE_K}, H=2048 F=768 bf16; gates 0-2 on the "
            f"{'route= gate/up' if token else 'route'} build", None)


# argmax: greedy decoding's two-stage argmax over the vocabulary (kernels/argmax.py)

def _draw_argmax(rng, small):
    if small:  # the interpreter: a few chunks at most
        return {"B": rng.choice([1, 2, 3]), "V": rng.choice([1, 5, 4096, 4097, 9000])}
    return {"B": rng.choice([1, 2, 7, 8, 33, 64]),
            "V": rng.choice([1, 17, 4096, 4097, 32000, 128256, 151936, rng.randint(2, 200000)])}


def _build_argmax(shape, dtype, device, gen):
    """Random logits with the cases the rule is about planted in some rows: a value tied
    in two chunks (the lower index must win), NaNs (the first one wins), a row of -inf."""
    B, V = shape["B"], shape["V"]
    x = torch.randn(B, V, generator=gen)
    for b in range(B):
        kind = b % 4
        if kind == 1 and V > 1:  # a tie across the row: the lower index wins
            i, j = sorted(torch.randint(0, V, (2,), generator=gen).tolist())
            x[b, i] = x[b, j] = 50.0
        elif kind == 2:  # NaN beats everything, first one wins
            x[b, torch.randint(0, V, (2,), generator=gen)] = float("nan")
        elif kind == 3 and b % 8 == 7:
            x[b] = float("-inf")
    return {"logits": x.to(_dtype(dtype)).to(device)}


def _argmax_onehot(idx, V):
    # compared as a one-hot [B, V]: one wrong row is an error of at least sqrt(2 / B)
    # (>= 0.17 at 64 rows), far above any tolerance, where the indices' own relative
    # error could hide an off-by-one
    return torch.nn.functional.one_hot(idx.long(), V).double()


def _argmax_run(inp):
    from ..kernels.argmax import argmax
    x = inp["logits"]
    return _argmax_onehot(argmax(x), x.shape[1])


def _argmax_call(inp):
    from ..kernels.argmax import argmax
    return argmax(inp["logits"])


def _argmax_reference(inp):
    x = inp["logits"].double()  # exact upcast: the same order, the same NaNs
    return _argmax_onehot(x.argmax(-1), x.shape[1])


def _argmax_entry():
    run = RunSpec(draw_shape=_draw_argmax, build=_build_argmax, run=_argmax_run,
                  timed=_argmax_call, reference=_argmax_reference,
                  dtypes=("bf16", "fp16", "fp32"), interpreter_dtypes=("fp16", "fp32"),
                  baseline=lambda inp: inp["logits"].argmax(-1),
                  baseline_name="torch argmax(-1)",
                  profile_shapes=({"B": 1, "V": 128256}, {"B": 8, "V": 151936}),
                  sanitizer_shapes=({"B": 3, "V": 4097}, {"B": 1, "V": 17}),
                  describe=lambda sh: f"B{sh['B']}-V{sh['V']}")
    return ("argmax", "wsattn.kernels.argmax", "compile_spec", {"dtype": "bf16"}, run,
            "Triton greedy argmax, two stages (4096-entry chunks, then the chunks), bf16",
            None)


# --------------------------------------------------------------------------- registry

ENTRIES = (
    _prefill_entry("prefill_triton", "wsattn.kernels.prefill_triton"),
    _prefill_entry("prefill_triton_causal", "wsattn.kernels.prefill_triton", causal=True),
    _prefill_entry("prefill_triton_varlen", "wsattn.kernels.prefill_triton", varlen=True),
    _paged_entry(),
    _paged_entry("gather"),
    _paged_entry("gluon"),
    _paged_entry("gluon_one_consumer"),
    _paged_append_entry(),
    _decode_entry("decode_triton", paged=False),
    _decode_entry("decode_triton_paged", paged=True),
    _decode_entry("decode_triton_paged64", paged=True, page=64),
    _merge_entry(),
    _prefill_entry("prefill_gluon", "wsattn.kernels.prefill_gluon", impl="gluon", only_ccs=(90,)),
    _prefill_entry("prefill_gluon_causal", "wsattn.kernels.prefill_gluon", causal=True, impl="gluon",
                   only_ccs=(90,)),
    _prefill_entry("prefill_gluon_varlen", "wsattn.kernels.prefill_gluon", varlen=True, impl="gluon",
                   only_ccs=(90,)),
    _prefill_entry("prefill_gluon_varlen_plain", "wsattn.kernels.prefill_gluon", varlen=True,
                   impl="gluon", only_ccs=(90,), plain=True),
    _prefill_entry("prefill_gluon_varlen_one_consumer", "wsattn.kernels.prefill_gluon",
                   causal=True, varlen=True, impl="gluon", only_ccs=(90,), one_consumer=True),
    _gemv_entry("gemv_norm_silu", "norm_silu"),
    _gemv_entry("gemv_residual", "residual"),
    _gemv_entry("gemv_splitk", "residual", split=True),
    _qkv_entry("qkv_rope_qwen3", "qwen3"),
    _qkv_entry("qkv_rope_qwen2", "qwen2"),
    _qkv_entry("qkv_rope_olmoe", "olmoe"),
    _qkv_entry("qkv_rope_fused", "qwen3", fused=True),
    _qkv_entry("qkv_rope_gemv", "qwen2", gemv_rope=True),
    _moe_entry(),
    _moe_entry("moe_gluon", impl="gluon"),
    _moe_token_entry(),
    _moe_ds_entry("moe_deepseek", token=False),
    _moe_ds_entry("moe_token_deepseek", token=True),
    _argmax_entry(),
)
NAMES = tuple(e[0] for e in ENTRIES)


def _compile_spec_of(module, func, kwargs, only_ccs):
    def compile_spec(cc, **overrides):  # overrides: another build, e.g. head_dim=64
        if only_ccs and cc not in only_ccs:
            raise UnsupportedTarget(f"no code path for sm_{cc}: this kernel targets "
                                    f"{', '.join(f'sm_{c}' for c in only_ccs)} only")
        args = {k: v.fn(cc) if isinstance(v, _ByTarget) else v for k, v in {**kwargs, **overrides}.items()}
        return getattr(importlib.import_module(module), func)(cc, **args)
    return compile_spec


class UnsupportedTarget(Exception):
    """A kernel with no code path for a target (reported as a failed compile gate)."""


def get(name: str) -> KernelSpec:
    """The library kernel ``name``; unavailable (with the reason) if it cannot be found."""
    origin = {"kind": "library", "name": name}
    entry = next((e for e in ENTRIES if e[0] == name), None)
    if entry is None:
        return unavailable(name, f"unknown kernel {name!r}: library kernels are {', '.join(NAMES)}, "
                                 "or give module:function", origin)
    _, module, func, kwargs, run, desc, only_ccs = entry
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        return unavailable(name, f"not available: cannot import {module} ({type(e).__name__}: {e})", origin)
    if not callable(getattr(mod, func, None)):
        return unavailable(name, f"not available: {module} has no {func}() yet", origin)
    return KernelSpec(name=name, compile_spec=_compile_spec_of(module, func, kwargs, only_ccs), run=run,
                      origin=origin, description=desc)


def all_specs() -> list:
    return [get(n) for n in NAMES]
