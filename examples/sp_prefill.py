"""Sequence-parallel prefill: each rank holds a zig-zag shard of one long sequence.

    torchrun --nproc-per-node 2 examples/sp_prefill.py            # GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/sp_prefill.py --seqlen 256   # CPU (gloo)

Every rank builds the same global Q/K/V from one seed (in a real model each rank would
only ever hold its shard), keeps its shard, runs the all-gather and the overlapped SP
prefill, and checks its piece of the output against one device's attention.
"""

import argparse
import os

import torch
import torch.distributed as dist

import wsattn
import wsattn.sp as sp
from wsattn.sp.sharding import shard


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=None, help="global sequence length")
    p.add_argument("--prefix", type=int, default=0, help="cached prefix tokens (kv_len - q_len)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype, impl = (torch.bfloat16, "auto") if cuda else (torch.float32, "reference")
    Hq, Hkv, D = (32, 8, 128) if cuda else (4, 1, 64)
    S = args.seqlen or (16384 if cuda else 64 * W)
    Sk = S + args.prefix

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, S, Hq, D, generator=g).to(dev, dtype)
    k = torch.randn(1, Sk, Hkv, D, generator=g).to(dev, dtype)
    v = torch.randn(1, Sk, Hkv, D, generator=g).to(dev, dtype)
    q_s, k_s, v_s = (shard(t, W, rank, dim=1, zigzag=True) for t in (q, k, v))

    out, lse = sp.prefill(q_s, k_s, v_s, causal=True, impl=impl)
    out_o, lse_o = sp.prefill_overlapped(q_s, k_s, v_s, causal=True, impl=impl)

    ref = shard(wsattn.attention(q, k, v, causal=True, impl=impl), W, rank, dim=1, zigzag=True)
    err = lambda a: ((a.double() - ref.double()).norm() / ref.double().norm()).item()  # noqa: E731
    print(f"rank {rank}/{W}: q shard {tuple(q_s.shape)}, rel. error vs one device: "
          f"all-gather {err(out):.2e}, overlapped {err(out_o):.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
