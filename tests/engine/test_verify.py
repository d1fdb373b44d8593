"""Verification: the vectorised greedy walk equals the step-by-step walk on random trees."""
from __future__ import annotations

import torch

from esp_worker.tree import DraftTree, ancestor_matrix
from esp_worker.verify import verify, verify_greedy


def test_worked_example():
    tree = DraftTree(
        tokens=torch.tensor([[9, 1, 2, 3]]), parents=torch.tensor([[-1, 0, 0, 2]]), valid=torch.ones(1, 4, dtype=torch.bool)
    )
    v = 8
    logits = torch.zeros(1, 4, v)
    for slot, best in enumerate([2, 5, 3, 7]):  # argmax at r, a, b, c
        logits[0, slot, best] = 1.0
    anc = ancestor_matrix(tree.parents)
    res = verify_greedy(tree, logits, anc, anc.sum(-1) - 1, 2)
    assert res.committed[0, : res.num_committed[0]].tolist() == [2, 3, 7]
    assert res.path_slots[0].tolist() == [0, 2, 3]


def test_greedy_vectorised_equals_walk_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, n, v = 3, int(torch.randint(1, 12, (1,), generator=g)), 5
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]) for _ in range(b)])
        # distinct sibling tokens: token = (slot index + offset) % v is not enough; draw then dedupe by slot id
        tokens = torch.randint(0, v, (b, n + 1), generator=g)
        for r in range(b):
            seen = {}
            for i in range(1, n + 1):
                key = (int(parents[r, i]), int(tokens[r, i]))
                if key in seen:
                    tokens[r, i] = v + i  # unique token, never the argmax
                seen[key] = i
        valid = torch.rand(b, n + 1, generator=g) > 0.1
        valid[:, 0] = True
        tree = DraftTree(tokens, parents, valid)
        logits = torch.randn(b, n + 1, v + n + 2, generator=g)
        logits[..., v:] = -10  # the model never picks the unique filler tokens
        anc = ancestor_matrix(parents)
        depth = anc.sum(-1) - 1
        max_depth = int(depth.max())
        walk = verify(tree, logits, max_depth, lambda lg, active: lg.argmax(-1))
        vec = verify_greedy(tree, logits, anc, depth, max_depth)
        assert torch.equal(walk.num_committed, vec.num_committed)
        for r in range(b):
            k = int(walk.num_committed[r])
            assert walk.committed[r, :k].tolist() == vec.committed[r, :k].tolist()
            assert walk.path_slots[r, :k].tolist() == vec.path_slots[r, :k].tolist()
            assert int(vec.last_token[r]) == int(walk.committed[r, k - 1])  # the next root


def test_chain_and_depth_one_fast_paths_equal_the_walk():
    """Chains (path in place) and trees of depth 1 take their own few-op paths in verify_greedy: same
    acceptance, committed tokens and path as the step-by-step walk, invalid (padding) nodes never accepted."""
    g = torch.Generator().manual_seed(1)
    v = 4  # a small vocabulary: long accepted runs happen
    for shape in ("chain", "fan"):
        for _ in range(200):
            b, n = 4, int(torch.randint(1, 10, (1,), generator=g))
            if shape == "chain":
                parents = torch.arange(-1, n).expand(b, -1)
                key = ("chain", n)
                valid = (torch.arange(n + 1) <= torch.randint(0, n + 1, (b, 1), generator=g))  # prefix-closed
                tokens = torch.randint(0, v, (b, n + 1), generator=g)
            else:
                parents = torch.tensor([-1] + [0] * n).expand(b, -1)
                key = ("esp-k1", n)
                valid = torch.rand(b, n + 1, generator=g) > 0.2
                valid[:, 0] = True
                tokens = torch.cat([torch.randint(0, v, (b, 1), generator=g), torch.randperm(n, generator=g).expand(b, -1)], 1)
            logits = torch.randn(b, n + 1, max(v, n), generator=g)
            tree = DraftTree(tokens, parents, valid, static_key=key)
            anc = ancestor_matrix(parents)
            depth = anc.sum(-1) - 1
            max_depth = int(depth.max())
            fast = verify_greedy(tree, logits, anc, depth, max_depth)
            walk = verify(DraftTree(tokens, parents, valid), logits, max_depth, lambda lg, active: lg.argmax(-1))
            assert torch.equal(fast.num_committed, walk.num_committed), shape
            assert torch.equal(fast.last_slot, walk.last_slot), shape
            for r in range(b):
                k = int(walk.num_committed[r])
                assert fast.committed[r, :k].tolist() == walk.committed[r, :k].tolist()
                assert fast.path_slots[r, :k].tolist() == walk.path_slots[r, :k].tolist()
                assert int(fast.last_token[r]) == int(walk.committed[r, k - 1]), shape  # the next root


def test_plain_pass_gives_its_token_as_the_next_root():
    logits = torch.randn(3, 1, 7, generator=torch.Generator().manual_seed(2))
    tree = DraftTree(torch.zeros(3, 1, dtype=torch.long), torch.full((3, 1), -1), torch.ones(3, 1, dtype=torch.bool))
    res = verify_greedy(tree, logits, torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long), 0)
    assert res.last_token.tolist() == logits[:, 0].argmax(-1).tolist() == res.committed[:, 0].tolist()
