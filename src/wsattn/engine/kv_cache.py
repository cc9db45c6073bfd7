"""The paged KV cache and its host-side page allocator.

Layout (what the reference forward, the decode kernels and the QKV+RoPE append kernel
read and write)::

    k, v          [layers, num_pages, page_size, Hkv, D]   one tensor each, model dtype
    block_table   int32 [B, max_pages]   page indices of each sequence, in order
    seqlens       int32 [B]              tokens written per sequence

Token ``t`` of a sequence lives in page ``block_table[b, t // page_size]`` at slot
``t % page_size``. Entries of a block-table row past the pages a sequence owns are 0: a
valid page index, so a kernel that reads a whole row never leaves the cache, and never
used, since ``seqlens`` bounds every read.

The allocator is plain Python on the host (no GPU work, no synchronisation): a sequence
is admitted with the number of tokens it may ever hold (prompt + max_new_tokens), gets
all of its pages at once, lowest-numbered free pages first (so a run is reproducible),
and gives them back on :meth:`PagedKVCache.release`. Every admission is checked in full
before anything changes: a request that does not fit raises ``ValueError`` and leaves the
allocator and the cache as they were.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

# The engine's page in tokens. The decode kernel reads a 16-token page at 0.89-0.95x the
# contiguous cache at the decode step's shapes and a 64-token page at 0.95-1.06x;
# in the step that is ~1 us a layer at B1 (Llama-3.1-8B B1 4.179 -> 4.133 ms/token, B8
# 5.745 -> 5.674; notes/decode_step.md). The cost is up to 63 tokens of unused slots per
# sequence.
PAGE_SIZE = 64


def _cfg_dims(cfg) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model config."""
    return int(cfg.layers), int(cfg.kv_heads), int(cfg.head_dim)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass
class _Seq:
    pages: list[int]   # owned pages, in token order
    capacity: int      # tokens the sequence may hold (what it was admitted with)
    length: int = 0    # tokens written


