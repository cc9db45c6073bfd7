"""Sequence-parallel decode: each rank attends over its shard of the KV cache, the ranks
exchange only the partial states, and every rank merges them.

Per step and per rank: one decode kernel over the local (paged) cache shard gives a
partial (out [B, Hq, D], lse [B, Hq]); both are packed into one fp32 state
[B, Hq, D + 1] (the LSE travels in fp32, not fp16 as in the public systems); the W
states are exchanged and every rank merges them with ``merge_states`` in rank order, so
all ranks hold the same result. For B=16, Hq=32, D=128 a state is 264 KB.

Two exchanges (:class:`StateExchange`):

* ``"allgather"``: pack, NCCL (or gloo) all-gather into a persistent buffer, merge.
* ``"symm"``: ONE kernel (kernels/state_exchange.py) that stores this rank's rows into
  every peer's slot of a torch symmetric-memory buffer over NVLink, raises one flag per
  peer and program, waits for the peers' flags and merges in rank order: the same bits
  as the all-gather path, one launch, no NCCL kernel, no host involvement; multicast
  is never used.

A rank whose shard of a sequence is empty (seqlens[b] == 0) contributes (0, -inf): the
kernel still runs on that row with the length clamped to 1 and the first page pointed at
page 0 (so it reads a valid page), and the result is replaced on the device; a rank
whose shard has room for no key at all (L_max = 0) runs no kernel. No host sync with
check=False, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import wsattn

from .. import api
from . import checks
from .comm import all_gather_flat, backend_of, rank_and_size, resolve_group

__all__ = ["decode", "StateExchange", "pack_state", "partial_decode"]

EXCHANGES = ("auto", "allgather", "symm")


def symm_unavailable_reason(group, device) -> str | None:
    """Why the symmetric-memory exchange cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"tensors are on {device}, symmetric memory needs CUDA"
    if backend_of(group) != "nccl":
        return f"the group's backend is {backend_of(group)}, symmetric memory needs NCCL"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory is missing ({e})"
    return None


