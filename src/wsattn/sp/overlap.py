"""Sequence-parallel prefill with the K/V exchange hidden under the attention.

The all-gather path (prefill.py) waits for every peer's K/V before the first kernel.
Here the exchange is split per peer and the attention per K/V chunk:

1. Post the exchange of K/V shards as W-1 shift steps: at step d every rank sends its
   packed [2, B, Sk/W, Hkv, D] shard to rank r+d and receives rank r-d's, as one
   ``batch_isend_irecv`` (send and receive grouped, so the pair cannot deadlock). Each
   step has its own work handle: the per-chunk ready signal. On NCCL the transfers run
   on NCCL's own streams, concurrently with the attention on the compute stream, and
   ``work.wait()`` only makes the compute stream wait for that one step (an event wait,
   no host sync); on gloo they run on gloo's threads and ``wait()`` blocks the host
   until that step has landed: the same algorithm, testable on a CPU.
2. Meanwhile attend the local Q shard over the local K/V shard: ONE causal call, because
   under zig-zag or contiguous sharding the causal mask in local coordinates is exactly
   the global mask restricted to the local chunks.
3. For d = 1..W-1: wait for step d, then ONE unmasked call of the local rows that see
   rank r-d's keys over those keys (see :func:`_peer_part`), folded into the running
   (out, lse) in place by ``merge_into`` (the LSE merge of kernels/merge.py): no
   stacked copies, no concatenation. Merging in step order makes the result
   independent of which transfer landed first.

With a cached prefix (K/V shards longer than Q shards) the chunks of Q and K/V differ
in length: then every (Q chunk, K/V chunk) pair is attended with its own causal
structure (past chunks unmasked, the diagonal with the bottom-right mask, future chunks
skipped; :func:`chunk_attention`) and merged per Q chunk by ``merge_states`` in global
chunk order.

Fixed-length batches only; variable-length batches go through prefill_varlen.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import wsattn

from . import checks
from .comm import rank_and_size, resolve_group
from .prefill import _kernel_impl, prefill, validate_fixed
from .sharding import local_chunks

__all__ = ["prefill_overlapped", "chunk_attention", "post_exchange", "SymmPull"]

TRANSPORTS = ("auto", "p2p", "symm")


def chunk_attention(q, k, v, offset: int, causal: bool, sm_scale, impl):
    """Attention of a query chunk over one key chunk, under a causal mask shifted by
    offset: query row i sees key row j iff j <= i + offset (offset = the query chunk's
    first key position minus the key chunk's first key position).

    q [B, Cq, Hq, D], k/v [B, Ck, Hkv, D]. Returns (out [B, Cq, Hq, D], lse fp32
    [B, Hq, Cq]) with rows that see no key at (0, -inf), or None when no row sees any.
    Rows split into three static ranges: [0, a) see nothing, [a, b) a prefix of the
    chunk (one bottom-right causal call over k[:, :b + offset]), [b, Cq) all of it (one
    unmasked call).
    """
    B, Cq, Hq, D = q.shape
    Ck = k.shape[1]
    if not causal:
        return wsattn.attention(q, k, v, False, sm_scale, return_lse=True, impl=impl)
    a = min(max(0, -offset), Cq)
    if a == Cq:
        return None
    b = min(max(Ck - offset, a), Cq)
    outs, lses = [], []
    if a:
        outs.append(q.new_zeros(B, a, Hq, D))
        lses.append(torch.full((B, Hq, a), float("-inf"), device=q.device, dtype=torch.float32))
    if b > a:
        o, l = wsattn.attention(q[:, a:b], k[:, :b + offset], v[:, :b + offset], True, sm_scale,
                                return_lse=True, impl=impl)
        outs.append(o)
        lses.append(l)
    if Cq > b:
        o, l = wsattn.attention(q[:, b:], k, v, False, sm_scale, return_lse=True, impl=impl)
        outs.append(o)
        lses.append(l)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def post_exchange(send: torch.Tensor, rank: int, W: int, group):
    """Post the W-1 shift steps; returns [(source rank, recv buffer, works)] in step
    order. Step d receives rank (r-d) % W's shard."""
    steps = []
    for d in range(1, W):
        dst, src = (rank + d) % W, (rank - d) % W
        buf = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, dst), group),
               dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src), group)]
        steps.append((src, buf, dist.batch_isend_irecv(ops)))
    return steps


