"""The library's own kernels, registered by name for the ladder and the card ledger.

Each entry calls a kernel module's ``compile_spec(cc, ...)`` for gates 0-2 and runs the
public API (``wsattn.attention(..., impl="triton")``, ``wsattn.decode``,
``wsattn.merge_states``) against ``wsattn.reference`` for gates 3-7. Registration is
defensive: a kernel module or function that is missing gives a spec marked unavailable
(a failed gate 1 naming the reason), never an import error.
"""

from __future__ import annotations

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


def _describe_prefill(shape):
    s = shape
    seq = (f"Sq{'+'.join(map(str, s['Sq']))}-Sk{'+'.join(map(str, s['Sk']))}" if isinstance(s["Sq"], list)
           else f"B{s['B']}-Sq{s['Sq']}-Sk{s['Sk']}")
    return f"{seq}-H{s['Hq']}-HKV{s['Hkv']}-D{s['D']}"


def _build_prefill(shape, dtype, device, gen):
    dt = _dtype(dtype)
    rnd = lambda *sz: torch.randn(*sz, generator=gen).to(dt).to(device)
    s = shape
    if isinstance(s["Sq"], list):
        cq = torch.tensor([0] + list(_cumsum(s["Sq"])), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + list(_cumsum(s["Sk"])), dtype=torch.int32, device=device)
        return {"q": rnd(sum(s["Sq"]), s["Hq"], s["D"]), "k": rnd(sum(s["Sk"]), s["Hkv"], s["D"]),
                "v": rnd(sum(s["Sk"]), s["Hkv"], s["D"]), "cu_q": cq, "cu_k": ck}
    return {"q": rnd(s["B"], s["Sq"], s["Hq"], s["D"]), "k": rnd(s["B"], s["Sk"], s["Hkv"], s["D"]),
            "v": rnd(s["B"], s["Sk"], s["Hkv"], s["D"])}


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def _prefill_runner(causal, impl):
    def run(inp):
        import wsattn
        if impl == "gluon":
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


# Sanitizers slow kernels 10-100x: two small shapes, odd lengths (not multiples of a tile,
# S = 1), GQA, and both head dims (the Gluon kernel is a different build at D=64).
_SANITIZER_PREFILL = {
    False: ({"B": 1, "Sq": 17, "Sk": 40, "Hq": 4, "Hkv": 2, "D": 128},
            {"B": 2, "Sq": 1, "Sk": 127, "Hq": 2, "Hkv": 1, "D": 64}),
    True: ({"Sq": [17, 1], "Sk": [40, 1], "Hq": 4, "Hkv": 2, "D": 128},
           {"Sq": [127], "Sk": [127], "Hq": 2, "Hkv": 1, "D": 64}),
}


def _prefill_entry(name, module, causal=False, varlen=False, impl="triton", only_ccs=None):
    kwargs = {"head_dim": 128, "dtype": "bf16", "causal": causal}
    if varlen:
        kwargs["varlen"] = True
    run = RunSpec(draw_shape=_draw_prefill(causal, varlen, 128), build=_build_prefill,
                  run=_prefill_runner(causal, impl), reference=_prefill_reference(causal),
                  dtypes=("bf16", "fp16"), interpreter=impl == "triton",
                  baseline=None if varlen else _sdpa_prefill(causal),
                  baseline_name=None if varlen else "torch SDPA (cuDNN/flash)",
                  profile_shapes=() if varlen else (
                      {"B": 4, "Sq": 4096, "Sk": 4096, "Hq": 16, "Hkv": 16, "D": 128},),
                  sanitizer_shapes=_SANITIZER_PREFILL[varlen], describe=_describe_prefill)
    desc = f"{'Gluon' if impl == 'gluon' else 'Triton'} prefill, D=128 bf16" + \
        (", causal" if causal else "") + (", varlen" if varlen else "")
    return name, module, "compile_spec", kwargs, run, desc, only_ccs


# --------------------------------------------------------------------------- decode

