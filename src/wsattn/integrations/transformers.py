"""The ``"wsattn"`` attention implementation for Hugging Face transformers (5.x).

Importing this module registers it (``register()`` is idempotent)::

    import wsattn.integrations.transformers              # registers "wsattn"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="wsattn")
    # or from_pretrained(path, attn_implementation="wsattn"),
    # or model.set_attn_implementation("wsattn") on a loaded model

The name must be registered before the model is built: transformers checks
``attn_implementation`` against its registry when the model is constructed.

Two registrations, both needed:

* ``AttentionInterface``: :func:`attention_forward` is called by every attention layer
  that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Qwen3, ...) with
  query ``[B, Hq, S, D]`` and key/value ``[B, Hkv, L, D]`` (the cache already appended:
  prefill S = L, decode S = 1, chunked prefill S < L) and returns
  ``(out [B, S, Hq, D], None)``.
* ``AttentionMaskInterface``: the mask builder of ``"sdpa"``. For a name it does not
  know, transformers builds no mask at all, and a padded batch would silently attend
  to its padding. So wsattn receives exactly what sdpa receives: ``None`` (no padding;
  causal is implied), or a boolean mask ``[B, 1, S, L]`` (True = attend). A 4-D mask
  the caller prepared (boolean, or additive float with 0 / the dtype's minimum) is
  passed through by transformers unchanged and handled the same way.

How a mask runs:

* ``None``: ``wsattn.attention(q, k, v, causal=is_causal)`` over the whole cache
  (``wsattn.decode`` when S = 1). With sdpa's convention for a ``None`` mask, S > 1
  queries over L > S keys (only an empty static cache makes that) attend to the first S
  keys; the rest of such a cache is empty.
* a mask: read once per mask (all layers of a forward share one mask object; on CUDA
  this is one host synchronisation per forward, two for runs of queries) and matched
  exactly against the patterns wsattn expresses: each batch row b attends to one key
  range ``[lo_b, hi_b)``, causally (bottom-right aligned: query i sees keys
  ``lo_b <= j <= i + hi_b - S``) or in full. Left padding (``lo_b`` > 0), a static
  cache's empty tail (``hi_b`` < L) and padding queries that see no key (output 0, as
  sdpa gives) all have this form. When every row has the same range the keys are a
  slice of the cache (no copy); otherwise the queries and the keys of each row are
  packed (one copy) and run by ``wsattn.attention_varlen``. Or each row is runs of
  queries, every query attending to one contiguous key range: sequences packed one
  after another (a block-diagonal mask, what transformers builds from ``position_ids``
  that restart at 0, and chunked-attention masks: disjoint key ranges), and right
  padding (the padding queries after a sequence attend to all of its keys: a full run
  over the causal run's keys). Each run, causal or full, is one sequence of a varlen
  call (one call for the causal runs, one for the full ones).
* anything else (sliding windows, whose query runs overlap in their keys, masks with
  holes, per-head masks, additive bias values) raises :class:`UnsupportedMask`: wsattn
  never ignores a mask and has no masked fallback; use ``attn_implementation="sdpa"``
  for such a model.

Refused with a ValueError before any attention runs: ``dropout > 0`` (a model in
training mode with ``attention_dropout > 0``), ``output_attentions=True`` (wsattn never
forms the attention matrix), and the features of other model families that arrive as
keyword arguments (``sliding_window``, ``softcap``, ``s_aux`` sinks, ``position_bias``).
Head dims and dtypes are checked by :mod:`wsattn.api`: the kernels take D 64 / 128 / 256;
on a CPU without the interpreter ``impl="auto"`` runs the float64 reference, any D.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import wsattn

NAME = "wsattn"

# keyword arguments of other model families' attention features; a value other than
# None means the layer needs something wsattn does not compute
_UNSUPPORTED_KWARGS = {
    "sliding_window": "a sliding-window attention layer",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks (s_aux)",
    "position_bias": "an additive position bias",
}


class UnsupportedMask(ValueError):
    """A mask that is not one key range per batch row (causal or full)."""


@dataclass(frozen=True)
class KeyRanges:
    """A mask in the form wsattn runs: batch row b attends to keys ``[lo[b], hi[b])``,
    causally (query i of S sees keys ``j <= i + hi[b] - S``) or in full.

    segments: for a mask that is not one range a row, every row's runs of queries as
    ``(b, q0, q1, k0, k1, causal)``: queries ``[q0, q1)`` of row b attend to keys
    ``[k0, k1)``, causally (bottom-right aligned) or in full. Sequences packed one after
    another (a block-diagonal mask: transformers builds one from position_ids that
    restart) give disjoint key ranges; right padding gives a causal run and then the
    padding queries' full run over the same keys. ``causal`` then tells nothing. Empty
    when each row is one range (lo and hi say it all)."""
    causal: bool
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    segments: tuple[tuple[int, int, int, int, int, bool], ...] = ()

    def packed(self, S: int) -> tuple[tuple[int, int, int, int, int, bool], ...]:
        """The (b, q0, q1, k0, k1, causal) runs of the varlen calls (rows with no key left
        out: their queries get 0)."""
        if self.segments:
            return self.segments
        out = []
        for b, (lo, hi) in enumerate(zip(self.lo, self.hi)):
            n = hi - lo
            first = (S - min(n, S)) if self.causal else (0 if n else S)
            if first < S:
                out.append((b, first, S, lo, hi, self.causal))
        return tuple(out)


# --------------------------------------------------------------------------- masks

def _keep(mask: torch.Tensor, B: int, S: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [B, S, L] bool, ok: a 0-d bool tensor, False when the mask holds something
    wsattn cannot express: differing heads or additive bias values)."""
    if mask.dim() != 4:
        raise UnsupportedMask(f"wsattn: attention_mask must be 4-D [B, 1, S, L] (or None), "
                              f"got shape {tuple(mask.shape)}")
    try:
        mask = mask.expand(B, mask.shape[1], S, L)
    except RuntimeError:
        raise UnsupportedMask(f"wsattn: attention_mask of shape {tuple(mask.shape)} does not "
                              f"broadcast to [B={B}, heads, S={S}, L={L}]") from None
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        # an additive mask: 0 attends, the dtype's minimum (or -inf) masks; any other
        # value is a bias wsattn does not add
        keep = mask == 0
        ok = (keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()
    else:
        raise UnsupportedMask(f"wsattn: attention_mask must be bool or floating point, got "
                              f"{mask.dtype}")
    if keep.shape[1] > 1:
        ok = ok & (keep == keep[:, :1]).all()
    return keep[:, 0], ok


def analyse_mask(mask: torch.Tensor, B: int, S: int, L: int,
                 prefer_causal: bool = True) -> KeyRanges:
    """Match a 4-D attention mask (bool, True = attend, or additive float; broadcastable
    to [B, heads, S, L]) exactly against "one key range per batch row, causal or full".

    One host read. Raises :class:`UnsupportedMask` naming what does not fit. When a mask
    fits both (S = 1, or rows that see nothing), ``prefer_causal`` decides.
    """
    keep, ok = _keep(mask, B, S, L)
    last = keep[:, -1]                                          # [B, L]: the last query row
    has = last.any(-1)
    lo = torch.where(has, last.to(torch.int8).argmax(-1), 0)    # first key it sees
    hi = torch.where(has, L - last.flip(-1).to(torch.int8).argmax(-1), 0)  # last + 1
    j = torch.arange(L, device=keep.device)
    i = torch.arange(S, device=keep.device)
    span = (j >= lo[:, None, None]) & (j < hi[:, None, None])   # [B, 1, L]
    tri = j[None, None, :] <= i[None, :, None] + (hi[:, None, None] - S)  # [B, S, L]
    is_causal = (keep == (span & tri)).all()
    is_full = (keep == span).all()
    flags = torch.cat([lo, hi, torch.stack([is_causal, is_full, ok]).long()]).tolist()
    lo_h, hi_h, (c, f, good) = tuple(flags[:B]), tuple(flags[B:2 * B]), flags[2 * B:]
    if not good:
        raise UnsupportedMask(
            "wsattn: attention_mask holds per-head patterns or additive bias values (not only "
            "0 and the dtype's minimum); wsattn cannot express them; use "
            "attn_implementation='sdpa' for this model")
    if c or f:
        return KeyRanges(bool(c) and (prefer_causal or not f), lo_h, hi_h)
    return KeyRanges(bool(c), lo_h, hi_h, _segments(keep))


_NOT_EXPRESSIBLE = (
    "wsattn: attention_mask is neither one key range per batch row nor runs of queries over "
    "one key range each (packed sequences, right padding), causal or full: {why}; wsattn "
    "cannot express it and never ignores a mask; use attn_implementation='sdpa' for this "
    "model")


def _segments(keep: torch.Tensor):
    """The runs (b, q0, q1, k0, k1, causal) of a mask (keep [B, S, L]) whose every query
    attends to one contiguous key range: a run is a maximal stretch of queries with the
    same first key whose last key grows by one a query (causal, bottom-right aligned) or
    stays (full). Consecutive runs of a row must have disjoint key ranges (packed
    sequences) or the same one (right padding's queries after their sequence); anything
    else (a sliding window's overlapping ranges) is refused. One more host read."""
    B, S, L = keep.shape
    has = keep.any(-1)                                           # [B, S]
    qlo = torch.where(has, keep.to(torch.int8).argmax(-1), 0)    # each query's first key
    qhi = torch.where(has, L - keep.flip(-1).to(torch.int8).argmax(-1), 0)  # last + 1
    j = torch.arange(L, device=keep.device)
    contiguous = (keep == ((j >= qlo[..., None]) & (j < qhi[..., None]))).all()
    qlo, qhi, has, contiguous = (t.cpu() for t in (qlo, qhi, has, contiguous))
    if not contiguous:
        raise UnsupportedMask(_NOT_EXPRESSIBLE.format(why="a query attends to keys that are "
                                                      "not one contiguous range"))
    segments = []
    for b in range(B):
        lo_b, hi_b, has_b = qlo[b].tolist(), qhi[b].tolist(), has[b].tolist()
        prev = None  # the row's previous run's key range
        i = 0
        while i < S:
            if not has_b[i]:
                i += 1  # a query that sees no key: output 0
                continue
            end, step = i + 1, None
            if end < S and has_b[end] and lo_b[end] == lo_b[i] and hi_b[end] - hi_b[i] in (0, 1):
                step = hi_b[end] - hi_b[i]
                while end < S and has_b[end] and lo_b[end] == lo_b[i] \
                        and hi_b[end] - hi_b[end - 1] == step:
                    end += 1
            keys = (lo_b[i], hi_b[end - 1])
            if prev is not None and keys != prev and keys[0] < prev[1]:
                raise UnsupportedMask(_NOT_EXPRESSIBLE.format(
                    why=f"row {b}'s query runs overlap in their keys (a sliding window?)"))
            prev = keys
            # a one-query run is both; it goes with the causal ones (the same attention)
            segments.append((b, i, end, keys[0], keys[1], step != 0))
            i = end
    return tuple(segments)


# the last mask analysed: every layer of one forward receives the same mask object, so it
# is read on the host once per forward, not once per layer. The version counter catches an
# in-place change; inference-mode tensors have none, so a mask the caller keeps and edits
# in place under torch.inference_mode() must be a new tensor to be read again (the masks
# transformers builds are new every forward).
_last_mask: tuple | None = None


def _ranges(mask: torch.Tensor, B: int, S: int, L: int, causal: bool) -> KeyRanges:
    global _last_mask
    version = None if mask.is_inference() else mask._version
    key = (version, tuple(mask.shape), B, S, L, causal)
    if _last_mask is not None and _last_mask[0]() is mask and _last_mask[1] == key:
        return _last_mask[2]
    ranges = analyse_mask(mask, B, S, L, prefer_causal=causal)
    _last_mask = (weakref.ref(mask), key, ranges)
    return ranges


# --------------------------------------------------------------------------- running

def _dense(q, k, v, causal, scale, impl):
    """q [B, S, Hq, D], k/v [B, K, Hkv, D] views, S <= K when causal."""
    if q.shape[1] == 1:  # one new token: the split-KV decode kernel, over all K keys
        seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
        return wsattn.decode(q, k, v, seqlens, sm_scale=scale, impl=impl)
    return wsattn.attention(q, k, v, causal=causal, sm_scale=scale, impl=impl)


def _one_range(q, k, v, causal, scale, impl):
    """Every row attends to all of k/v [B, K, Hkv, D] (causally or not)."""
    S, K = q.shape[1], k.shape[1]
    if K == 0 or (causal and S > K):
        # queries before the first key (padding queries) see nothing: output 0
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
        if K:
            out[:, S - K:] = _dense(q[:, S - K:], k, v, causal, scale, impl)
        return out
    return _dense(q, k, v, causal, scale, impl)


def _packed(q, k, v, r: KeyRanges, scale, impl):
    """Rows with different key ranges, or rows of several query runs: pack each run's
    queries and keys, one attention_varlen call for the causal runs and one for the full
    ones, scatter back (queries that see nothing get 0)."""
    B, S, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    out = q.new_zeros(B * S, Hq, D)
    for causal in (True, False):
        seqs = [x for x in r.packed(S) if x[5] is causal]
        if not seqs:
            continue
        q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
        for b, q0, q1, k0, k1, _ in seqs:
            q_idx.extend(range(b * S + q0, b * S + q1))
            k_idx.extend(range(b * L + k0, b * L + k1))
            cu_q.append(len(q_idx))
            cu_k.append(len(k_idx))
        dev = q.device
        q_idx = torch.tensor(q_idx, dtype=torch.long).to(dev, non_blocking=True)
        k_idx = torch.tensor(k_idx, dtype=torch.long).to(dev, non_blocking=True)
        cu = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(dev, non_blocking=True)
        qp = q.reshape(B * S, Hq, D)[q_idx]
        kp = k.reshape(B * L, Hkv, D)[k_idx]
        vp = v.reshape(B * L, Hkv, D)[k_idx]
        max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
        max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        out[q_idx] = wsattn.attention_varlen(qp, kp, vp, cu[0], cu[1], max_q, max_k,
                                             causal=causal, sm_scale=scale, impl=impl)
    return out.view(B, S, Hq, D)


def _check_call(module, dropout, kwargs):
    layer = getattr(module, "layer_idx", None)
    where = f"wsattn attention{'' if layer is None else f' (layer {layer})'}"
    if dropout:
        raise ValueError(f"{where}: dropout={dropout} > 0 is not supported (wsattn is "
                         "inference only); call model.eval() or set attention_dropout=0")
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        raise ValueError(f"{where}: output_attentions=True is not supported (wsattn never forms "
                         "the attention matrix); use attn_implementation='eager' to get "
                         "attention weights")
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: {name}={kwargs[name]!r}: {what} is not supported by "
                             "wsattn; use attn_implementation='sdpa' for this model")


