"""`wsattn bench step`: a whole decode step (ms/token) of real model shapes against its
memory floor, transformers next to wsattn's engine, with kernels per step and GPU idle
time from a profiler trace.

Models (random weights from configs written below from the public ``config.json``
values, built with transformers' ``from_config`` in bf16 on the GPU; nothing is
downloaded): Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B. Cases: batch B and context (the
prompt length, the keys each timed step reads); by default the issue's targets, or the
grid of ``--batch`` x ``--ctx`` x ``--models``.

Columns (``impl``):

* ``hf-eager``: ``model.generate`` with its default dynamic cache (sdpa attention);
* ``hf-compile``: ``generate(cache_implementation="static")``, which transformers
  compiles with torch.compile;
* ``wsattn-graph`` / ``wsattn-graph-pdl``: :class:`wsattn.engine.Engine` with
  ``step="kernels"`` (fused kernels, one CUDA graph per step) and ``pdl=False`` / ``True``;
  ``wsattn-graph-pdl[gemv,decode]`` and the like: PDL on for those kernel families only
  (``wsattn.engine.runner.PDL_FAMILIES``; ``gemv:late`` / ``gemv:early`` in place of
  ``gemv``: the GEMVs releasing the next kernel after their weight stream / right after
  their wait at every batch, instead of by rows, ``PDL_VARIANTS``), to find where PDL pays
  or costs. ``wsattn-graph-pdl`` is also what the engine runs by default on sm_90+.
  Checked first: the engine's logits over a few steps, teacher-forced on its own tokens,
  against the same weights computed in fp32 by transformers, next to transformers' own
  bf16 error against that reference (``rel_err_hf``): within the bf16 tolerance or twice
  transformers' own error (see :func:`teacher_forced_check`); a failed check is recorded,
  not timed.

Per-token time, for every column alike: the time from the first new token to the last of
``1 + n`` new tokens, over n (median of a few runs). The marks are CUDA events recorded as
each token is ready (transformers: in a streamer's ``put``, which its decode loop calls
after its per-token synchronisation; the engine: its ``timings`` events), so what is
timed is n decode steps with their sampling and host work, and the prompt's prefill is
outside the span. (Timing whole runs and subtracting a one-token run put the prefill's
run-to-run spread, 10-200 ms at the 4k-token prompts on the H200, into a difference of
about 30 ms: per-token figures moved by 0.3-0.9 ms between runs of the same commit.)
The floor is (weight bytes a step reads + KV bytes at the context) / the copy ceiling
measured in the same run; ``frac_floor`` = floor / ms per token. The copy both reads and
writes; a read-only stream (a step dominated by its KV cache) runs a few percent faster, so
``frac_floor`` can pass 1. Kernels per step and
GPU busy time come from two torch.profiler traces, of generating 1 and 1 + n tokens: their
difference over n is one step's share; idle per step = ms per token - GPU busy per step (the union of kernel and
copy intervals, so kernels overlapped by PDL are not counted twice). A kernel's duration
in the trace includes its PDL wait, so what each launch costs the step is read from its
critical time instead (``critical_by_launch``: by kernel name and grid, how far its end
moved the end of the GPU's work).
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from ..engine.kv_cache import PAGE_SIZE
from .moe import MODELS as MOE_MODELS

IMPLS = ("hf-eager", "hf-compile", "wsattn-graph", "wsattn-graph-pdl")
WSATTN_IMPLS = ("wsattn-graph", "wsattn-graph-pdl")
PDL_SUBSET = "wsattn-graph-pdl["  # + comma-separated kernel families + "]"
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 32768)
ELT = 2  # bf16


PAGE_SUFFIX = "@page"  # + tokens per KV page: a wsattn column on an engine of that page size


def split_page(impl: str) -> tuple[str, int | None]:
    """(the column without its ``@pageN`` suffix, N or None for the engine's default)."""
    base, sep, n = impl.partition(PAGE_SUFFIX)
    return (base, int(n)) if sep else (impl, None)


def step_impl(text: str) -> str:
    """A ``--step-impl`` column: one of IMPLS, or ``wsattn-graph-pdl[f1,f2,...]`` with
    names from ``wsattn.engine.runner.PDL_FAMILIES`` or ``PDL_VARIANTS``; a wsattn column
    may end in ``@pageN``, its engine's KV pages of N tokens (the engine's default
    otherwise), so page sizes compare side by side in one run. ValueError naming what is
    wrong."""
    base, sep, n = text.partition(PAGE_SUFFIX)
    if sep:
        if not (n.isdigit() and int(n) >= 1 and str(int(n)) == n):
            raise ValueError(f"{text!r}: {PAGE_SUFFIX} takes a positive page size in tokens, "
                             f"got {n!r}")
        if not is_wsattn(base):
            raise ValueError(f"{text!r}: {PAGE_SUFFIX}N applies to the wsattn columns, not "
                             f"{base!r}")
        step_impl(base)
        return text
    if text in IMPLS:
        return text
    if not (text.startswith(PDL_SUBSET) and text.endswith("]")):
        raise ValueError(f"step column must be one of {IMPLS} or {PDL_SUBSET}FAMILY,...], "
                         f"got {text!r}")
    from wsattn.engine.runner import PDL_FAMILIES, PDL_VARIANTS, _pdl_families
    names = list(pdl_of(text))
    why = "repeated" if len(set(names)) != len(names) else None
    if why is None:
        try:  # the runner's own check of the names, before any engine is built
            _pdl_families(names, has_pdl=True)
        except ValueError as e:
            why = str(e)
    if why is not None:
        raise ValueError(f"{text!r}: the kernel families must be distinct names of "
                         f"{PDL_FAMILIES} (or the variants {tuple(PDL_VARIANTS)}), got "
                         f"{names}: {why}")
    return text


def pdl_of(impl: str):
    """The ``pdl=`` of a wsattn column: False, True, or the tuple of kernel families."""
    impl = split_page(impl)[0]
    if impl.startswith(PDL_SUBSET):
        return tuple(impl[len(PDL_SUBSET):-1].split(","))
    return impl == "wsattn-graph-pdl"


def is_wsattn(impl: str) -> bool:
    impl = split_page(impl)[0]
    return impl in WSATTN_IMPLS or impl.startswith(PDL_SUBSET)


# The public config.json values that shape the step (hidden, layers, heads, kv heads,
# head_dim, ffn, vocab, rope, tied embeddings); everything else at transformers' defaults.
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
              num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
              max_position_embeddings=131072, rope_theta=500000.0, attention_bias=False,
              mlp_bias=False, bos_token_id=128000, eos_token_id=128001, vocab_size=128256)
