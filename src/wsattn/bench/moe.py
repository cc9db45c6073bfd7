"""`wsattn bench moe`: one mixture-of-experts layer of a decode step at real model shapes,
wsattn's Triton path against transformers' own MoE block and ``torch._grouped_mm``, in TB/s
of the touched expert weights and as a fraction of the copy ceiling.

Shapes (from the public ``config.json`` values below, through
:class:`~wsattn.models.ModelConfig`): Qwen3-30B-A3B (hidden 2048, 128 experts, top-8,
expert FFN 768, ``norm_topk_prob``), Mixtral-8x7B (hidden 4096, 8 experts, top-2, FFN
14336, always renormalised), OLMoE-1B-7B (hidden 2048, 64 experts, top-8, FFN 1024, not
renormalised), dots.llm1 (hidden 4096, 128 experts, top-6, FFN 1408: DeepSeek-V3's
sigmoid routing with a score-correction bias, renormalised and scaled by 2.5); B in {1,
8, 32, 64} tokens; bf16; random weights (seeded per model; dots.llm1's bias N(0, 0.02)
in float32) and random router inputs (seeded per case). The layer is the routed MLP of
a MoE layer after its RMSNorm: router, top-k, expert FFNs, combine; no residual, and no
shared experts (dots.llm1's are a dense MLP every token takes, a GEMV in the step).

Columns (``impl``):

* ``hf-<experts implementation>``: transformers' own sparse MoE block of the model type
  (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``,
  ``Dots1MoE`` with its shared experts taken out) built
  from the model config with ``config._experts_implementation`` set to each
  implementation transformers offers (5.17: ``eager``, ``batched_mm``, ``grouped_mm``,
  ``sonicmoe``, ``deepgemm``); one that cannot run here (a missing package, a dtype it
  refuses) is "not available" with the reason;
* ``torch-grouped-mm``: ``torch._grouped_mm`` over the case's tokens grouped by expert:
  the gather, both grouped GEMMs, SiLU·mul, the routing weights and the combine are
  timed; routing and grouping are computed beforehand and not timed (the note says so);
* ``wsattn-triton`` / ``wsattn-triton-pdl``: :func:`wsattn.kernels.moe.moe` (route,
  group, grouped gate/up, grouped down + combine: six launches, the router logits and
  the top-k being two, as are the down and the combine) with PDL off / on;
* ``wsattn-triton-token``: one token (B 1 only; "not available" above) as the decode
  step's bucket 1 runs it (``KernelStep``'s ``moe_one_token`` and ``moe_topk_in_gate_up``
  defaults): :func:`~wsattn.kernels.moe.route_logits` (the router logits only),
  :func:`~wsattn.kernels.moe.one_token_grouping` (no launch; its tables made once,
  before capture), the grouped gate/up selecting its slot's expert itself
  (``moe_gate_up(..., route=)``), then down and combine: four launches, PDL on where the
  GPU has it (sm_90+), as in the step. ``moe()`` itself groups with the kernel at every T
  (a stateless call cannot make the one-token tables outside a capture), so the
  ``wsattn-triton*`` columns at B 1 time two launches (top-k, grouping) the step does
  not run;
* ``wsattn-gluon``: :func:`wsattn.kernels.moe.moe` with ``impl="gluon"`` (the sm_90
  warp-specialized grouped kernel for gate/up and down; route, group and combine as
  above, PDL on where available); "not available" with the kernel's own reason while it
  is refused (not yet verified on a GPU, or not an sm_90 GPU, or not fp16/bf16).

Every column's output is checked before it is timed, against a float64 MoE layer
(:func:`reference`) from the same weights and that column's own routing (its router's
expert ids; weights recomputed in float64), within ``wsattn.testing.TOL``; a failed check
is recorded, not timed. ``tokens_rerouted`` counts the tokens whose expert set differs
from the float64 routing of the case (bf16 logits can flip a near tie).

Per row: ``experts_hit``, the distinct experts the column's own routing touches
(counted on the host from its checked call, outside timing; the weight copies are sized
from the float64 routing's count, once per case), ``touched_bytes`` = experts_hit x 3
x hidden x ffn x element size + the router weight, TB/s of those bytes, ``frac_copy`` =
that over the copy ceiling measured in the same run (the fraction of the touched-weight
floor), and on wsattn rows the issue's targets (Qwen3-30B-A3B shape: >= 0.80 at B 1
and 8, >= 0.70 at B 64; no target elsewhere) as met / missed, never asserted. The
weights are held in several copies where the touched bytes alone would fit in L2, and
each timed call reads the next copy (``copies`` in the row). Time is a CUDA-graph replay
(``wsattn.bench.timing.cuda_timer``); a column that cannot be captured (transformers'
eager expert loop reads the routing on the host) is timed eagerly and ``timing`` says so.

End to end (the whole decode step of a MoE model, ms/token next to transformers eager
and static cache + torch.compile) is the step benchmark's: ``wsattn bench step --models
qwen3-30b-a3b olmoe-1b-7b --batch 1 8 32 64 --ctx 4096`` (:mod:`wsattn.bench.step`; its
MoE models are these layers' configs; Mixtral-8x7B's weights do not fit there twice).
"""