class SymmPull:
    """The alternative transport: every rank's shard sits in a torch symmetric-memory
    buffer and each rank pulls its peers' shards with copy-engine copies on a side
    stream, one event per peer as its ready signal (no NCCL kernel takes SMs from the
    attention). Multicast is never used.

    Per call, on the side stream: barrier (every peer has finished pulling the previous
    call's shards), copy the local shard into the buffer, barrier (every shard is in
    place), then one pull per peer in the shift order, each followed by its event.

    Buffers are flat and shared by every shard shape that fits: one set per (group, dtype,
    device), of a power-of-two number of elements. A larger shard allocates the next set
    (collectively: shards have the same shape on every rank, so every rank grows at the
    same call); the smaller sets are kept, not freed, because a CUDA graph captured earlier
    may still replay into them and a peer may still be reading them. So the memory held is
    less than twice that of the largest shard seen, whatever the number of prompt lengths."""

    _cache: dict = {}  # (id(group), dtype, device) -> the largest set
    _retired: dict = {}  # same key -> the smaller sets, kept alive (see above)

    def __init__(self, group, capacity: int, dtype, device):
        import warnings
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.world_size = rank_and_size(group)
        self.capacity = capacity
        self.buf = symm_mem.empty((capacity, ), dtype=dtype, device=device)
        with warnings.catch_warnings():  # needed before torch 2.9, a no-op after
            warnings.simplefilter("ignore", FutureWarning)
            if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        self.handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.peers = [self.handle.get_buffer(p, (capacity, ), dtype)
                      for p in range(self.world_size)]
        self.recv = {p: torch.empty(capacity, dtype=dtype, device=device)
                     for p in range(self.world_size) if p != self.rank}
        self.events = {p: torch.cuda.Event() for p in self.recv}
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def get(cls, group, shape, dtype, device) -> "SymmPull":
        """The buffer set a shard of this shape uses (allocated collectively if none fits)."""
        need = max(1, math.prod(shape))
        key = (id(group), dtype, str(device))
        cur = cls._cache.get(key)
        if cur is None or cur.capacity < need:
            if cur is not None:
                cls._retired.setdefault(key, []).append(cur)
            cur = cls._cache[key] = cls(group, 1 << (need - 1).bit_length(), dtype, device)
        return cur

    @classmethod
    def held(cls, group, dtype, device) -> list[int]:
        """Capacities (elements) of the buffer sets kept for (group, dtype, device)."""
        key = (id(group), dtype, str(device))
        sets = cls._retired.get(key, []) + ([cls._cache[key]] if key in cls._cache else [])
        return [s.capacity for s in sets]

    def post(self, send):
        """Start the pulls; returns [(source rank, buffer, [event])] in shift order."""
        n, shape = send.numel(), send.shape
        if n > self.capacity:
            raise ValueError(f"SymmPull: a shard of {n} elements does not fit {self.capacity}")
        compute = torch.cuda.current_stream()
        # after the send tensor is written and after the previous call's readers of recv
        self.stream.wait_stream(compute)
        send.record_stream(self.stream)
        steps = []
        with torch.cuda.stream(self.stream):
            self.handle.barrier(channel=0)
            self.buf[:n].view(shape).copy_(send)
            self.handle.barrier(channel=0)
            for d in range(1, self.world_size):
                src = (self.rank - d) % self.world_size
                recv = self.recv[src][:n].view(shape)
                recv.copy_(self.peers[src][:n].view(shape))  # a peer-to-peer copy-engine read
                self.events[src].record(self.stream)
                steps.append((src, recv, [_EventWait(self.events[src])]))
        return steps


