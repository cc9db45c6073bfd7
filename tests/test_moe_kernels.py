"""The MoE decode kernels (wsattn.kernels.moe): route, group, grouped gate/up, down+combine.

Numerics run through the Triton interpreter in a fresh child process (TRITON_INTERPRET=1
set before Triton is imported, outputs NaN-poisoned), fp32 and fp16, against a float64
torch reference of the whole block (route -> per-token sum over the chosen experts of
w_j * down(silu(gate) * up)), with routing compared to the reference's stable descending
sort (ids equal, weights close). Grouping edge cases: experts without a token, one
expert taking every token, T*k not a multiple of any block, T = 1, every block size; and
all five grouping outputs bit for bit against a counting sort over random routings
(ids with repeats and outside [0, E) too), from poisoned buffers.
Reruns are bit-identical. The tie and NaN rules of the router are pinned. sm_90 builds
compile on the CPU without spills at the Qwen3-30B-A3B shape (H 2048, E 128, k 8, F 768)
for T 1/8/64, with griddepcontrol in the PTX exactly when PDL is on.
DeepSeek-V3 / dots.llm1 routing (score_bias, groups, topk_groups, scale): route(), the
top-k inside the gate/up launch and moe() against a float64 Dots1TopkRouter reference
(stable sorts for torch.topk) and, on fp32 inputs, transformers' own Dots1TopkRouter;
hand-made logits where the bias or the group limit changes the choice, NaN and ties;
refusals by name before any launch; the sm_90 builds at DeepSeek-V3's shape without
spills.
"""

from __future__ import annotations

import functools
import json
import math
import re
import textwrap

import pytest
import torch

from conftest import interpreter_child

REFERENCE = r'''
def reference_route(x, rw, k, renorm, eps=None, scoring="softmax"):
    """float64 router: the module's rule is torch.sort(descending, stable)[:, :k]."""
    x64 = x.double()
    logits = x64 @ rw.double().T
    if eps is not None:
        logits = logits * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    v, i = torch.sort(p, dim=-1, descending=True, stable=True)
    v, i = v[:, :k], i[:, :k]
    if renorm:
        v = v / v.sum(-1, keepdim=True)
    return v, i


def reference_ds_route(x, rw, k, renorm, bias=None, groups=1, topk_groups=1, scale=1.0,
                       eps=None):
    """float64 DeepSeek-V3 / dots.llm1 router: transformers' Dots1TopkRouter arithmetic
    (sigmoid scores; keys = scores + e_score_correction_bias; a group scores the sum of its
    two largest keys; the topk_group best groups kept; weights the unbiased scores,
    renormalised by sum + 1e-20, times routed_scaling_factor), with the module's tie rule:
    stable descending sorts in place of torch.topk (NaN first, equal values by index)."""
    x64 = x.double()
    logits = x64 @ rw.double().T
    if eps is not None:
        logits = logits * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    scores = torch.sigmoid(logits)
    keys = scores if bias is None else scores + bias.double()
    T, E = keys.shape
    if groups > 1:
        top2 = torch.sort(keys.view(T, groups, E // groups), dim=-1, descending=True,
                          stable=True)[0][..., :2]
        best = torch.sort(top2.sum(-1), dim=-1, descending=True, stable=True)[1]
        kept = torch.zeros(T, groups, dtype=torch.bool)
        kept.scatter_(1, best[:, :topk_groups], True)
        keys = keys.masked_fill(~kept.repeat_interleave(E // groups, 1), float("-inf"))
    i = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, :k]
    v = scores.gather(1, i)
    if renorm:
        v = v / (v.sum(-1, keepdim=True) + 1e-20)
    return v * scale, i


def reference_moe(x, rw, wgu, wd, k, renorm, eps=None, res=None, scoring="softmax", ds=None):
    """float64 MoE block: sum over the chosen experts of w_j * down(silu(gate) * up).
    ds: None, or reference_ds_route's keywords (bias, groups, topk_groups, scale): the
    DeepSeek-V3 router (sigmoid) in place of reference_route."""
    if ds is None:
        v, i = reference_route(x, rw, k, renorm, eps, scoring)
    else:
        v, i = reference_ds_route(x, rw, k, renorm, eps=eps, **ds)
    x64 = x.double()
    if eps is not None:
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    out = torch.zeros_like(x64) if res is None else res.double().clone()
    F = wgu.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(i[t, j])
            h = wgu[e].double() @ x64[t]
            out[t] += v[t, j] * (wd[e].double() @ (torch.nn.functional.silu(h[:F]) * h[F:]))
    return out, v, i


def reference_group(ids, E, block):
    """Python counting sort: rows, padded offsets, counts, active blocks, expert of block."""
    flat = ids.flatten().tolist()
    rows, offs, counts = [], [0], []
    for e in range(E):
        ps = [p for p, x in enumerate(flat) if x == e]
        pad = -(-len(ps) // block) * block
        rows += ps + [-1] * (pad - len(ps))
        offs.append(offs[-1] + pad)
        counts.append(len(ps))
    eob = [e for e in range(E) for _ in range((offs[e + 1] - offs[e]) // block)]
    return rows, offs, counts, offs[-1] // block, eob
'''
exec(REFERENCE)  # the same references in this process (GPU tests) and in the child