MODELS = {
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "num_hidden_layers": 16, "head_dim": 64,
                     "intermediate_size": 8192, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}},
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128,
                     "intermediate_size": 14336, "tie_word_embeddings": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}},
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                     hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                     use_sliding_window=False, sliding_window=None, max_window_layers=36,
                     bos_token_id=151643, eos_token_id=151645),
}
# The MoE decode issue's end-to-end model: the 48-layer Qwen3-30B-A3B shape, the same
# config as one layer of `wsattn bench moe`.
MODELS["qwen3-30b-a3b"] = dict(MOE_MODELS["qwen3-30b-a3b"])
# OLMoE-1B-7B: 64 experts, top-8 without renormalising, QK-norm over the whole projection
# (no issue target names its step; 14 GB of bf16 weights, so transformers' columns and the
# fp32 check fit beside it). Mixtral-8x7B is not a step model: its 93 GB of bf16 weights
# do not fit twice (transformers' model and the engine's folded copy) on one H200; its
# layer is in `wsattn bench moe`.
MODELS["olmoe-1b-7b"] = dict(MOE_MODELS["olmoe-1b-7b"])
# A MoE family with a shared expert beside 60 routed ones (no issue target names it).
MODELS["qwen1.5-moe-a2.7b"] = dict(
    model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_act="silu",
    hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
    num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
    mlp_only_layers=[], vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=8192,
    rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
    sliding_window=None, max_window_layers=21, bos_token_id=151643, eos_token_id=151643)
# DeepSeek-V3's routing (sigmoid, score-correction bias, routed scale) and two ungated
# shared experts: dots.llm1 cut to 8 of its 62 layers (its first dense, then 7 MoE layers
# of 128 experts, top-6; 35 GB of bf16 weights, so transformers' model and the engine's
# copy fit together), the layer of `wsattn bench moe --moe-models dots-llm1` (no issue
# target names it)
MODELS["dots-llm1-8-layers"] = dict(MOE_MODELS["dots-llm1"], num_hidden_layers=8)

# The issues' targets on an H200 (ms/token of the wsattn step); what the default run covers.
TARGETS = {("llama-3.2-1b", 1, 4096): 0.70, ("llama-3.2-1b", 8, 4096): 0.80,
           ("llama-3.2-1b", 64, 1024): 1.2, ("llama-3.1-8b", 1, 4096): 4.1,
           ("llama-3.1-8b", 8, 4096): 4.4, ("qwen3-30b-a3b", 1, 4096): 1.75,
           ("qwen3-30b-a3b", 8, 4096): 7.0}
# Models whose fp32 copy does not fit beside them on one GPU (61 GB of bf16 weights: 122
# GB more in fp32): their logits check runs on a model of the same config cut to this
# many layers (same kernels, same buckets), built, checked and freed before the full
# model's engine is built and timed; the row's note says so.
CHECK_LAYERS = {"qwen3-30b-a3b": 4, "qwen1.5-moe-a2.7b": 4, "dots-llm1-8-layers": 4}
PDL_TARGET = 1.05  # graph without PDL / with PDL at the 1B shape, B 1
KERNELS_PER_LAYER_TARGET = 6

ROW_FIELDS = ("op", "impl", "case", "model", "B", "ctx", "new_tokens", "dtype", "status",
              "reason", "note", "rel_err", "rel_err_hf", "rel_err_vs_hf", "tol",
              "check_passed", "check_steps",
              "ms_per_token", "samples_ms", "tokens_per_s", "weight_bytes", "kv_bytes",
              "floor_ms", "floor_weights_ms", "frac_floor", "copy_tbps", "target_ms",
              "target_met", "ratio_hf_compile", "pdl_speedup", "kernels_per_step",
              "kernels_per_layer", "copies_per_step", "kernel_us_per_step",
              "busy_us_per_step", "idle_us_per_step", "kernels_by_time", "gaps_by_pair",
              "critical_by_launch", "profile_steps", "page_size", "need_gib", "peak_gib")


def model_config(name: str):
    """The :class:`~wsattn.models.ModelConfig` of a benchmark model (no transformers needed)."""
    from wsattn.models import ModelConfig

    return ModelConfig.from_hf(dict(MODELS[name]))


def hf_config(name: str):
    """The transformers config of a benchmark model."""
    from transformers import CONFIG_MAPPING

    d = dict(MODELS[name])
    return CONFIG_MAPPING[d.pop("model_type")](**d)


def experts_hit(num_experts: int, top_k: int, B: int) -> float:
    """Distinct experts B tokens touch in a MoE layer, expected under uniform routing:
    E (1 - (1 - k/E)^B) (random weights route close to uniformly)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** B) if num_experts else 0.0


def _attn_params(cfg) -> int:
    h, q, kv = cfg.hidden, cfg.q_size, cfg.kv_size
    return (h * (q + 2 * kv) + q * h + 2 * h + (q + 2 * kv if cfg.qkv_bias else 0)
            + (2 * cfg.head_dim if cfg.qk_norm else 0)
            + (q + kv if cfg.qk_norm_whole else 0))  # OLMoE: over the whole projection


def _mlp_params(cfg, experts: float) -> float:
    """Every layer's MLP with ``experts`` experts in each MoE layer (router included, and
    a shared expert, with its gate where it has one: every token reads it). A router's
    score-correction bias (dots1: E float32 values, 512 bytes a layer) is a buffer, not
    a parameter, and is not counted."""
    h, moe = cfg.hidden, len(cfg.moe_layers)
    shared = 3 * h * cfg.shared_ffn + (h if cfg.shared_gated else 0) if cfg.shared_ffn else 0
    return ((cfg.layers - moe) * 3 * h * cfg.ffn
            + moe * (cfg.experts * h + experts * 3 * h * cfg.moe_ffn + shared))


def weight_bytes(cfg, B: int = 1, elt: int = ELT) -> int:
    """Bytes of weights one decode step of B tokens reads: every layer's attention
    projections and norms, the dense MLPs, in MoE layers the router and the experts the B
    tokens touch (``experts_hit``, expected), the final norm, the whole LM head, and B
    rows of the embedding (tied or not)."""
    h = cfg.hidden
    hit = experts_hit(cfg.experts, cfg.top_k, B)
    return round(elt * (cfg.layers * _attn_params(cfg) + _mlp_params(cfg, hit) + h
                        + cfg.vocab * h + B * h))


def param_bytes(cfg, elt: int = ELT) -> int:
    """Bytes of the model's parameters: every expert, the embedding once more unless tied."""
    h = cfg.hidden
    return int(elt * (cfg.layers * _attn_params(cfg) + _mlp_params(cfg, cfg.experts) + h
                      + cfg.vocab * h * (1 if cfg.tie_embeddings else 2)))