from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass

import torch

from .cases import DTYPES, tbps
from .timing import _sync, release
from .gemv import FRESH_BYTES, write
from .report import fmt, status_text, target_text

BATCHES = (1, 8, 32, 64)
HF_EXPERTS = ("eager", "batched_mm", "grouped_mm", "sonicmoe", "deepgemm")
HF_IMPLS = tuple(f"hf-{e}" for e in HF_EXPERTS)
WSATTN_IMPLS = ("wsattn-triton", "wsattn-triton-pdl", "wsattn-triton-token", "wsattn-gluon")
IMPLS = HF_IMPLS + ("torch-grouped-mm",) + WSATTN_IMPLS
GLUON_MISSING = "the Gluon grouped kernel is refused here"  # the generic reason; rows carry its own

# config.json values as published, trimmed to what the layer and ModelConfig read
MODELS = {
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                      "rms_norm_eps": 1e-6, "use_sliding_window": False,
                      "sliding_window": None, "max_window_layers": 48,
                      "tie_word_embeddings": False, "vocab_size": 151936,
                      "attention_bias": False},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
                     "sliding_window": None, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                     "router_aux_loss_coef": 0.02},
    "olmoe-1b-7b": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
                    "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                    "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
                    "rope_theta": 10000.0, "vocab_size": 50304,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "dots-llm1": {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1",
                  "hidden_size": 4096, "num_hidden_layers": 62, "intermediate_size": 10944,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
                  "vocab_size": 152064, "first_k_dense_replace": 1,
                  "moe_intermediate_size": 1408, "n_routed_experts": 128,
                  "n_shared_experts": 2, "num_experts_per_tok": 6, "norm_topk_prob": True,
                  "routed_scaling_factor": 2.5, "max_position_embeddings": 32768,
                  "rope_theta": 10000000, "scoring_func": "sigmoid", "attention_bias": False,
                  "tie_word_embeddings": False},
}
# transformers' block class per model type
HF_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
             "olmoe": "OlmoeSparseMoeBlock", "dots1": "Dots1MoE"}

# The issue's targets: fraction of the touched-weight floor (= of the copy ceiling) a
# wsattn MoE layer reaches on an H200
TARGETS = {("qwen3-30b-a3b", 1): 0.80, ("qwen3-30b-a3b", 8): 0.80, ("qwen3-30b-a3b", 64): 0.70}

ROW_FIELDS = ("op", "impl", "case", "model", "family", "B", "hidden", "experts", "top_k",
              "ffn", "renormalize", "dtype", "experts_hit", "touched_bytes", "copies",
              "tokens_rerouted", "status", "reason", "note", "rel_err", "tol",
              "check_passed", "median_ms", "q20_ms", "q80_ms", "reps", "calls", "timing",
              "tbps", "copy_tbps", "floor_us", "frac_copy", "target_frac", "target_met",
              "ratio_best_hf", "pdl_speedup")


def model_config(name: str):
    """The :class:`~wsattn.models.ModelConfig` of a benchmark model."""
    from wsattn.models import ModelConfig

    return ModelConfig.from_hf(dict(MODELS[name]))


