"""The MoE decode kernels (wsattn.kernels.moe: route / route_logits, group /
one_token_grouping, the grouped gate/up and down projections, the combine) against
transformers' own sparse MoE block, and the kernel step's greedy decode against
transformers' generate, for tiny random fp32 Qwen3-MoE, Mixtral, OLMoE and dots1 models
(test_models_moe's tiny_model: its configs, seeds and weight scaling; dots1 with
DeepSeek-V3's sigmoid routing, its score-correction bias and group-limited top-k).

transformers 5.x names (5.17, read from its modeling files): the block is
``model.model.layers[i].mlp`` (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock,
OlmoeSparseMoeBlock; Mixtral's checkpoint key block_sparse_moe is loaded into ``mlp``);
its router ``mlp.gate`` (``*TopKRouter``) returns ``(router_logits [T, E],
router_scores [T, k], router_indices [T, k])``: torch.topk over the fp32 softmax
(descending), the k weights renormalised always for Mixtral and per norm_topk_prob for
the others (dots1's ``Dots1TopkRouter``: sigmoid scores, bias, groups, listed by
``torch.topk(..., sorted=False)``, so its experts are compared as a set and each weight
with its expert's); its experts ``mlp.experts`` hold ``gate_up_proj [E, 2F, H]`` and
``down_proj [E, H, F]``, and their forward is the one config._experts_implementation
names ("grouped_mm" by default, or the "eager" per-expert loop; both are compared).

The kernels run through the Triton interpreter in a fresh child process
(TRITON_INTERPRET=1, outputs NaN-poisoned), fp32 on both sides."""

from __future__ import annotations

import concurrent.futures
import json
import os
import textwrap

from conftest import assert_matches_generate, interpreter_child

TESTS = os.path.dirname(os.path.abspath(__file__))
NAMES = ["qwen3_moe-norm", "mixtral", "olmoe", "dots1"]  # test_models_moe.CONFIGS keys
# tokens of a block call: 1 (the one-token path in the step); pairs B*top_k = 6 and 26,
# not a multiple of the grouping block (16); 64 tokens, the kernels' most, 128 pairs, a
# multiple of it (Mixtral's 4 experts there: 32 pairs an expert, block 32)
BATCHES = [1, 3, 13, 64]
# fp32 both sides; the two differ by summation order and by the FlashNorm folding only
# (measured: <= 1.8e-7 on the weights, <= 8.7e-7 on a token's block output)
WEIGHTS_ABS = 1e-6  # routing weights lie in [0, 1]
BLOCK_REL = 5e-6  # relative error of one token's block output
# every compared order of transformers' logits is at least this far apart (measured
# >= 2.2e-4): the logits here are below 3 in magnitude, fp32 rounds them by ~2e-7 and the
# kernels sum them in another order, so a pair within ~1e-6 could swap legitimately
MIN_LOGIT_GAP = 1e-4
N_NEW = 32
PROMPT_LENS = [7, 4]  # test_models_moe's: bucket 2, the step's grouping-kernel path
FP32_LOGITS = 1e-5  # one step's logits, relative, as test_models_moe / test_runner_moe
# 32 interpreted decode steps cost 20-27 CPU seconds a family; all three the issue names:
# Qwen3-MoE (renormalised, per-head QK-norm), Mixtral (top-2 of 4, always renormalised)
# and OLMoE (not renormalised, QK-norm over the whole projection), and dots1 (DeepSeek-V3
# routing: the only family whose router has a bias and groups)
GENERATE_NAMES = ["qwen3_moe-norm", "mixtral", "olmoe", "dots1"]

