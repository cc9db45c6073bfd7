"""Text generation over a paged KV cache: :class:`Engine` and :func:`generate`.

An :class:`Engine` holds a model's FlashNorm-folded weights
(:func:`wsattn.models.weights.load` then :func:`wsattn.models.flashnorm.fold`), a
:class:`~wsattn.engine.kv_cache.PagedKVCache` and a *step function*; one request runs as

1. checks of everything the caller passed (token ids in the vocabulary, non-empty
   prompts, ``max_new_tokens >= 0``, the batch within the largest bucket, prompt + new
   tokens within the model's positions and the cache): a ``ValueError`` naming the
   argument, raised before any forward runs and before the cache changes;
2. admission: each sequence gets the pages for prompt + ``max_new_tokens`` tokens;
3. prefill: the prompts in chunks of at most ``prefill_chunk`` tokens per sequence, all
   sequences of the batch packed into one varlen call per chunk; the logits at each
   prompt's last token give the first new token;
4. decode: one call of the step function per new token, for the whole batch;
5. sampling on the logits' device: greedy (``temperature == 0``: argmax, ties to the
   lowest id, as transformers), or temperature / top-k / top-p with a seeded
   ``torch.Generator`` (same seed, same tokens);
6. release of the pages, also when a step raises.

The step function (the :class:`Step` interface below) is where the forward runs:

* ``step="reference"``: :mod:`wsattn.models.reference`, plain PyTorch, any device and
  dtype; prefill and decode read and write the paged cache.
* ``step="kernels"``: :class:`wsattn.engine.runner.KernelStep`, the fused decode kernels
  (one CUDA graph per batch bucket, PDL; prefill through cuBLAS and
  :func:`wsattn.attention_varlen`), on CUDA (fp16/bf16) or the CPU through the Triton
  interpreter (``TRITON_INTERPRET=1``, fp32/fp16); anything else it refuses by name.
"""

from __future__ import annotations

import importlib
import math
import operator
import time
from collections.abc import Iterable
from typing import Protocol, Sequence

import torch

from .kv_cache import PAGE_SIZE, PagedKVCache