def folded_bytes(cfg, elt: int = ELT) -> int:
    """Bytes of the engine's weights that are new tensors rather than the model's own:
    the fused QKV projections (and their concatenated biases) and every weight a norm is
    folded into (FlashNorm: QKV, the dense gate/up, the router, every expert's gate/up, a
    shared expert's gate/up and gate, the LM head)."""
    h, q, kv = cfg.hidden, cfg.q_size, cfg.kv_size
    moe = len(cfg.moe_layers)
    # a shared expert's gate/up, and its gate where it has one
    shared = 2 * h * cfg.shared_ffn + (h if cfg.shared_gated else 0) if cfg.shared_ffn else 0
    bias = q + 2 * kv if cfg.qkv_bias else 0  # the q/k/v biases, concatenated
    return elt * (cfg.layers * (h * (q + 2 * kv) + bias) + (cfg.layers - moe) * 2 * h * cfg.ffn
                  + moe * (cfg.experts * h + cfg.experts * 2 * h * cfg.moe_ffn + shared)
                  + cfg.vocab * h)


def kv_bytes(cfg, B: int, ctx: int, elt: int = ELT) -> int:
    """Bytes of K and V a step reads at ``ctx`` cached tokens per sequence."""
    return elt * B * ctx * cfg.layers * 2 * cfg.kv_heads * cfg.head_dim


@dataclass(frozen=True)
class StepCase:
    model: str
    B: int
    ctx: int  # prompt tokens: the keys a timed step reads (n more at most)
    dtype: str = "bf16"
    op: str = "step"

    @property
    def id(self) -> str:
        return f"step-{self.model}-B{self.B}-ctx{self.ctx}-{self.dtype}"

    @property
    def cfg(self):
        return model_config(self.model)

    def weight_bytes(self) -> int:
        return weight_bytes(self.cfg, self.B)

    def kv_bytes(self) -> int:
        return kv_bytes(self.cfg, self.B, self.ctx)

    def floor_ms(self, copy_tbps: float, weights_only: bool = False) -> float:
        nbytes = self.weight_bytes() + (0 if weights_only else self.kv_bytes())
        return nbytes / (copy_tbps * 1e12) * 1e3

    @property
    def target_ms(self) -> float | None:
        return TARGETS.get((self.model, self.B, self.ctx))


def step_cases(models=None, batches=None, contexts=None) -> list[StepCase]:
    """The issue's target cases (restricted to ``models``), or, when batches or contexts
    are given, the grid models x batches x contexts (the others at their full sets)."""
    models = list(MODELS) if models is None else list(models)
    for m in models:
        if m not in MODELS:
            raise ValueError(f"model must be one of {tuple(MODELS)}, got {m!r}")
    if batches is None and contexts is None:
        return [StepCase(m, b, c) for (m, b, c) in TARGETS if m in models]
    return [StepCase(m, b, c) for m in models for b in (batches or BATCHES)
            for c in (contexts or CONTEXTS)]


def column_memory(case: StepCase, new_tokens: int, impl: str) -> int:
    """Bytes one column holds at once, roughly: transformers' weights, the column's own KV
    cache of ctx + new tokens (transformers' dynamic one for hf-eager, its static one for
    hf-compile, the engine's paged one for a wsattn column) and 4 GB of activations; a
    wsattn column also holds the engine's tensors. A model checked on a cut (CHECK_LAYERS)
    adds only the engine's new tensors (``folded_bytes``): the cut model and its fp32 copy
    are freed before the full engine is built. Any other model counts the engine's copy
    and the fp32 reference (twice the bytes) in every column, since the reference, once
    made, lives until the case ends. Columns run one after another, each one's engine,
    cache and compiled step freed before the next starts (``run_case``)."""
    cfg = case.cfg
    own = kv_bytes(cfg, case.B, case.ctx + new_tokens + 2) + (4 << 30)
    if case.model in CHECK_LAYERS:
        return param_bytes(cfg) + (folded_bytes(cfg) if is_wsattn(impl) else 0) + own
    return 4 * param_bytes(cfg) + own


def memory_needed(case: StepCase, new_tokens: int, impls=IMPLS) -> int:
    """The most any of the columns ``impls`` holds at once (``column_memory``)."""
    return max(column_memory(case, new_tokens, i) for i in impls)


# --------------------------------------------------------------------------- the trace

TOP_KERNELS = 12  # kernel names (and name pairs) a row lists, by GPU time (idle time) a
#                   step (durations: with PDL a kernel's time includes its wait)
CRITICAL_LAUNCHES = 24  # launch shapes a row lists by critical time a step (every GEMV
#                         shape of a layer, decode, its combine, the QKV epilogue, ...)
GPU_CATS = {"kernel": "kernels", "gpu_memcpy": "copies", "gpu_memset": "copies"}