class StateExchange:
    """Exchanges and merges the [B, Hq, D+1] fp32 decode states of a group.

    Built once per (group, shape, method) and reused, so captured CUDA graphs see the
    same buffers every replay (the first eager call builds it: do one before capturing).
    ``method`` is "allgather" or "symm"; with "auto" the ranks agree (one small
    exchange) on "symm" where every rank can build it, else "allgather";
    ``fallback_reason`` says why.

    * "allgather": pack the state, NCCL (or gloo) all-gather into a persistent buffer,
      ``merge_states`` in rank order: three to six launches.
    * "symm": one launch of kernels/state_exchange.py: each program stores its rows into
      every peer's slot of a torch symmetric-memory buffer (NVLink), raises a flag per
      peer, waits for the peers' flags and merges in rank order. Same bits as
      "allgather". Multicast is never used.
    """

    _cache: dict = {}

    def __init__(self, group, shape, device, method="auto", timeout_s=None):
        if method not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {method!r}")
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        self.shape = tuple(shape)
        self.device = device
        self.fallback_reason = None
        self.method = "allgather"
        if method == "allgather" or self.world_size == 1:
            self._allgather_buffers()
            return
        reason = symm_unavailable_reason(group, device)
        B, Hq, D1 = self.shape
        R, D = B * Hq, D1 - 1
        data = flags = None
        if reason is None:
            try:
                from torch.distributed import _symmetric_memory as symm_mem
                from ..kernels import state_exchange as se
                data = symm_mem.empty(se.buffer_shape(self.world_size, R, D),
                                      dtype=torch.float32, device=device)
                flags = symm_mem.empty((self.world_size, se.num_programs(R, D)),
                                       dtype=se.FLAG_DTYPE, device=device)
            except Exception as e:  # an allocator that cannot map peer memory here
                reason = f"symm_mem.empty failed: {type(e).__name__}: {e}"
        # Every rank must take the same branch: rendezvous is a collective.
        per_rank = checks.agree("decode_exchange_setup", group, self.rank, self.world_size,
                                {"symm ok": int(reason is None)}, timeout_s=timeout_s)
        if not all(f["symm ok"] for f in per_rank):
            reason = reason or "another rank cannot use symmetric memory"
        handles = None
        if reason is None:
            try:
                import warnings
                from torch.distributed import _symmetric_memory as symm_mem
                with warnings.catch_warnings():  # needed before torch 2.9, a no-op after
                    warnings.simplefilter("ignore", FutureWarning)
                    if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
                        symm_mem.enable_symm_mem_for_group(group.group_name)
                handles = [symm_mem.rendezvous(t, group.group_name) for t in (data, flags)]
            except Exception as e:
                reason = f"symm_mem.rendezvous failed: {type(e).__name__}: {e}"
        if reason is not None:
            if method == "symm":
                raise RuntimeError(f"wsattn.sp.decode: exchange='symm' unavailable: {reason}")
            self.fallback_reason = reason
            self._allgather_buffers()
            return
        self.method = "symm"
        self.data, self.flags, self._handles = data, flags, handles

        def offsets(t, handle):  # element offsets from this rank's buffer to each peer's
            ptrs = [handle.get_buffer(p, tuple(t.shape), t.dtype).data_ptr()
                    for p in range(self.world_size)]
            return torch.tensor([(ptr - t.data_ptr()) // t.element_size() for ptr in ptrs],
                                dtype=torch.int64, device=device)
        self.data_off = offsets(data, handles[0])
        self.flag_off = offsets(flags, handles[1])
        self.epochs = torch.zeros(flags.shape[1], dtype=flags.dtype, device=device)
        flags.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any peer raises one

    def _allgather_buffers(self):
        self.out = torch.empty((self.world_size,) + self.shape, dtype=torch.float32,
                               device=self.device)

    @classmethod
    def get(cls, group, shape, device, method="auto", timeout_s=None) -> "StateExchange":
        """The cached exchange for (group, shape, device, method); timeout_s bounds the
        wait for peers when it is built (see checks.agree)."""
        key = (id(group), tuple(shape), str(device), method)
        if key not in cls._cache:
            cls._cache[key] = cls(group, shape, device, method, timeout_s)
        return cls._cache[key]

    def merge(self, out: torch.Tensor, lse: torch.Tensor, seqlens: torch.Tensor,
              impl: str = "auto"):
        """This rank's partial (out [B, Hq, D], lse fp32 [B, Hq]; sequences with
        seqlens[b] == 0 count as empty) -> the merge over every rank, (out in out's
        dtype, lse fp32), identical on every rank."""
        B, Hq, D = out.shape
        if self.method == "symm":
            from ..kernels import state_exchange as se
            merged = torch.empty_like(out)
            merged_lse = torch.empty((B, Hq), dtype=torch.float32, device=out.device)
            se.launch(out.reshape(B * Hq, D), lse.reshape(B * Hq), seqlens,
                      merged.view(B * Hq, D), merged_lse.view(B * Hq), self.data, self.flags,
                      self.epochs, self.data_off, self.flag_off, self.rank, self.world_size)
            return merged, merged_lse
        state = pack_state(out, lse, seqlens == 0)
        states = all_gather_flat(state, self.world_size, self.group, out=self.out)
        merge_impl = impl if impl in ("triton", "reference") else "auto"
        merged, merged_lse = wsattn.merge_states(states[..., :D], states[..., D],
                                                 impl=merge_impl)
        return merged.to(out.dtype), merged_lse


def pack_state(out: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor | None = None,
               state: torch.Tensor | None = None) -> torch.Tensor:
    """(out [..., D], lse [...]) -> fp32 [..., D+1]; rows where empty is True become
    (0, -inf)."""
    D = out.shape[-1]
    if state is None:
        state = torch.empty(out.shape[:-1] + (D + 1,), dtype=torch.float32, device=out.device)
    if empty is None:
        state[..., :D].copy_(out)
        state[..., D].copy_(lse)
    else:
        e = empty.reshape(empty.shape + (1,) * (lse.dim() - empty.dim()))
        state[..., :D].copy_(torch.where(e[..., None], 0.0, out.float()))
        state[..., D].copy_(torch.where(e, float("-inf"), lse))
    return state


def partial_decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, impl, num_splits,
                   validate):
    """The decode kernel on a shard that may be empty for some rows.

    Returns (out, lse, empty [rows] bool). Empty rows run with length 1 over page 0 (a
    valid read whose result is discarded), so the kernel's seqlens >= 1 rule holds with
    no host read. A shard with room for no key at all (a contiguous cache of L_max = 0,
    or a block table of no page: seqlens must then be all 0) runs no kernel: every row
    is (0, -inf), decided from shapes alone, so still no host read."""
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if capacity == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse, torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    empty = seqlens == 0
    safe_lens = torch.clamp(seqlens, min=1)
    if block_table is not None:
        block_table = block_table.clone()
        block_table[:, 0] = torch.where(empty, 0, block_table[:, 0])
    out, lse = wsattn.decode(q, k_cache, v_cache, safe_lens, block_table, sm_scale,
                             num_splits=num_splits, return_lse=True, impl=impl, validate=validate)
    return out, lse, empty


def _exchange_request(exchange, impl):
    """The exchange every rank must take the same way ("reference" takes "allgather":
    the fused exchange is a Triton kernel)."""
    if not isinstance(exchange, str) or exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return "allgather" if impl == "reference" and exchange == "auto" else exchange