__all__ = ["Engine", "Step", "generate", "sample", "BUCKETS"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes the GPU runner captures a graph for
STEPS = ("reference", "kernels")
IMPLS = ("auto",) + STEPS


class Step(Protocol):
    """What the engine calls to run the model; a GPU runner plugs in by providing this.

    Construction: ``Step(cfg, weights, cache)`` with the ModelConfig, the folded
    :class:`~wsattn.models.weights.Weights` (``norms_folded=True``) and the
    :class:`~wsattn.engine.kv_cache.PagedKVCache`; ``wsattn.engine.runner`` must export
    it as ``KernelStep``. The engine builds a new step whenever it reallocates the pool
    (only between requests), so a runner may capture its CUDA graphs against
    ``cache.k`` / ``cache.v`` and its own static buffers once, in the constructor or
    lazily per bucket.

    Both methods write the K/V of the tokens they are given into ``cache`` (pages and
    block table as :class:`~wsattn.engine.kv_cache.PagedKVCache` lays them out) and return
    float32 logits; neither touches the allocator (the engine advances lengths). Index
    tensors arrive on the cache's device, built from host-side lengths (no host read of
    device values is needed).
    """

    def prefill(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, start: torch.Tensor,
                block_table: torch.Tensor, *, lengths=None, starts=None) -> torch.Tensor:
        """tokens: int64 [T], B sequences' next chunks packed; cu_seqlens: int32 [B + 1]
        (chunk b is tokens[cu[b]:cu[b+1]], every chunk non-empty); start: int32 [B], the
        tokens each sequence already has in the cache (the chunk's first position);
        block_table: int32 [B, max_pages]; lengths / starts: the same chunk lengths and
        starts as host lists (the engine knows them), so a step never reads device values
        on the host. Returns float32 [B, vocab], the logits at each chunk's last token."""

    def decode(self, tokens: torch.Tensor, seqlens: torch.Tensor,
               block_table: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [B], one new token per sequence; seqlens: int32 [B], cache length
        *including* the new token (its position is seqlens - 1); block_table: int32
        [B, max_pages]. Returns float32 [B, vocab]. B is at most the largest bucket; a
        runner pads B up to its bucket itself."""


class ReferenceStep:
    """The step through :mod:`wsattn.models.reference` (plain PyTorch, any device/dtype),
    computing in ``compute_dtype`` (default: float32 for 16-bit weights, else theirs).

    A prefill chunk at the start of a prompt runs through ``reference.prefill``; a later
    chunk (a prompt longer than ``prefill_chunk``) runs token by token through
    ``reference.decode_step``, since the reference prefill starts at position 0. Same
    function, slower: chunking is for the kernel path's memory, not the reference's.
    """

    name = "reference"

    def __init__(self, cfg, weights, cache: PagedKVCache, compute_dtype=None):
        self.cfg, self.weights, self.cache = cfg, weights, cache
        self._ref = importlib.import_module("wsattn.models.reference")
        if compute_dtype is None:
            half = weights.dtype in (torch.float16, torch.bfloat16)
            compute_dtype = torch.float32 if half else weights.dtype
        self.compute_dtype = compute_dtype

    def _kv(self, block_table):
        return self._ref.KVCache(self.cache.k, self.cache.v, block_table)

    def prefill(self, tokens, cu_seqlens, start, block_table, *, lengths=None, starts=None):
        if lengths is not None and starts is not None:
            lens, start_h = list(lengths), list(starts)
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
        else:
            cu, start_h = cu_seqlens.tolist(), start.tolist()
            lens = [b - a for a, b in zip(cu, cu[1:])]
        B, dev = len(lens), tokens.device
        out = [None] * B
        fresh = [b for b in range(B) if start_h[b] == 0]
        if fresh:
            S = max(lens[b] for b in fresh)
            ids = torch.zeros(len(fresh), S, dtype=torch.int64, device=dev)
            for j, b in enumerate(fresh):
                ids[j, :lens[b]] = tokens[cu[b]:cu[b + 1]]
            lengths = torch.tensor([lens[b] for b in fresh], device=dev)
            logits = self._ref.prefill(self.cfg, self.weights, ids, lengths,
                                       self._kv(block_table[fresh]),
                                       compute_dtype=self.compute_dtype)
            for j, b in enumerate(fresh):
                out[b] = logits[j]
        later = [b for b in range(B) if start_h[b] > 0]
        for t in range(max((lens[b] for b in later), default=0)):
            rows = [b for b in later if t < lens[b]]
            tok = torch.stack([tokens[cu[b] + t] for b in rows])
            pos = torch.tensor([start_h[b] + t for b in rows], device=dev)
            logits = self._ref.decode_step(self.cfg, self.weights, tok, pos,
                                           self._kv(block_table[rows]),
                                           compute_dtype=self.compute_dtype)
            for j, b in enumerate(rows):
                out[b] = logits[j]
        return torch.stack(out).float()

    def decode(self, tokens, seqlens, block_table):
        return self._ref.decode_step(self.cfg, self.weights, tokens, seqlens.long() - 1,
                                     self._kv(block_table),
                                     compute_dtype=self.compute_dtype).float()


def _make_step(name, cfg, weights, cache, buckets=BUCKETS):
    if name == "reference":
        return ReferenceStep(cfg, weights, cache)
    # name == "kernels"
    runner = importlib.import_module("wsattn.engine.runner")
    return runner.KernelStep(cfg, weights, cache, buckets=buckets)


# --------------------------------------------------------------------------- sampling

def _check_sampling(temperature, top_k, top_p):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens from logits, on the logits' device (no host synchronisation).

    logits: float [B, vocab]. temperature 0: argmax (lowest id on ties; top_k/top_p
    ignored). Otherwise softmax(logits / temperature) restricted to the top_k most likely
    tokens, then to the smallest set whose probability reaches top_p (the most likely
    token always stays), sampled with ``generator`` (on the logits' device). Returns
    int64 [B].
    """
    if temperature == 0:
        if logits.is_cuda:
            # many programs instead of torch's one reduction over a row (~27 us at one row
            # of 128k on the H200); the same indices (kernels/argmax.py)
            from ..kernels import argmax
            if logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype in argmax.DTYPES:
                return argmax.argmax(logits)
        return logits.argmax(dim=-1)
    scores = logits.float()
    # the largest logit moved to 0 first: a tiny temperature then sends the others to -inf
    # (the argmax, with ties shared) instead of every score to inf and softmax to NaN
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the ones before it already reach top_p
        drop = (cum - sorted_scores.softmax(dim=-1)) >= top_p
        drop[..., 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------- engine

def _prompts(input_ids, vocab: int) -> tuple[list[torch.Tensor], bool]:
    """input_ids -> (list of int64 1-D CPU tensors, whether the input was one 2-D tensor)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S] or a list of sequences, got shape "
                             f"{tuple(input_ids.shape)}")
        rows, as_tensor = list(input_ids), True
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        rows, as_tensor = list(input_ids), False
    else:
        raise ValueError(f"input_ids must be a tensor [B, S] or a list of token sequences, got "
                         f"{type(input_ids).__name__}")
    if not rows:
        raise ValueError("input_ids holds no sequences")
    out = []
    for i, r in enumerate(rows):
        t = r if isinstance(r, torch.Tensor) else torch.as_tensor(r)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"input_ids[{i}] must hold integer token ids, got {t.dtype}")
        if t.dim() != 1:
            # a flat list of ids (one tokenised prompt) would otherwise be read as that
            # many one-token prompts, and a 2-D row joined into one prompt
            raise ValueError(
                f"input_ids[{i}] must be one prompt, a 1-D sequence of token ids, got "
                f"{'a single id' if t.dim() == 0 else f'shape {tuple(t.shape)}'} (one prompt "
                "as a flat list: pass [ids], or a 1-D tensor)")
        t = t.to("cpu", torch.int64)
        if t.numel() == 0:
            raise ValueError(f"input_ids[{i}] is an empty prompt")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"input_ids[{i}] holds token id {lo if lo < 0 else hi}, outside the "
                             f"vocabulary [0, {vocab})")
        out.append(t)
    return out, as_tensor


class Engine:
    """A loaded model, its paged KV cache and its step function.

    Args:
        model_or_path: a transformers ``*ForCausalLM`` object or a local checkpoint folder
            (see :func:`wsattn.models.weights.load`).
        dtype: weights, activations and cache dtype (default: the checkpoint's).
        device: default ``"cuda"`` if available, else ``"cpu"``.
        step: ``"reference"`` or ``"kernels"`` (see the module docstring; ``"kernels"``
            refuses by name a device/dtype it does not run, when the step is built).
        page_size: tokens per KV page.
        buckets: increasing batch sizes; the largest is the most sequences per request.
        num_pages: KV pages in the pool; None: grown to fit each request (the pool is
            reallocated only between requests, when nothing is live).
        max_seq_len: most tokens per sequence (prompt + new); default: the model's
            max positions.
        prefill_chunk: most prompt tokens per sequence in one prefill call.
    """

    def __init__(self, model_or_path, *, dtype=None, device=None, step: str = "reference",
                 page_size: int = PAGE_SIZE, buckets=BUCKETS, num_pages: int | None = None,
                 max_seq_len: int | None = None, prefill_chunk: int = 512):
        from ..models import flashnorm
        from ..models.weights import load

        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        buckets = _check_buckets(buckets)
        for name, value in (("page_size", page_size), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages must be None or a positive int, got {num_pages!r}")
        device = _check_device(device)
        if max_seq_len is not None and (isinstance(max_seq_len, bool)
                                        or not isinstance(max_seq_len, int)):
            raise ValueError(f"max_seq_len must be None or an int, got {max_seq_len!r}")
        cfg, weights = load(model_or_path, dtype=dtype, device=device)
        self.cfg, self.weights = cfg, flashnorm.fold(weights)
        self.device, self.dtype = device, self.weights.dtype
        self.step_name, self.page_size, self.buckets = step, page_size, buckets
        self.prefill_chunk = prefill_chunk
        self.max_seq_len = cfg.max_positions if max_seq_len is None else max_seq_len
        if not 1 <= self.max_seq_len <= cfg.max_positions:
            raise ValueError(f"max_seq_len must be in [1, {cfg.max_positions}] (the model's "
                             f"max positions), got {max_seq_len!r}")
        self._fixed_pool = num_pages is not None
        self.cache = self.step = None
        if num_pages is not None:
            self._new_pool(num_pages)

    def _new_pool(self, num_pages):
        self.cache = PagedKVCache(self.cfg, num_pages, self.page_size, self.dtype, self.device,
                                  max_batch=self.buckets[-1], max_seq_len=self.max_seq_len)
        self.step = _make_step(self.step_name, self.cfg, self.weights, self.cache,
                               self.buckets)

    def check(self, prompts: list[torch.Tensor], max_new_tokens: int) -> None:
        """Everything :meth:`run` checks before any work (prompts as :meth:`run` takes
        them); raises ValueError naming the argument."""
        _check_batch(prompts, max_new_tokens, self.buckets[-1], self.max_seq_len,
                     self.cfg.max_positions)
        if self.cache is not None:
            if self._fixed_pool or self.cache.live:
                self.cache.check_admit([p.numel() + max_new_tokens for p in prompts])

    @torch.inference_mode()
    def run(self, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
            top_k: int | None = None, top_p: float | None = None,
            eos_token_id: int | Sequence[int] | None = None, return_logits: bool = False,
            seed: int | None = None, timings: dict | None = None):
        """Generate; arguments and result as :func:`generate`.

        timings: a dict to fill with ``prefill_s`` (prompt prefill, incl. sampling the
        first token), ``decode_s`` (every later step) and ``decode_steps``; measured with
        CUDA events on a GPU (one synchronisation at the end), ``time.perf_counter``
        elsewhere. None: nothing is measured and nothing synchronises.
        """
        prompts, as_tensor, eos = _check_request(
            self.cfg, input_ids, temperature, top_k, top_p, eos_token_id, return_logits, seed)
        self.check(prompts, max_new_tokens)
        B = len(prompts)
        if max_new_tokens == 0:
            logits = torch.empty(B, 0, self.cfg.vocab, dtype=torch.float32, device=self.device)
            return _result(prompts, [], as_tensor, logits if return_logits else None)

        caps = [p.numel() + max_new_tokens for p in prompts]
        if not self._fixed_pool and (self.cache is None or not self.cache.live):
            need = sum(-(-c // self.page_size) for c in caps)
            if self.cache is None or self.cache.num_pages < need:
                self._new_pool(need)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device)
            if seed is None:
                gen.seed()  # a fresh random seed for this generator only, not torch's global one
            else:
                gen.manual_seed(seed)
        ids = self.cache.admit(caps)  # from here on the pages go back whatever happens
        try:
            new, logits = self._loop(ids, prompts, max_new_tokens, temperature, top_k, top_p,
                                     eos, gen, return_logits, _Clock(self.device, timings))
        finally:
            self.cache.release(ids)
        return _result(prompts, new, as_tensor, logits)

    def _loop(self, ids, prompts, max_new_tokens, temperature, top_k, top_p, eos, gen,
              return_logits, clock):
        cache, dev = self.cache, self.device
        clock.mark()
        block_table = cache.block_table(ids)
        last = self._prefill(ids, prompts, block_table)
        new, all_logits = [], []
        done = torch.zeros(len(ids), dtype=torch.bool, device=dev)
        eos_t = None if eos is None else torch.tensor(eos, dtype=torch.int64, device=dev)
        # The lengths the next step attends over, kept on the device and advanced there:
        # building them from the cache's host lengths each step is a pageable host-to-device
        # copy, which synchronises the stream, so the GPU sat idle for the host's whole
        # between-step work (177-303 us a token in the H200 step traces).
        seqlens = cache.seqlens(ids)
        stop = _EosStop(dev)
        for i in range(max_new_tokens):
            if return_logits:
                all_logits.append(last)
            tok = sample(last, temperature, top_k, top_p, gen)
            if eos_t is not None:
                tok = torch.where(done, eos_t[0], tok)  # finished rows repeat eos as padding
                done |= torch.isin(tok, eos_t)
                stop.push(done.all())
            new.append(tok)
            if i == 0:
                clock.mark()
            if i + 1 == max_new_tokens or stop.done_at() is not None:
                break
            cache.advance(ids, [1] * len(ids))
            seqlens = seqlens + 1
            last = self.step.decode(tok, seqlens, block_table)
        clock.mark()
        clock.report(len(new) - 1)
        if eos_t is not None:
            # the token after which every sequence was done: the steps run past it while
            # its flag was on its way to the host are dropped (their rows were eos padding)
            n = stop.finish()
            if n is not None:
                new, all_logits = new[:n + 1], all_logits[:n + 1]
        logits = torch.stack(all_logits, dim=1) if return_logits else None
        return new, logits

    def _prefill(self, ids, prompts, block_table):
        """Run the prompts through the step in chunks; return float32 [B, vocab], the
        logits at each prompt's last token."""
        B, C = len(ids), self.prefill_chunk
        last = [None] * B
        done_tokens = [0] * B
        while True:
            rows = [b for b in range(B) if done_tokens[b] < prompts[b].numel()]
            if not rows:
                break
            chunks = [prompts[b][done_tokens[b]:done_tokens[b] + C] for b in rows]
            lens = [c.numel() for c in chunks]
            cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            sub = [ids[b] for b in rows]
            starts = [self.cache.length(s) for s in sub]
            logits = self.step.prefill(torch.cat(chunks).to(self.device), cu.to(self.device),
                                       self.cache.seqlens(sub), block_table[rows],
                                       lengths=lens, starts=starts)
            self.cache.advance(sub, lens)
            for j, b in enumerate(rows):
                done_tokens[b] += lens[j]
                if done_tokens[b] == prompts[b].numel():
                    last[b] = logits[j]
        return torch.stack(last)


class _EosStop:
    """When every sequence has emitted eos, without a host sync per token on CUDA.

    push(flag) takes each step's device bool "all done after this token". On the CPU it
    is read at once. On CUDA it is copied to pinned memory behind an event and read once
    the event has passed (``query``, never a wait), so the loop runs a step or two past
    the stop while the flag travels; ``finish`` then names the first done step and the
    caller drops the steps after it. The host waits for the oldest flag only when it is
    more than MAX_LAG steps ahead of it.
    """

    MAX_LAG = 2

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending = []  # (step, pinned bool, event), oldest first
        self.step = -1
        self.first = None  # first step whose flag read True

    def push(self, flag: torch.Tensor) -> None:
        self.step += 1
        if self.first is not None:
            return
        if not self.cuda:
            if bool(flag):
                self.first = self.step
            return
        slot, event = self._slot(), self._event()
        slot.copy_(flag, non_blocking=True)
        event.record()
        self.pending.append((self.step, slot, event))

    @staticmethod
    def _slot() -> torch.Tensor:
        return torch.empty((), dtype=torch.bool, pin_memory=True)

    @staticmethod
    def _event():
        return torch.cuda.Event()

    def _read(self, wait_all: bool) -> None:
        while self.pending and self.first is None:
            step, slot, event = self.pending[0]
            if not event.query():
                if not (wait_all or len(self.pending) > self.MAX_LAG):
                    return
                event.synchronize()
            self.pending.pop(0)
            if bool(slot):
                self.first = step
                self.pending.clear()

    def done_at(self) -> int | None:
        """The first done step seen so far (None: not yet, or not yet known)."""
        self._read(wait_all=False)
        return self.first

    def finish(self) -> int | None:
        """The first done step of all pushed (waits for the flags still travelling)."""
        self._read(wait_all=True)
        return self.first


class _Clock:
    """Marks at the start, after the first token, at the end; does nothing without a dict."""

    def __init__(self, device, out: dict | None):
        self.out, self.cuda = out, device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.out is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def report(self, decode_steps):
        if self.out is None:
            return
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.out.update(prefill_s=spans[0], decode_s=spans[1], decode_steps=decode_steps)


def _check_buckets(buckets) -> tuple[int, ...]:
    buckets = tuple(buckets)
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                          for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be increasing positive ints, got {buckets!r}")
    return buckets


def _check_request(cfg, input_ids, temperature, top_k, top_p, eos_token_id, return_logits,
                   seed):
    """What a request is checked for against the model's config alone (no weights, no
    cache): -> (prompts, whether input_ids was one tensor, eos ids)."""
    prompts, as_tensor = _prompts(input_ids, cfg.vocab)
    _check_sampling(temperature, top_k, top_p)
    eos = _eos(eos_token_id, cfg.vocab)
    if not isinstance(return_logits, bool):
        raise ValueError(f"return_logits must be a bool, got {return_logits!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2**63 <= seed < 2**64):
        raise ValueError(f"seed must be None or an int in [-2**63, 2**64) (what "
                         f"torch.Generator.manual_seed takes), got {seed!r}")
    return prompts, as_tensor, eos


def _check_batch(prompts, max_new_tokens, max_batch, max_seq_len, max_positions):
    """The batch and every sequence's length against the buckets and positions."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if len(prompts) > max_batch:
        raise ValueError(f"input_ids: a batch of {len(prompts)} is above the largest "
                         f"batch bucket ({max_batch})")
    for i, p in enumerate(prompts):
        if p.numel() + max_new_tokens > max_seq_len:
            raise ValueError(
                f"input_ids[{i}]: prompt of {p.numel()} + max_new_tokens {max_new_tokens} "
                f"is past the {max_seq_len} positions a sequence may hold "
                f"(the model's max positions: {max_positions})")


def _eos(eos_token_id, vocab):
    if eos_token_id is None:
        return None
    bad = ValueError(f"eos_token_id must be None, or an id (or list of ids) in [0, {vocab}), "
                     f"got {eos_token_id!r}")

    def as_id(e):  # ints and integer-like values (numpy ints, 0-d integer tensors)
        if isinstance(e, (bool, float)) or (isinstance(e, torch.Tensor) and (
                e.dim() or e.dtype.is_floating_point or e.dtype == torch.bool)):
            raise bad
        try:
            return operator.index(e)
        except TypeError:
            raise bad from None

    if isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, Iterable):
        items = [eos_token_id]
    else:
        try:
            items = list(eos_token_id)
        except TypeError:  # a 0-d array or tensor
            items = [eos_token_id]
    ids = [as_id(e) for e in items]
    if not ids or any(not 0 <= e < vocab for e in ids):
        raise bad
    return ids


def _result(prompts, new, as_tensor, logits):
    new_t = (torch.stack(new, dim=1).cpu() if new
             else torch.empty(len(prompts), 0, dtype=torch.int64))
    if as_tensor:
        tokens = torch.cat([torch.stack(prompts), new_t], dim=1)
    else:
        tokens = [torch.cat([p, n]) for p, n in zip(prompts, new_t)]
    return tokens if logits is None else (tokens, logits)


KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what "auto" runs the kernels for on CUDA


def _check_device(device) -> torch.device:
    """``device`` as a torch.device (None: CUDA if available, else the CPU); a ValueError
    naming it when torch cannot parse it or it names a GPU this machine lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be None, a torch.device or a device string such as "
                         f"'cuda', 'cuda:1' or 'cpu', got {device!r} ({e})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"device {device!r}: no CUDA GPU is available on this machine")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA GPU(s)")
    return dev


def _resolve_impl(impl, device, dtype=None):
    """The step for ``impl``: "auto" is the kernels on CUDA for a 16-bit model (every
    family the loader takes: dense, Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, dots1), else the
    reference.
    ``dtype`` None: decided again once the checkpoint's dtype is known."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    on_cuda = torch.device(device).type == "cuda"
    return "kernels" if on_cuda and (dtype is None or dtype in KERNEL_DTYPES) else "reference"


def generate(model_or_path, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, return_logits: bool = False,
             page_size: int = PAGE_SIZE, buckets=BUCKETS, dtype=None, device=None,
             impl: str = "auto", seed: int | None = None, prefill_chunk: int = 512):
    """Generate tokens after each prompt with a paged KV cache.

    Args:
        model_or_path: a transformers ``*ForCausalLM`` object (Llama 3.x, Qwen2/2.5,
            Qwen3 dense, Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, dots1) or a local
            folder with ``config.json`` + ``*.safetensors``.
        input_ids: int tensor [B, S] (every prompt S tokens), or a list of B 1-D int
            tensors / lists (prompts of any lengths >= 1). Ids in [0, vocab).
        max_new_tokens: new tokens per sequence (>= 0).
        temperature: 0 for greedy (argmax); > 0 samples from softmax(logits / temperature)
            after top_k (keep the k most likely) and top_p (keep the smallest set
            reaching probability top_p).
        eos_token_id: an id or list of ids; a sequence that samples one keeps it and is
            padded with the first eos id after it; generation stops when all are done
            (on CUDA the check reads no flag synchronously: the GPU may run a step or two
            past the stop, whose tokens are dropped, so the result is the same).
        return_logits: also return the logits each new token was chosen from.
        page_size, buckets, prefill_chunk: see :class:`Engine`; at most ``buckets[-1]``
            sequences.
        dtype, device: model dtype (default: the checkpoint's) and device (default CUDA
            if available, else CPU).
        impl: ``"reference"`` (plain PyTorch step), ``"kernels"`` (the fused-kernel
            runner, :mod:`wsattn.engine.runner`), or ``"auto"``: kernels on CUDA for a
            float16/bfloat16 model, else the reference.
        seed: seeds the sampler's ``torch.Generator``; same seed, same tokens.

    Returns:
        tokens: int64 on the CPU, [B, S + n] for a tensor input, or a list of [S_b + n]
        tensors for a list input; n = max_new_tokens unless every sequence hit eos first.
        With return_logits, (tokens, logits) with logits float32 [B, n, vocab] on the
        device; logits[:, i] is what token S + i was chosen from.

    >>> tokens = generate("path/to/Llama-3.2-1B", torch.tensor([[128000, 791]]),
    ...                   32)  # doctest: +SKIP
    """
    # the request is checked against the config before any weight is read or moved
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _check_sampling(temperature, top_k, top_p)
    step = _resolve_impl(impl, _check_device(device), dtype)
    from ..models.weights import read_config
    cfg = read_config(model_or_path)
    prompts, _, _ = _check_request(cfg, input_ids, temperature, top_k, top_p, eos_token_id,
                                   return_logits, seed)
    _check_batch(prompts, max_new_tokens, _check_buckets(buckets)[-1], cfg.max_positions,
                 cfg.max_positions)
    engine = Engine(model_or_path, dtype=dtype, device=device, step=step, page_size=page_size,
                    buckets=buckets, prefill_chunk=prefill_chunk)
    # the step is built at the first request: "auto" can still follow the checkpoint's dtype
    # and features
    engine.step_name = _resolve_impl(impl, engine.device, engine.dtype)
    return engine.run(input_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, eos_token_id=eos_token_id, return_logits=return_logits,
                      seed=seed)