def hf_config(name: str, experts_implementation: str):
    """transformers' config of a benchmark model with that experts implementation."""
    from transformers import CONFIG_MAPPING

    d = dict(MODELS[name])
    d.pop("architectures", None)
    cfg = CONFIG_MAPPING[d.pop("model_type")](**d)
    cfg._experts_implementation = experts_implementation
    return cfg


@dataclass(frozen=True)
class MoeCase:
    """One MoE layer of ``model`` on B decode tokens."""
    model: str
    B: int
    dtype: str = "bf16"
    fresh_bytes: int = FRESH_BYTES  # weight copies together span at least this
    op: str = "moe"

    @property
    def id(self) -> str:
        return f"moe-{self.model}-B{self.B}-{self.dtype}"

    @property
    def cfg(self):
        return model_config(self.model)

    @property
    def elt(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def target_frac(self) -> float | None:
        return TARGETS.get((self.model, self.B))

    def touched_bytes(self, experts_hit: int) -> int:
        """Bytes one layer must read: gate, up and down of each hit expert, the router."""
        c = self.cfg
        return (experts_hit * 3 * c.hidden * c.moe_ffn + c.experts * c.hidden) * self.elt

    def copies(self, experts_hit: int) -> int:
        """Weight copies to cycle through so that the touched bytes span ``fresh_bytes``."""
        return max(1, math.ceil(self.fresh_bytes / self.touched_bytes(experts_hit)))


def moe_cases(models=None, batches=BATCHES, dtype: str = "bf16") -> list[MoeCase]:
    models = list(MODELS) if models is None else list(models)
    for m in models:
        if m not in MODELS:
            raise ValueError(f"model must be one of {tuple(MODELS)}, got {m!r}")
    for b in batches:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 64:
            raise ValueError(f"batch must be an int in 1..64 (the MoE decode kernels' T), "
                             f"got {b!r}")
    return [MoeCase(m, b, dtype) for m in models for b in batches]


def distinct_experts(ids) -> int:
    """The number of distinct expert ids in a [T, top_k] routing (a host tensor or list)."""
    return len(set(torch.as_tensor(ids).reshape(-1).tolist()))


# --------------------------------------------------------------------------- reference

def routing64(x, router_w, cfg, bias=None):
    """The case's routing in float64: (scores [T, E]: the softmax probabilities, or each
    expert's sigmoid under ``cfg.scoring == "sigmoid"``; ids [T, top_k] int64), ids by
    the kernels' rule (stable descending sorts: ties to the lower expert, and group,
    index). bias: the router's score-correction bias where ``cfg.router_bias``."""
    from wsattn.models.moe import choice_keys

    logits = x.double() @ router_w.double().t()
    if cfg.scoring == "sigmoid":
        scores = torch.sigmoid(logits)
        keys = choice_keys(scores, bias, cfg.router_groups, cfg.router_topk_groups,
                           stable=True)
    else:
        scores = keys = torch.softmax(logits, dim=-1)
    ids = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, :cfg.top_k]
    return scores, ids


def weights64(cfg, scores, ids):
    """The routing weights [T, top_k] of ids from routing64's scores, as the config routes:
    renormalised over the k where ``cfg.norm_topk`` (sigmoid: transformers' ``+ 1e-20``
    and the routed scale)."""
    from wsattn.models.moe import sigmoid_weights

    if cfg.scoring == "sigmoid":
        return sigmoid_weights(scores, ids, cfg.norm_topk, cfg.routed_scale)
    w = scores.gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True) if cfg.norm_topk else w


def reference(x, router_w, w_gate_up, w_down, ids, cfg, bias=None) -> torch.Tensor:
    """float64 MoE layer with the given routing ids [T, top_k]: weights are the float64
    routing weights of those experts (:func:`weights64`), expert outputs summed in slot
    order. Only the hit experts' weights are converted."""
    scores, _ = routing64(x, router_w, cfg, bias)
    ids = ids.to(x.device).long()
    w = weights64(cfg, scores, ids)
    x64 = x.double()
    F_ = w_down.shape[2]
    y = torch.zeros_like(x64)
    for e in torch.unique(ids).tolist():
        gu, wd = w_gate_up[e].double(), w_down[e].double()
        for j in range(ids.shape[1]):
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            if rows.numel():
                h = x64[rows] @ gu.t()
                act = torch.nn.functional.silu(h[:, :F_]) * h[:, F_:]
                y[rows] += w[rows, j, None] * (act @ wd.t())
    return y