class _EventWait:
    """A ready signal with the interface of a work handle: wait() makes the current
    stream wait for the event (no host sync)."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)


def prefill_overlapped(q, k, v, causal: bool = True, sm_scale: float | None = None, *,
                       group=None, zigzag: bool = True, impl: str = "auto", check: bool = True,
                       timeout_s: float | None = None, global_seqlen: int | None = None,
                       transport: str = "auto"):
    """Same contract as :func:`wsattn.sp.prefill` (shards in, local (out, lse) out), with
    each peer's K/V consumed as soon as its transfer step has landed.

    transport: "symm" (copy-engine pulls from peers' symmetric memory on a side stream,
        CUDA + NCCL only; see :class:`SymmPull`), "p2p" (NCCL or gloo batch_isend_irecv
        per shift step), or "auto": symm on CUDA with NCCL, else p2p. On two H200s
        (benchmarks/results/sp_H200_w2_*_906c00d.json) symm was as fast or faster up to
        S = 32768 and replays from a CUDA graph; NCCL's batched send/recv is not
        captured. Memory: symm keeps its buffers (the shard in symmetric memory plus one
        receive buffer per peer) for the life of the process, shared by every shard that
        fits, in power-of-two sizes: less than twice the largest shard's (SymmPull).

    Example (under torchrun):
        >>> out, lse = wsattn.sp.prefill_overlapped(q_shard, k_shard, v_shard, causal=True)
    """
    group = resolve_group(group)
    rank, W = rank_and_size(group)
    if W == 1:
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        return prefill(q, k, v, causal, sm_scale, group=group, zigzag=zigzag, impl=impl,
                       check=check, timeout_s=timeout_s, global_seqlen=global_seqlen)
    resolved = []

    def transport_check():  # every rank must take the same transport: both are collective
        resolved.append(_resolve_transport(transport, group, q.device))

    validate_fixed("prefill_overlapped", q, k, v, causal, zigzag, group, rank, W, check, timeout_s,
                   global_seqlen, sm_scale, impl,
                   extra={"transport": checks.code(transport, TRANSPORTS)}, more=transport_check)
    transport = resolved[0] if resolved else _resolve_transport(transport, group, q.device)
    Sq_loc, Sk_loc = q.shape[1], k.shape[1]
    send = torch.stack([k, v])  # [2, B, Sk/W, Hkv, D]: one message per step
    if transport == "symm":
        steps = SymmPull.get(group, send.shape, send.dtype, send.device).post(send)
    else:
        steps = post_exchange(send, rank, W, group)

    if not causal or Sq_loc == Sk_loc:
        return _attend_as_shards_land(q, k, v, steps, rank, W, causal, zigzag, sm_scale, impl)

    # A cached prefix: K/V chunks are longer than Q chunks, so attend chunk pair by chunk
    # pair (chunk_attention keeps each pair's causal structure) and merge per Q chunk.
    chunks = local_chunks(W, rank, zigzag)
    n = len(chunks)
    cq, ck = Sq_loc // n, Sk_loc // n
    prefix = W * (Sk_loc - Sq_loc)
    q_chunks = [q[:, h * cq:(h + 1) * cq] for h in range(n)]
    parts = [dict() for _ in range(n)]  # per local Q chunk: global K/V chunk -> (out, lse)

    def consume(src_rank, kv):
        for hk, ck_idx in enumerate(local_chunks(W, src_rank, zigzag)):
            kc, vc = kv[0, :, hk * ck:(hk + 1) * ck], kv[1, :, hk * ck:(hk + 1) * ck]
            for hq, cq_idx in enumerate(chunks):
                part = chunk_attention(q_chunks[hq], kc, vc, prefix + cq_idx * cq - ck_idx * ck,
                                       causal, sm_scale, impl)
                if part is not None:
                    parts[hq][ck_idx] = part

    consume(rank, send)
    for src_rank, buf, works in steps:
        for w in works:  # the ready signal of this peer's chunk
            w.wait()
        consume(src_rank, buf)

    outs, lses = [], []
    for hq in range(n):
        ordered = [parts[hq][c] for c in sorted(parts[hq])]
        if len(ordered) == 1:
            o, l = ordered[0]
        else:
            o, l = wsattn.merge_states(torch.stack([p[0] for p in ordered]),
                                       torch.stack([p[1].transpose(1, 2) for p in ordered]),
                                       impl=_kernel_impl(impl))  # [B, Cq, Hq, D], [B, Cq, Hq]
            l = l.transpose(1, 2)
        outs.append(o)
        lses.append(l)
    if n == 1:
        return outs[0], lses[0].contiguous()
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _resolve_transport(transport, group, device) -> str:
    """"p2p" or "symm" for the requested transport, or ValueError."""
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    from .decode import symm_unavailable_reason
    reason = symm_unavailable_reason(group, device)
    if transport == "auto":
        return "p2p" if reason else "symm"
    if transport == "symm" and reason:
        raise ValueError(f"transport='symm' unavailable: {reason}")
    return transport


def _peer_part(rank: int, src: int, zigzag: bool, causal: bool, cq: int, ck: int):
    """Which local query rows see which keys of rank src's shard (no cached prefix):
    (first query row, key rows or None for all of them), or None when none does.

    Causal, contiguous shards: all of src's keys are in the past of all local rows when
    src < rank, in the future otherwise. Causal, zig-zag (local chunks r and 2W-1-r,
    src's p and 2W-1-p): chunk r sees p iff p < r and never 2W-1-p; chunk 2W-1-r sees p
    always and 2W-1-p iff p > r. So a peer below is seen by every local row through its
    first chunk only, a peer above by the second local chunk only, through both of its
    chunks; either way ONE unmasked call."""
    if not causal:
        return 0, None
    if not zigzag:
        return (0, None) if src < rank else None
    return (0, ck) if src < rank else (cq, None)


def _attend_as_shards_land(q, k, v, steps, rank, W, causal, zigzag, sm_scale, impl):
    """Shards of equal Q and K/V length: the local part is ONE call (under zig-zag or
    contiguous sharding the causal mask in local coordinates is exactly the global one
    restricted to the local chunks), then ONE call per peer as its shard lands, folded
    into the running result in place, in step order."""
    n = len(local_chunks(W, rank, zigzag))
    cq, ck = q.shape[1] // n, k.shape[1] // n
    out, lse = wsattn.attention(q, k, v, causal, sm_scale, return_lse=True, impl=impl)
    for src_rank, buf, works in steps:
        for w in works:  # the ready signal of this peer's shard
            w.wait()
        part = _peer_part(rank, src_rank, zigzag, causal, cq, ck)
        if part is None:
            continue
        q0, kend = part
        kk, vv = (buf[0], buf[1]) if kend is None else (buf[0][:, :kend], buf[1][:, :kend])
        o, l = wsattn.attention(q[:, q0:], kk, vv, False, sm_scale, return_lse=True, impl=impl)
        _merge_into(out[:, q0:], lse[:, :, q0:], o, l, impl)
    return out, lse


def _merge_into(acc, acc_lse, part, part_lse, impl):
    """acc <- merge(acc, part) in place: the Triton kernel on a GPU or the interpreter,
    else merge_states of the reference."""
    from ..target import interpreting
    if impl != "reference" and (acc.device.type == "cuda" or interpreting()):
        from ..kernels.merge import merge_into
        merge_into(acc, acc_lse, part, part_lse)
        return
    o, l = wsattn.merge_states(torch.stack([acc, part]),
                               torch.stack([acc_lse.transpose(1, 2), part_lse.transpose(1, 2)]),
                               impl="reference")
    acc.copy_(o)
    acc_lse.copy_(l.transpose(1, 2))
