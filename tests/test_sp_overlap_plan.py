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


def test_sharding_helpers_refuse_what_they_would_misread():
    """rank outside [0, W), cu_seqlens that do not cover x, lengths past the cache: each a
    ValueError naming it, not a silently wrong shard."""
    import pytest
    import torch

    from wsattn.sp.sharding import shard, shard_kv_cache, shard_kv_cache_blocks, shard_varlen

    x = torch.arange(8)
    for W, r in ((2, 2), (2, -1), (0, 0), (2, True)):
        with pytest.raises(ValueError, match="rank|world_size"):
            shard(x, W, r, dim=0)
    for cu in ([0, 4, 8, 10][:3], [2, 6, 10], [0, 8, 4], [0, 4, 16], [0.0, 10.0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            shard_varlen(torch.arange(10), cu, 2, 0)
    k = torch.randn(2, 64, 1, 16)
    with pytest.raises(ValueError, match=r"seqlens must hold one length in \[0, L=64\]"):
        shard_kv_cache(k, k, [66, 64], 2, 0, page_size=16)
    with pytest.raises(ValueError, match="seqlens must hold one length"):
        shard_kv_cache(k, k, [3], 2, 0, page_size=16)
    with pytest.raises(ValueError, match="rank"):
        shard_kv_cache_blocks(k, k, [8, 8], 2, 3, 2, 16)