def rerouted(ids, ref_ids) -> int:
    """Tokens whose set of experts differs between two [T, top_k] routings."""
    a, b = torch.as_tensor(ids).cpu().long(), torch.as_tensor(ref_ids).cpu().long()
    return int((a.sort(dim=1)[0] != b.sort(dim=1)[0]).any(dim=1).sum())


# --------------------------------------------------------------------------- rows

def make_row(stamp: dict, case: MoeCase, impl: str, status: str, *, experts_hit=None,
             copies=None, reason=None, note=None, rel_err=None, tol=None, timing=None,
             copy_tbps=None, tokens_rerouted=None) -> dict:
    """One row; every row has the keys of ROW_FIELDS (None where they do not apply)."""
    c = case.cfg
    row = dict(stamp)
    row.update({k: None for k in ROW_FIELDS})
    wsattn = impl.startswith("wsattn")
    row.update(op=case.op, impl=impl, case=case.id, model=case.model, family=c.family,
               B=case.B, hidden=c.hidden, experts=c.experts, top_k=c.top_k, ffn=c.moe_ffn,
               renormalize=c.norm_topk, dtype=case.dtype, experts_hit=experts_hit,
               copies=copies, status=status, reason=reason, note=note, rel_err=rel_err,
               tol=tol, check_passed=None if rel_err is None else rel_err <= tol,
               tokens_rerouted=tokens_rerouted, copy_tbps=copy_tbps,
               target_frac=case.target_frac if wsattn else None)
    if experts_hit is not None:
        row["touched_bytes"] = case.touched_bytes(experts_hit)
        if copy_tbps:
            row["floor_us"] = row["touched_bytes"] / (copy_tbps * 1e12) * 1e6
    if timing is not None:
        row.update(median_ms=timing.median_ms, q20_ms=timing.q20_ms, q80_ms=timing.q80_ms,
                   reps=timing.reps, calls=timing.calls, timing=timing.method)
        if row["touched_bytes"] is not None:
            row["tbps"] = tbps(row["touched_bytes"], timing.median_ms)
            if copy_tbps:
                row["frac_copy"] = row["tbps"] / copy_tbps
                if row["target_frac"] is not None:
                    row["target_met"] = "met" if row["frac_copy"] >= row["target_frac"] \
                        else "missed"
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """ratio_best_hf (the fastest timed hf-* column's time / this row's) on timed non-hf
    rows; pdl_speedup (wsattn-triton's time / wsattn-triton-pdl's) on the PDL row."""
    timed = [r for r in rows if r.get("op") == "moe" and r["status"] == "ok"]
    for r in timed:
        same = [p for p in timed if p["case"] == r["case"]]
        hf = [p["median_ms"] for p in same if p["impl"].startswith("hf-")]
        if hf and not r["impl"].startswith("hf-"):
            r["ratio_best_hf"] = min(hf) / r["median_ms"]
        nopdl = next((p for p in same if p["impl"] == "wsattn-triton"), None)
        if r["impl"] == "wsattn-triton-pdl" and nopdl:
            r["pdl_speedup"] = nopdl["median_ms"] / r["median_ms"]
    return rows


# --------------------------------------------------------------------------- GPU work

class NotAvailable(Exception):
    """A column that cannot run here (the reason is the message)."""