def make_attention_forward(impl: str = "auto"):
    """The attention function transformers calls, running wsattn with ``impl``."""

    def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs):
        """transformers' attention-function signature.

        Args:
            module: the attention layer (``is_causal``, ``layer_idx``, ``config`` read).
            query: [B, Hq, S, D]; key, value: [B, Hkv, L, D], the cache appended
                (Hq a multiple of Hkv: GQA is native, no repeat of K/V).
            attention_mask: None or a 4-D mask (see the module docstring).
            dropout: must be 0. scaling: softmax scale (default 1/sqrt(D)).
            is_causal: overrides ``module.is_causal`` (default True).

        Returns:
            (out [B, S, Hq, D] in query's dtype, None).
        """
        _check_call(module, dropout, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal)
        q = query.transpose(1, 2)            # [B, S, Hq, D] (a view)
        k = key.transpose(1, 2)              # [B, L, Hkv, D]
        v = value.transpose(1, 2)
        B, S = q.shape[:2]
        L = k.shape[1]
        if attention_mask is None:
            if causal and 1 < S < L:
                # sdpa's convention for a None mask (top-left): only an empty static cache
                # gives S > 1 queries over L > S keys, and its keys past S are empty
                k, v = k[:, :S], v[:, :S]
            out = _one_range(q, k, v, causal, scaling, impl)
        else:
            r = _ranges(attention_mask, B, S, L, causal)
            if not r.segments and len(set(r.lo)) == 1 and len(set(r.hi)) == 1:
                lo, hi = r.lo[0], r.hi[0]
                out = _one_range(q, k[:, lo:hi], v[:, lo:hi], r.causal, scaling, impl)
            else:
                out = _packed(q, k, v, r, scaling, impl)
        return out.contiguous(), None

    attention_forward.wsattn_impl = impl
    return attention_forward


attention_forward = make_attention_forward("auto")


def register(name: str = NAME, impl: str = "auto") -> None:
    """Register ``name`` with transformers: the attention function (running wsattn with
    ``impl``) and sdpa's mask builder. Idempotent; registering again rebinds the name.
    ``import wsattn.integrations.transformers`` calls ``register()``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if impl not in wsattn.api.IMPLS:
        raise ValueError(f"impl must be one of {wsattn.api.IMPLS}, got {impl!r}")
    current = AttentionInterface._global_mapping.get(name)
    if getattr(current, "wsattn_impl", None) != impl:
        AttentionInterface.register(name, attention_forward if impl == "auto" and name == NAME
                                    else make_attention_forward(impl))
    AttentionMaskInterface.register(name, sdpa_mask)


register()
