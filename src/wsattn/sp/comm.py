"""Thin wrappers over torch.distributed shared by the sp modules.

Collectives always move flat contiguous buffers: gloo's all-gather only takes a 1-D
output, and NCCL is indifferent, so one code path serves both backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the GPU machines carry 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group(group):
    """The group to use (the default group for None), with a clear error when
    torch.distributed has not been initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("wsattn.sp needs torch.distributed initialised (torchrun + "
                           "dist.init_process_group) before it is called")
    return dist.group.WORLD if group is None else group


def rank_and_size(group) -> tuple[int, int]:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it was given")
    return rank, dist.get_world_size(group)


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def all_gather_flat(inp: torch.Tensor, world_size: int, group, async_op: bool = False,
                    out: torch.Tensor | None = None):
    """Gather inp (any shape, contiguous) from every rank into out [W, *inp.shape].

    Returns out, or (out, work) with async_op. With world_size 1 it is a copy."""
    inp = inp.contiguous()
    if out is None:
        out = torch.empty((world_size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
    if world_size == 1:
        out[0].copy_(inp)
        return (out, None) if async_op else out
    work = _all_gather_single(out.view(-1), inp.view(-1), group=group, async_op=async_op)
    return (out, work) if async_op else out