CHILD = REFERENCE + textwrap.dedent(r'''
    import json, sys
    import torch
    from wsattn.kernels import moe as M
    from wsattn.testing import rel_err

    torch.manual_seed(0)
    case, arg = sys.argv[1], json.loads(sys.argv[2])
    res = {}
    TOL_CHILD = {"float32": 2e-5, "float16": 4e-3}

    def weights(E, H, F, dt):
        rw = (torch.randn(E, H) / H ** 0.5).to(dt)  # logits ~ N(0, 1): no fp32 saturation
        wgu = (torch.randn(E, 2 * F, H) / H ** 0.5).to(dt)
        wd = (torch.randn(E, H, F) / F ** 0.5).to(dt)
        return rw, wgu, wd

    def one_token_both_ways(x, rw, wgu, wd, r, k, block, renorm, **routing):
        """One token through route() + the one-token grouping (base), and twice through
        route_logits + moe_gate_up(route=), its ids and weights NaN / -7 poisoned first:
        (w, ids, base, y, y2, rt)."""
        from wsattn.target import target_of
        E = rw.shape[0]
        tables = M.one_token_tables(k, block, "cpu")
        st = M.default_settings(target_of(x.device), T=1, top_k=k, num_experts=E,
                                dtype=x.dtype, block=block)
        w, ids = M.route(x, rw, top_k=k, renormalize=renorm, norm_eps=1e-5, **routing)
        g = M.one_token_grouping(ids, E, block, tables)
        base = M.moe_down_combine(M.moe_gate_up(x, wgu, g, norm_eps=1e-5, settings=st),
                                  wd, g, w, residual=r, settings=st)
        outs = []
        for _ in range(2):
            rt = M.route_logits(x, rw, top_k=k, renormalize=renorm, norm_eps=1e-5, **routing)
            rt.weights.fill_(float("nan"))
            rt.ids.fill_(-7)
            g2 = M.one_token_grouping(rt.ids, E, block, tables)
            act2 = M.moe_gate_up(x, wgu, g2, norm_eps=1e-5, settings=st, route=rt)
            outs.append((M.moe_down_combine(act2, wd, g2, rt.weights, residual=r,
                                            settings=st), rt))
        (y, rt), (y2, _) = outs
        return w, ids, base, y, y2, rt

    if case == "block":
        dt = getattr(torch, arg["dtype"])
        # (T, E, k, H, F, renorm, norm, residual, scoring, block): every block size's path
        # (the FMA blocks 1 and 4 by explicit settings, default_block no longer picks
        # them; 16 and 32 by default), shapes off every tile
        from wsattn.target import target_of
        for T, E, k, H, F, renorm, norm, resid, scoring, block in (
                (1, 8, 2, 64, 32, True, False, False, "softmax", 1),
                (1, 16, 4, 96, 40, False, True, True, "softmax", 1),
                (3, 16, 4, 80, 24, True, True, False, "softmax", 4),
                (7, 12, 3, 72, 36, False, False, True, "sigmoid", 4),
                (20, 8, 2, 64, 48, True, True, True, "softmax", 16),
                (64, 16, 8, 48, 40, True, False, True, "softmax", 32),
                # H past the router's 2048-wide tile (its loop after the PDL wait) and
                # past the combine's 1024-wide block above COMBINE_NARROW_T tokens
                (9, 8, 2, 2120, 24, True, True, True, "softmax", 16)):
            key = f"T{T}-E{E}-k{k}-H{H}-F{F}-{'renorm' if renorm else 'raw'}" \
                  f"{'-norm' if norm else ''}{'-res' if resid else ''}-{scoring}"
            x = torch.randn(T, H).to(dt)
            rw, wgu, wd = weights(E, H, F, dt)
            r = torch.randn(T, H).to(dt) if resid else None
            eps = 1e-5 if norm else None
            ref, rv, ri = reference_moe(x, rw, wgu, wd, k, renorm, eps, r, scoring)
            w, ids = M.route(x, rw, top_k=k, renormalize=renorm, norm_eps=eps, scoring=scoring)
            st = None if block == M.default_block(T, k, E) else M.default_settings(
                target_of(x.device), T=T, top_k=k, num_experts=E, dtype=dt, block=block)
            kw = dict(top_k=k, renormalize=renorm, norm_eps=eps, scoring=scoring, residual=r,
                      settings=st)
            y1 = M.moe(x, rw, wgu, wd, **kw)
            y2 = M.moe(x, rw, wgu, wd, **kw)
            res[key] = {"out": rel_err(y1, ref), "ids_equal": bool(torch.equal(ids.long(), ri)),
                        "weights": rel_err(w, rv), "rerun_identical": bool(torch.equal(y1, y2)),
                        "dtype": str(y1.dtype), "ids_dtype": str(ids.dtype),
                        "block": block}

    elif case == "grouping":
        # each row: (name, ids [T, k], E)
        cases = [("T1", [[5, 2, 7]], 8),
                 ("empty_experts", [[0, 3], [3, 0], [0, 3]], 16),
                 ("one_expert_all_tokens_k1", [[2]] * 37, 4),
                 ("one_expert_in_every_token", [[1, j % 5 + 2] for j in range(23)], 8),
                 ("odd_pairs", torch.randint(0, 10, (13, 1)).tolist(), 10),
                 ("full_64x8", torch.stack([torch.randperm(128)[:8] for _ in range(64)])
                  .tolist(), 128)]
        for name, ids, E in cases:
            ids = torch.tensor(ids, dtype=torch.int32)
            for block in (1, 2, 4, 16, 32):
                g = M.group(ids, E, block)
                rows, offs, counts, nact, eob = reference_group(ids, E, block)
                nb = M.blocks_max(ids.shape[0], ids.shape[1], E, block)
                sp = g.sorted_pairs.tolist()
                res[f"{name}-b{block}"] = {
                    "rows": sp[:len(rows)] == rows and all(v == -1 for v in sp[len(rows):]),
                    "sizes": len(sp) == nb * block and g.expert_of_block.numel() == nb,
                    "offsets": g.expert_offsets.tolist() == offs,
                    "counts": g.expert_counts.tolist() == counts,
                    "nact": g.num_active_blocks.tolist() == [nact],
                    "eob": g.expert_of_block.tolist() == eob + [-1] * (nb - len(eob))}

    elif case == "grouping_random":
        # group()'s five outputs, all of every buffer, against the counting sort, over
        # random routings: distinct experts a token (as route gives), ids drawn with
        # repeats, and ids outside [0, E) (they join no expert). Outputs start poisoned
        # (-7, never a value the grouping writes), so an element no lane wrote fails.
        real_empty = torch.empty

        def poisoned_empty(*a, **kw):
            t = real_empty(*a, **kw)
            return t.fill_(-7) if t.dtype == torch.int32 else t

        cases, bad = 0, []
        for T in (1, 2, 7, 8, 33, 64):
            for E, k in ((128, 8), (64, 8), (8, 2), (5, 3)):
                for block in M.FMA_BLOCKS + M.DOT_BLOCKS:
                    for kind in ("routing", "repeats", "outside"):
                        if kind == "routing":
                            ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
                        else:
                            ids = torch.randint(0, E, (T, k))
                        if kind == "outside":
                            stray = torch.tensor([-1, -5, E, E + 1, 16, 1000, 2 ** 31 - 1])
                            hit = torch.rand(T, k) < 0.3
                            ids = torch.where(hit, stray[torch.randint(0, 7, (T, k))], ids)
                        ids = ids.to(torch.int32).contiguous()
                        torch.empty = poisoned_empty
                        try:
                            g = M.group(ids, E, block)
                        finally:
                            torch.empty = real_empty
                        rows, offs, counts, nact, eob = reference_group(ids, E, block)
                        nb = M.blocks_max(T, k, E, block)
                        want = {"sorted_pairs": rows + [-1] * (nb * block - len(rows)),
                                "expert_offsets": offs, "expert_counts": counts,
                                "expert_of_block": eob + [-1] * (nb - len(eob)),
                                "num_active_blocks": [nact]}
                        wrong = [n for n, v in want.items()
                                 if getattr(g, n).dtype != torch.int32
                                 or getattr(g, n).tolist() != v]
                        cases += 1
                        if wrong:
                            bad.append(f"T{T}-E{E}-k{k}-b{block}-{kind}: {wrong}")
        res = {"cases": cases, "bad": bad}

    elif case == "ties_nan":
        H, E, k = 32, 8, 3
        x = torch.randn(4, H)
        rw = torch.randn(E, H) / 4
        rw[2] = rw[5] = rw[6] = x[0] * 4  # experts 2, 5, 6: equal, clearly top for token 0
        w, ids = M.route(x, rw, top_k=k, renormalize=False)
        res["tie_ids_token0"] = ids[0].tolist()
        _, ri = reference_route(x, rw, k, False)
        res["ties_equal_reference"] = bool(torch.equal(ids.long(), ri))
        # NaN in one token's hidden state: its logits are all NaN
        xn = torch.randn(3, H)
        xn[1, 4] = float("nan")
        wgu = torch.randn(E, 2 * 16, H) / 6
        wd = torch.randn(E, H, 16) / 4
        w, ids = M.route(xn, rw, top_k=k, renormalize=True)
        res["nan_ids"] = ids[1].tolist()
        res["nan_weights_all_nan"] = bool(torch.isnan(w[1]).all())
        res["others_finite"] = bool(torch.isfinite(w[[0, 2]]).all())
        y = M.moe(xn, rw, wgu, wd, top_k=k, renormalize=True)
        res["nan_row_out_all_nan"] = bool(torch.isnan(y[1]).all())
        ref, _, _ = reference_moe(xn[[0, 2]], rw, wgu, wd, k, True)
        res["other_rows"] = rel_err(y[[0, 2]], ref)
        # sigmoid: only the NaN logit is NaN; it ranks first (NaN above every number)
        rw2 = torch.randn(E, H)
        xs = torch.randn(1, H)
        rw2[4, 0] = float("nan")
        w, ids = M.route(xs, rw2, top_k=k, renormalize=False, scoring="sigmoid")
        _, ri = reference_route(xs, rw2, k, False, scoring="sigmoid")
        res["sigmoid_nan_ids"] = ids[0].tolist()
        res["sigmoid_nan_ref_ids"] = ri[0].tolist()
        res["sigmoid_nan_first_weight_nan"] = bool(torch.isnan(w[0, 0]))

    elif case == "one_token":
        # one_token_grouping against group(): the same bits through gate/up and
        # down + combine, for FMA and dot blocks, with a residual and the FlashNorm scale
        from wsattn.target import target_of
        for dtn in ("float32", "float16"):
            dt = getattr(torch, dtn)
            for E, k, H, F, block in ((8, 2, 64, 32, 1), (16, 4, 96, 40, 4),
                                      (12, 3, 72, 36, 16), (128, 8, 64, 48, 16)):
                x = torch.randn(1, H).to(dt)
                rw, wgu, wd = weights(E, H, F, dt)
                r = torch.randn(1, H).to(dt)
                w, ids = M.route(x, rw, top_k=k, renormalize=True, norm_eps=1e-5)
                st = M.default_settings(target_of(x.device), T=1, top_k=k, num_experts=E,
                                        dtype=dt, block=block)
                outs = []
                for g in (M.group(ids, E, block),
                          M.one_token_grouping(ids, E, block, M.one_token_tables(k, block, "cpu"))):
                    act = M.moe_gate_up(x, wgu, g, norm_eps=1e-5, settings=st)
                    outs.append(M.moe_down_combine(act, wd, g, w, residual=r, settings=st))
                ref, _, _ = reference_moe(x, rw, wgu, wd, k, True, 1e-5, r)
                res[f"{dtn}-E{E}-k{k}-b{block}"] = {
                    "equal": bool(torch.equal(outs[0], outs[1])),
                    "err": rel_err(outs[1], ref), "tol": TOL_CHILD[dtn]}

    elif case == "topk_in_gate_up":
        # route_logits + moe_gate_up(route=) against route() + the one-token grouping: the
        # same experts in the same slots, the weights within rounding, the output within
        # rounding of it and within tolerance of float64; softmax / sigmoid, renormalised or
        # not, FMA and dot blocks, E up to 256; ties (equal router rows) and a NaN logit
        for dtn in ("float32", "float16"):
            dt = getattr(torch, dtn)
            for E, k, H, F, block, renorm, scoring in (
                    (8, 2, 64, 32, 1, True, "softmax"), (16, 4, 96, 40, 4, False, "softmax"),
                    (12, 3, 72, 36, 16, True, "sigmoid"), (128, 8, 64, 48, 16, True, "softmax"),
                    (256, 8, 64, 32, 16, False, "sigmoid"), (5, 5, 32, 16, 16, True, "softmax")):
                x = torch.randn(1, H).to(dt)
                rw, wgu, wd = weights(E, H, F, dt)
                rw[E // 2] = rw[0]  # a tie: the lower index must come first
                r = torch.randn(1, H).to(dt)
                w, ids, base, y, y2, rt = one_token_both_ways(x, rw, wgu, wd, r, k, block,
                                                              renorm, scoring=scoring)
                ref, rv, ri = reference_moe(x, rw, wgu, wd, k, renorm, 1e-5, r, scoring)
                res[f"{dtn}-E{E}-k{k}-b{block}-{scoring}-{renorm}"] = {
                    "ids_equal": rt.ids.tolist() == ids.tolist() == ri.tolist(),
                    "weights": (rt.weights - w).abs().max().item(),
                    "out_vs_route": rel_err(y, base), "err": rel_err(y, ref),
                    "tol": TOL_CHILD[dtn], "rerun_identical": bool(torch.equal(y, y2))}
        # a NaN logit: ids 0..k-1 and NaN weights (route's rule), the output row NaN
        E, k, H, F = 16, 4, 64, 32
        rw, wgu, wd = weights(E, H, F, torch.float32)
        x = torch.randn(1, H)
        x[0, 3] = float("nan")
        rt = M.route_logits(x, rw, top_k=k, renormalize=True)
        g = M.one_token_grouping(rt.ids, E, 16, M.one_token_tables(k, 16, "cpu"))
        y = M.moe_down_combine(M.moe_gate_up(x, wgu, g, route=rt), wd, g, rt.weights)
        res["nan"] = {"ids": rt.ids[0].tolist() == list(range(k)),
                      "weights_nan": bool(torch.isnan(rt.weights).all()),
                      "out_nan": bool(torch.isnan(y).all())}
        # chosen logits: ties inside the top-k and across its edge (the exact-order pass),
        # -inf and +inf logits; ids against the rule (a stable descending sort of the
        # logits), weights against float64
        inf = float("inf")
        cases = {"all_equal": [0.5] * 16, "straddle": [0, 1, 5, 5, 5, 2] + [-1] * 10,
                 "inside": [3, 9, 9, 1, 7, 0.5] + [-2] * 10,
                 "neg_inf": [-inf, 2, -inf, -inf, 1] + [-inf] * 11,
                 "pos_inf": [1, 2, inf, 0] + [-1] * 12}
        for name, vals in cases.items():
            for scoring in ("softmax", "sigmoid"):
                lg = torch.tensor([vals], dtype=torch.float32)
                rt = M.LogitsRoute(lg, torch.full((1, k), float("nan")),
                                   torch.full((1, k), -1, dtype=torch.int32), k, True,
                                   scoring == "sigmoid")
                g = M.one_token_grouping(rt.ids, E, 16, M.one_token_tables(k, 16, "cpu"))
                M.moe_gate_up(torch.randn(1, H), wgu, g, route=rt)
                key = lg[0].double()
                if scoring == "softmax" and torch.isinf(key).any() and key.max() == inf:
                    want_ids, want_w = list(range(k)), None  # every probability NaN
                else:
                    want_ids = torch.sort(key, descending=True, stable=True)[1][:k].tolist()
                    sc = torch.softmax(key, 0) if scoring == "softmax" else torch.sigmoid(key)
                    want_w = sc[want_ids] / sc[want_ids].sum()
                got_w = rt.weights[0].double()
                res[f"{name}-{scoring}"] = {
                    "ids": rt.ids[0].tolist() == want_ids,
                    "weights": bool(torch.isnan(got_w).all()) if want_w is None
                    else bool(torch.allclose(got_w, want_w, rtol=1e-6, atol=0))}

    elif case == "ds":
        # DeepSeek-V3 / dots.llm1 routing (score_bias, groups, topk_groups, scale) in one
        # dtype: route() against the float64 reference and transformers' own router; the
        # top-k inside the gate/up launch against route(); the whole block against float64
        from wsattn.target import target_of
        dtn = arg["dtype"]
        dt = getattr(torch, dtn)
        hf_router = None
        if dtn == "float32":
            import transformers
            from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter as hf_router
        res = {"route": {}, "hf": {}, "slot": {}, "block": {}}
        H, scale = 48, 2.5
        for E, k in ((16, 4), (64, 6)):
            for groups, topk_groups in ((1, 1), (4, 1), (4, 2)):
                for renorm in (True, False):
                    rw = (torch.randn(E, H) / H ** 0.5).to(dt)
                    bias = torch.randn(E) * 0.2
                    if hf_router is not None:
                        hf = hf_router(transformers.Dots1Config(
                            n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                            topk_group=topk_groups, norm_topk_prob=renorm,
                            routed_scaling_factor=scale, hidden_size=H))
                        with torch.no_grad():
                            hf.weight.copy_(rw)
                            hf.e_score_correction_bias.copy_(bias)
                    for T in (1, 5):
                        x = torch.randn(T, H).to(dt)
                        w, ids = M.route(x, rw, top_k=k, renormalize=renorm, scoring="sigmoid",
                                         score_bias=bias, groups=groups,
                                         topk_groups=topk_groups, scale=scale)
                        rv, ri = reference_ds_route(x, rw, k, renorm, bias, groups,
                                                    topk_groups, scale)
                        key = f"E{E}-g{groups}-tg{topk_groups}-{'renorm' if renorm else 'raw'}-T{T}"
                        res["route"][key] = {
                            "ids_equal": bool(torch.equal(ids.long(), ri)),
                            "weights": (w.double() - rv).abs().max().item(),
                            "dtypes": [str(w.dtype), str(ids.dtype)]}
                        if hf_router is not None:
                            with torch.no_grad():
                                _, hw, hi = hf(x)
                            # transformers' topk(sorted=False): compare as sets, weights by id
                            hs, ho = hi.sort(-1)
                            os_, oo = ids.long().sort(-1)
                            res["hf"][key] = {
                                "ids_equal": bool(torch.equal(hs, os_)),
                                "weights": (w.gather(1, oo) - hw.gather(1, ho)).abs().max().item()}
        # the top-k inside the gate/up launch (T = 1): (E, k, H, F, block, renorm, groups,
        # topk_groups, bias); DeepSeek-V3's 256 experts in 8 groups of which 4 kept, group
        # counts and sizes not powers of two, bias only, groups only; a tie (an equal router
        # row and bias) in every case
        for E, k, H, F, block, renorm, groups, topk_groups, with_bias in (
                (16, 4, 64, 32, 1, True, 4, 2, True), (64, 6, 96, 40, 16, False, 8, 3, True),
                (256, 8, 64, 32, 16, True, 8, 4, True), (24, 3, 72, 36, 16, True, 6, 2, True),
                (48, 4, 64, 24, 16, False, 3, 1, True), (32, 4, 64, 32, 16, True, 1, 1, True),
                (16, 4, 64, 32, 16, True, 4, 1, False)):
            x = torch.randn(1, H).to(dt)
            rw, wgu, wd = weights(E, H, F, dt)
            bias = torch.randn(E) * 0.2 if with_bias else None
            rw[E // 2] = rw[0]  # a tie: the lower index must come first
            if bias is not None:
                bias[E // 2] = bias[0]
            r = torch.randn(1, H).to(dt)
            ds = dict(score_bias=bias, groups=groups, topk_groups=topk_groups, scale=scale)
            w, ids, base, y, y2, rt = one_token_both_ways(x, rw, wgu, wd, r, k, block, renorm,
                                                          scoring="sigmoid", **ds)
            ref, rv, ri = reference_moe(x, rw, wgu, wd, k, renorm, 1e-5, r, ds=dict(
                bias=bias, groups=groups, topk_groups=topk_groups, scale=scale))
            res["slot"][f"E{E}-k{k}-b{block}-g{groups}-tg{topk_groups}-bias{int(with_bias)}"] = {
                "ids_equal": rt.ids.tolist() == ids.tolist() == ri.tolist(),
                "weights": (rt.weights - w).abs().max().item(),
                "weights_ref": (rt.weights.double() - rv).abs().max().item(),
                "out_vs_route": rel_err(y, base), "err": rel_err(y, ref),
                "tol": TOL_CHILD[dtn], "rerun_identical": bool(torch.equal(y, y2))}
        # moe(): (T, E, k, H, F, renorm, norm, residual, groups, topk_groups, block)
        for T, E, k, H, F, renorm, norm, resid, groups, topk_groups, block in (
                (1, 16, 4, 64, 32, True, False, False, 4, 2, 1),
                (5, 64, 6, 80, 24, False, True, True, 8, 3, 16),
                (9, 32, 4, 72, 40, True, True, False, 1, 1, 4),
                (12, 24, 3, 64, 48, True, False, True, 6, 2, 16)):
            x = torch.randn(T, H).to(dt)
            rw, wgu, wd = weights(E, H, F, dt)
            bias = torch.randn(E) * 0.2
            r = torch.randn(T, H).to(dt) if resid else None
            eps = 1e-5 if norm else None
            ref, rv, ri = reference_moe(x, rw, wgu, wd, k, renorm, eps, r, ds=dict(
                bias=bias, groups=groups, topk_groups=topk_groups, scale=scale))
            st = None if block == M.default_block(T, k, E) else M.default_settings(
                target_of(x.device), T=T, top_k=k, num_experts=E, dtype=dt, block=block)
            kw = dict(top_k=k, renormalize=renorm, norm_eps=eps, scoring="sigmoid",
                      score_bias=bias, groups=groups, topk_groups=topk_groups, scale=scale,
                      residual=r, settings=st)
            w, ids = M.route(x, rw, **{n: kw[n] for n in (
                "top_k", "renormalize", "norm_eps", "scoring", "score_bias", "groups",
                "topk_groups", "scale")})
            y1 = M.moe(x, rw, wgu, wd, **kw)
            y2 = M.moe(x, rw, wgu, wd, **kw)
            res["block"][f"T{T}-E{E}-k{k}-g{groups}-tg{topk_groups}-b{block}"] = {
                "out": rel_err(y1, ref), "ids_equal": bool(torch.equal(ids.long(), ri)),
                "weights": (w.double() - rv).abs().max().item(), "tol": TOL_CHILD[dtn],
                "rerun_identical": bool(torch.equal(y1, y2)), "dtype": str(y1.dtype)}

    elif case == "ds_cases":
        # hand-made logits: the router is the identity (H = E), so x is the logits, exact
        # in fp32; each case through route() and through the gate/up launch (route=)
        def two_ways(logits, k, renorm=False, bias=None, groups=1, topk_groups=1,
                     scale=1.0, rw=None):
            x = torch.tensor([logits], dtype=torch.float32)
            E = x.shape[1]
            rw = torch.eye(E) if rw is None else rw
            kw = dict(top_k=k, renormalize=renorm, scoring="sigmoid", score_bias=bias,
                      groups=groups, topk_groups=topk_groups, scale=scale)
            w, ids = M.route(x, rw, **kw)
            rt = M.route_logits(x, rw, **kw)
            g = M.one_token_grouping(rt.ids, E, 16, M.one_token_tables(k, 16, "cpu"))
            M.moe_gate_up(x, torch.randn(E, 32, E), g, route=rt)
            rv, ri = reference_ds_route(x, rw, k, renorm, bias, groups, topk_groups, scale)
            return {"ids": ids[0].tolist(), "slot_ids": rt.ids[0].tolist(),
                    "ref_ids": ri[0].tolist(), "w": w[0].tolist(),
                    "slot_w": rt.weights[0].tolist(), "ref_w": rv[0].tolist()}

        lg = [0.3, -0.5, 0.8, 4.0, -0.2, 0.1, 0.6, -1.0,
              0.2, -0.7, 0.5, -0.3, 0.0, 0.4, -0.6, 0.7]
        bias = torch.zeros(16)
        res["no_bias"] = two_ways(lg, 4, bias=bias)
        bias[3] = -10.0  # the largest logit, pushed out
        bias[7] = 1.0  # a small logit, pulled in first
        res["bias"] = two_ways(lg, 4, bias=bias)
        res["bias_renorm"] = two_ways(lg, 4, True, bias, scale=2.5)
        res["sigmoid"] = torch.sigmoid(torch.tensor(lg)).tolist()
        # four groups of four: group 0 has the global top (3.0) and nothing else, group 1
        # a duplicated max (1.0 twice: 1.462), group 2 a larger max but a small second
        # (2.5, 0.0: 1.424; counting group 1's max once would make it win)
        grouped = [3.0, -3, -3, -3, 1.0, 1.0, -6, -6, 2.5, 0.0, -6, -6, -2, -2, -2, -2]
        res["groups_off"] = two_ways(grouped, 2, groups=1)
        res["groups_1"] = two_ways(grouped, 2, groups=4, topk_groups=1)
        res["groups_2"] = two_ways(grouped, 3, groups=4, topk_groups=2)
        # a bias that moves group 3 to the front (its four keys +1)
        gb = torch.zeros(16)
        gb[12:] = 1.0
        res["groups_bias"] = two_ways(grouped, 2, groups=4, topk_groups=1, bias=gb)
        # NaN: one NaN logit (expert 9) in a group of otherwise low keys: that group ranks
        # first, expert 9 first, its weight NaN (all of them renormalised)
        nan_rw = torch.eye(16)
        nan_rw[9, 0] = float("nan")
        low = [1.0, 0.5, 0.2, 0.9, 0.8, 0.7, 0.6, 0.4, -8, 0.0, -8, -8, 0.3, 0.1, -0.1, 0.6]
        small = torch.randn(16) * 0.01
        res["nan_renorm"] = two_ways(low, 4, True, small, 4, 2, 2.5, rw=nan_rw)
        res["nan_raw"] = two_ways(low, 4, False, small, 4, 2, 2.5, rw=nan_rw)
        # every logit NaN (a NaN in x): groups 0.. and ids 0..k-1, NaN weights
        res["all_nan"] = two_ways([float("nan")] + [0.0] * 15, 4, True, small, 4, 2)
        # ties: equal logits and bias (experts 2 and 6) at the top; two groups of equal
        # scores (1 and 3): the lower one kept alone, and with both kept the experts of
        # equal keys by index
        tl_ = [0.1, 0.2, 2.0, -0.5, 0.3, -0.2, 2.0, 0.0, -1, -1, -1, -1, 0.5, 0.4, 0.3, 0.2]
        tb = torch.zeros(16)
        tb[2] = tb[6] = 0.25
        res["tie_keys"] = two_ways(tl_, 3, bias=tb)
        tg = [-1, -1, -1, -1, 0.9, 0.8, 0.1, 0.0, -2, -2, -2, -2, 0.9, 0.8, 0.1, 0.0]
        res["tie_groups_1"] = two_ways(tg, 3, groups=4, topk_groups=1, bias=torch.zeros(16))
        res["tie_groups_2"] = two_ways(tg, 4, groups=4, topk_groups=2, bias=torch.zeros(16))
        # moe(): a token of NaN logits gives a NaN row, the other token its reference
        E, H, F = 16, 16, 8
        x = torch.randn(2, H)
        x[0, 5] = float("nan")
        rw = torch.randn(E, H) / 4
        wgu = torch.randn(E, 2 * F, H) / 4
        wd = torch.randn(E, H, F) / 3
        b = torch.randn(E) * 0.2
        kw = dict(top_k=3, renormalize=True, scoring="sigmoid", score_bias=b, groups=4,
                  topk_groups=2, scale=2.5)
        y = M.moe(x, rw, wgu, wd, **kw)
        ref, _, _ = reference_moe(x[1:], rw, wgu, wd, 3, True, ds=dict(
            bias=b, groups=4, topk_groups=2, scale=2.5))
        res["moe_nan"] = {"nan_row": bool(torch.isnan(y[0]).all()),
                          "other_row": rel_err(y[1:], ref)}

    elif case == "bf16":
        dt = torch.bfloat16
        x = torch.randn(5, 64).to(dt)
        rw, wgu, wd = weights(8, 64, 32, dt)
        ref, _, _ = reference_moe(x, rw, wgu, wd, 2, True, 1e-5)
        y = M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, norm_eps=1e-5)
        res["out"] = rel_err(y, ref)
        res["dtype"] = str(y.dtype)

    elif case == "alias":
        x = torch.randn(3, 16)
        rw, wgu, wd = weights(4, 16, 8, torch.float32)
        res_ = torch.randn(3, 16)
        want = M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, residual=res_.clone())
        got = res_.clone()
        back = M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, residual=got, out=got)
        res["equal"] = bool(torch.equal(got, want))
        res["same_tensor"] = back.data_ptr() == got.data_ptr()

    elif case == "pdl":
        x = torch.randn(2, 32)
        rw = torch.randn(4, 32)
        try:
            M.route(x, rw, top_k=2, renormalize=True, pdl=True)
            res["error"] = None
        except ValueError as e:
            res["error"] = str(e)
    print("RESULT " + json.dumps(res))
''')


