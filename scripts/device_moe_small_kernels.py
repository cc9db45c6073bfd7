"""The MoE step's two small single-purpose kernels side by side: the top-k router
(`_route_kernel`, one program a token) at num_warps 1 / 2 / 4 / 8, and the grouping
(`_group_kernel`, programs of one warp that each count every pair and place 32 of them)
against the previous grouping kernel (`_prev_group_kernel` below: one program, four
block-wide passes of [64, BLOCK_E] one-hot tiles) at its 4 warps and at 1. GPU time per
launch from a profiled CUDA-graph replay of REPS launches.

Checked before anything is timed: the grouping's five outputs bitwise against the
previous kernel's over a sweep of random routings (T 1 / 2 / 7 / 8 / 16 / 33 / 64, (E,
top_k) (128, 8) / (64, 8) / (8, 2) / (5, 3), every block size, ids with and without
repeats in a token), and each timed variant's output against its reference (the top-k's
default build: ids bitwise, weights within fp32 rounding; the grouping: the previous
kernel's, bitwise). No grouping is timed if the sweep finds a mismatch.

    PYTHONPATH=src python3 scripts/device_moe_small_kernels.py [--out DIR]

Why: the grouping launch was 5.7 us at T 8 on the H200 (24.3 at T 64), ~3 % of the
Qwen3-30B-A3B B8 step, on one SM while the GPU waits. Prediction for the new kernel,
T 8 (64 pairs, E 128, block 16): ~2.5-3 us; Mixtral (16 pairs, E 8) about as before (~2.4,
the old kernel was already near a launch's floor there); T 64 ~3.5-4.5 us. GPU only.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from wsattn.bench.step import profile_summary
from wsattn.kernels import moe as M
from wsattn.kernels._intmath import next_pow2

REPS = 64
WARPS = (1, 2, 4, 8)
# (name, T, E, top_k): Qwen3-30B-A3B at B 1 / 8 / 64, OLMoE-1B-7B at B 8, Mixtral-8x7B at
# B 1 / 8
SHAPES = (("qwen3-30b-a3b", 1, 128, 8), ("qwen3-30b-a3b", 8, 128, 8),
          ("qwen3-30b-a3b", 64, 128, 8), ("olmoe-1b-7b", 8, 64, 8),
          ("mixtral-8x7b", 1, 8, 2), ("mixtral-8x7b", 8, 8, 2))
PREV_CHUNK = 64  # the previous kernel's pass tile and tail store
PREV_TAIL = 1024
DEVICE = "cuda"  # the grouping check also runs in the Triton interpreter with "cpu"


@triton.jit
def _prev_group_kernel(ids_ptr, pairs_ptr, offs_ptr, counts_ptr, eob_ptr, nact_ptr,
                       P, E, ROWS, NB,
                       BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                       TAIL: tl.constexpr, PDL: tl.constexpr):
    # the previous grouping kernel, verbatim: grid (1,), four passes of block-wide
    # reductions and scans over [CHUNK, BLOCK_E] one-hot tiles
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.arange(0, BLOCK_E)
    e_live = e < E
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(offs_ptr + e, starts, mask=e_live)
    tl.store(offs_ptr + E, total)
    tl.store(counts_ptr + e, counts, mask=e_live)
    tl.store(nact_ptr, total // BLOCK)
    run = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot + run[None, :]
        row = tl.sum(onehot * (starts[None, :] + before), axis=1)
        tl.store(pairs_ptr + row, p, mask=p < P)
        run += tl.sum(onehot, axis=0)
    j = tl.arange(0, BLOCK)
    pad = (starts + counts)[:, None] + j[None, :]
    tl.store(pairs_ptr + pad, tl.full([BLOCK_E, BLOCK], -1, tl.int32),
             mask=e_live[:, None] & (pad < ends[:, None]))
    rr = tl.arange(0, TAIL)
    for r0 in range(0, ROWS, TAIL):
        r = r0 + rr
        tl.store(pairs_ptr + r, tl.full([TAIL], -1, tl.int32), mask=(r >= total) & (r < ROWS))
    for b0 in range(0, NB, CHUNK):
        b = b0 + c
        r = b * BLOCK
        inside = (starts[None, :] <= r[:, None]) & (r[:, None] < ends[None, :]) \
            & e_live[None, :]
        owner = tl.sum(tl.where(inside, e[None, :], 0), axis=1)
        found = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(eob_ptr + b, tl.where(found, owner, -1), mask=b < NB)


def kernel_us(launch, name) -> float:
    """GPU time of one launch: a graph of REPS launches, profiled, averaged."""
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    summary = profile_summary(torch, "cuda", graph.replay)
    rows = [(n, us) for key, (n, us) in summary["by_name"].items() if key.startswith(name)]
    if len(rows) != 1:
        raise RuntimeError(f"expected one {name} entry in the trace, got {summary['by_name']}")
    n, us = rows[0]
    return us / n


def route_case(T, E, k, warps):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g) * 3
    wts = torch.empty(T, k, device="cuda")
    ids = torch.empty(T, k, dtype=torch.int32, device="cuda")

    def launch():
        M._route_kernel[(T,)](logits, wts, ids, E, TOP_K=k, BLOCK_E=max(16, next_pow2(E)),
                              BLOCK_TK=next_pow2(k), RENORM=True, SIGMOID=False, PDL=False,
                              num_warps=warps)
    launch()
    torch.cuda.synchronize()
    return launch, (wts.clone(), ids.clone())


def group_outputs(T, E, k, block):
    nb = M.blocks_max(T, k, E, block)
    rows = nb * block
    # poisoned: an element neither kernel writes shows up as a mismatch or a stray value
    return [torch.full((n,), 0x5EED, dtype=torch.int32, device=DEVICE)
            for n in (rows, E + 1, E, nb, 1)], rows, nb


def group_launch(kernel, ids, T, E, k, block, warps):
    """A launch of the new ("new") or previous ("prev") grouping kernel and its outputs
    (sorted_pairs, expert_offsets, expert_counts, expert_of_block, num_active_blocks)."""
    out, rows, nb = group_outputs(T, E, k, block)
    if kernel == "new":
        grid, const = M._group_launch(T, k, E, block)

        def launch():
            M._group_kernel[grid](ids, *out, T * k, E, rows, nb, PDL=False, num_warps=warps,
                                  **const)
    else:
        def launch():
            _prev_group_kernel[(1,)](ids, *out, T * k, E, rows, nb, BLOCK=block,
                                     BLOCK_E=max(16, next_pow2(E)), CHUNK=PREV_CHUNK,
                                     TAIL=PREV_TAIL, PDL=False, num_warps=warps)
    return launch, out


def group_run(kernel, ids, T, E, k, block, warps):
    launch, out = group_launch(kernel, ids, T, E, k, block, warps)
    launch()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return launch, tuple(t.clone() for t in out)


def routing(T, E, k, gen, repeats):
    """Valid ids [T, k]: distinct experts a token (as the router gives), or drawn with
    repeats (group() takes any ids in [0, E))."""
    if repeats:
        return torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32).to(DEVICE)
    return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int().to(DEVICE)


def check_sweep(tokens=(1, 2, 7, 8, 16, 33, 64)) -> dict:
    """The new grouping against the previous kernel (4 warps), bitwise, over random
    routings; returns {"cases": n, "mismatches": [...]}."""
    gen = torch.Generator().manual_seed(2)
    cases, bad = 0, []
    for T in tokens:
        for E, k in ((128, 8), (64, 8), (8, 2), (5, 3)):
            for block in M.FMA_BLOCKS + M.DOT_BLOCKS:
                for repeats in (False, True):
                    ids = routing(T, E, k, gen, repeats)
                    _, new = group_run("new", ids, T, E, k, block, M.GROUP_NUM_WARPS)
                    _, prev = group_run("prev", ids, T, E, k, block, 4)
                    cases += 1
                    same = [torch.equal(a, b) for a, b in zip(new, prev)]
                    if not all(same):
                        bad.append({"T": T, "E": E, "top_k": k, "block": block,
                                    "repeats": repeats, "equal": same})
    return {"cases": cases, "mismatches": bad}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep-tokens", default="1,2,7,8,16,33,64",
                    help="T of the bitwise sweep (each a few dozen builds)")
    ap.add_argument("--skip-route", action="store_true", help="time the grouping only")
    args = ap.parse_args()
    sweep = check_sweep(tuple(int(t) for t in args.sweep_tokens.split(",")))
    print(json.dumps({"check": "group new vs prev, bitwise", "cases": sweep["cases"],
                      "mismatches": len(sweep["mismatches"])}), flush=True)
    for m in sweep["mismatches"][:20]:
        print(json.dumps(m), flush=True)
    rows = []
    for model, T, E, k in SHAPES:
        base = None
        for warps in () if args.skip_route else \
                (M.ROUTE_NUM_WARPS,) + tuple(w for w in WARPS if w != M.ROUTE_NUM_WARPS):
            launch, out = route_case(T, E, k, warps)
            if base is None:
                base, ok = out, True
            else:
                ok = torch.equal(out[1], base[1]) and torch.allclose(out[0], base[0], rtol=1e-6,
                                                                     atol=0)
            row = {"model": model, "T": T, "E": E, "top_k": k, "kernel": "route",
                   "num_warps": warps, "default": warps == M.ROUTE_NUM_WARPS,
                   "matches_reference": ok, "us": kernel_us(launch, "_route_kernel") if ok
                   else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
        block = M.default_block(T, k, E)
        ids = routing(T, E, k, torch.Generator().manual_seed(1), False)
        _, ref = group_run("prev", ids, T, E, k, block, 4)
        new_warps = (M.GROUP_NUM_WARPS,) + tuple(w for w in (1, 2, 4) if w != M.GROUP_NUM_WARPS)
        for kernel, warps in [("prev", 4), ("prev", 1)] + [("new", w) for w in new_warps]:
            row = {"model": model, "T": T, "E": E, "top_k": k, "block": block,
                   "kernel": "group", "variant": kernel, "num_warps": warps,
                   "programs": M._group_launch(T, k, E, block)[0][0] if kernel == "new" else 1,
                   "default": kernel == "new" and warps == M.GROUP_NUM_WARPS}
            try:  # one variant that fails to build or run does not lose the others
                launch, out = group_run(kernel, ids, T, E, k, block, warps)
                ok = all(torch.equal(a, b) for a, b in zip(out, ref)) \
                    and not sweep["mismatches"]
                name = "_group_kernel" if kernel == "new" else "_prev_group_kernel"
                row.update(matches_reference=ok, us=kernel_us(launch, name) if ok else None)
            except Exception as err:  # noqa: BLE001 (reported in the row)
                row.update(matches_reference=None, us=None, error=repr(err)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = os.path.join(args.out, "moe_small_kernels.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "group_check": sweep, "rows": rows},
                  f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
