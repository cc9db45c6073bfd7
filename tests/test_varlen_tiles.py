"""The varlen tile table (wsattn.kernels.varlen_tiles): the kernel through the interpreter
against a Python enumeration of the same order, on packs with empty sequences, sequences
shorter than a row block, more sequences than one program reads at a time and tile
counts that do not fill the last program; the bound and the code range."""

from __future__ import annotations

import json

import pytest

from conftest import interpreter_child
from wsattn.kernels import varlen_tiles as vt


def reference(lengths, hq, block_m, causal, n_tiles, longest_first=False, keys=None):
    """(sequence per tile, code per tile): sequence by sequence (longest_first: by key
    count, keys or else the lengths, most first, ties in pack order), its heads in turn, a
    head's row blocks fastest (causal: the last first); -1 / 0 for the spares."""
    seqs, codes = [], []
    order = range(len(lengths))
    keys = lengths if keys is None else keys
    if longest_first:
        order = sorted(order, key=lambda b: (-keys[b], b))
    for b in order:
        n = lengths[b]
        nb = -(-n // block_m)
        for h in range(hq):
            for r in range(nb):
                seqs.append(b)
                codes.append(h * vt.CODE_BASE + (nb - 1 - r if causal else r))
    assert len(seqs) <= n_tiles
    spare = n_tiles - len(seqs)
    return seqs + [-1] * spare, codes + [0] * spare


PACKS = {  # name: (lengths, Hq, BLOCK_M)
    "mixed": ([225, 3851, 64, 1000, 700, 128, 129, 0, 5, 2048], 4, 128),
    "empty-first-and-last": ([0, 300, 0, 0, 17, 0], 3, 192),
    "one-sequence": ([1000], 2, 128),
    "all-empty": ([0, 0, 0], 2, 128),
    "many-short": ([(7 * i) % 200 for i in range(150)], 2, 64),  # > SEQS at a time
    "single-tokens": ([1] * 70, 1, 128),
}

CHILD = r"""
import json, sys
import torch
from wsattn.kernels import varlen_tiles as vt
packs = json.loads(sys.argv[1])
out = {}
for name, (lengths, hq, bm) in packs.items():
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    for causal in (False, True):
        n = hq * vt.tile_bound(sum(lengths), len(lengths), bm, max(lengths))
        t = vt.varlen_tile_table(cu, n, hq, bm, causal)
        out[f"{name}-{causal}"] = {"n": n, "seq": t[0].tolist(), "code": t[1].tolist()}
        t = vt.varlen_tile_table(cu, n, hq, bm, causal, longest_first=True)
        out[f"{name}-{causal}-longest"] = {"n": n, "seq": t[0].tolist(),
                                           "code": t[1].tolist()}
        # with keys of their own (a cached prefix, reversed so that the order changes)
        keys = [3 * x + 7 * (len(lengths) - i) for i, x in enumerate(lengths)]
        cu_k = torch.tensor([0] + keys, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        t = vt.varlen_tile_table(cu, n, hq, bm, causal, longest_first=True, cu_seqlens_k=cu_k)
        out[f"{name}-{causal}-keys"] = {"n": n, "seq": t[0].tolist(), "code": t[1].tolist(),
                                        "keys": keys}
        # the same keys as counts (the paged build's seqlens_k), not their running sum
        t = vt.varlen_tile_table(cu, n, hq, bm, causal, longest_first=True,
                                 cu_seqlens_k=torch.tensor(keys, dtype=torch.int32),
                                 key_counts=True)
        out[f"{name}-{causal}-counts"] = {"seq": t[0].tolist(), "code": t[1].tolist()}
print("RESULT " + json.dumps(out))
"""


def test_table_kernel_equals_the_enumeration():
    """Both orders (pack order, and longest_first: the same tiles, sequences by length)
    against the Python enumeration."""
    got = interpreter_child(CHILD, json.dumps(PACKS), timeout=300)
    for name, (lengths, hq, bm) in PACKS.items():
        for causal in (False, True):
            for longest in (False, True):
                r = got[f"{name}-{causal}" + ("-longest" if longest else "")]
                seqs, codes = reference(lengths, hq, bm, causal, r["n"], longest)
                assert r["seq"] == seqs, (name, causal, longest)
                assert r["code"] == codes, (name, causal, longest)
            r = got[f"{name}-{causal}-keys"]
            seqs, codes = reference(lengths, hq, bm, causal, r["n"], True, r["keys"])
            assert r["seq"] == seqs and r["code"] == codes, (name, causal, "keys")
            c = got[f"{name}-{causal}-counts"]
            assert c["seq"] == seqs and c["code"] == codes, (name, causal, "counts")
            a, b = got[f"{name}-{causal}"], got[f"{name}-{causal}-longest"]
            assert sorted(zip(a["seq"], a["code"])) == sorted(zip(b["seq"], b["code"]))


def test_bound_holds_every_real_tile_with_at_most_one_spare_a_sequence():
    for lengths, _, bm in PACKS.values():
        real = sum(-(-n // bm) for n in lengths)
        bound = vt.tile_bound(sum(lengths), len(lengths), bm)
        assert real <= bound <= real + len(lengths) + 1
        assert vt.tile_bound(sum(lengths), len(lengths), bm, max(lengths)) <= bound
        assert real <= vt.tile_bound(sum(lengths), len(lengths), bm, max(lengths))


@pytest.mark.parametrize("tq, hq, fits", [(16384, 32, True), (128 * 65535, 8, True),
                                          (128 * 65536, 8, False), (1024, 32768, False)])
def test_codes_stay_in_range(tq, hq, fits):
    assert vt.table_fits(tq, hq, 128) is fits


# order: "pack" (the default build, no LONGEST_FIRST), "longest" (LONGEST_FIRST over the
# running key counts cu_k: prefill_varlen), "counts" (LONGEST_FIRST with KEY_COUNTS, cu_k
# each sequence's own key count: the paged build, prefill_paged); causal only reverses a
# head's row blocks, so each order once with a mask and once without
@pytest.mark.parametrize("causal, one, order", [
    (False, False, "pack"), (True, False, "pack"), (True, True, "pack"),
    (False, False, "longest"), (True, False, "longest"),
    (False, False, "counts"), (True, False, "counts")])
def test_sm90_table_kernel_compiles_without_spills(causal, one, order):
    """sm_90 build, no spills; also with n_seq and Hq the constant 1 (a specialization),
    the longest-first order and the paged build's order by key counts."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"cu_q": "*i32", "tiles": "*i32", "n_seq": "i32", "n_tiles": "i32", "Hq": "i32",
           "BLOCK_M": "constexpr", "CAUSAL": "constexpr", "PIDS": "constexpr",
           "SEQS": "constexpr"}
    const = {"BLOCK_M": 128, "CAUSAL": causal, "PIDS": vt.PIDS, "SEQS": vt.SEQS}
    if order != "pack":
        sig.update(LONGEST_FIRST="constexpr", cu_k="*i32")
        const["LONGEST_FIRST"] = True
    if order == "counts":
        sig["KEY_COUNTS"] = "constexpr"
        const["KEY_COUNTS"] = True
    if one:
        sig.update(n_seq="constexpr", Hq="constexpr")
        const.update(n_seq=1, Hq=1)
    k = triton.compile(ASTSource(vt._varlen_tiles_kernel, sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": vt.WARPS})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", "-o", os.devnull, f.name],
                             capture_output=True, text=True, check=True).stderr
    st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                log).groups())
    assert st == ld == 0, log