def _child(case: str, **arg) -> dict:
    return interpreter_child(CHILD, case, json.dumps(arg))


TOL = {"float32": 2e-5, "float16": 4e-3}  # fp32 accumulates exactly here: no tf32 on CPU


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_moe_block_against_float64_reference(dtype):
    r = _child("block", dtype=dtype)
    assert len(r) == 7, r
    assert {v["block"] for v in r.values()} == {1, 4, 16, 32}, r  # every path ran
    for key, v in r.items():
        assert v["out"] <= TOL[dtype], (key, v)
        assert v["ids_equal"] is True, (key, v)
        assert v["weights"] <= (1e-5 if dtype == "float32" else 1e-3), (key, v)
        assert v["rerun_identical"] is True, (key, v)
        assert v["dtype"] == f"torch.{dtype}" and v["ids_dtype"] == "torch.int32", (key, v)


def test_grouping_edge_cases_match_a_python_counting_sort():
    r = _child("grouping")
    assert len(r) == 30, r
    bad = {k: v for k, v in r.items() if not all(v.values())}
    assert not bad, bad


def test_grouping_matches_a_python_counting_sort_bit_for_bit_over_random_routings():
    """Every element of group()'s five outputs against the counting sort (T 1/2/7/8/33/64,
    (E, k) (128, 8) / (64, 8) / (8, 2) / (5, 3), every block, ids with repeats and ids
    outside [0, E)): several programs each count every pair and place their own, so a
    slip in one program's share or in the padding and tail split shows here."""
    r = _child("grouping_random")
    assert r["cases"] == 6 * 4 * 6 * 3, r
    assert not r["bad"], r["bad"]