CHILD = textwrap.dedent(r'''
    import json, sys
    sys.path.insert(0, sys.argv[3])  # tests/: test_models_moe's tiny models
    import torch
    from test_models_moe import tiny_model
    from wsattn.engine import runner as R
    from wsattn.engine.generate import Engine
    from wsattn.kernels import moe as M
    from wsattn.models import load
    from wsattn.testing import rel_err

    torch.set_num_threads(1)
    case, arg = sys.argv[1], json.loads(sys.argv[2])
    name = arg["name"]
    model = tiny_model(name)
    res = {"experts_impl": model.config._experts_implementation}

    def token_err(out, ref):  # worst per-token relative error of [T, H] outputs
        return max(rel_err(out[t], ref[t]) for t in range(ref.shape[0]))

    if case == "block":
        cfg, _ = load(model)
        k, E = cfg.top_k, cfg.experts
        res["moe_layers"] = list(cfg.moe_layers)
        # the step's routes, read back after its _moe (route_logits' ids and weights are
        # written by the gate/up launch)
        routes = []
        real_route, real_route_logits = R.route, R.route_logits

        def spy(real):
            def call(*a, **kw):
                routes.append(real(*a, **kw))
                return routes[-1]
            return call

        R.route, R.route_logits = spy(real_route), spy(real_route_logits)
        e = Engine(model, step="kernels", device="cpu", num_pages=4, page_size=16)
        step = e.step
        res["cases"] = {}
        for i in cfg.moe_layers:
            layer = model.model.layers[i]
            block = layer.mlp
            for B in arg["batches"]:
                g = torch.Generator().manual_seed(1000 * i + B)
                h = torch.randn(B, cfg.hidden, generator=g)  # the residual stream
                refs = {}
                with torch.no_grad():
                    x = layer.post_attention_layernorm(h)  # the block's input
                    logits, hf_w, hf_ids = block.gate(x)
                    keys = logits.float()
                    if cfg.scoring == "sigmoid":  # the choice's keys; sorted=False lists
                        keys = keys.sigmoid() + block.gate.e_score_correction_bias
                        order = hf_ids.argsort(-1)
                        hf_ids, hf_w = hf_ids.gather(1, order), hf_w.gather(1, order)
                    for impl in ("grouped_mm", "eager"):
                        model.set_experts_implementation(impl)
                        refs[impl] = block(x[None])[0]
                    model.set_experts_implementation(res["experts_impl"])
                    # the routed experts alone, what the four kernels compute (dots1's
                    # block adds its shared experts after them)
                    shared = (block.shared_experts(x) if hasattr(block, "shared_experts")
                              else 0)
                    routed = {impl: ref - shared for impl, ref in refs.items()}
                top = keys.sort(-1, descending=True).values[:, :k + 1]
                r = res["cases"][f"layer{i}-B{B}"] = {
                    "gap": (top[:, :-1] - top[:, 1:]).min().item(),
                    "B": B, "hf_shapes": [list(hf_w.shape), list(hf_ids.shape)]}

                def compare(path, wts, ids, out, refs):
                    if cfg.scoring == "sigmoid":  # as transformers' list, by expert id
                        order = ids.long().argsort(-1)
                        ids, wts = ids.gather(1, order), wts.gather(1, order)
                    r[path] = {"ids": torch.equal(ids.long(), hf_ids),
                               "sets": all(set(a) == set(b) for a, b in
                                           zip(ids.tolist(), hf_ids.tolist())),
                               "weights": (wts - hf_w).abs().max().item(),
                               "out": max(token_err(out, ref) for ref in refs.values())}

                # transformers' weights, its block input: route -> group -> gate/up ->
                # down + combine at the step's grouping block for B rows
                bias = getattr(block.gate, "e_score_correction_bias", None)
                wts, ids = M.route(x, block.gate.weight.detach(), top_k=k,
                                   renormalize=cfg.norm_topk, scoring=cfg.scoring,
                                   score_bias=bias, groups=cfg.router_groups,
                                   topk_groups=cfg.router_topk_groups,
                                   scale=cfg.routed_scale)
                grouping = M.group(ids, E, M.default_block(B, k, E))
                act = M.moe_gate_up(x, block.experts.gate_up_proj.detach(), grouping)
                out = M.moe_down_combine(act, block.experts.down_proj.detach(), grouping, wts)
                compare("kernels", wts, ids, out, routed)
                r["block"], r["pairs"] = grouping.block, B * k

                # the step's own _moe at bucket B: FlashNorm-folded weights, the residual
                # stream in place (h + block(norm(h))); at B = 1 route_logits and the
                # one-token grouping
                buf = R._Buffers(cfg, B, step.max_pages, torch.float32, torch.device("cpu"))
                hh = h.clone()
                routes.clear()
                step._moe(step.weights.layers[i], hh, buf)
                route = routes[-1]
                wts, ids = ((route.weights, route.ids) if isinstance(route, M.LogitsRoute)
                            else route)
                compare("step", wts, ids, hh - h, refs)
                r["step"]["residual"] = token_err(hh, h + refs["grouped_mm"])
                r["step"]["routes"] = [type(t).__name__ for t in routes]

    elif case == "generate":
        lens, n_new = arg["lens"], arg["n_new"]
        cfg, _ = load(model)
        ids = torch.randint(0, cfg.vocab, (len(lens), max(lens)),
                            generator=torch.Generator().manual_seed(3))
        prompts = [ids[b, :n] for b, n in enumerate(lens)]
        e = Engine(model, step="kernels", device="cpu")
        toks, logits = e.run(prompts, n_new, return_logits=True)  # [B, n_new, vocab]
        res["step"] = type(e.step).__name__
        res["launches"] = dict(e.step.launches)
        res["moe_layers"] = len(cfg.moe_layers)
        res["blocks"] = {str(b): buf.moe_block for b, buf in e.step._buffers.items()}
        res["tokens"] = [t[n:].tolist() for t, n in zip(toks, lens)]
        r = res["hf"] = {"tokens": [], "gen_err": [], "tf_err": [], "gap": [], "diff": []}
        for b, (p, n) in enumerate(zip(prompts, lens)):
            with torch.no_grad():
                out = model.generate(p[None], attention_mask=torch.ones_like(p[None]),
                                     max_new_tokens=n_new, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True,
                                     pad_token_id=0, eos_token_id=None)
                # teacher-forced: transformers' logits on the kernel step's tokens
                tf = model(toks[b][None]).logits[0, n - 1:-1]  # [n_new, vocab]
            gen = torch.stack(out.logits, 1)[0]
            r["tokens"].append(out.sequences[0, n:].tolist())
            r["gen_err"].append([rel_err(logits[b, s], gen[s]) for s in range(n_new)])
            r["tf_err"].append([rel_err(logits[b, s], tf[s]) for s in range(n_new)])
            top2 = tf.topk(2, dim=-1).values
            r["gap"].append((top2[:, 0] - top2[:, 1]).tolist())
            r["diff"].append((logits[b] - tf).abs().amax(-1).tolist())

    print("RESULT " + json.dumps(res))
''')


