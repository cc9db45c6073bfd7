"""How a sequence is split across ranks, and how the pieces go back together.

Two layouts, both of whole tokens along the sequence axis:

* contiguous: rank r holds tokens [r * S/W, (r+1) * S/W).
* zig-zag (head-tail): the sequence is cut into 2W equal chunks and rank r holds
  chunks r and 2W-1-r, concatenated in that order. Under a causal mask chunk c costs
  about c+1 diagonal blocks, so every rank gets (r+1) + (2W-r) = 2W+1 of them: the
  causal work is balanced, where contiguous sharding gives the last rank W times the
  work of the first.

Everything here works on static shapes and host integers only, or on device tensors
with device ops (the varlen index maps), so the forward passes that use it never read
a device value on the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

__all__ = [
    "local_chunks", "check_shardable", "check_rank", "shard", "unshard", "shard_positions",
    "reorder_gathered", "shard_varlen", "unshard_varlen", "varlen_global_index",
    "shard_kv_cache", "shard_kv_cache_blocks",
]


def check_rank(world_size, rank) -> None:
    """ValueError unless world_size >= 1 and 0 <= rank < world_size (ints)."""
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}) with world_size >= 1, "
                         f"got rank {rank}")


def _host_ints(name, values) -> list[int]:
    """A list or 1-D tensor of ints as Python ints (the sharding helpers run on the host)."""
    if torch.is_tensor(values):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints, got "
                             f"{values.dtype} {tuple(values.shape)}")
        return [int(v) for v in values.tolist()]
    out = list(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
        raise ValueError(f"{name} must hold ints, got {out!r}")
    return out


def local_chunks(world_size: int, rank: int, zigzag: bool) -> tuple[int, ...]:
    """Global chunk indices rank holds, in local order: (r, 2W-1-r) for zig-zag
    (chunks of S/(2W) tokens), (r,) for contiguous (chunks of S/W tokens)."""
    return (rank, 2 * world_size - 1 - rank) if zigzag else (rank,)


def num_chunks(world_size: int, zigzag: bool) -> int:
    """How many equal chunks the global sequence is cut into."""
    return 2 * world_size if zigzag else world_size


def check_shardable(seqlen: int, world_size: int, zigzag: bool, name: str = "sequence") -> None:
    """Raise ValueError unless a sequence of seqlen tokens splits into equal chunks."""
    n = num_chunks(world_size, zigzag)
    if seqlen % n:
        how = f"2 * world_size = {n} chunks (zig-zag)" if zigzag else f"{n} ranks"
        raise ValueError(f"{name} length {seqlen} does not split evenly into {how}; pad it to a "
                         f"multiple of {n}" + (" or pass zigzag=False" if zigzag else ""))


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1,
          zigzag: bool = True) -> torch.Tensor:
    """The shard of x (the global sequence along dim) that rank holds, contiguous.

    Example:
        >>> x = torch.arange(8)
        >>> shard(x, 2, 0, dim=0), shard(x, 2, 1, dim=0)
        (tensor([0, 1, 6, 7]), tensor([2, 3, 4, 5]))
    """
    check_rank(world_size, rank)
    S = x.shape[dim]
    check_shardable(S, world_size, zigzag)
    c = S // num_chunks(world_size, zigzag)
    parts = [x.narrow(dim, i * c, c) for i in local_chunks(world_size, rank, zigzag)]
    return torch.cat(parts, dim=dim).contiguous()


def unshard(shards, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """Inverse of :func:`shard`: shards is a list of W tensors (rank order) or a tensor
    [W, ...] stacked on a new leading dim; returns the global tensor."""
    if isinstance(shards, (list, tuple)):
        shards = torch.stack(list(shards))
    return reorder_gathered(shards, dim, zigzag)


def reorder_gathered(gathered: torch.Tensor, dim: int, zigzag: bool) -> torch.Tensor:
    """gathered [W, ...] (rank r's shard at index r) -> the global tensor along dim
    (dim counts in the shard's dims, without the leading W).

    Built from views and one cat, with no index tensor, so it stays capturable."""
    d = dim + 1  # W = gathered.shape[0] ranks
    L = gathered.shape[d]

    def ranks_along(t):  # [W, ..., n, ...] -> [..., W * n, ...] with rank-major order
        return t.movedim(0, d - 1).flatten(d - 1, d)

    if not zigzag:
        return ranks_along(gathered)
    if L % 2:
        raise ValueError(f"a zig-zag shard holds two equal chunks, got {L} tokens along dim {dim}")
    c = L // 2
    heads = gathered.narrow(d, 0, c)  # chunk r of rank r: chunks 0..W-1 in rank order
    tails = gathered.narrow(d, c, c).flip(0)  # chunk 2W-1-r: ascending when ranks descend
    return torch.cat([ranks_along(heads), ranks_along(tails)], dim=dim)


def shard_positions(seqlen: int, world_size: int, rank: int, zigzag: bool = True,
                    device=None) -> torch.Tensor:
    """Global token positions (int64) of rank's shard, in local order."""
    return shard(torch.arange(seqlen, device=device), world_size, rank, 0, zigzag)


# --------------------------------------------------------------------------- varlen

def shard_varlen(x: torch.Tensor, cu_seqlens, world_size: int, rank: int,
                 zigzag: bool = True):
    """Shard packed sequences one by one.

    x [T, ...] packs sequences at offsets cu_seqlens (list of ints or a tensor, [B+1]).
    Returns (x_local [T/W, ...] packing each sequence's shard in order,
    cu_seqlens_local int32 [B+1] on x's device). Every sequence length must split evenly.
    """
    check_rank(world_size, rank)
    cu = _host_ints("cu_seqlens", cu_seqlens)
    if not cu or cu[0] != 0 or cu[-1] != x.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at x's "
                         f"{x.shape[0]} tokens, got {cu}")
    parts, local = [], [0]
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        check_shardable(b - a, world_size, zigzag, name=f"sequence {i}")
        parts.append(shard(x[a:b], world_size, rank, 0, zigzag))
        local.append(local[-1] + (b - a) // world_size)
    out = torch.cat(parts) if parts else x[:0]
    return out.contiguous(), torch.tensor(local, dtype=torch.int32, device=x.device)


def unshard_varlen(shards, cu_seqlens_local, zigzag: bool = True) -> torch.Tensor:
    """Inverse of :func:`shard_varlen` given every rank's packed shard (rank order)."""
    if isinstance(shards, (list, tuple)):
        shards = torch.stack(list(shards))
    W = shards.shape[0]
    idx = varlen_global_index(cu_seqlens_local.to(shards.device), shards.shape[1], W, zigzag)
    return shards.flatten(0, 1).index_select(0, idx)


def varlen_global_index(cu_local: torch.Tensor, total_local: int, world_size: int,
                        zigzag: bool) -> torch.Tensor:
    """For each token of the global packed order, its row in the gathered shards
    flattened to [W * total_local, ...]: int64 [W * total_local], computed with device
    ops only (no host read of cu_local, so it is capturable).

    cu_local int32 [B+1]: each sequence's shard offsets (equal on every rank).
    """
    W = world_size
    dev = cu_local.device
    cu_loc = cu_local.to(torch.int64)
    cu_glob = cu_loc * W
    g = torch.arange(W * total_local, device=dev)
    seq = torch.searchsorted(cu_glob, g, right=True) - 1  # empty sequences are skipped
    p = g - cu_glob[seq]  # position inside the global sequence
    lens = (cu_loc[1:] - cu_loc[:-1])[seq]  # the sequence's shard length
    if zigzag:
        c = torch.clamp(lens // 2, min=1)
        chunk = p // c
        src_rank = torch.where(chunk < W, chunk, 2 * W - 1 - chunk)
        off = torch.where(chunk < W, 0, c) + p % c
    else:
        c = torch.clamp(lens, min=1)
        src_rank = p // c
        off = p % c
    return src_rank * total_local + cu_loc[seq] + off


# --------------------------------------------------------------------------- KV caches

def _page_pool(pieces, page_size, Hkv, D, dtype, device, generator=None):
    """Write pieces (list of [n_i, Hkv, D]) into a shuffled page pool; returns
    (pool [num_pages, page_size, Hkv, D], page lists per piece). Page 0 is a spare that
    no piece uses, so a table entry of 0 is always a valid page."""
    need = [-(-p.shape[0] // page_size) for p in pieces]
    n_pages = 1 + sum(need)
    order = (torch.randperm(n_pages - 1, generator=generator) + 1).tolist()
    pool = torch.zeros(n_pages, page_size, Hkv, D, dtype=dtype, device=device)
    tables, at = [], 0
    for piece, n in zip(pieces, need):
        pages = order[at:at + n]
        at += n
        for i, pg in enumerate(pages):
            rows = piece[i * page_size:(i + 1) * page_size]
            pool[pg, :rows.shape[0]] = rows
        tables.append(pages)
    return pool, tables


def _check_lens(seqlens, k, v) -> list[int]:
    """seqlens as ints, one a sequence of k / v [B, L, Hkv, D], each in [0, L]."""
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must be [B, L, Hkv, D] of one shape, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    lens = _host_ints("seqlens", seqlens)
    if len(lens) != k.shape[0] or any(not 0 <= n <= k.shape[1] for n in lens):
        raise ValueError(f"seqlens must hold one length in [0, L={k.shape[1]}] a sequence "
                         f"(B={k.shape[0]}), got {lens}")
    return lens


def shard_kv_cache(k, v, seqlens, world_size: int, rank: int, page_size: int = 16,
                   seed: int = 0):
    """Rank's paged shard of contiguous caches k, v [B, L, Hkv, D] holding seqlens[b]
    keys each: positions [floor(r*n/W), floor((r+1)*n/W)) of every sequence (so short
    sequences leave some ranks empty).

    Returns (k_pages, v_pages [num_pages, page_size, Hkv, D], block_table int32
    [B, max_pages], local_seqlens int32 [B]) on k's device."""
    check_rank(world_size, rank)
    lens = _check_lens(seqlens, k, v)
    B, _, Hkv, D = k.shape
    spans = [(n * rank // world_size, n * (rank + 1) // world_size) for n in lens]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    kp, tables = _page_pool([k[b, a:e] for b, (a, e) in enumerate(spans)], page_size, Hkv, D,
                            k.dtype, k.device, g)
    vp, _ = _page_pool([v[b, a:e] for b, (a, e) in enumerate(spans)], page_size, Hkv, D,
                       v.dtype, v.device, torch.Generator().manual_seed(seed * 1000 + rank))
    width = max([len(t) for t in tables] + [1])
    table = torch.zeros(B, width, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    local = torch.tensor([e - a for a, e in spans], dtype=torch.int32)
    return kp, vp, table.to(k.device), local.to(k.device)


def shard_kv_cache_blocks(k, v, seqlens, world_size: int, rank: int, n_blocks: int,
                          block_tokens: int, page_size: int = 16, seed: int = 0):
    """Rank's shard for the rank-count-invariant decode: global position blocks
    [j*T, (j+1)*T) (T = block_tokens) with j % W == rank, block j in local slot j // W.

    Returns (k_pages, v_pages, block_table int32 [B, ceil(n_blocks/W), T/page_size],
    block_lens int32 [B, ceil(n_blocks/W)] tokens of each sequence in each slot)."""
    check_rank(world_size, rank)
    if block_tokens % page_size:
        raise ValueError(f"block_tokens ({block_tokens}) must be a multiple of page_size ({page_size})")
    lens = _check_lens(seqlens, k, v)
    if max(lens, default=0) > n_blocks * block_tokens:
        raise ValueError(f"a sequence of {max(lens)} keys does not fit {n_blocks} blocks of "
                         f"{block_tokens}")
    B, _, Hkv, D = k.shape
    nb_loc = -(-n_blocks // world_size)
    slots = [(b, i) for b in range(B) for i in range(nb_loc)]
    span = {}
    for b, i in slots:
        j = i * world_size + rank
        a = min(j * block_tokens, lens[b]) if j < n_blocks else lens[b]
        e = min((j + 1) * block_tokens, lens[b]) if j < n_blocks else lens[b]
        span[b, i] = (a, e)
    g = lambda: torch.Generator().manual_seed(seed * 1000 + rank)  # noqa: E731
    kp, tables = _page_pool([k[b, a:e] for (b, i), (a, e) in span.items()], page_size, Hkv, D,
                            k.dtype, k.device, g())
    vp, _ = _page_pool([v[b, a:e] for (b, i), (a, e) in span.items()], page_size, Hkv, D,
                       v.dtype, v.device, g())
    table = torch.zeros(B, nb_loc, block_tokens // page_size, dtype=torch.int32)
    blens = torch.zeros(B, nb_loc, dtype=torch.int32)
    for ((b, i), (a, e)), t in zip(span.items(), tables):
        table[b, i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        blens[b, i] = e - a
    return kp, vp, table.to(k.device), blens.to(k.device)