def validate_decode(op, q, k_cache, v_cache, seqlens, block_table, group, rank, W, check,
                    timeout_s, extra=None, error=None, sm_scale=None, impl="auto",
                    num_splits=None, more=None):
    """Local checks (or the caller's error), then the cross-rank agreement.

    With check=True the local checks are everything :func:`wsattn.decode` would refuse
    for the call :func:`partial_decode` makes on this shard (``api.check_decode``), plus
    the sp rules, all before the agreement: an error on one rank reaches every rank as
    the same ShardError instead of leaving the peers blocked in the exchange. ``more``
    (a callable) adds the caller's own checks at the end."""
    def local():
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q must be [B, Hq, D] (one new token per sequence), got "
                             f"{getattr(q, 'shape', type(q).__name__)}")
        for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seqlens", seqlens)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n} must be a tensor, got {type(t).__name__}")
            checks.check_device(n, t, group)
        if block_table is not None:
            if not isinstance(block_table, torch.Tensor):
                raise TypeError(f"block_table must be a tensor or None, got "
                                f"{type(block_table).__name__}")
            checks.check_device("block_table", block_table, group)
        if seqlens.dtype != torch.int32 or seqlens.shape != (q.shape[0],):
            raise ValueError(f"seqlens must be int32 [B={q.shape[0]}] (this rank's shard "
                             f"lengths, 0 allowed), got {seqlens.dtype} {tuple(seqlens.shape)}")
        if not check:
            return
        # Everything api.decode would refuse, on the shapes partial_decode passes it (the
        # same as the caller's). Its value check wants seqlens >= 1: this rank's lengths
        # may be 0, so values are checked below against [0, capacity] instead, which is
        # what the clamped call then satisfies.
        api.check_decode(q, k_cache, v_cache, seqlens, block_table, sm_scale,
                         num_splits=num_splits, impl=impl, validate=False)
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        if block_table is not None and capacity and k_cache.shape[0] == 0:
            raise ValueError("a paged k_cache shard needs at least one page (page 0 is "
                             "read for sequences whose shard is empty)")
        api.check_decode_values(seqlens, block_table, k_cache.shape[0], k_cache.shape[1], 0,
                                capacity)
        if more is not None:
            more()

    err = error or checks.local_error(local)
    if not check:
        if err:
            raise ValueError(f"wsattn.sp.{op}: {err}")
        return
    ok = err is None
    fields = {"batch": q.shape[0] if ok else -1, "query heads": q.shape[1] if ok else -1,
              "head dim": q.shape[2] if ok else -1,
              "kv heads": k_cache.shape[2] if ok else -1,
              "dtype": checks.DTYPE_CODE.get(q.dtype, 0) if ok else -1,
              "paged": int(block_table is not None), "world size": W,
              "sm_scale": checks.scale_field(sm_scale)}
    fields.update(extra or {})
    checks.agree(op, group, rank, W, fields, err, same=tuple(fields), timeout_s=timeout_s)


def decode(q, k_cache, v_cache, seqlens, block_table=None, sm_scale: float | None = None, *,
           group=None, exchange: str = "auto", impl: str = "auto", num_splits: int | None = None,
           return_lse: bool = False, check: bool = True, timeout_s: float | None = None):
    """Decode one new token per sequence against a KV cache sharded across ranks.

    Args:
        q: [B, Hq, D], the same on every rank.
        k_cache, v_cache: this rank's shard, paged [num_pages, page_size, Hkv, D] with
            block_table int32 [B, max_pages], or contiguous [B, L_max, Hkv, D] (L_max = 0
            allowed: a rank that holds no key runs no kernel and contributes nothing).
        seqlens: int32 [B], how many of each sequence's keys this rank holds (0 allowed:
            that rank contributes nothing to that sequence). Which positions a rank holds
            does not matter: one new token attends to all earlier keys.
        exchange: "auto" (symmetric memory where available, else all-gather),
            "allgather" or "symm".
        check: first run every check :func:`wsattn.decode` would make on this rank's
            shard, plus the sp ones, then agree across ranks: bad input on any rank
            raises the same ShardError on every rank (host reads; turn off for CUDA-graph
            capture).

    Returns:
        out [B, Hq, D] in q's dtype (the same on every rank), or (out, lse fp32 [B, Hq]).

    Example (under torchrun):
        >>> out = wsattn.sp.decode(q, k_pages, v_pages, local_lens, block_table)
    """
    group = resolve_group(group)
    rank, W = rank_and_size(group)
    request = _safe_request(exchange, impl)  # None when invalid: refused by the check

    def more():
        _exchange_request(exchange, impl)
        checks.flag("return_lse", return_lse)

    validate_decode("decode", q, k_cache, v_cache, seqlens, block_table, group, rank, W, check,
                    timeout_s, sm_scale=sm_scale, impl=impl, num_splits=num_splits,
                    more=more,
                    extra={"exchange": checks.code(request, EXCHANGES)})
    out, lse, _ = partial_decode(q, k_cache, v_cache, seqlens, block_table, sm_scale, impl,
                                 num_splits, check)
    B, Hq, D = q.shape
    ex = StateExchange.get(group, (B, Hq, D + 1), q.device, request or exchange,
                           timeout_s=timeout_s)
    out, lse = ex.merge(out, lse, seqlens, impl)
    return (out, lse) if return_lse else out


def _safe_request(exchange, impl):
    try:
        return _exchange_request(exchange, impl)
    except ValueError:
        return None