class PagedKVCache:
    """Paged K/V storage for every layer plus the page allocator.

    Args:
        cfg: the model's :class:`~wsattn.models.config.ModelConfig` (``layers``,
            ``kv_heads``, ``head_dim``; ``max_positions`` caps ``max_seq_len``).
        num_pages: pages in the pool (shared by all sequences).
        page_size: tokens per page.
        dtype, device: of the k/v pages (the model's activation dtype).
        max_batch: the most sequences admitted at once (the largest batch bucket);
            None: no limit beyond the pages.
        max_seq_len: the most tokens one sequence may hold (default: the whole pool,
            capped by the model's max positions). Fixes ``max_pages`` per sequence,
            i.e. the width of every block table.

    Attributes:
        k, v: [layers, num_pages, page_size, Hkv, D] tensors, zero-initialised.

    Example::

        cache = PagedKVCache(cfg, num_pages=64, page_size=16, dtype=torch.float32,
                             device="cpu", max_batch=8)
        ids = cache.admit([12 + 32, 7 + 32])          # prompt + new tokens each
        bt = cache.block_table(ids)                    # int32 [2, cache.max_pages]
        ...                                            # forward writes 12 / 7 tokens
        cache.advance(ids, [12, 7]); cache.seqlens(ids)  # int32 [2] = [12, 7]
        cache.release(ids)
    """

    def __init__(self, cfg, num_pages: int, page_size: int = PAGE_SIZE, dtype=torch.float32,
                 device="cpu", *, max_batch: int | None = None, max_seq_len: int | None = None):
        layers, hkv, d = _cfg_dims(cfg)
        self.num_pages = _positive_int("num_pages", num_pages)
        self.page_size = _positive_int("page_size", page_size)
        if max_batch is not None:
            _positive_int("max_batch", max_batch)
        self.max_batch = max_batch
        pool_tokens = num_pages * page_size
        limit = pool_tokens if max_seq_len is None else _positive_int("max_seq_len", max_seq_len)
        max_pos = getattr(cfg, "max_positions", None)
        if max_pos:
            limit = min(limit, int(max_pos))
        self.max_seq_len = min(limit, pool_tokens)
        self.max_pages = -(-self.max_seq_len // page_size)
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (layers, num_pages, page_size, hkv, d)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free: list[int] = list(range(num_pages))  # a min-heap: lowest page first
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ accounting
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def live(self) -> list[int]:
        """Ids of the admitted sequences, in admission order."""
        return list(self._seqs)

    def pages_of(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).pages)

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def capacity(self, seq_id: int) -> int:
        return self._seq(seq_id).capacity

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"seq_id {seq_id!r} is not an admitted sequence "
                             f"(live: {self.live})") from None

    # ------------------------------------------------------------------ admission
    def check_admit(self, capacities) -> None:
        """Raise ValueError if sequences of these capacities (tokens each) cannot all be
        admitted now; changes nothing."""
        caps = list(capacities)
        if not caps:
            raise ValueError("admit: no sequences given")
        for i, c in enumerate(caps):
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"capacities[{i}] must be a positive int, got {c!r}")
            if c > self.max_seq_len:
                raise ValueError(
                    f"sequence {i} needs {c} tokens (prompt + new tokens), more than one "
                    f"sequence may hold ({self.max_seq_len} = min(pool of {self.num_pages} "
                    f"pages x {self.page_size}, max_seq_len, model's max positions))")
        if self.max_batch is not None and len(self._seqs) + len(caps) > self.max_batch:
            raise ValueError(
                f"batch of {len(caps)} (+{len(self._seqs)} live) is above the largest "
                f"batch bucket ({self.max_batch})")
        need = sum(self.pages_for(c) for c in caps)
        if need > len(self._free):
            raise ValueError(f"not enough free KV pages: the batch needs {need} pages of "
                             f"{self.page_size} tokens, {len(self._free)} of "
                             f"{self.num_pages} are free")

    def admit(self, capacities) -> list[int]:
        """Admit one sequence per capacity (tokens it may ever hold), give each all of its
        pages now, and return their ids (fresh ints, increasing). All or nothing."""
        caps = list(capacities)
        self.check_admit(caps)
        ids = []
        for c in caps:
            pages = [heapq.heappop(self._free) for _ in range(self.pages_for(c))]
            self._seqs[self._next_id] = _Seq(pages=pages, capacity=c)
            ids.append(self._next_id)
            self._next_id += 1
        return ids

    def advance(self, seq_ids, counts) -> None:
        """Record that ``counts[i]`` more tokens were written for ``seq_ids[i]``; refuses
        (changing nothing) a count that would pass a sequence's capacity."""
        seqs = [self._seq(s) for s in seq_ids]
        counts = [int(n) for n in counts]
        if len(counts) != len(seqs):
            raise ValueError(f"advance: {len(seqs)} seq_ids but {len(counts)} counts")
        for s, sid, n in zip(seqs, seq_ids, counts):
            if n < 0 or s.length + n > s.capacity:
                raise ValueError(f"sequence {sid}: {s.length} + {n} tokens is past its "
                                 f"capacity of {s.capacity}")
        for s, n in zip(seqs, counts):
            s.length += n

    def release(self, seq_ids) -> None:
        """Return the sequences' pages to the pool. Their page contents are left as they
        are: a later owner overwrites before it reads (seqlens bounds every read)."""
        ids = list(seq_ids)
        for sid in ids:
            self._seq(sid)
        if len(set(ids)) != len(ids):
            raise ValueError(f"release: repeated seq_ids {ids}")
        for sid in ids:
            for p in self._seqs.pop(sid).pages:
                heapq.heappush(self._free, p)

    # ------------------------------------------------------------------ device views
    def block_table(self, seq_ids, max_pages: int | None = None, *, out=None) -> torch.Tensor:
        """int32 [B, max_pages] on the cache's device: row i lists seq_ids[i]'s pages in
        token order, then zeros. ``max_pages`` defaults to the widest a sequence may be
        (``self.max_pages``); ``out`` (int32 [B, max_pages] on the device) is filled in
        place, e.g. a CUDA graph's static buffer."""
        seqs = [self._seq(s) for s in seq_ids]
        width = self.max_pages if max_pages is None else _positive_int("max_pages", max_pages)
        for sid, s in zip(seq_ids, seqs):
            if len(s.pages) > width:
                raise ValueError(f"max_pages={width} is narrower than sequence {sid}'s "
                                 f"{len(s.pages)} pages")
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        host = torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)
        return self._to_device(host, out, "block_table")

    def seqlens(self, seq_ids, *, out=None) -> torch.Tensor:
        """int32 [B] on the cache's device: tokens written for each of seq_ids."""
        host = torch.tensor([self._seq(s).length for s in seq_ids], dtype=torch.int32)
        return self._to_device(host, out, "seqlens")

    def _to_device(self, host, out, name):
        if out is None:
            return host.to(self.device)
        if out.shape != host.shape or out.dtype != torch.int32 or out.device != self.device:
            raise ValueError(f"{name}: out must be int32 {tuple(host.shape)} on "
                             f"{self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        out.copy_(host, non_blocking=True)
        return out
