"""The plan of overlapped sequence-parallel prefill (no process group needed): for every
world size 1..8, zig-zag or contiguous, causal or not, the local call (the local Q shard
over the local K/V shard under a local-coordinate causal mask) plus one unmasked call per
peer (``_peer_part``) cover every (query, key) pair the global mask allows exactly once,
and no other."""

import pytest
import torch

from wsattn.sp.overlap import _peer_part
from wsattn.sp.sharding import local_chunks, shard


def _coverage(W, zigzag, causal, S):
    """count[i, j]: how many calls attend global query i to global key j."""
    count = torch.zeros(S, S, dtype=torch.int64)
    pos = torch.arange(S)
    n = len(local_chunks(W, 0, zigzag))
    for r in range(W):
        mine = shard(pos, W, r, 0, zigzag)  # global positions of the local rows, in order
        c = len(mine) // n
        L = len(mine)
        local = torch.ones(L, L, dtype=torch.bool)
        if causal:
            local = torch.tril(local)  # the local call's mask, in local coordinates
        count[mine[:, None], mine[None, :]] += local.long()
        for d in range(1, W):
            src = (r - d) % W
            part = _peer_part(r, src, zigzag, causal, c, c)
            if part is None:
                continue
            q0, kend = part
            theirs = shard(pos, W, src, 0, zigzag)
            keys = theirs if kend is None else theirs[:kend]
            count[mine[q0:, None], keys[None, :]] += 1
    return count


@pytest.mark.parametrize("W", range(1, 9))
@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_local_call_plus_one_call_per_peer_covers_the_mask_exactly_once(W, zigzag, causal):
    S = 2 * W * 3
    want = torch.ones(S, S, dtype=torch.int64)
    if causal:
        want = torch.tril(want)
    assert torch.equal(_coverage(W, zigzag, causal, S), want)