def gpu_summary(trace) -> dict:
    """Kernel and copy activity in a torch.profiler Chrome trace (the dict of
    ``export_chrome_trace``'s JSON, or its event list): counts, summed kernel time, busy
    time (the union of all kernel/copy intervals, so overlapping kernels count once) and
    the span from the first start to the last end, in microseconds."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    counts = {"kernels": 0, "copies": 0}
    kernel_us, spans, by_name = 0.0, [], {}
    for e in events:
        what = GPU_CATS.get(e.get("cat"))
        if what is None or e.get("ph", "X") != "X":
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        counts[what] += 1
        if what == "kernels":
            kernel_us += dur
            n, us = by_name.get(e.get("name", "?"), (0, 0.0))
            by_name[e.get("name", "?")] = (n + 1, us + dur)
        spans.append((ts, ts + dur))
    busy, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
    return {**counts, "kernel_us": kernel_us, "busy_us": busy, "span_us": span,
            "by_name": by_name, "gaps": _gaps(events), "critical": _critical(events)}


def _launch_key(e) -> str:
    """A kernel's name with its grid (``name [x,y,z]``), so that launches of one kernel
    with different shapes (a layer's GEMVs) are told apart; the name alone without a grid."""
    grid = (e.get("args") or {}).get("grid")
    name = e.get("name", "?")
    return f"{name} [{','.join(str(g) for g in grid)}]" if grid else name


def _critical(events) -> dict:
    """Per launch key (_launch_key), in start order: (count, critical us), where a kernel's
    or copy's critical time is how far it moved the end of the GPU's work: its end minus
    the latest end before it, when positive. With PDL a kernel starts (and its duration
    counts) while the one before still runs, but it cannot finish before it; so in a
    serial stream the critical times plus the idle gaps add up to the span, and each is
    what that launch cost the step."""
    ks = sorted((float(e["ts"]), float(e.get("dur", 0.0)), _launch_key(e)) for e in events
                if e.get("cat") in GPU_CATS and e.get("ph", "X") == "X")
    out, end = {}, -math.inf
    for ts, dur, key in ks:
        gain = max(0.0, ts + dur - max(end, ts))  # an idle gap before ts is not its cost
        n, us = out.get(key, (0, 0.0))
        out[key] = (n + 1, us + gain)
        end = max(end, ts + dur)
    return out


def _gaps(events) -> dict:
    """Per (kernel, next kernel) name pair, in start order: (count, idle us, overlap us).
    Idle: from the end of everything before to the next kernel's start, when positive;
    overlap: how long the next kernel ran alongside the one before it (PDL's early
    starts, which include its wait in griddepcontrol.wait)."""
    ks = sorted((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
                if e.get("cat") == "kernel" and e.get("ph", "X") == "X")
    out, end = {}, -math.inf
    for (ts0, dur0, name0), (ts1, _, name1) in zip(ks, ks[1:]):
        end = max(end, ts0 + dur0)
        n, idle, over = out.get((name0, name1), (0, 0.0, 0.0))
        out[(name0, name1)] = (n + 1, idle + max(0.0, ts1 - end),
                               over + max(0.0, min(end, ts0 + dur0) - ts1))
    return out


def _step_share(long: dict, short: dict, steps: int, key: str, us_key: str) -> list:
    """{key: (count, us)} of the long trace minus the short one, over steps: rows {key,
    "per_step", us_key} of the keys the steps added, the most us first."""
    rows = []
    for k, (n, us) in long.items():
        n0, us0 = short.get(k, (0, 0.0))
        if n > n0:
            rows.append({key: k, "per_step": (n - n0) / steps, us_key: (us - us0) / steps})
    rows.sort(key=lambda r: -r[us_key])
    return rows


def per_step(long: dict, short: dict, steps: int, ms_per_token: float | None = None) -> dict:
    """One step's share of the GPU work: the trace of t(1 + steps) minus that of t(1),
    over ``steps``; idle = ms_per_token - busy (when the step time is given)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    d = {k: (long[k] - short[k]) / steps for k in ("kernels", "copies", "kernel_us", "busy_us")}
    idle = None if ms_per_token is None else ms_per_token * 1e3 - d["busy_us"]
    names = _step_share(long.get("by_name", {}), short.get("by_name", {}), steps, "name",
                        "us_per_step")
    pairs = []
    lg, sg = long.get("gaps", {}), short.get("gaps", {})
    for (a, b), (n, idle_us, over_us) in lg.items():
        n0, i0, o0 = sg.get((a, b), (0, 0.0, 0.0))
        if n > n0:
            pairs.append({"after": a, "next": b, "per_step": (n - n0) / steps,
                          "idle_us_per_step": (idle_us - i0) / steps,
                          "overlap_us_per_step": (over_us - o0) / steps})
    pairs.sort(key=lambda r: -r["idle_us_per_step"])
    crit = _step_share(long.get("critical", {}), short.get("critical", {}), steps, "launch",
                       "critical_us_per_step")
    return {"kernels_per_step": d["kernels"], "copies_per_step": d["copies"],
            "kernel_us_per_step": d["kernel_us"], "busy_us_per_step": d["busy_us"],
            "idle_us_per_step": idle, "kernels_by_time": names[:TOP_KERNELS],
            "gaps_by_pair": pairs[:TOP_KERNELS], "critical_by_launch": crit[:CRITICAL_LAUNCHES]}


class TokenMarks:
    """A transformers streamer that marks when each ``put`` arrives (a CUDA event on a GPU,
    ``time.perf_counter`` elsewhere): the prompt first, then one put per new token."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, torch.device(device).type == "cuda"
        self.marks = []

    def put(self, value) -> None:
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass

    def per_token_ms(self) -> float:
        """(last token - first token) / the steps between them, in ms."""
        steps = len(self.marks) - 2  # the prompt's put and the first token's are not steps
        if steps < 1:
            raise ValueError(f"need the prompt and two or more tokens put, got "
                             f"{len(self.marks)} puts")
        first, last = self.marks[1], self.marks[-1]
        if self.cuda:
            last.synchronize()
            return first.elapsed_time(last) / steps
        return (last - first) * 1e3 / steps


def engine_per_token_ms(timings: dict) -> float:
    """ms per decode step from the engine's ``timings`` (first new token to the last)."""
    if not timings.get("decode_steps"):
        raise ValueError(f"the engine ran no decode step: {timings}")
    return timings["decode_s"] * 1e3 / timings["decode_steps"]


# --------------------------------------------------------------------------- rows

def make_row(stamp: dict, case: StepCase, impl: str, status: str, *, new_tokens=None,
             reason=None, note=None, rel_err=None, tol=None, check_steps=None,
             ms_per_token=None, samples_ms=None, copy_tbps=None, profile=None,
             profile_steps=None, rel_err_hf=None, rel_err_vs_hf=None) -> dict:
    """One row; every row has the keys of ROW_FIELDS (None where they do not apply)."""
    row = dict(stamp)
    row.update({k: None for k in ROW_FIELDS})
    row.update(op=case.op, impl=impl, case=case.id, model=case.model, B=case.B, ctx=case.ctx,
               new_tokens=new_tokens, dtype=case.dtype, status=status, reason=reason,
               note=note, rel_err=rel_err, tol=tol, check_steps=check_steps,
               rel_err_hf=rel_err_hf, rel_err_vs_hf=rel_err_vs_hf,
               check_passed=None if rel_err is None else rel_err <= tol,
               weight_bytes=case.weight_bytes(), kv_bytes=case.kv_bytes(),
               # the issues' targets are H200 figures: judged on an H200 only
               target_ms=case.target_ms if impl in WSATTN_IMPLS
               and "H200" in str(stamp.get("gpu", "")) else None,
               copy_tbps=copy_tbps, samples_ms=samples_ms, profile_steps=profile_steps)
    if copy_tbps:
        row.update(floor_ms=case.floor_ms(copy_tbps),
                   floor_weights_ms=case.floor_ms(copy_tbps, weights_only=True))
    if ms_per_token is not None:
        row.update(ms_per_token=ms_per_token, tokens_per_s=case.B * 1e3 / ms_per_token)
        if row["floor_ms"]:
            row["frac_floor"] = row["floor_ms"] / ms_per_token
        if row["target_ms"] is not None:
            row["target_met"] = "met" if ms_per_token <= row["target_ms"] else "missed"
    if profile is not None:
        row.update(profile)
        if ms_per_token is not None:
            row["idle_us_per_step"] = ms_per_token * 1e3 - profile["busy_us_per_step"]
        row["kernels_per_layer"] = profile["kernels_per_step"] / case.cfg.layers
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """ratio_hf_compile (its ms / this row's) on every timed row; pdl_speedup (graph ms /
    graph + PDL ms) on the PDL row, in place."""
    timed = {(r["case"], r["impl"]): r for r in rows
             if r.get("op") == "step" and r.get("ms_per_token")}
    for (case, impl), r in timed.items():
        peer = timed.get((case, "hf-compile"))
        if peer and peer is not r:
            r["ratio_hf_compile"] = peer["ms_per_token"] / r["ms_per_token"]
        base, page = split_page(impl)
        nopdl = timed.get((case, "wsattn-graph" + ("" if page is None else f"{PAGE_SUFFIX}{page}")))
        if base.startswith("wsattn-graph-pdl") and nopdl:
            r["pdl_speedup"] = nopdl["ms_per_token"] / r["ms_per_token"]
    return rows


def format_table(rows: list[dict]) -> str:
    from .report import fmt, status_text
    lines = [f"ceiling {r['impl']}: {r['tbps']:.2f} TB/s ({r['case']})"
             for r in rows if r["op"] == "ceiling" and r.get("tbps")]
    head = (f"{'case':<36} {'impl':<17} {'ms/tok':>7} {'floor':>6} {'of floor':>8} "
            f"{'target':>7} {'x hf-cmp':>8} {'PDL x':>6} {'kern/step':>9} {'idle us':>8} "
            f"{'rel err':>8} {'hf err':>8}  status")
    lines += ["", head, "-" * len(head)]
    for r in (r for r in rows if r["op"] == "step"):
        target = "-" if r["target_ms"] is None else f"{r['target_ms']:.2f}" + (
            "" if r["target_met"] is None else (" ok" if r["target_met"] == "met" else " !"))
        status = status_text(r)
        lines.append(f"{r['case']:<36} {r['impl']:<17} {fmt(r['ms_per_token'], '.3f'):>7} "
                     f"{fmt(r['floor_ms'], '.3f'):>6} {fmt(r['frac_floor'], '.3f'):>8} "
                     f"{target:>7} {fmt(r['ratio_hf_compile'], '.2f'):>8} "
                     f"{fmt(r['pdl_speedup'], '.3f'):>6} {fmt(r['kernels_per_step'], '.1f'):>9} "
                     f"{fmt(r['idle_us_per_step'], '.0f'):>8} {fmt(r['rel_err'], '.1e'):>8} "
                     f"{fmt(r['rel_err_hf'], '.1e'):>8}  "
                     f"{status[:120]}")
    for r in (r for r in rows if r["op"] == "step" and r.get("kernels_by_time")):
        lines.append(f"  {r['case']} {r['impl']} kernels by GPU time per step: " + "; ".join(
            f"{k['name'][:40]} x{k['per_step']:.3g} {k['us_per_step']:.1f} us"
            for k in r["kernels_by_time"][:6]))
        if r.get("gaps_by_pair"):
            lines.append(f"  {r['case']} {r['impl']} idle between kernels per step: " + "; ".join(
                f"{g['after'][:24]} -> {g['next'][:24]} {g['idle_us_per_step']:.1f} us "
                f"(overlap {g['overlap_us_per_step']:.1f})" for g in r["gaps_by_pair"][:4]))
        if r.get("critical_by_launch"):
            lines.append(f"  {r['case']} {r['impl']} critical time per step by launch: " + "; ".join(
                f"{c['launch'][:48]} x{c['per_step']:.3g} {c['critical_us_per_step']:.1f} us"
                for c in r["critical_by_launch"][:10]))
    return "\n".join(lines)


def plot_rows(rows: list[dict], path):
    """ms/token per case and implementation (log scale), one panel per model; the floor
    and the target as markers."""
    from .plot import MISSING, pyplot, save
    plt = pyplot()
    if plt is None:
        return None, MISSING
    ok = [r for r in rows if r["op"] == "step" and r.get("ms_per_token")]
    if not ok:
        return None, "no timed rows to plot"
    models = [m for m in MODELS if any(r["model"] == m for r in ok)]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    impls += [i for i in dict.fromkeys(r["impl"] for r in ok) if i not in IMPLS]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    width = 0.8 / len(impls)
    for ax, model in zip(axes.flat, models):
        cases = sorted({(r["B"], r["ctx"]) for r in ok if r["model"] == model})
        ys_all = []
        for j, impl in enumerate(impls):
            ys = [next((r["ms_per_token"] for r in ok if (r["model"], r["B"], r["ctx"],
                        r["impl"]) == (model, b, c, impl)), float("nan")) for b, c in cases]
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=impl)
            ys_all += ys
        mid = [i + 0.4 - width / 2 for i in range(len(cases))]
        floors = [next((r["floor_ms"] for r in ok if (r["model"], r["B"], r["ctx"]) ==
                        (model, b, c) and r["floor_ms"]), float("nan")) for b, c in cases]
        ax.scatter(mid, floors, marker="_", s=900, color="black", label="floor", zorder=3)
        targets = [TARGETS.get((model, b, c), float("nan")) for b, c in cases]
        ax.scatter(mid, targets, marker="x", color="red", label="target", zorder=3)
        ax.set_xticks(mid, [f"B{b} ctx{c // 1024}k" for b, c in cases], fontsize=8)
        ax.set_yscale("log")
        # A log axis fitted to a few close values starts just under the smallest and makes
        # the bars' heights meaningless: start at the decade below, leave room for the legend.
        shown = [v for v in ys_all + floors + targets if v == v and v > 0]
        ax.set_ylim(10 ** math.floor(math.log10(min(shown))), max(shown) * 8)
        ax.set_ylabel("ms / token")
        ax.set_title(model, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    s = rows[0]
    return save(fig, axes, len(models),
                f"wsattn bench step - {s.get('gpu')} - {s.get('commit')} - {s.get('date')}", path)


# --------------------------------------------------------------------------- GPU work

class NotAvailable(Exception):
    """A column that cannot run here (the reason is the message)."""


def build_model(name: str, device, dtype: str = "bf16", layers: int | None = None):
    """transformers model of ``name`` with random weights, built on ``device``; ``layers``:
    the same config cut to that many decoder layers."""
    import torch
    from transformers import AutoModelForCausalLM

    from .cases import DTYPES

    cfg = hf_config(name)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "max_window_layers", None) is not None:
            cfg.max_window_layers = layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
    return model.eval()


def build_engine(model, case: StepCase, pdl, max_seq_len: int, device, page_size=None):
    """(wsattn's Engine on the kernel step with PDL on or off, or on for the kernel
    families ``pdl`` names (a tuple, see :func:`pdl_of`), a note or None).

    ``Engine(..., pdl=)`` where the engine takes it; otherwise the engine gets a fixed
    pool (never reallocated, so its step is never rebuilt) and its step is replaced by
    ``KernelStep(cfg, weights, cache, buckets=, pdl=)``, the runner's documented
    constructor. page_size: the engine's KV page in tokens (None: its default).
    NotAvailable when the runner is missing, rather than timing something else under its
    name."""
    import importlib

    from wsattn.engine.generate import Engine

    try:
        runner = importlib.import_module("wsattn.engine.runner")
    except ModuleNotFoundError as e:
        if e.name == "wsattn.engine.runner":
            raise NotAvailable("wsattn.engine.runner (the GPU step: fused kernels, graphs, "
                               "PDL) is not in this tree") from None
        raise
    from .cases import DTYPES

    kw = dict(step="kernels", dtype=DTYPES[case.dtype], device=device, buckets=(case.B,),
              max_seq_len=max_seq_len)
    if page_size is not None:
        kw["page_size"] = page_size
    try:
        return Engine(model, pdl=pdl, **kw), None
    except TypeError as e:
        if "pdl" not in str(e):
            raise
    page_size = kw.pop("page_size", PAGE_SIZE)
    engine = Engine(model, page_size=page_size,
                    num_pages=case.B * -(-max_seq_len // page_size), **kw)
    engine.step = runner.KernelStep(engine.cfg, engine.weights, engine.cache,
                                    buckets=engine.buckets, pdl=pdl)
    return engine, "pdl set on KernelStep (Engine takes no pdl=)"


def _sync(torch, device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def chrome_trace(torch, device, fn) -> dict:
    """The torch.profiler Chrome trace (its JSON as a dict) of fn, synchronised before it
    ends (no GPU events on a CPU device)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        fn()
        _sync(torch, device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def profile_summary(torch, device, fn) -> dict:
    """gpu_summary of a torch.profiler trace of fn (no GPU events on a CPU device)."""
    return gpu_summary(chrome_trace(torch, device, fn))


def teacher_forced_check(model, engine, ids, steps: int, dtype: str = "bf16", tol=None,
                         ref_model=None):
    """The engine's logits for ``steps`` new tokens, teacher-forced on the engine's own
    tokens (one forward over prompt + tokens), on the first and last sequence, measured
    against ``ref_model``: the same weights computed in fp32 (``model`` itself when it is
    fp32). transformers' own forward in the model's dtype is measured against the same
    reference, since random weights make logits flat and their relative error large for
    any bf16 computation: the check passes when the engine is within ``tol`` (default the
    dtype's, wsattn.testing.TOL) or within twice transformers' own error.

    Returns (relative error vs fp32, the tolerance applied, {"rel_err_hf": transformers'
    error vs fp32, "rel_err_vs_hf": the engine vs transformers})."""
    import torch

    from wsattn.testing import TOL, rel_err

    ref_model = model if ref_model is None else ref_model
    tokens, logits = engine.run(ids, steps, return_logits=True)
    S = ids.shape[1]
    outs, theirs, refs = [], [], []
    for b in sorted({0, ids.shape[0] - 1}):
        seq = tokens[b:b + 1, :S + steps - 1].to(logits.device)
        with torch.inference_mode():
            theirs.append(last_logits(model, seq, steps))
            refs.append(theirs[-1] if ref_model is model else
                        last_logits(ref_model, seq, steps))
        outs.append(logits[b].float())
    outs, theirs, refs = torch.stack(outs), torch.stack(theirs), torch.stack(refs)
    hf = rel_err(theirs, refs)
    base = TOL[dtype] if tol is None else tol
    return rel_err(outs, refs), max(base, 2 * hf), {"rel_err_hf": hf,
                                                    "rel_err_vs_hf": rel_err(outs, theirs)}


# bytes of attention scores one transformers forward of the check may hold: with grouped
# heads and fp32 (the reference), or a mask, sdpa falls back to its math kernel, which holds
# [heads, queries, keys] fp32 scores (128 GiB for 32 heads over 32k tokens)
CHECK_SCORES_BYTES = 4 << 30


def last_logits(model, seq, steps: int, scores_bytes: int = CHECK_SCORES_BYTES):
    """fp32 logits [steps, vocab] of the last ``steps`` positions of ``seq`` [1, S] by
    ``model``: one forward where its attention scores fit ``scores_bytes``, else the
    positions before them in chunks through a transformers DynamicCache and the last
    ``steps`` in a final forward (the same function: causal attention over the cache)."""
    S = seq.shape[1]
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    chunk = S if heads is None else max(1, scores_bytes // (4 * heads * S))
    if chunk >= S:
        return model(input_ids=seq, logits_to_keep=steps).logits[0].float()
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for start in range(0, S - steps, chunk):
        model(input_ids=seq[:, start:min(start + chunk, S - steps)], past_key_values=cache,
              use_cache=True, logits_to_keep=1)
    return model(input_ids=seq[:, S - steps:], past_key_values=cache, use_cache=True,
                 logits_to_keep=steps).logits[0].float()


def fp32_reference(model):
    """The same weights as ``model`` in fp32 (``model`` itself when already fp32)."""
    import copy

    import torch

    if next(model.parameters()).dtype == torch.float32:
        return model
    return copy.deepcopy(model).float().eval()


def check_on_cut(case: StepCase, pdl, max_len: int, ids, steps: int, tol, device,
                 page_size=None):
    """teacher_forced_check on the case's model cut to CHECK_LAYERS layers (its own random
    weights; the engine built on it as the timed one is on the full model), then freed:
    (rel, tol, detail, note)."""
    import torch

    layers = CHECK_LAYERS[case.model]
    cut = build_model(case.model, device, case.dtype, layers=layers)
    engine = ref = None
    try:
        engine, _ = build_engine(cut, case, pdl, max_len, device, page_size)
        ref = fp32_reference(cut)
        rel, tol, detail = teacher_forced_check(cut, engine, ids, steps, case.dtype, tol, ref)
    finally:
        del cut, engine, ref
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    note = (f"logits checked on the {layers}-layer cut of this config (the full model's fp32 "
            "copy does not fit beside it)")
    return rel, tol, detail, note


def device_memory(device) -> float:
    """Bytes of memory on ``device`` (a CUDA GPU's total; unbounded elsewhere)."""
    import torch

    if torch.device(device).type != "cuda":
        return math.inf
    return torch.cuda.get_device_properties(device).total_memory


def release_compiled_step(model) -> None:
    """Drop what transformers' compiled static-cache step keeps after ``generate``
    returns: the compiled call it stores on the model, and torch.compile's graphs with
    their CUDA graph memory pools (``torch._dynamo.reset`` clears the CUDA graph trees),
    so the next column starts without them. Nothing is lost across cases: each (B,
    context) compiles its own step anyway."""
    import torch._dynamo

    model.__dict__.pop("_compiled_call", None)
    torch._dynamo.reset()


def run_case(case: StepCase, impls, model, stamp, device, copy_tbps, args) -> list[dict]:
    """Rows of every column for one case; a column's failure is its row, never the run's."""
    import torch

    from .suite import _short

    # the traced run is the timed one, 1 + n tokens: another length would give the static
    # cache another shape, which torch.compile would compile (and cudagraph-warm) anew
    n, checks = args.new_tokens, args.check_steps
    g = torch.Generator().manual_seed(case.B * 7919 + case.ctx)
    ids = torch.randint(0, case.cfg.vocab, (case.B, case.ctx), generator=g)
    common = dict(new_tokens=n, copy_tbps=copy_tbps)
    on_cuda = torch.device(device).type == "cuda"
    total = device_memory(device)
    rows, ref = [], None
    for impl in impls:
        engine = None
        need = column_memory(case, max(n, checks), impl)
        if need > 0.9 * total:
            held = ("the weights, the engine's copy and the fp32 reference"
                    if case.model not in CHECK_LAYERS else
                    "the weights and the engine's folded tensors" if is_wsattn(impl)
                    else "the weights")
            rows.append(make_row(stamp, case, impl, "not available", **common,
                                 reason=f"needs ~{need / 2**30:.0f} GiB ({held} + its KV "
                                        f"cache), the GPU has {total / 2**30:.0f}"))
            continue
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            note = rel = tol = None
            if impl.startswith("hf-"):
                ids_dev = ids.to(device)
                extra = {"cache_implementation": "static"} if impl == "hf-compile" else {}

                def gen(tokens, extra=extra, ids_dev=ids_dev, streamer=None):
                    with torch.inference_mode():
                        return model.generate(ids_dev, attention_mask=torch.ones_like(ids_dev),
                                              max_new_tokens=tokens, min_new_tokens=tokens,
                                              do_sample=False, pad_token_id=0,
                                              streamer=streamer, **extra)

                def timed(tokens, gen=gen):
                    marks = TokenMarks(torch, device)
                    gen(tokens, streamer=marks)
                    return marks.per_token_ms()
            else:
                pdl, max_len = pdl_of(impl), case.ctx + max(n, checks) + 2
                page = split_page(impl)[1]
                tol_arg = getattr(args, "check_tol", None)
                if case.model in CHECK_LAYERS:
                    rel, tol, detail, cut_note = check_on_cut(case, pdl, max_len, ids, checks,
                                                              tol_arg, device, page)
                    engine, note = build_engine(model, case, pdl, max_len, device, page)
                    note = "; ".join(filter(None, [note, cut_note]))
                else:
                    engine, note = build_engine(model, case, pdl, max_len, device, page)
                    if ref is None:
                        ref = fp32_reference(model)
                    rel, tol, detail = teacher_forced_check(model, engine, ids, checks,
                                                            case.dtype, tol_arg, ref)
                common.update(detail)
                if not rel <= tol:
                    rows.append(make_row(stamp, case, impl, "failed", rel_err=rel, tol=tol,
                                         check_steps=checks, note=note, **common,
                                         reason=f"logits vs transformers teacher-forced: "
                                                f"relative error {rel:.3e} > {tol:.1e}; not timed"))
                    continue

                def gen(tokens, engine=engine):
                    return engine.run(ids, tokens)

                def timed(tokens, engine=engine):
                    t = {}
                    engine.run(ids, tokens, timings=t)
                    return engine_per_token_ms(t)
            for _ in range(2):  # warm-up: compilation, graph capture, allocator
                gen(1 + n)
            samples = [timed(1 + n) for _ in range(args.repeats)]
            ms = statistics.median(samples)
            prof = None
            try:
                prof = per_step(profile_summary(torch, device, lambda: gen(1 + n)),
                                profile_summary(torch, device, lambda: gen(1)), n)
            except Exception as e:  # the timing stands without the trace
                note = "; ".join(filter(None, [note, "profile failed: " + _short(e)]))
            rows.append(make_row(stamp, case, impl, "ok", rel_err=rel, tol=tol,
                                 check_steps=checks if rel is not None else None,
                                 ms_per_token=ms, samples_ms={"per_token": samples},
                                 profile=prof, profile_steps=n, note=note, **common))
            if engine is not None:
                rows[-1]["page_size"] = getattr(engine, "page_size", None)
            rows[-1]["need_gib"] = need / 2**30
            if on_cuda:  # what the column held at most, against the guard's estimate
                rows[-1]["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except NotAvailable as e:
            rows.append(make_row(stamp, case, impl, "not available", reason=str(e)[:300], **common))
        except Exception as e:  # a broken column must not stop the run
            rows.append(make_row(stamp, case, impl, "error", reason=_short(e), **common))
        finally:
            # gen/timed hold the column's engine (or its inputs) through their defaults:
            # dropped with it here, or the next column's engine is built beside it (at the
            # 48-layer MoE shape the second one ran out of memory)
            engine = gen = timed = None
            common.pop("rel_err_hf", None), common.pop("rel_err_vs_hf", None)
            if impl == "hf-compile":
                release_compiled_step(model)
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    return rows


def checkpoint(rows: list[dict], stamp, args) -> None:
    """The rows so far into --json's file (no plot), after every case: a large case takes
    minutes (~100 s a column at Llama-3.1-8B B64 ctx 4k on an H200), so a run stopped by a
    time limit keeps the cases that finished. The end of the run rewrites it whole."""
    from .gemv import json_path
    from .report import write_json

    path = json_path(stamp, args)
    if path is not None:
        write_json(add_ratios(rows), path)


def main(args) -> int:
    """Run the step benchmark (a CUDA GPU is checked for by the caller)."""
    import torch
    from tqdm import tqdm

    from . import ceilings as ceil_mod
    from .report import exit_status
    from .env import stamp as make_stamp
    from .gemv import write
    from .timing import cuda_timer

    device = torch.device("cuda", torch.cuda.current_device())
    stamp = make_stamp(device)
    cases = step_cases(args.models, args.batch, args.ctx)
    impls = list(args.step_impl)
    print(f"wsattn bench step on {stamp['gpu']}, torch {stamp['torch']}, commit "
          f"{stamp['commit']}: {len(cases)} cases x {impls}", file=sys.stderr)
    rows, copy_tbps = ceil_mod.copy_ceiling_rows(cuda_timer(args.warmup_ms, args.rep_ms, args.timing), device, stamp)
    import torch._dynamo
    # every (model, B, context) recompiles transformers' static-cache step
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    with tqdm(total=len(cases) * len(impls), desc="wsattn bench step", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for name in [m for m in MODELS if any(c.model == m for c in cases)]:
            try:
                model = build_model(name, device)
            except Exception as e:
                from .suite import _short
                for c in (c for c in cases if c.model == name):
                    rows += [make_row(stamp, c, i, "error", reason="model: " + _short(e))
                             for i in impls]
                    bar.update(len(impls))
                continue
            for case in (c for c in cases if c.model == name):
                bar.set_postfix_str(case.id, refresh=True)
                rows += run_case(case, impls, model, stamp, device, copy_tbps, args)
                checkpoint(rows, stamp, args)
                bar.update(len(impls))
            del model
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    add_ratios(rows)
    print(format_table(rows))
    write(rows, stamp, args, plot_rows)
    return exit_status(rows, is_wsattn)


def _step_impl_arg(text: str) -> str:
    import argparse
    try:
        return step_impl(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(group) -> None:
    """step's options (--models is gemv's, shared)."""
    group.add_argument("--batch", nargs="+", type=int, default=None, metavar="B",
                       help="step: batch sizes (with --ctx: the grid; default: the issue's "
                            "target cases)")
    group.add_argument("--ctx", nargs="+", type=int, default=None, metavar="N",
                       help=f"step: context lengths (default with --batch: "
                            f"{' '.join(map(str, CONTEXTS))})")
    group.add_argument("--step-impl", nargs="+", type=_step_impl_arg, default=list(IMPLS),
                       metavar="IMPL", help=f"step: columns (default all: {' '.join(IMPLS)}; "
                                           f"{PDL_SUBSET}FAMILY,...]: PDL on for those kernel "
                                           f"families of wsattn.engine.runner.PDL_FAMILIES "
                                           f"only, or its PDL_VARIANTS, e.g. gemv:late; a wsattn "
                                           f"column + {PAGE_SUFFIX}N: its engine's KV pages of N "
                                           f"tokens, e.g. wsattn-graph-pdl{PAGE_SUFFIX}64)")
    group.add_argument("--new-tokens", type=int, default=32,
                       help="step: decode steps timed, from the first new token to the "
                            "last of 1 + n (default 32)")
    group.add_argument("--repeats", type=int, default=3,
                       help="step: timed runs (the median is reported; default 3)")
    group.add_argument("--check-steps", type=int, default=4,
                       help="step: new tokens whose logits are checked (default 4)")
    group.add_argument("--check-tol", type=float, default=None,
                       help="step: tolerance on the logits' relative error (default: the "
                            "dtype's, wsattn.testing.TOL)")