def test_one_token_grouping_gives_the_grouping_kernels_bits():
    """One token: the kernel-free grouping (a block a slot, the ids as the experts of the
    blocks) gives bitwise the output of group()'s, and both are within tolerance of the
    float64 block; FMA and dot blocks, E up to 128, fp32 and fp16."""
    r = _child("one_token")
    assert len(r) == 8, r
    for key, v in r.items():
        assert v["equal"] is True and v["err"] <= v["tol"], (key, v)


def test_topk_inside_the_gate_up_launch_routes_as_route_does():
    """route_logits + moe_gate_up(route=): each gate/up program selects its slot's expert
    from the logits and writes the ids and weights; the same ids as route() and the
    float64 sort (ties by lower index), weights within rounding (the renormalising sum
    runs in another order), output within tolerance of float64 and bit-identical on a
    rerun; a NaN logit gives route's ids 0..k-1 and NaN weights."""
    r = _child("topk_in_gate_up")
    assert len(r) == 23, r
    nan = r.pop("nan")
    assert all(nan.values()), nan
    chosen = {key: r.pop(key) for key in list(r) if "-" in key and key.split("-")[0] in (
        "all_equal", "straddle", "inside", "neg_inf", "pos_inf")}
    assert len(chosen) == 10 and all(all(v.values()) for v in chosen.values()), chosen
    for key, v in r.items():
        assert v["ids_equal"] is True, (key, v)
        assert v["weights"] <= 1e-6, (key, v)  # fp32 weights: a few ulp apart at most
        assert v["out_vs_route"] <= v["tol"] and v["err"] <= v["tol"], (key, v)
        assert v["rerun_identical"] is True, (key, v)