def _inputs(case: MoeCase, device):
    """x [B, H] (seeded per case), router [E, H], w_gate_up [E, 2F, H], w_down [E, H, F]
    (seeded per model), in the case's dtype on ``device``; the router's score-correction
    bias [E] float32 where the config has one, else None."""
    c, dt = case.cfg, DTYPES[case.dtype]
    E, H, F_ = c.experts, c.hidden, c.moe_ffn

    def randn(g, *shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    gw = torch.Generator(device=device).manual_seed(zlib.crc32(case.model.encode()))
    router_w = randn(gw, E, H, scale=H ** -0.5)
    w_gate_up = torch.empty(E, 2 * F_, H, dtype=dt, device=device)
    w_down = torch.empty(E, H, F_, dtype=dt, device=device)
    for e in range(E):  # one expert at a time: no fp32 copy of the whole layer at once
        w_gate_up[e] = randn(gw, 2 * F_, H, scale=H ** -0.5)
        w_down[e] = randn(gw, H, F_, scale=F_ ** -0.5)
    # drawn after the experts, so the other models' weights are as before
    bias = ((torch.randn(E, generator=gw, device=device) * 0.02).float()
            if c.router_bias else None)
    gx = torch.Generator(device=device).manual_seed(zlib.crc32(case.id.encode()))
    x = randn(gx, case.B, H, scale=1.0)
    return x, router_w, w_gate_up, w_down, bias


def _hf_block(case: MoeCase, experts: str, router_w, w_gate_up, w_down, bias=None):
    """transformers' sparse MoE block of the case's model type holding these tensors (a
    block with shared experts gets them taken out: the layer here is the routed part)."""
    import importlib

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if experts != "eager" and experts not in ALL_EXPERTS_FUNCTIONS:
        raise NotAvailable(f"transformers has no experts implementation {experts!r} "
                           f"(it offers eager, {', '.join(sorted(ALL_EXPERTS_FUNCTIONS))})")
    if experts == "deepgemm" and case.dtype != "bf16":
        raise NotAvailable("transformers' deepgemm experts path takes bf16 only")
    cfg = hf_config(case.model, experts)
    family = MODELS[case.model]["model_type"]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    with torch.device("meta"):
        block = getattr(module, HF_BLOCKS[family])(cfg)
    block.gate.weight = torch.nn.Parameter(router_w, requires_grad=False)
    block.experts.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(w_down, requires_grad=False)
    if hasattr(block.gate, "e_score_correction_bias"):
        block.gate.e_score_correction_bias = bias
    if hasattr(block, "shared_experts"):
        block.shared_experts = _NoSharedExperts()
    return block.eval()


class _NoSharedExperts(torch.nn.Module):
    """Stands in for a block's shared experts: adds nothing (one elementwise add of zero
    remains in transformers' forward)."""

    def forward(self, x):
        return torch.zeros((), dtype=x.dtype, device=x.device)


def _grouped_mm_plan(ids, scores, cfg, device):
    """The case's tokens grouped by expert, on the device: (token of each sorted row,
    its routing weight fp32, offsets int32 [E] (cumulative ends), the sorted row of each
    pair t*k + j)."""
    T, k = ids.shape
    experts = cfg.experts
    w = weights64(cfg, scores, ids)
    flat = ids.reshape(-1).cpu()
    order = torch.sort(flat, stable=True)[1]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    counts = torch.bincount(flat, minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return (torch.div(order, k, rounding_mode="floor").to(device),
            w.reshape(-1).float()[order.to(w.device)].to(device), offs.to(device), inv.to(device))


def _calls(case: MoeCase, impl: str, x, copies, plan):
    """(first: the checked call on copy 0, fn: the timed call cycling through the copies,
    ids: the routing ids the column uses, note). NotAvailable where the column cannot run."""
    from wsattn.engine.runner import moe_routing
    from wsattn.kernels import moe as kmoe
    from wsattn.target import target_of

    c = case.cfg
    T, H = x.shape
    note = None
    bias = plan.get("bias")
    if impl == "wsattn-gluon":
        from wsattn.kernels import moe_gluon
        reason = moe_gluon.unsupported_reason(x.device, x.dtype)
        if reason is not None:
            raise NotAvailable(reason)
        routing = moe_routing(c, bias)
        out = torch.empty_like(x)

        # PDL off for the route, group and combine launches too: the Gluon launch takes
        # none, and the column is compared with wsattn-triton, which has it off throughout
        def call(i):
            router_w, w_gate_up, w_down = copies[i][:3]
            return kmoe.moe(x, router_w, w_gate_up, w_down, **routing, out=out,
                            impl="gluon", pdl=False)

        ids = kmoe.route(x, copies[0][0], **routing, pdl=False)[1]
    elif impl.startswith("hf-"):
        if impl == "hf-batched_mm" and x.device.type == "cuda":
            # batched_mm gathers a copy of its expert's gate/up and down weights per pair
            need = T * c.top_k * 3 * H * c.moe_ffn * case.elt
            free = torch.cuda.mem_get_info(x.device)[0]
            if need > 0.8 * free:
                raise NotAvailable(f"batched_mm gathers {need / 2**30:.0f} GiB of expert "
                                   f"weights per call; {free / 2**30:.0f} GiB free")
        blocks = [_hf_block(case, impl[3:], *w, bias=bias) for w in copies]

        def call(i):
            with torch.no_grad():
                return blocks[i](x.view(T, 1, H)).view(T, H)

        with torch.no_grad():
            ids = blocks[0].gate(x)[2]
    elif impl == "torch-grouped-mm":
        gmm = getattr(torch, "_grouped_mm", None)
        if gmm is None:
            raise NotAvailable(f"torch {torch.__version__} has no torch._grouped_mm")
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
            raise NotAvailable("torch._grouped_mm needs sm_80 or later")
        if x.device.type == "cuda" and x.dtype != torch.bfloat16:
            raise NotAvailable(f"torch._grouped_mm on CUDA takes bf16, not {case.dtype}")
        token, weight, offs, inv = plan["grouped"]
        F_ = c.moe_ffn
        note = "routing and grouping precomputed, not timed"

        def call(i):
            _, w_gate_up, w_down = copies[i]
            h = gmm(x.index_select(0, token), w_gate_up.transpose(-2, -1), offs=offs)
            act = torch.nn.functional.silu(h[:, :F_]) * h[:, F_:]
            y = gmm(act, w_down.transpose(-2, -1), offs=offs).float() * weight[:, None]
            return y.index_select(0, inv).view(T, c.top_k, H).sum(dim=1).to(x.dtype)

        ids = plan["ids"]
    elif impl == "wsattn-triton-token":
        if T != 1:
            raise NotAvailable(f"the decode step's one-token path takes B = 1, not {T}")
        block = kmoe.default_block(1, c.top_k, c.experts)
        tables = kmoe.one_token_tables(c.top_k, block, x.device)  # before any capture
        routing = moe_routing(c, bias)
        out = torch.empty_like(x)

        def run(i):  # the output and the ids the gate/up launch selected
            router_w, w_gate_up, w_down = copies[i][:3]
            r = kmoe.route_logits(x, router_w, **routing)
            g = kmoe.one_token_grouping(r.ids, c.experts, block, tables)
            act = kmoe.moe_gate_up(x, w_gate_up, g, route=r)
            return kmoe.moe_down_combine(act, w_down, g, r.weights, out), r.ids

        ids = run(0)[1].clone()
        note = "the decode step's bucket-1 path (top-k inside gate/up, no grouping launch)"

        def call(i):
            return run(i)[0]
    elif impl in ("wsattn-triton", "wsattn-triton-pdl") or impl.startswith("wsattn-triton["):
        pdl = impl.endswith("-pdl")
        settings = parse_settings(impl[len("wsattn-triton["):-1]) if "[" in impl else None
        t = target_of(x.device)
        if pdl and not (t.backend == "cuda" and t.cc >= 90):
            raise NotAvailable(f"PDL needs a CUDA GPU of sm_90 or later; this is {t.name}")
        routing = moe_routing(c, bias)
        out = torch.empty_like(x)

        def call(i):
            router_w, w_gate_up, w_down = copies[i][:3]
            return kmoe.moe(x, router_w, w_gate_up, w_down, **routing, out=out, pdl=pdl,
                            settings=settings)

        ids = kmoe.route(x, copies[0][0], **routing, pdl=pdl)[1]
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    state = {"i": 0}

    def fn():
        # each captured call reads the next copy, so a replay streams HBM, not L2
        i = state["i"] % len(copies)
        state["i"] += 1
        return call(i)

    return (lambda: call(0)), fn, ids, note


def parse_settings(spec: str):
    """'block,BLOCK_N,BLOCK_K,num_warps,num_stages' -> a MoeSettings (ValueError naming
    what is wrong)."""
    from wsattn.kernels.moe import MoeSettings
    parts = spec.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--moe-settings: each SPEC is block,BLOCK_N,BLOCK_K,num_warps,"
                         f"num_stages (five ints), got {spec!r}")
    return MoeSettings(*(int(p) for p in parts))


def run_case(case: MoeCase, impls, timer, stamp, device, copy_tbps) -> list[dict]:
    """Rows of every column for one case: check against float64, then time. A column's
    failure is its row, never the run's."""
    from wsattn.testing import TOL, rel_err

    from .suite import _short

    c = case.cfg
    try:
        x, router_w, w_gate_up, w_down, bias = _inputs(case, device)
        scores, ref_ids = routing64(x, router_w, c, bias)
        hit = distinct_experts(ref_ids.cpu())  # on the host, once, outside timing
        n_copies = case.copies(hit)
        copies = [(router_w, w_gate_up, w_down)] + [
            (router_w.clone(), w_gate_up.clone(), w_down.clone()) for _ in range(n_copies - 1)]
        plan = {"ids": ref_ids, "bias": bias,
                "grouped": _grouped_mm_plan(ref_ids, scores, c, device)}
    except Exception as e:  # out of memory on a smaller GPU, say
        return [make_row(stamp, case, i, "error", reason="inputs: " + _short(e)) for i in impls]
    common = dict(experts_hit=hit, copies=n_copies, copy_tbps=copy_tbps)
    tol, refs, rows = TOL[case.dtype], {}, []
    for impl in impls:
        try:
            first, fn, ids, note = _calls(case, impl, x, copies, plan)
            y = first()
            _sync(device)
            key = tuple(ids.reshape(-1).tolist())
            if key not in refs:
                refs[key] = reference(x, router_w, w_gate_up, w_down, ids, c, bias)
            err = rel_err(y, refs[key])
            moved = rerouted(ids, ref_ids)
            # the touched bytes of the experts this column's own routing hit (a near tie in
            # its lower precision can route a token elsewhere than the float64 routing)
            own = dict(common, experts_hit=distinct_experts(ids.cpu()))
        except NotAvailable as e:
            rows.append(make_row(stamp, case, impl, "not available", reason=str(e)[:300],
                                 **common))
            continue
        except (ImportError, OSError) as e:
            # a package or hub kernel behind one of transformers' experts implementations,
            # missing here; in wsattn's own columns the same is a bug: an error
            status = "error" if impl.startswith("wsattn") else "not available"
            rows.append(make_row(stamp, case, impl, status, reason=_short(e), **common))
            continue
        except Exception as e:  # a broken column must not stop the benchmark
            rows.append(make_row(stamp, case, impl, "error", reason=_short(e), **common))
            continue
        if not err <= tol:
            rows.append(make_row(stamp, case, impl, "failed", rel_err=err, tol=tol, note=note,
                                 tokens_rerouted=moved, **own,
                                 reason=f"relative error {err:.3e} > {tol:.1e}; not timed"))
            continue
        try:
            timing = timer(fn)
        except Exception as e:
            rows.append(make_row(stamp, case, impl, "error", rel_err=err, tol=tol, note=note,
                                 tokens_rerouted=moved, reason="while timing: " + _short(e),
                                 **own))
            continue
        rows.append(make_row(stamp, case, impl, "ok", rel_err=err, tol=tol, timing=timing,
                             note=note, tokens_rerouted=moved, **own))
    del x, copies, plan, refs
    release(device)
    return rows


# --------------------------------------------------------------------------- report

def format_table(rows: list[dict]) -> str:
    lines = [f"ceiling {r['impl']}: {r['tbps']:.2f} TB/s ({r['case']})"
             for r in rows if r["op"] == "ceiling" and r.get("tbps")]
    head = (f"{'case':<30} {'impl':<18} {'hit':>4} {'MB':>7} {'floor us':>8} {'us':>8} "
            f"{'TB/s':>6} {'of copy':>7} {'target':>9} {'x hf':>6} {'rel err':>8}  status")
    lines += ["", head, "-" * len(head)]
    for r in (r for r in rows if r["op"] == "moe"):
        target = target_text(r["target_frac"], r["target_met"])
        status = status_text(r)
        lines.append(
            f"{r['case']:<30} {r['impl']:<18} {fmt(r['experts_hit'], 'd'):>4} "
            f"{fmt(None if r['touched_bytes'] is None else r['touched_bytes'] / 1e6, '.1f'):>7} "
            f"{fmt(r['floor_us'], '.1f'):>8} "
            f"{fmt(None if r['median_ms'] is None else r['median_ms'] * 1e3, '.1f'):>8} "
            f"{fmt(r['tbps'], '.2f'):>6} {fmt(r['frac_copy'], '.3f'):>7} {target:>9} "
            f"{fmt(r['ratio_best_hf'], '.2f'):>6} {fmt(r['rel_err'], '.1e'):>8}  {status[:120]}")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path):
    """Fraction of the copy ceiling (of the touched-weight floor) against B per column,
    one panel per model; the targets as red crosses."""
    from .plot import MISSING, pyplot, save
    plt = pyplot()
    if plt is None:
        return None, MISSING
    ok = [r for r in rows if r["op"] == "moe" and r["status"] == "ok" and r["frac_copy"]]
    if not ok:
        return None, "no timed rows with a copy ceiling to plot"
    models = [m for m in MODELS if any(r["model"] == m for r in ok)]
    models += sorted({r["model"] for r in ok} - set(models))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes.flat, models):
        for impl in impls:
            pts = sorted((r["B"], r["frac_copy"]) for r in ok
                         if (r["model"], r["impl"]) == (model, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        targets = sorted((b, t) for (m, b), t in TARGETS.items() if m == model)
        if targets:
            ax.scatter(*zip(*targets), marker="x", color="red", label="target", zorder=3)
        ax.axhline(1.0, linestyle="--", color="grey", linewidth=1, label="copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("B (tokens)")
        ax.set_ylabel("fraction of copy ceiling (touched bytes)")
        ax.set_title(model, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    s = rows[0]
    return save(fig, axes, len(models),
                f"wsattn bench moe - {s.get('gpu')} - {s.get('commit')} - {s.get('date')}", path)


def main(args) -> int:
    """Run the MoE layer benchmark (a CUDA GPU is checked for by the caller)."""
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .report import exit_status
    from .env import stamp as make_stamp
    from .timing import cuda_timer

    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    timer = cuda_timer(args.warmup_ms, args.rep_ms, args.timing)
    try:
        cases = moe_cases(args.moe_models, args.moe_batch, args.dtype)
    except ValueError as e:
        print(f"wsattn bench moe: {e}", file=sys.stderr)
        return 2
    impls = list(args.moe_impl)
    try:  # extra columns: the Triton path (PDL off) with exactly these settings
        impls += [f"wsattn-triton[{spec}]" for spec in (args.moe_settings or [])
                  if parse_settings(spec)]
    except ValueError as e:
        print(f"wsattn bench moe: {e}", file=sys.stderr)
        return 2
    print(f"wsattn bench moe on {stamp['gpu']}, torch {stamp['torch']}, triton "
          f"{stamp['triton']}, commit {stamp['commit']}: {len(cases)} cases x {impls}",
          file=sys.stderr)
    rows, copy_tbps = ceil_mod.copy_ceiling_rows(timer, device, stamp)
    for case in tqdm(cases, desc="wsattn bench moe", file=sys.stderr, dynamic_ncols=True):
        rows += run_case(case, impls, timer, stamp, device, copy_tbps)
    add_ratios(rows)
    print(format_table(rows))
    write(rows, stamp, args, plot_rows)
    return exit_status(rows, lambda i: i in WSATTN_IMPLS or i.startswith("wsattn-triton["))


def add_arguments(group) -> None:
    group.add_argument("--moe-models", nargs="+", choices=tuple(MODELS), default=None,
                       metavar="MODEL", help=f"moe: model shapes (default all: {' '.join(MODELS)})")
    group.add_argument("--moe-batch", nargs="+", type=int, default=list(BATCHES), metavar="B",
                       help=f"moe: tokens per step, 1..64 (default {' '.join(map(str, BATCHES))})")
    group.add_argument("--moe-impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                       metavar="IMPL", help=f"moe: columns (default all: {' '.join(IMPLS)})")
    group.add_argument("--moe-settings", nargs="+", default=None, metavar="SPEC",
                       help="moe: extra columns wsattn-triton[SPEC], the Triton path (PDL "
                            "off) launched with SPEC = block,BLOCK_N,BLOCK_K,num_warps,"
                            "num_stages (wsattn.kernels.moe.MoeSettings)")
