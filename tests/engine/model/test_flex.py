"""engine.attention_backend=flex: the block mask of a replayed pass sees exactly the keys the attention bias does.

FlexAttention's eager form evaluates the mask function at every key and ignores the block mask's counts, so these
tests compile it with Inductor, whose kernel skips the blocks the counts leave out (as the CUDA kernel does): a
count one block short, or a full block that should be partial, changes the output. Rows' lengths put their blocks
across 128-slot boundaries; the unseen slots hold large keys and values, so reading one would show.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from esp_worker.model.attention import attention_bias
from esp_worker.model.flex import KEY_BLOCK, flex_mask

pytestmark = pytest.mark.slow  # each case compiles an Inductor kernel


def _attend_flex(query, key, value, hist_len, visible):
    return flex_mask(hist_len, visible, query.shape[2], key.shape[2]).attend(query, key, value, 0.125)


def _attend_bias(query, key, value, hist_len, visible):
    """The SDPA path's visibility: attention_bias over the capacity, heads repeated for the grouped query heads."""
    b, h, q, _ = query.shape
    cache_len = hist_len - 1
    pos = cache_len[:, None] + torch.arange(q)
    bias = attention_bias(visible, cache_len, pos, key.shape[2], torch.float32)
    g = h // key.shape[1]
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                         attn_mask=bias, scale=0.125)
    return out.transpose(1, 2)


def _tree_layouts(rows: int, q: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, Q, Q] visibility of random trees: each input sees itself and its parent's visible inputs."""
    vis = torch.zeros(rows, q, q, dtype=torch.bool)
    for r in range(rows):
        for i in range(q):
            vis[r, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                vis[r, i] |= vis[r, parent]
    return vis


@pytest.mark.parametrize("lengths,q,capacity,per_row", [
    ((1, 127, 128, 129, 300), 1, 512, False),  # plain passes: a row's block at, before and after a block boundary
    # trees, one per row, their blocks across boundaries; the slab's own size as the last capacity bucket (1000:
    # a part block at the end)
    ((2, 126, 250, 900), 5, 1000, True),
    ((1, 200), 130, 512, False),  # more inputs than a block: two query blocks
])
def test_flex_sees_the_bias_keys(lengths, q, capacity, per_row):
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, hd = len(lengths), 4, 2, 16
    hist_len = torch.tensor(lengths)
    query = torch.randn(b, heads, q, hd, generator=gen)
    key = torch.randn(b, kv_heads, capacity, hd, generator=gen)
    value = torch.randn(b, kv_heads, capacity, hd, generator=gen)
    for r, n in enumerate(lengths):  # slots no input sees: stale keys and values from longer rows
        key[r, :, n - 1 + q:] = 40.0
        value[r, :, n - 1 + q:] = 1e4
    visible = _tree_layouts(b if per_row else 1, q, gen)
    want = _attend_bias(query, key, value, hist_len, visible)
    torch._dynamo.reset()
    got = torch.compile(_attend_flex, fullgraph=True, dynamic=False)(query, key, value, hist_len, visible)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_capacity_buckets_below_the_slab_are_whole_blocks():
    """The graphs' capacity buckets are powers of two from 128 (graphs/runner.py), then the slab's own size."""
    from esp_worker.graphs.runner import capacity_buckets

    assert all(c % KEY_BLOCK == 0 for c in capacity_buckets(1000)[:-1])