def test_route_in_gate_up_refuses_what_it_cannot_take():
    from wsattn.kernels import moe as M
    E, k, H, F = 8, 2, 32, 16
    x = torch.randn(1, H)
    rw = torch.randn(E, H)
    wgu = torch.randn(E, 2 * F, H)
    tables = M.one_token_tables(k, 16, "cpu")
    with pytest.raises(ValueError, match=r"x must be \[1, H\]"):
        M.route_logits(torch.randn(2, H), rw, top_k=k, renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        M.route_logits(x, rw, top_k=E + 1, renormalize=True)
    # checked before any launch: a grouping not made from route.ids, the wrong type
    fake = M.LogitsRoute(torch.zeros(1, E), torch.zeros(1, k), torch.zeros(1, k, dtype=torch.int32),
                         k, True, False)
    other = M.one_token_grouping(torch.zeros(1, k, dtype=torch.int32), E, 16, tables)
    with pytest.raises(ValueError, match=r"one_token_grouping\(route.ids"):
        M.moe_gate_up(x, wgu, other, route=fake)
    with pytest.raises(TypeError, match="LogitsRoute"):
        M.moe_gate_up(x, wgu, other, route=(fake.logits, fake.weights))
    g = M.one_token_grouping(fake.ids, E, 16, tables)
    with pytest.raises(ValueError, match="impl 'triton'"):
        M.moe_gate_up(x, wgu, g, route=fake, impl="gluon")
    wrong_e = M.LogitsRoute(torch.zeros(1, E + 1), fake.weights, fake.ids, k, True, False)
    with pytest.raises(ValueError, match="route has logits"):
        M.moe_gate_up(x, wgu, g, route=wrong_e)


def test_one_token_grouping_refuses_bad_input_by_name():
    from wsattn.kernels import moe as M
    ids = torch.tensor([[3, 1]], dtype=torch.int32)
    tables = M.one_token_tables(2, 16, "cpu")
    assert M.one_token_grouping(ids, 4, 16, tables).expert_of_block.data_ptr() == ids.data_ptr()
    with pytest.raises(ValueError, match=r"topk_ids must be a \[1, top_k\]"):
        M.one_token_grouping(torch.tensor([[3, 1], [0, 2]], dtype=torch.int32), 4, 16, tables)
    with pytest.raises(TypeError, match="int32"):
        M.one_token_grouping(ids.long(), 4, 16, tables)
    with pytest.raises(ValueError, match="num_experts"):
        M.one_token_grouping(ids, 1, 16, tables)
    with pytest.raises(ValueError, match=r"one_token_tables\(top_k=2, block=4\)"):
        M.one_token_grouping(ids, 4, 4, tables)
    with pytest.raises(ValueError, match="block must be one of"):
        M.one_token_tables(2, 8, "cpu")


def test_router_ties_lower_index_first_and_nan_propagates():
    """torch.topk orders ties arbitrarily (CPU gave [2, 4, 1]); the router's rule is the
    stable descending sort, and a NaN logit gives NaN weights, never a dropped token."""
    r = _child("ties_nan")
    assert r["tie_ids_token0"] == [2, 5, 6], r
    assert r["ties_equal_reference"] is True, r
    assert r["nan_ids"] == [0, 1, 2] and r["nan_weights_all_nan"] is True, r
    assert r["others_finite"] is True and r["nan_row_out_all_nan"] is True, r
    assert r["other_rows"] <= TOL["float32"], r
    assert r["sigmoid_nan_ids"][0] == 4 and r["sigmoid_nan_ids"] == r["sigmoid_nan_ref_ids"], r
    assert r["sigmoid_nan_first_weight_nan"] is True, r


def test_bf16_runs_in_fp32_under_the_interpreter():
    r = _child("bf16")
    assert r["dtype"] == "torch.bfloat16" and r["out"] <= 2e-2, r


def test_pdl_refused_off_sm90():
    r = _child("pdl")
    assert r["error"] and "pdl=True needs a CUDA GPU of sm_90" in r["error"], r


# --------------------------------------------------------------------------- DeepSeek-V3 routing

@functools.lru_cache(maxsize=None)
def _ds(dtype):
    return _child("ds", dtype=dtype)


@functools.lru_cache(maxsize=None)
def _ds_cases():
    return _child("ds_cases")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_deepseek_route_matches_reference_and_transformers(dtype):
    """route(scoring="sigmoid", score_bias=, groups=, topk_groups=, scale=2.5): the ids of
    the float64 Dots1TopkRouter reference with the stable-sort tie rule, weights within fp32
    rounding of it (E 16 / 64, groups 1 / 4 with 1 / 2 kept, renormalised or not, T 1 / 5);
    on fp32 inputs also the ids of transformers' own Dots1TopkRouter (a set: it sorts
    nothing) and its weights id for id."""
    r = _ds(dtype)
    assert len(r["route"]) == 2 * 3 * 2 * 2, r["route"]
    for key, v in r["route"].items():
        assert v["ids_equal"] is True, (key, v)
        assert v["weights"] <= 2e-6, (key, v)  # weights ~ 2.5 / k: a few fp32 ulp
        assert v["dtypes"] == ["torch.float32", "torch.int32"], (key, v)
    if dtype == "float32":
        assert len(r["hf"]) == 2 * 3 * 2 * 2, r["hf"]
        for key, v in r["hf"].items():
            assert v["ids_equal"] is True and v["weights"] <= 2e-6, (key, v)
    else:
        assert not r["hf"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_deepseek_topk_inside_the_gate_up_launch_routes_as_route_does(dtype):
    """route_logits(score_bias=, groups=, topk_groups=, scale=) + moe_gate_up(route=): the
    ids route() and the float64 reference give (a tie by an equal router row and bias
    included), weights within rounding of route()'s, the output within tolerance of
    route()'s path and of float64, bit-identical on a rerun: DeepSeek-V3's E 256 in 8
    groups (4 kept), groups and group sizes that are not powers of two, bias only, groups
    only, FMA and dot blocks."""
    r = _ds(dtype)["slot"]
    assert len(r) == 7, r
    for key, v in r.items():
        assert v["ids_equal"] is True, (key, v)
        assert v["weights"] <= 1e-6 and v["weights_ref"] <= 2e-6, (key, v)
        assert v["out_vs_route"] <= v["tol"] and v["err"] <= v["tol"], (key, v)
        assert v["rerun_identical"] is True, (key, v)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_deepseek_moe_block_against_float64_reference(dtype):
    r = _ds(dtype)["block"]
    assert len(r) == 4, r
    for key, v in r.items():
        assert v["out"] <= v["tol"] and v["ids_equal"] is True, (key, v)
        assert v["weights"] <= 2e-6 and v["rerun_identical"] is True, (key, v)
        assert v["dtype"] == f"torch.{dtype}", (key, v)


def _agree(v):
    """route(), the gate/up launch and the float64 reference chose the same ids."""
    return v["ids"] == v["slot_ids"] == v["ref_ids"]


def test_score_bias_moves_the_choice_not_the_weights():
    r = _ds_cases()
    s = r["sigmoid"]
    assert _agree(r["no_bias"]) and r["no_bias"]["ids"][0] == 3, r["no_bias"]
    v = r["bias"]
    # the largest logit (expert 3) with a bias of -10 is out; expert 7 (a logit of -1,
    # a bias of +1) is first; the weights are the unbiased sigmoids
    assert _agree(v) and 3 not in v["ids"] and v["ids"][0] == 7, v
    for w in (v["w"], v["slot_w"]):
        assert w == pytest.approx([s[i] for i in v["ids"]], rel=1e-6, abs=0), v
    v = r["bias_renorm"]
    assert _agree(v) and v["ids"] == r["bias"]["ids"], v
    chosen = [s[i] for i in v["ids"]]
    want = [2.5 * c / (sum(chosen) + 1e-20) for c in chosen]
    assert v["w"] == pytest.approx(want, rel=1e-6) and v["slot_w"] == pytest.approx(want, rel=1e-6)


def test_group_limit_moves_the_choice():
    r = _ds_cases()
    assert all(_agree(v) for k, v in r.items() if k.startswith("groups")), r
    assert r["groups_off"]["ids"] == [0, 8]  # the global top two
    # group 0 (the global top, nothing else) loses; group 1's duplicated max counts twice
    # (1.462 against group 2's 1.424)
    assert r["groups_1"]["ids"] == [4, 5]
    assert r["groups_2"]["ids"] == [8, 4, 5]  # groups 1 and 2 kept
    v = r["groups_bias"]  # group 3 biased ahead; its weights still sigmoid(-2)
    assert v["ids"] == [12, 13] and v["w"] == pytest.approx([0.11920292] * 2, rel=1e-6), v


def test_deepseek_routing_nan_and_ties():
    """A NaN logit ranks above every number: its group is kept whatever its other keys,
    it is chosen first with a NaN weight (all NaN when renormalised), and the token's MoE
    output is NaN; a token of NaN logits gets ids 0..k-1. Equal keys (equal logits and
    bias) and equal group scores: the lower index first."""
    r = _ds_cases()
    for name in ("nan_renorm", "nan_raw", "all_nan", "tie_keys", "tie_groups_1",
                 "tie_groups_2"):
        assert _agree(r[name]), (name, r[name])
    v = r["nan_renorm"]
    assert v["ids"][0] == 9 and all(math.isnan(w) for w in v["w"] + v["slot_w"]), v
    v = r["nan_raw"]
    assert v["ids"][0] == 9 and math.isnan(v["w"][0]) and math.isnan(v["slot_w"][0]), v
    assert all(math.isfinite(w) for w in v["w"][1:] + v["slot_w"][1:]), v
    assert v["w"][1:] == pytest.approx(v["ref_w"][1:], rel=1e-6), v
    v = r["all_nan"]
    assert v["ids"] == [0, 1, 2, 3] and all(math.isnan(w) for w in v["w"] + v["slot_w"]), v
    assert r["moe_nan"]["nan_row"] is True and r["moe_nan"]["other_row"] <= TOL["float32"]
    assert r["tie_keys"]["ids"][:2] == [2, 6], r["tie_keys"]
    assert r["tie_groups_1"]["ids"] == [4, 5, 6], r["tie_groups_1"]
    assert r["tie_groups_2"]["ids"] == [4, 12, 5, 13], r["tie_groups_2"]


# --------------------------------------------------------------------------- validation

def _m():
    from wsattn.kernels import moe
    return moe


def _args(T=2, E=4, k=2, H=16, F=8, dt=torch.float32):
    return dict(x=torch.randn(T, H, dtype=dt), router_w=torch.randn(E, H, dtype=dt),
                w_gate_up=torch.randn(E, 2 * F, H, dtype=dt), w_down=torch.randn(E, H, F, dtype=dt),
                top_k=k, renormalize=True)


@pytest.mark.parametrize("change, error, match", [
    (dict(top_k=5), ValueError, r"top_k must be an int in 1..E=4"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(x=torch.randn(65, 16)), ValueError, "T=65 tokens"),
    (dict(x=torch.randn(2, 16, 1)), ValueError, r"x must be \[T, H\]"),
    (dict(x=torch.randn(2, 16).double()), TypeError, "x dtype"),
    (dict(router_w=torch.randn(4, 15)), ValueError, r"router_w must be \[E, H=16\]"),
    (dict(router_w=torch.randn(4, 16).half()), TypeError, "router_w dtype"),
    (dict(router_w=torch.randn(300, 16)), ValueError, "route takes 1..256"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(scoring="softplus"), ValueError, "scoring must be one of"),
    (dict(norm_eps=0.0), ValueError, "norm_eps must be > 0"),
    (dict(norm_eps=1e-50), ValueError, "norm_eps .*fp32's normal range"),
    (dict(norm_eps=float("inf")), ValueError, "norm_eps .*fp32's normal range"),
    (dict(pdl="yes"), TypeError, "pdl must be None or a bool"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_route_refuses_bad_input_by_name(change, error, match):
    a = _args()
    a.update(change)
    with pytest.raises(error, match=match):
        _m().route(a["x"], a["router_w"], top_k=a["top_k"], renormalize=a["renormalize"],
                   **{k: a[k] for k in ("norm_eps", "scoring", "pdl") if k in a})


class _NoLaunch:
    """Stands in for a kernel: any launch fails the test (refusals come before one)."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched before the bad input was refused")


_BIAS = torch.zeros(4)


@pytest.mark.parametrize("change, error, match", [
    (dict(score_bias=_BIAS, scoring="softmax"), ValueError, "score_bias .*needs scoring='sigmoid'"),
    (dict(score_bias=torch.zeros(5)), ValueError, r"score_bias must be \[E=4\]"),
    (dict(score_bias=torch.zeros(4, 1)), ValueError, r"score_bias must be \[E=4\]"),
    (dict(score_bias=torch.zeros(4).double()), TypeError, "score_bias must be float32"),
    (dict(score_bias=torch.zeros(4).half()), TypeError, "score_bias must be float32"),
    (dict(score_bias=[0.0] * 4), TypeError, "score_bias must be None or a torch.Tensor"),
    (dict(score_bias=torch.zeros(4, device="meta")), ValueError, "score_bias must be on x"),
    (dict(score_bias=torch.zeros(8)[::2]), ValueError, "score_bias must be contiguous"),
    (dict(groups=3), ValueError, "groups must be a divisor of E=4"),
    (dict(groups=0), ValueError, "groups must be a divisor"),
    (dict(groups=True), ValueError, "groups must be an int"),
    (dict(groups=2.0), ValueError, "groups must be an int"),
    (dict(groups=4), ValueError, r"groups=4 leaves E // groups = 1"),
    (dict(groups=2, scoring="softmax"), ValueError, r"groups > 1 .*needs scoring='sigmoid'"),
    (dict(groups=2, topk_groups=3), ValueError, r"topk_groups must be in 1..groups=2"),
    (dict(topk_groups=0), ValueError, r"topk_groups must be in 1..groups=1"),
    (dict(topk_groups=True), ValueError, "topk_groups must be an int"),
    (dict(groups=2, topk_groups=1, top_k=3), ValueError,
     r"top_k=3 exceeds .* topk_groups \* \(E // groups\) = 2"),
    (dict(scale=0.0), ValueError, "scale .*positive finite"),
    (dict(scale=-1.0), ValueError, "scale .*positive finite"),
    (dict(scale=float("nan")), ValueError, "scale .*positive finite"),
    (dict(scale=float("inf")), ValueError, "scale .*positive finite"),
    (dict(scale=True), ValueError, "scale .*positive finite"),
    (dict(scale="2"), ValueError, "scale .*positive finite"),
    (dict(scale=1e39), ValueError, "scale .*fp32's normal range"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_deepseek_routing_refuses_bad_input_by_name(change, error, match, monkeypatch):
    """route, route_logits and moe refuse a bad score_bias / groups / topk_groups / scale
    by name before any kernel runs (every launch here would fail the test)."""
    m = _m()
    for name in ("_router_logits_kernel", "_route_kernel", "_group_kernel", "_grouped_kernel"):
        monkeypatch.setattr(m, name, _NoLaunch())
    a = _args()
    kw = dict(top_k=a["top_k"], renormalize=True, scoring="sigmoid")
    kw.update(change)
    with pytest.raises(error, match=match):
        m.route(a["x"], a["router_w"], **kw)
    with pytest.raises(error, match=match):
        m.route_logits(a["x"][:1], a["router_w"], **kw)
    with pytest.raises(error, match=match):
        m.moe(a["x"], a["router_w"], a["w_gate_up"], a["w_down"], **kw)


def test_gate_up_refuses_a_logits_route_with_bad_routing():
    """A LogitsRoute built by hand is checked as route_logits checks its arguments."""
    m = _m()
    E, k, H, F = 8, 3, 32, 16
    ids = torch.zeros(1, k, dtype=torch.int32)
    g = m.one_token_grouping(ids, E, 16, m.one_token_tables(k, 16, "cpu"))
    base = (torch.zeros(1, E), torch.zeros(1, k), ids, k, True, True)
    for extra, match in (((torch.zeros(E), 3, 1, 1.0), "groups must be a divisor"),
                         ((torch.zeros(E + 1), 1, 1, 1.0), r"score_bias must be \[E=8\]"),
                         ((None, 2, 1, 0.0), "scale"),
                         ((None, 4, 1, 1.0), r"top_k=3 exceeds")):
        with pytest.raises(ValueError, match=match):
            m.moe_gate_up(torch.randn(1, H), torch.randn(E, 2 * F, H), g,
                          route=m.LogitsRoute(*base, *extra))
    soft = m.LogitsRoute(torch.zeros(1, E), torch.zeros(1, k), ids, k, True, False,
                         torch.zeros(E))
    with pytest.raises(ValueError, match="score_bias .*needs scoring='sigmoid'"):
        m.moe_gate_up(torch.randn(1, H), torch.randn(E, 2 * F, H), g, route=soft)


@pytest.mark.parametrize("ids, E, block, error, match", [
    (torch.zeros(2, 3, dtype=torch.int64), 4, 1, TypeError, "topk_ids must be int32"),
    (torch.zeros(2, 5, dtype=torch.int32), 4, 1, ValueError, "top_k=5 columns"),
    (torch.zeros(65, 2, dtype=torch.int32), 4, 1, ValueError, "T=65"),
    (torch.zeros(2, 2, dtype=torch.int32), 4, 8, ValueError, "block must be one of"),
    (torch.zeros(2, 2, dtype=torch.int32), 0, 1, ValueError, "num_experts"),
    (torch.zeros(3, 2, dtype=torch.int32).t(), 4, 1, ValueError, "contiguous"),
], ids=["int64", "k_gt_E", "T65", "block8", "E0", "strided"])
def test_group_refuses_bad_input_by_name(ids, E, block, error, match):
    with pytest.raises(error, match=match):
        _m().group(ids, E, block)


def _fake_grouping(E=4, k=2, T=2, block=1):
    m = _m()
    nb = m.blocks_max(T, k, E, block)
    z = torch.zeros
    return m.Grouping(z(nb * block, dtype=torch.int32), z(E + 1, dtype=torch.int32),
                      z(nb, dtype=torch.int32), z(1, dtype=torch.int32),
                      z(E, dtype=torch.int32), block, k, E, T)


@pytest.mark.parametrize("what, change, error, match", [
    ("gate_up", dict(w_gate_up=torch.randn(3, 16, 16)), ValueError, "w_gate_up has 3 experts"),
    ("gate_up", dict(w_gate_up=torch.randn(4, 16, 15)), ValueError, r"w_gate_up must be \[E, 2F, H=16\]"),
    ("gate_up", dict(w_gate_up=torch.randn(4, 15, 16)), ValueError, "even 2F"),
    ("gate_up", dict(w_gate_up=torch.randn(4, 16, 16).half()), TypeError, "w_gate_up dtype"),
    ("gate_up", dict(grouping=(1, 2)), TypeError, "grouping must be the Grouping"),
    ("gate_up", dict(settings=2), TypeError, "settings must be None or a MoeSettings"),
    ("gate_up", dict(block_settings=4), ValueError, "differs from the grouping's block=1"),
    ("down", dict(w_down=torch.randn(4, 16, 7)), ValueError, r"w_down must be \[E, H, F=8\]"),
    ("down", dict(w_down=torch.randn(5, 16, 8)), ValueError, "w_down has 5 experts"),
    ("down", dict(topk_weights=torch.rand(2, 3)), ValueError, r"topk_weights must be \[T, top_k=2\]"),
    ("down", dict(topk_weights=torch.rand(2, 2).double()), TypeError, "float32"),
    ("down", dict(residual=torch.randn(2, 15)), ValueError, r"residual must be a \[T, H\]"),
    ("down", dict(out=torch.randn(2, 16).half()), TypeError, "out dtype"),
    ("down", dict(act=torch.randn(5, 8)), ValueError, "act must be"),
    # the grouping was made for T=2: fewer or more tokens would read or write past a buffer
    ("gate_up", dict(x=torch.randn(1, 16)), ValueError, "x has T=1 tokens; the grouping was made for 2"),
    ("gate_up", dict(x=torch.randn(3, 16)), ValueError, "x has T=3 tokens"),
    ("down", dict(topk_weights=torch.rand(1, 2)), ValueError, "topk_weights has T=1 tokens; the grouping"),
    ("down", dict(topk_weights=torch.rand(4, 2)), ValueError, "topk_weights has T=4 tokens"),
    ("down", dict(topk_weights=torch.rand(2, 2, device="meta")), ValueError, "topk_weights must be on act's device"),
    ("down", dict(out=torch.empty(1, 16).expand(2, 16)), ValueError, "out's elements overlap"),
    ("down", dict(partial_overlap=True), ValueError, "out must be residual itself or not overlap it"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_grouped_launchers_refuse_bad_input_by_name(what, change, error, match):
    m = _m()
    a = _args()
    g = _fake_grouping()
    kw = dict(grouping=g, act=torch.randn(g.sorted_pairs.shape[0], 8),
              topk_weights=torch.rand(2, 2), residual=None, out=None, settings=None)
    a.update(kw)
    if "block_settings" in change:
        change = dict(settings=m.MoeSettings(block=change["block_settings"], BLOCK_N=16, BLOCK_K=16))
    if "partial_overlap" in change:
        buf = torch.randn(3, 16)
        change = dict(residual=buf[0:2], out=buf[1:3])
    a.update(change)
    with pytest.raises(error, match=match):
        if what == "gate_up":
            m.moe_gate_up(a["x"], a["w_gate_up"], a["grouping"], settings=a["settings"])
        else:
            m.moe_down_combine(a["act"], a["w_down"], a["grouping"], a["topk_weights"],
                               a["out"], residual=a["residual"])


def test_an_exact_alias_of_the_residual_is_the_one_overlap_taken():
    """out may be residual itself (the residual stream updated in place): the same bits
    as a separate out (interpreter)."""
    r = _child("alias")
    assert r == {"equal": True, "same_tensor": True}, r


@pytest.mark.parametrize("change, error, match", [
    (dict(w_gate_up=torch.randn(4, 16, 16).half()), TypeError, "w_gate_up dtype"),
    (dict(w_gate_up=torch.randn(3, 16, 16)), ValueError, "w_gate_up has 3 experts"),
    (dict(w_gate_up=torch.randn(4, 15, 16)), ValueError, "even 2F"),
    (dict(w_gate_up=torch.randn(4, 16, 15)), ValueError, r"w_gate_up must be \[E=4, 2F, H=16\]"),
    (dict(w_down=torch.randn(4, 32, 8)), ValueError, r"w_down must be \[E=4, H=16, F=8\]"),
    (dict(w_down=torch.randn(4, 8, 8)), ValueError, r"w_down must be \[E=4, H=16, F=8\]"),
    (dict(w_down=torch.randn(4, 16, 4)), ValueError, r"w_down must be \[E=4, H=16, F=8\]"),
    (dict(w_down=torch.randn(5, 16, 8)), ValueError, "w_down has 5 experts"),
    (dict(residual=torch.randn(1, 16)), ValueError, r"residual must be a \[T, H\]"),
    (dict(out=torch.empty(2, 16).half()), TypeError, "out dtype"),
    (dict(settings="fast"), TypeError, "settings must be None or a MoeSettings"),
    (dict(pdl=1), TypeError, "pdl must be None or a bool"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_moe_refuses_everything_before_its_first_launch(change, error, match, monkeypatch):
    """moe() checks the expert weights (against x's H and w_gate_up's F), residual, out
    and settings before route's first kernel, not after the kernels before each
    launcher have run (every launch here fails the test)."""
    m = _m()
    for name in ("_router_logits_kernel", "_route_kernel", "_group_kernel", "_grouped_kernel",
                 "_combine_kernel"):
        monkeypatch.setattr(m, name, _NoLaunch())
    a = _args()
    kw = dict(residual=None, out=None, settings=None, pdl=None)
    kw.update({k: v for k, v in change.items() if k in kw})
    a.update({k: v for k, v in change.items() if k not in kw})
    with pytest.raises(error, match=match):
        m.moe(a["x"], a["router_w"], a["w_gate_up"], a["w_down"], top_k=2, renormalize=True,
              **kw)


def test_settings_refuse_bad_values():
    m = _m()
    with pytest.raises(ValueError, match="block must be one of"):
        m.MoeSettings(block=8, BLOCK_N=32, BLOCK_K=32)
    for block in (True, 16.0):
        with pytest.raises(ValueError, match="block must be one of"):
            m.MoeSettings(block=block, BLOCK_N=32, BLOCK_K=32)
        with pytest.raises(ValueError, match="block must be one of"):
            m.group(torch.zeros(2, 2, dtype=torch.int32), 4, block)
        with pytest.raises(ValueError, match="block must be one of"):
            m.one_token_tables(2, block, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        m.MoeSettings(block=1, BLOCK_N=24, BLOCK_K=32)
    with pytest.raises(ValueError, match="BLOCK_N and BLOCK_K >= 16"):
        m.MoeSettings(block=16, BLOCK_N=8, BLOCK_K=32)


def test_blocks_max_bounds_every_grouping():
    """The static row count covers the worst case: every touched expert one pair past a
    block boundary."""
    m = _m()
    for T, k, E, block in ((1, 8, 128, 1), (8, 8, 128, 4), (64, 8, 128, 16), (3, 2, 4, 32)):
        pairs = T * k
        worst = sum(-(-c // block) for c in [1] * min(E, pairs))  # one pair per expert
        if pairs > E:  # the rest piled on so that as many experts as possible spill a block
            worst = max(worst, sum(-(-c // block) for c in
                                   [pairs // E + (i < pairs % E) for i in range(E)]))
        assert m.blocks_max(T, k, E, block) >= worst


# --------------------------------------------------------------------------- compile-only

QWEN3_30B = dict(H=2048, E=128, top_k=8, F=768)
KERNELS = {"router_logits": dict(norm=True), "route": {}, "group": {}, "gate_up": dict(norm=True), "down": {},
           "combine": dict(residual=True)}


DEEPSEEK_V3 = dict(H=7168, E=256, top_k=8, F=2048)
DEEPSEEK_V3_ROUTING = dict(scoring="sigmoid", score_bias=True, groups=8, topk_groups=4)


def _compile(kernel, shape=QWEN3_30B, **kw):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = _m().compile_spec(90, kernel, **shape, **kw)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])


@pytest.mark.parametrize("T", [1, 8, 64], ids=lambda t: f"T{t}")
def test_sm90_qwen3_30b_builds_do_not_spill_and_pdl_waits(T, record_property):
    from test_prefill_compile import _ptxas_usage
    rows = []
    for kernel, flags in KERNELS.items():
        k = _compile(kernel, T=T, pdl=True, **flags)
        regs, stores, loads = _ptxas_usage(k)
        row = f"T{T} {kernel}: {regs} regs, spills {stores}/{loads}, shared {k.metadata.shared}"
        rows.append(row)
        record_property(f"T{T}.{kernel}.registers", regs)
        record_property(f"T{T}.{kernel}.spill_bytes", stores + loads)
        assert stores + loads == 0, row
        assert k.metadata.shared <= 232448, row
        ptx = k.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") == 1, row
        assert ptx.count("griddepcontrol.launch_dependents") == 1, row
        assert k.metadata.launch_pdl, row
    print("\n".join(rows))


def test_sm90_gate_up_with_the_top_k_inside_does_not_spill(record_property):
    """The one-token gate/up build that selects its slot's expert itself (route=): no
    spills at the Qwen3-30B-A3B shape, one PDL wait, and the logits read after it."""
    from test_prefill_compile import _ptxas_usage
    k = _compile("gate_up", T=1, pdl=True, norm=True, route=True)
    regs, stores, loads = _ptxas_usage(k)
    record_property("T1.gate_up_route.registers", regs)
    assert stores + loads == 0, (regs, stores, loads)
    ptx = k.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert k.metadata.launch_pdl


def test_sm90_deepseek_v3_routing_builds_do_not_spill(record_property):
    """DeepSeek-V3's routing (sigmoid, e_score_correction_bias, 8 groups of 32 of which 4
    kept, top 8 of 256) in the top-k kernel (T 1 and 64) and in the one-token gate/up build
    that selects its slot itself: no spills, one PDL wait; the top-k kernel loads the bias
    (a weight) before the wait and the logits after it."""
    from test_prefill_compile import _ptxas_usage
    for kernel, kw in (("route", dict(T=1)), ("route", dict(T=64)),
                       ("gate_up", dict(T=1, norm=True, route=True))):
        k = _compile(kernel, shape=DEEPSEEK_V3, pdl=True, **DEEPSEEK_V3_ROUTING, **kw)
        regs, stores, loads = _ptxas_usage(k)
        row = f"{kernel} {kw}: {regs} regs, spills {stores}/{loads}"
        record_property(f"deepseek_v3.{kernel}.T{kw['T']}.registers", regs)
        assert stores + loads == 0, row
        assert k.asm["ptx"].count("griddepcontrol.wait") == 1, row
        if kernel == "route":
            ttgir = k.asm["ttgir"]
            tw = ttgir.index("griddepcontrol.wait")
            assert [n.split("_")[0] for n in re.findall(r"(%\w+) = tt\.load", ttgir[:tw])] \
                == ["%bias"], row
            assert re.search(r"%logits\w* = tt\.load", ttgir[tw:]), row


def test_sm90_router_loads_its_weight_before_the_pdl_wait():
    ttgir = _compile("router_logits", T=8, pdl=True, norm=True).asm["ttgir"]
    tw = ttgir.index("griddepcontrol.wait")
    names = re.findall(r"(%\w+) = tt\.load", ttgir[:tw])
    assert [n.split("_")[0] for n in names] == ["%w"], names  # the router weight only
    assert re.search(r"%xv\w* = tt\.load", ttgir[tw:])


def test_sm90_pdl_off_has_no_griddepcontrol():
    for kernel, flags in KERNELS.items():
        assert "griddepcontrol" not in _compile(kernel, T=8, **flags).asm["ptx"], kernel


def test_sm90_grouped_dot_path_uses_wgmma_at_64_tokens():
    ptx = _compile("gate_up", T=64, norm=True).asm["ptx"]
    assert "wgmma" in ptx or "mma.sync" in ptx


# --------------------------------------------------------------------------- GPU

def _qwen3_30b_gpu_layer(T, seed):
    """A Qwen3-30B-A3B MoE layer on the GPU (H 2048, 128 experts top 8, F 768), bf16:
    (x, router_w, w_gate_up, w_down, residual, top_k)."""
    torch.manual_seed(seed)
    dt, dev = torch.bfloat16, "cuda"
    H, E, k, F = 2048, 128, 8, 768
    x = torch.randn(T, H, device=dev).to(dt)
    rw = torch.randn(E, H, device=dev).to(dt)
    wgu = (torch.randn(E, 2 * F, H, device=dev) / H ** 0.5).to(dt)
    wd = (torch.randn(E, H, F, device=dev) / F ** 0.5).to(dt)
    r = torch.randn(T, H, device=dev).to(dt)
    return x, rw, wgu, wd, r, k


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64], ids=lambda t: f"T{t}")
def test_gpu_bf16_qwen3_30b_shape_against_reference_and_reruns(T):
    m = _m()
    dt = torch.bfloat16
    x, rw, wgu, wd, r, k = _qwen3_30b_gpu_layer(T, 0)
    ns = {"torch": torch}
    exec(REFERENCE, ns)  # the float64 reference the interpreter children run, in this process
    ref, rv, ri = ns["reference_moe"](x.cpu(), rw.cpu(), wgu.cpu(), wd.cpu(), k, True, 1e-6, r.cpu())
    w, ids = m.route(x, rw, top_k=k, renormalize=True, norm_eps=1e-6)
    assert torch.equal(ids.long().cpu(), ri)
    kw = dict(top_k=k, renormalize=True, norm_eps=1e-6, residual=r)
    y1 = m.moe(x, rw, wgu, wd, **kw)
    y2 = m.moe(x, rw, wgu, wd, **kw)
    y3 = m.moe(x, rw, wgu, wd, pdl=False, **kw)
    from wsattn.testing import assert_close
    assert_close(y1, ref, dt)
    assert torch.equal(y1, y2) and torch.equal(y1, y3)


@pytest.mark.gpu
def test_gpu_moe_captures_in_a_cuda_graph():
    m = _m()
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(8, 256, device=dev).to(dt)
    rw = torch.randn(16, 256, device=dev).to(dt)
    wgu = (torch.randn(16, 2 * 128, 256, device=dev) / 16).to(dt)
    wd = (torch.randn(16, 256, 128, device=dev) / 11).to(dt)
    out = torch.empty_like(x)
    kw = dict(top_k=4, renormalize=True, out=out)
    eager = m.moe(x, rw, wgu, wd, **kw).clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m.moe(x, rw, wgu, wd, **kw)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, m.moe(x, rw, wgu, wd, top_k=4, renormalize=True))
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "nopdl"])
def test_gpu_topk_inside_gate_up_at_the_qwen3_30b_shape(pdl):
    """One token at the Qwen3-30B-A3B shape (128 experts, top 8), bf16: route_logits +
    moe_gate_up(route=) writes route()'s ids and its weights within rounding, and the
    layer's output is within bf16 tolerance of float64 and bit-identical on a rerun, the
    weight and id buffers NaN / -1 poisoned before each run."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    m = _m()
    x, rw, wgu, wd, r, k = _qwen3_30b_gpu_layer(1, seed=5)
    E, block = rw.shape[0], 16
    ns = {"torch": torch}
    exec(REFERENCE, ns)
    ref, rv, ri = ns["reference_moe"](x.cpu(), rw.cpu(), wgu.cpu(), wd.cpu(), k, True, 1e-6,
                                      r.cpu())
    w, ids = m.route(x, rw, top_k=k, renormalize=True, norm_eps=1e-6, pdl=pdl)
    tables = m.one_token_tables(k, block, x.device)
    outs = []
    for _ in range(2):
        rt = m.route_logits(x, rw, top_k=k, renormalize=True, norm_eps=1e-6, pdl=pdl)
        rt.weights.fill_(float("nan"))
        rt.ids.fill_(-1)
        g = m.one_token_grouping(rt.ids, E, block, tables)
        act = m.moe_gate_up(x, wgu, g, norm_eps=1e-6, pdl=pdl, route=rt)
        outs.append((m.moe_down_combine(act, wd, g, rt.weights, residual=r, pdl=pdl), rt))
    (y1, rt), (y2, _) = outs
    assert torch.equal(rt.ids, ids) and torch.equal(ids.long().cpu(), ri)
    assert (rt.weights - w).abs().max().item() <= 1e-6
    from wsattn.testing import assert_close
    assert_close(y1, ref, torch.bfloat16)
    assert torch.equal(y1, y2)
