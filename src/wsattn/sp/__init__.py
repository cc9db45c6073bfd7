"""Sequence parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs).

* :func:`prefill` / :func:`prefill_varlen` - all-gather K/V, then each rank's Q shard
  attends over the prefix it can see (zig-zag or contiguous shards, GQA, cached prefix).
* :func:`prefill_overlapped` - the same result with each peer's K/V consumed as soon as
  it lands, the transfers hidden under the local attention.
* :func:`decode` - each rank decodes over its KV-cache shard; only [B, Hq, D+1] fp32
  states are exchanged (NCCL all-gather or a symmetric-memory one-shot write) and merged.
* :func:`invariant_decode` - decode whose output is bitwise the same on any rank count.
* :mod:`.sharding` - zig-zag / contiguous shard and unshard helpers, paged-cache shards.

Every entry point returns the LSE convention of the library: natural log, fp32.
"""

from .decode import StateExchange, decode
from .invariant import invariant_decode
from .overlap import prefill_overlapped
from .prefill import prefill, prefill_varlen
from .checks import ShardError
from . import sharding

__all__ = ["prefill", "prefill_varlen", "prefill_overlapped", "decode", "invariant_decode",
           "StateExchange", "ShardError", "sharding"]
