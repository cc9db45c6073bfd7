"""The engine: the paged KV allocator, generate() against transformers, sampling, bad
input, and the `wsattn generate` command line (CPU, fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from wsattn.engine.kv_cache import PagedKVCache
from wsattn.models.config import ModelConfig

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=256, vocab_size=256,
            max_position_embeddings=512)


def _cfg(**over):
    return ModelConfig.from_hf({**TINY, **over})


# --------------------------------------------------------------------------- allocator

def test_cache_layout():
    cache = PagedKVCache(_cfg(), num_pages=10, page_size=4, dtype=torch.float32, device="cpu")
    assert cache.k.shape == (2, 10, 4, 1, 64) and cache.v.shape == cache.k.shape
    assert cache.max_seq_len == 40 and cache.max_pages == 10


def test_allocator_pages_freed_and_reused():
    """Released pages go back to the pool and are handed out again, lowest first; no page
    is ever owned by two live sequences."""
    cache = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    a, b = cache.admit([9, 4])                      # 3 pages + 1 page
    assert cache.pages_of(a) == [0, 1, 2] and cache.pages_of(b) == [3]
    assert cache.free_pages == 8
    (c,) = cache.admit([16])                        # 4 pages
    assert cache.pages_of(c) == [4, 5, 6, 7]
    cache.release([a])
    assert cache.free_pages == 7 and cache.live == [b, c]
    (d,) = cache.admit([13])                        # 4 pages: the freed 0,1,2 then 8
    assert cache.pages_of(d) == [0, 1, 2, 8]
    owned = [p for s in cache.live for p in cache.pages_of(s)]
    assert len(owned) == len(set(owned)) == 9 and cache.free_pages == 12 - 9
    cache.release([b, c, d])
    assert cache.free_pages == 12 and cache.live == []
    # the same requests on a fresh pool give the same pages: allocation is deterministic
    again = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    x, y = again.admit([9, 4])
    assert again.pages_of(x) == [0, 1, 2] and again.pages_of(y) == [3]


def test_block_table_and_seqlens():
    cache = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu",
                         max_seq_len=20)
    assert cache.max_pages == 5
    a, b = cache.admit([9, 4])
    bt = cache.block_table([b, a])
    assert bt.dtype == torch.int32 and bt.tolist() == [[3, 0, 0, 0, 0], [0, 1, 2, 0, 0]]
    assert cache.block_table([a], max_pages=3).tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="max_pages=2"):
        cache.block_table([a], max_pages=2)
    cache.advance([a, b], [7, 4])
    assert cache.seqlens([a, b]).tolist() == [7, 4]
    out = torch.full((2,), -1, dtype=torch.int32)
    assert cache.seqlens([b, a], out=out) is out and out.tolist() == [4, 7]
    with pytest.raises(ValueError, match="capacity of 9"):
        cache.advance([a, b], [3, 0])               # 7 + 3 > 9: nothing advances
    assert cache.seqlens([a, b]).tolist() == [7, 4]


@pytest.mark.parametrize("caps,match", [
    ([41], "more than one sequence may hold"),
    ([20, 20, 4], "not enough free KV pages"),
    ([1, 1, 1, 1, 1], "above the largest batch bucket"),
    ([], "no sequences"),
    ([0], "positive int"),
], ids=["too-long", "no-pages", "batch", "empty", "zero"])
def test_admit_refuses_without_change(caps, match):
    """A request that does not fit raises and leaves the allocator as it was."""
    cache = PagedKVCache(_cfg(), num_pages=10, page_size=4, dtype=torch.float32, device="cpu",
                         max_batch=4)
    with pytest.raises(ValueError, match=match):
        cache.admit(caps)
    assert cache.free_pages == 10 and cache.live == []
    assert cache.admit([40]) == [0]


def test_max_positions_caps_sequences():
    cache = PagedKVCache(_cfg(max_position_embeddings=24), num_pages=10, page_size=4,
                         dtype=torch.float32, device="cpu")
    assert cache.max_seq_len == 24 and cache.max_pages == 6
    with pytest.raises(ValueError, match="more than one sequence may hold"):
        cache.admit([25])


def test_release_unknown_or_repeated():
    cache = PagedKVCache(_cfg(), num_pages=4, page_size=4, dtype=torch.float32, device="cpu")
    (a,) = cache.admit([4])
    with pytest.raises(ValueError, match="not an admitted sequence"):
        cache.release([a + 1])
    with pytest.raises(ValueError, match="repeated"):
        cache.release([a, a])
    assert cache.live == [a]
    cache.release([a])
    with pytest.raises(ValueError, match="not an admitted sequence"):
        cache.release([a])