def _draw_decode(paged, head_dim):
    def draw(rng, small):
        hkv = rng.choice([1, 2])
        group = rng.choice([1, 4] if small else [1, 4, 8])
        lens = [1, 17, 60] if small else [1, 17, 127, 300, 2000]
        B = rng.choice([1, 2, 3])
        return {"B": B, "L": [rng.choice(lens) for _ in range(B)], "Hq": hkv * group, "Hkv": hkv,
                "D": 64 if small else head_dim, "paged": paged}
    return draw


def _describe_decode(s):
    return f"B{s['B']}-L{'+'.join(map(str, s['L']))}-H{s['Hq']}-HKV{s['Hkv']}-D{s['D']}" + \
        ("-paged" if s["paged"] else "")


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
    page = 16
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


def _decode_entry(name, paged):
    run = RunSpec(draw_shape=_draw_decode(paged, 128), build=_build_decode, run=_decode_run,
                  reference=_decode_reference, dtypes=("bf16", "fp16"), baseline=_sdpa_decode,
                  baseline_name="torch SDPA" + (" (contiguous cache)" if paged else ""),
                  profile_shapes=({"B": 8, "L": [65536] * 8, "Hq": 32, "Hkv": 8, "D": 128, "paged": paged},),
                  sanitizer_shapes=({"B": 2, "L": [17, 60], "Hq": 4, "Hkv": 1, "D": 128, "paged": paged},
                                    {"B": 1, "L": [1], "Hq": 2, "Hkv": 2, "D": 64, "paged": paged}),
                  describe=_describe_decode)
    return (name, "wsattn.kernels.decode_triton", "compile_spec",
            {"head_dim": 128, "dtype": "bf16", "paged": paged}, run,
            f"Triton split-KV decode, D=128 bf16{', paged' if paged else ''}", None)


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
    run = RunSpec(draw_shape=_draw_merge, build=_build_merge, run=_merge_run, reference=_merge_reference,
                  dtypes=("bf16", "fp16", "fp32"), interpreter_dtypes=("fp16", "fp32"),
                  baseline=_merge_eager, baseline_name="torch eager (fp32)",
                  profile_shapes=({"P": 8, "N": 32768, "D": 128},),
                  sanitizer_shapes=({"P": 3, "N": 17, "D": 128}, {"P": 1, "N": 1, "D": 64}),
                  describe=lambda s: f"P{s['P']}-N{s['N']}-D{s['D']}")
    return ("merge_states", "wsattn.kernels.merge", "compile_spec", {"head_dim": 128, "dtype": "bf16"},
            run, "LSE merge of partial states, D=128 bf16", None)


# --------------------------------------------------------------------------- registry

ENTRIES = (
    _prefill_entry("prefill_triton", "wsattn.kernels.prefill_triton"),
    _prefill_entry("prefill_triton_causal", "wsattn.kernels.prefill_triton", causal=True),
    _prefill_entry("prefill_triton_varlen", "wsattn.kernels.prefill_triton", varlen=True),
    _decode_entry("decode_triton", paged=False),
    _decode_entry("decode_triton_paged", paged=True),
    _merge_entry(),
    _prefill_entry("prefill_gluon", "wsattn.kernels.prefill_gluon", impl="gluon", only_ccs=(90,)),
    _prefill_entry("prefill_gluon_causal", "wsattn.kernels.prefill_gluon", causal=True, impl="gluon",
                   only_ccs=(90,)),
)
NAMES = tuple(e[0] for e in ENTRIES)


def _compile_spec_of(module, func, kwargs, only_ccs):
    def compile_spec(cc, **overrides):  # overrides: another build, e.g. head_dim=64
        if only_ccs and cc not in only_ccs:
            raise UnsupportedTarget(f"no code path for sm_{cc}: this kernel targets "
                                    f"{', '.join(f'sm_{c}' for c in only_ccs)} only")
        return getattr(importlib.import_module(module), func)(cc, **{**kwargs, **overrides})
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
