"""Rank-count-invariant sequence-parallel decode: the same bits on 1, 2, 4 or 8 ranks.

Ordinary split decode is not bitwise reproducible across rank counts: the key set each
partial covers, the kernel's own split count and the merge order all follow the number
of ranks, and floating-point sums depend on their grouping. Here all three are fixed by
token position instead:

* the global sequence is cut into position blocks of ``block_tokens`` keys, and there
  are ``n_blocks`` of them whatever W is (the caller's capacity: ceil(max_len / T));
* block j lives on rank j % W (round-robin keeps long contexts balanced), in local
  slot j // W, with its own block-table row of T / page_size pages;
* every block's partial state is one row of one decode call with ``num_splits=1``:
  the row's keys, its split structure and its reduction order are those of the block
  alone, not of the rank that holds it;
* the W ranks' block states are all-gathered, put in global block order, and merged
  by ONE ``merge_states`` call over all n_blocks parts, empty blocks (0, -inf)
  included, so the merge sees identical input on any rank count.

The cost (measured by bench.py, argued in notes/sp.md): the exchanged state grows from
[B, Hq, D+1] to [n_blocks, B, Hq, D+1] (B=1, Hq=32, D=128 at 1M tokens / 4096 = 256
blocks: 4.2 MB instead of 16.5 KB), the merge reads all n_blocks parts, and each block
runs as one split (parallelism comes from the blocks, which is ample for long contexts
and short for short ones). The decode kernel is assumed to compute a row's result
independently of the batch size it shares the call with (true of the reference and of
a split-KV kernel with a fixed split count); the tests check it bitwise.
"""

from __future__ import annotations

import numbers

import torch

import wsattn

from . import checks
from .comm import all_gather_flat, rank_and_size, resolve_group
from .decode import pack_state, partial_decode, validate_decode

__all__ = ["invariant_decode"]


def invariant_decode(q, k_cache, v_cache, block_lens, block_table, n_blocks: int,
                     sm_scale: float | None = None, *, group=None, impl: str = "auto",
                     return_lse: bool = False, check: bool = True,
                     timeout_s: float | None = None):
    """Decode whose output is bitwise independent of the number of ranks.

    Args:
        q: [B, Hq, D], the same on every rank.
        k_cache, v_cache: this rank's page pool [num_pages, page_size, Hkv, D].
        block_lens: int32 [B, ceil(n_blocks / W)]: keys of sequence b in local slot i,
            i.e. in global position block j = i * W + rank (0 for blocks past the end).
        block_table: int32 [B, ceil(n_blocks / W), block_tokens / page_size].
        n_blocks: number of position blocks of the global sequence; fixed by the caller
            independently of W (see :func:`wsattn.sp.sharding.shard_kv_cache_blocks`).

    Returns:
        out [B, Hq, D] (the same on every rank and for every W), or (out, lse [B, Hq]).
    """
    group = resolve_group(group)
    rank, W = rank_and_size(group)
    rows = {}

    def flatten():  # any error here is reported through the agreement, like every other
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, numbers.Integral) \
                or n_blocks < 1:
            raise ValueError(f"n_blocks must be a positive int, got {n_blocks!r}")
        for n, t in (("q", q), ("block_lens", block_lens), ("block_table", block_table)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n} must be a tensor, got {type(t).__name__}")
        if q.dim() != 3:
            raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
        B, Hq, D = q.shape
        nb_loc = -(-int(n_blocks) // W)
        if block_lens.dim() != 2 or block_lens.shape[0] != B or block_table.dim() != 3 \
                or block_table.shape[:2] != block_lens.shape:
            raise ValueError(f"block_lens must be [B={B}, slots] and block_table [B, slots, "
                             f"pages per block], got {tuple(block_lens.shape)} and "
                             f"{tuple(block_table.shape)}")
        if block_lens.shape[1] != nb_loc:
            raise ValueError(f"block_lens holds {block_lens.shape[1]} block slots per sequence, "
                             f"but {n_blocks} blocks over a group of size {W} need "
                             f"ceil({n_blocks}/{W}) = {nb_loc}: the shards were built for "
                             "another number of ranks")
        checks.flag("return_lse", return_lse)
        if check:  # (a host read, as the agreement's): keys in slots past n_blocks would
            # be dropped by the merge below, which keeps the n_blocks real blocks only
            pad = [i for i in range(nb_loc) if i * W + rank >= n_blocks]
            if pad and bool((block_lens[:, pad] != 0).any()):
                raise ValueError(f"block_lens holds keys in slot(s) {pad}, past the "
                                 f"{n_blocks} blocks (global block i * {W} + {rank} >= "
                                 f"n_blocks): the shards were built for more blocks")
        # one decode row per (sequence, slot): what the kernel call below takes
        rows.update(nb_loc=nb_loc, lens=block_lens.reshape(-1),
                    table=block_table.reshape(-1, block_table.shape[-1]),
                    q=q[:, None].expand(B, nb_loc, Hq, D).reshape(-1, Hq, D))

    bad = checks.local_error(flatten)
    validate_decode("invariant_decode", rows.get("q", q), k_cache, v_cache, rows.get("lens"),
                    rows.get("table"), group, rank, W, check, timeout_s,
                    extra={"n_blocks": int(n_blocks) if bad is None else -1}, error=bad,
                    sm_scale=sm_scale, impl=impl, num_splits=1)
    B, Hq, D = q.shape
    nb_loc, flat_lens, flat_table, q_rows = rows["nb_loc"], rows["lens"], rows["table"], rows["q"]
    out, lse, empty = partial_decode(q_rows, k_cache, v_cache, flat_lens, flat_table, sm_scale,
                                     impl, 1, check)
    state = pack_state(out, lse, empty).view(B, nb_loc, Hq, D + 1)
    states = all_gather_flat(state, W, group)  # [W, B, nb_loc, Hq, D+1]
    # slot i of rank r is global block i * W + r: order by (i, r), keep the n_blocks real ones
    states = states.permute(2, 0, 1, 3, 4).reshape(nb_loc * W, B, Hq, D + 1)[:n_blocks]
    merge_impl = impl if impl in ("triton", "reference") else "auto"
    out, lse = wsattn.merge_states(states[..., :D], states[..., D], impl=merge_impl)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
