"""Sequence-parallel decode: each rank holds a paged shard of every sequence's KV cache.

    torchrun --nproc-per-node 2 examples/sp_decode.py             # GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/sp_decode.py --context 300   # CPU (gloo)

Each rank attends over its shard, the ranks exchange [B, Hq, D+1] fp32 states and all
merge them, so every rank ends with the same output. A sequence shorter than the rank
count leaves some ranks with an empty shard. Also runs the rank-count-invariant mode.
"""

import argparse
import os

import torch
import torch.distributed as dist

import wsattn
import wsattn.sp as sp
from wsattn.sp.sharding import shard_kv_cache, shard_kv_cache_blocks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=None, help="longest sequence's keys")
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype, impl = (torch.bfloat16, "auto") if cuda else (torch.float32, "reference")
    Hq, Hkv, D, page, block = (32, 8, 128, 64, 4096) if cuda else (4, 2, 64, 16, 64)
    L = args.context or (65536 if cuda else 300)
    lens = [L] + [max(1, L // (3 * b)) for b in range(1, args.batch - 1)] + [1]
    lens = lens[:args.batch]

    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(lens), Hq, D, generator=g).to(dev, dtype)
    k = torch.randn(len(lens), L, Hkv, D, generator=g).to(dev, dtype)
    v = torch.randn(len(lens), L, Hkv, D, generator=g).to(dev, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = wsattn.decode(q, k, v, seqlens, impl=impl)

    k_pages, v_pages, table, local_lens = shard_kv_cache(k, v, lens, W, rank, page)
    out = sp.decode(q, k_pages, v_pages, local_lens, table, impl=impl)

    n_blocks = -(-L // block)  # fixed by the context, not by W
    kb, vb, btable, blens = shard_kv_cache_blocks(k, v, lens, W, rank, n_blocks, block, page)
    out_inv = sp.invariant_decode(q, kb, vb, blens, btable, n_blocks, impl=impl)

    err = lambda a: ((a.double() - ref.double()).norm() / ref.double().norm()).item()  # noqa: E731
    print(f"rank {rank}/{W}: local keys {local_lens.tolist()}, rel. error vs one device: "
          f"decode {err(out):.2e}, invariant {err(out_inv):.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
