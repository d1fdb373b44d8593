"""Tree math on hand-made trees: ancestors, depths, block layout with masks, static shapes."""
from __future__ import annotations

import torch

from esp_worker.tree import ancestor_matrix, block_layout, mask_indices, static_branches, static_parents


def test_ancestor_matrix_hand_tree():
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    anc = ancestor_matrix(parents)[0].int().tolist()
    assert anc == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]


def test_ancestor_matrix_deep_chain_and_batch():
    chain = torch.arange(-1, 11)[None]  # depth-11 chain
    star = torch.tensor([[-1] + [0] * 11])
    anc = ancestor_matrix(torch.cat([chain, star]))
    assert torch.equal(anc[0], torch.tril(torch.ones(12, 12, dtype=torch.bool)))
    assert anc[1].sum().item() == 12 + 11
    for depth in range(1, 12):  # a known depth bound takes fewer rounds and gives the same matrix
        tree = torch.cat([torch.arange(-1, depth), torch.zeros(11 - depth, dtype=torch.long)])[None]
        assert torch.equal(ancestor_matrix(tree, depth), ancestor_matrix(tree))


def test_block_layout_with_masks():
    # root r, n1 under r; k = 2 masks each: order [r, n1, m(r,1), m(r,2), m(n1,1), m(n1,2)]
    lay = block_layout(torch.tensor([[-1, 0]]), num_masks=2)
    assert lay.rel_pos[0].tolist() == [0, 1, 1, 2, 2, 3]
    vis = lay.visible[0].int().tolist()
    assert vis == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ]
    assert mask_indices(torch.tensor([1, 0]), 2, 2).tolist() == [[4, 5], [2, 3]]


def test_block_layout_no_masks_is_tree_attention():
    lay = block_layout(torch.tensor([[-1, 0, 0, 2]]), num_masks=0)
    assert lay.rel_pos[0].tolist() == [0, 1, 1, 2]
    assert lay.visible[0, 3].int().tolist() == [1, 0, 1, 1]


def test_static_branches_match_paper_trees():
    assert static_branches(10, 1) == [4]
    assert static_branches(30, 1) == [14]
    assert static_branches(60, 1) == [29]
    assert static_branches(60, 2) == [15, 4]
    assert static_branches(30, 2) == [7, 2]
    assert static_branches(10, 3) == [1]  # too small for three levels: shallower tree
    for bc in (10, 30, 60):
        for k in (1, 2, 3):
            assert (k + 1) * (1 + sum(static_branches(bc, k))) <= bc


def test_static_parents_top1_expansion():
    assert static_parents([3, 2]) == [-1, 0, 0, 0, 1, 1]
    assert static_parents([2, 1, 1]) == [-1, 0, 0, 1, 3]


def test_attention_bias_rows_of_one_length_equal_the_general_form():
    import torch

    from esp_worker.model.attention import attention_bias

    g = torch.Generator().manual_seed(0)
    for b, q, s, shared in [(1, 5, 7, True), (3, 4, 2, False), (2, 6, 11, True)]:
        in_block = torch.rand((1 if shared else b, q, q), generator=g) < 0.5
        in_block |= torch.eye(q, dtype=torch.bool)[None]
        cache_len = torch.full((b,), s)
        pos = s + torch.randint(0, q, (b, q), generator=g)
        general = attention_bias(in_block, cache_len, pos, s + q, torch.float32)
        fast = attention_bias(in_block, cache_len, pos, s + q, torch.float32, uniform_len=s)
        assert fast.shape == general.shape == (b, 1, q, s + q) and torch.equal(fast, general)


def test_static_block_bias_is_the_general_bias_as_the_context_grows():
    """A cached layout's bias is a view of one buffer per layout, grown with the context; its values are
    attention_bias's for every length, batch and dtype, and a second layout gets its own buffer."""
    from esp_worker.model.attention import StaticBlockBias, attention_bias

    g = torch.Generator().manual_seed(1)
    layouts = []
    for q in (3, 7):
        in_block = (torch.rand((1, q, q), generator=g) < 0.5) | torch.eye(q, dtype=torch.bool)[None]
        layouts.append(in_block)
    cached = StaticBlockBias()
    for s in (0, 5, 250, 251, 700):
        for in_block in layouts:
            for b, dtype in ((1, torch.float32), (3, torch.bfloat16)):
                q = in_block.shape[-1]
                pos = s + torch.arange(q).expand(b, q)
                want = attention_bias(in_block, torch.full((b,), s), pos, s + q, dtype)
                got = cached(("layout", q), in_block, s, b, dtype)
                assert got.shape == want.shape == (b, 1, q, s + q) and torch.equal(got, want)
    first, second = (cached(("layout", x.shape[-1]), x, 9, 1, torch.float32) for x in layouts)
    assert first.data_ptr() != second.data_ptr()