def _child(case: str, **arg) -> dict:
    return interpreter_child(CHILD, case, json.dumps(arg), TESTS)


def _each(case: str, names, **arg) -> dict:
    """The child for each family, two at a time (the interpreter is single-threaded; 2
    cores), the slowest (OLMoE, then Mixtral) first: {name: result}."""
    slowest_first = [n for n in ("olmoe", "mixtral", "dots1", "qwen3_moe-norm") if n in names]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_child, case, name=name, **arg) for name in slowest_first}
        return {name: futures[name].result() for name in names}


def test_moe_block_kernels_match_transformers():
    """Every MoE layer of each family, 1 to 64 tokens of random hidden states: the
    kernels on transformers' block weights and block input (route, group, grouped
    gate/up, down + combine), and the kernel step's _moe on its folded weights and the
    residual stream, choose transformers' experts in transformers' order, their weights
    within WEIGHTS_ABS, and each token's block output within BLOCK_REL of transformers'
    block (grouped_mm and eager experts)."""
    for name, r in _each("block", NAMES, batches=BATCHES).items():
        _check_block(name, r)


def _check_block(name, r):
    cases = r["cases"]
    assert r["experts_impl"] == "grouped_mm", r["experts_impl"]
    assert r["moe_layers"] == ([1] if name == "dots1" else [0, 1])
    assert len(cases) == len(BATCHES) * len(r["moe_layers"]), sorted(cases)
    for key, c in cases.items():
        where = f"{name} {key}"
        # the comparison's premise: no two compared logits near enough to swap by rounding
        assert c["gap"] >= MIN_LOGIT_GAP, f"{where}: logit gap {c['gap']:.2e}"
        assert c["hf_shapes"][0] == c["hf_shapes"][1] == [c["B"], 2], (where, c)
        for path in ("kernels", "step"):
            p = c[path]
            assert p["sets"] and p["ids"], f"{where} {path}: experts differ from transformers'"
            # dots1's weights are scaled by routed_scaling_factor (2.5)
            bound = WEIGHTS_ABS * (2.5 if name == "dots1" else 1)
            assert p["weights"] <= bound, f"{where} {path}: weights {p['weights']:.2e}"
            assert p["out"] <= BLOCK_REL, f"{where} {path}: block output {p['out']:.2e}"
        assert c["step"]["residual"] <= BLOCK_REL, (where, c["step"])
        one_token = key.endswith("-B1")
        assert c["step"]["routes"] == ["LogitsRoute" if one_token else "tuple"], (where, c)
    blocks = {c["block"] for c in cases.values()}
    assert blocks == ({16, 32} if name == "mixtral" else {16}), blocks
    # the grouping's padding rows are exercised: pairs off a block multiple, and on one
    assert any(c["pairs"] % c["block"] for c in cases.values())
    assert any(c["pairs"] % c["block"] == 0 for c in cases.values())


def test_kernel_step_greedy_32_tokens_match_transformers():
    """The kernel step of Qwen3-MoE, Mixtral, OLMoE and dots1 (prefill, then 31 decode steps
    through the MoE kernels at bucket 2) against transformers.generate, a batch of prompts
    of 7 and 4 tokens, 32 greedy tokens: tokens identical, every step's logits within
    FP32_LOGITS of generate's and of transformers' teacher-forced logits on the same
    tokens."""
    results = _each("generate", GENERATE_NAMES, lens=PROMPT_LENS, n_new=N_NEW)
    for name, r in results.items():
        steps = N_NEW - 1
        assert r["step"] == "KernelStep", (name, r["step"])
        moe = r["moe_layers"] * steps
        assert all(r["launches"].get(k) == moe for k in
                   ("moe_route", "moe_group", "moe_gate_up", "moe_down_combine")), \
            (name, r["launches"])
        assert r["blocks"] == {"2": 16}, (name, r["blocks"])
        hf = r["hf"]
        for b in range(len(PROMPT_LENS)):
            assert_matches_generate(f"{name} sequence {b}", hf, b, r["tokens"][b],
                                    FP32_LOGITS)
        # a random tiny model can fall into repeating one token, which checks less
        assert all(len(set(t)) > 2 for t in r["tokens"]), (name, r["tokens"])
