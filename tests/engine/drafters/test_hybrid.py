"""Hybrid drafting: the merge of n-gram and ESP proposals into one tree (known proposals -> known tree)."""
from __future__ import annotations

import math

import torch

from esp_worker.passes import PassPlan
from esp_worker.drafters.base import RowsView
from esp_worker.drafters.common import CandidatePool
from esp_worker.drafters.hybrid import HybridDrafter, HybridSettings, hybrid_nodes, hybrid_tokens
from esp_worker.drafters.mask_probe import MaskModel, MaskSettings
from esp_worker.drafters.pld import PromptLookupDrafter
from esp_worker.drafters.stand import StandDrafter
from esp_worker.tree import best_nodes

V, D = 20, 4


def drafter(bc: int = 10, k: int = 1) -> HybridDrafter:
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    store = StandDrafter(num_nodes=bc - 1, depth=4, topk=2, max_ngram=3, min_ngram=1)
    chain = PromptLookupDrafter(max_ngram=3, min_ngram=1, depth=4)
    return HybridDrafter(store, chain, MaskModel(lambda ids: table[ids], lambda h: h @ table.T, table),
                         MaskSettings(num_masks=k), HybridSettings(bc))


def view_with_probe(d: HybridDrafter, hist: list[int], probe: dict[int, float]) -> RowsView:
    h = torch.tensor([hist])
    n = torch.tensor([len(hist)])
    view = RowsView(h, n, n.clone(), [0], d.state_type())
    d.start_rows(view)
    lp = torch.full((1, 1, d.probe.num_cand), float("-inf"))
    ids = torch.zeros((1, 1, d.probe.num_cand), dtype=torch.long)
    for i, (tok, p) in enumerate(probe.items()):
        lp[0, 0, i], ids[0, 0, i] = math.log(p), tok
    view.state.update(cand_lp=lp, cand_ids=ids, has_probe=torch.ones(1, dtype=torch.bool))
    return view


def test_sizes():
    assert [hybrid_nodes(bc, 1, 4) for bc in (10, 30, 60)] == [7, 23, 47]
    assert hybrid_tokens(7, 1, 4) == 10 and hybrid_tokens(-1, 1, 4) == 1 and hybrid_tokens(0, 2, 4) == 3
    # from mask_min_nodes on, one node in mask_every owns masks too (the engine's default 32: root only below)
    assert [hybrid_nodes(bc, 1, 4, 32) for bc in (10, 30, 60)] == [8, 28, 47]
    assert hybrid_tokens(31, 1, 4, 32) == 33 and hybrid_tokens(32, 1, 4, 32) == 42


def test_small_trees_put_masks_on_the_root_only():
    d = drafter()
    d.mask_min_nodes = 32
    view = view_with_probe(d, [5, 6, 7, 8, 5, 6], {7: 0.5, 9: 0.3, 3: 0.1})
    b = d.propose(view, PassPlan(5))
    assert b.mask_owner.tolist() == [[0, -1, -1, -1, -1, -1]] and b.aux_embeds.shape[1] == 1
    assert b.layout.visible.shape[-1] == hybrid_tokens(5, 1, 4, 32) == 7


def test_merge_ranks_chain_and_probe_by_calibrated_estimate():
    d = drafter()
    # history [5 6 7 8 5 6]: the suffix [5 6] matched at 0 -> chain [7 8 5 6]; prior rate 0.8 per depth ->
    # 0.8, 0.64, 0.512, 0.41. Probe: 7 (0.5, the same token as chain node 1: merged), 9 (0.3), 3 (0.1).
    view = view_with_probe(d, [5, 6, 7, 8, 5, 6], {7: 0.5, 9: 0.3, 3: 0.1})
    b4 = d.propose(view, PassPlan(4))
    assert b4.tree.tokens.tolist() == [[6, 7, 8, 5, 6]] and b4.tree.parents.tolist() == [[-1, 0, 1, 2, 3]]
    b5 = d.propose(view, PassPlan(5))
    assert b5.tree.tokens.tolist() == [[6, 7, 8, 5, 6, 9]]
    assert b5.tree.parents.tolist() == [[-1, 0, 1, 2, 3, 0]]
    assert b5.source.tolist() == [[-1, 0, 0, 0, 0, 2]]  # ngram, ngram, ngram, ngram, esp
    # 1 + 5 // 4 = 2 mask owners: the root and the likeliest path end (the chain's leaf: 0.41 > 0.3 > 0.16)
    assert b5.mask_owner.tolist() == [[0, -1, -1, -1, 1, -1]]
    assert b5.aux_embeds.shape[1] == 2 and b5.layout.visible.shape[-1] == hybrid_tokens(5, 1, 4)
    mass = d.draft_mass(view)[0, :6].tolist()
    assert [round(x, 3) for x in mass] == [0.8, 0.64, 0.512, 0.41, 0.3, 0.1]


def test_no_match_gives_the_probe_the_whole_budget_and_no_probe_the_chain():
    d = drafter()
    view = view_with_probe(d, [1, 2, 3, 4], {7: 0.5, 9: 0.3, 3: 0.1})  # no repeated suffix: no chain
    b = d.propose(view, PassPlan(3))
    assert b.tree.tokens.tolist() == [[4, 7, 9, 3]] and b.tree.valid.all()
    assert b.source.tolist() == [[-1, 2, 2, 2]]
    view = view_with_probe(d, [5, 6, 7, 8, 5, 6], {7: 0.5})
    view.state.has_probe = torch.zeros(1, dtype=torch.bool)  # a stale probe offers nothing
    b = d.propose(view, PassPlan(5))
    kept = b.tree.tokens[0][b.tree.valid[0]].tolist()
    assert kept == [6, 7, 8, 5, 6] and (b.source[0][b.tree.valid[0]] != 2).all()  # the chain only


def test_calibration_learns_per_proposer_and_depth():
    from esp_worker.passes import PassRecord

    d = drafter()
    view = view_with_probe(d, [5, 6, 7, 8, 5, 6], {7: 0.5, 9: 0.3, 3: 0.1})
    for _ in range(50):  # the model always says 9: the esp node is accepted, the chain never
        block = d.propose(view, PassPlan(5))
        slot9 = block.tree.tokens[0].tolist().index(9)
        res = PassRecord(committed=torch.tensor([[9, 1]]), num_committed=torch.tensor([2]), hidden=None,
                         mask_hidden=None, path_slots=torch.tensor([[0, slot9]]), last_slot=torch.tensor([slot9]),
                         block=block, slot_logits=torch.zeros((1, 6, V)))
        d._calibrate(res)
        d._pools.clear()
    mass = d.draft_mass(view)[0]
    # esp's factor rose (0.3 -> 1), the chain's depth-1 rate fell towards 0
    assert mass[0] > 0.9 and d.alpha()[0] < 0.1


def test_calibration_skips_rows_a_pass_did_not_count_for():
    """A pass run ahead over rows the pass before ended (engine.cuda_graphs_run_ahead) teaches nothing there, and a
    pass over no live row does not even decay the counts."""
    from esp_worker.drafters.calibration import AcceptanceCalibration
    from esp_worker.tree import DraftTree

    tree = DraftTree(tokens=torch.tensor([[1, 2, 3], [1, 2, 3]]), parents=torch.tensor([[-1, 0, 1], [-1, 0, 1]]),
                     valid=torch.ones((2, 3), dtype=torch.bool))
    path, n = torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([3, 3])  # both drafts accepted in both rows
    cell, q = torch.tensor([[0, 0, 1], [0, 0, 1]]), torch.full((2, 3), 0.5)
    one, both = AcceptanceCalibration(torch.tensor([0.5, 0.5])), AcceptanceCalibration(torch.tensor([0.5, 0.5]))
    one.update(DraftTree(tree.tokens[:1], tree.parents[:1], tree.valid[:1]), path[:1], n[:1], cell[:1], q[:1])
    both.update(tree, path, n, cell, q, live=torch.tensor([True, False]))
    assert torch.equal(one.pred, both.pred) and torch.equal(one.acc, both.acc)
    before = both.pred.clone(), both.acc.clone()
    both.update(tree, path, n, cell, q, live=torch.tensor([False, False]))
    assert torch.equal(both.pred, before[0]) and torch.equal(both.acc, before[1])


def test_best_nodes_orphans_are_invalid():
    # equal ranks: entry 2 (child of 1) cannot be kept without its parent -> it hangs under the root, invalid
    rank = torch.tensor([[1.0, -1.0, -1.0]])
    tree, keep = best_nodes(torch.tensor([0]), rank, torch.tensor([[True, False, False]]), torch.tensor([[4, 5, 6]]),
                            torch.tensor([[-1, -1, 1]]), 2)
    assert keep.tolist() == [[0, 1]] and tree.valid.tolist() == [[True, True, False]]


class FakeHeads:
    """A heads proposer with a known pool: depth 1 tokens 7 (0.6) and 9 (0.2); depth 2: 5 under 7 (0.5)."""

    depth = 2

    def start_rows(self, view):
        view.state.cp_h = torch.zeros((1, D))
        view.state.cp_ok = torch.ones(1, dtype=torch.bool)

    def observe(self, view, result):
        pass

    def pool(self, view):
        score = torch.tensor([[math.log(0.6), math.log(0.2), math.log(0.6 * 0.5)]])
        return CandidatePool(score, torch.tensor([[7, 9, 5]]), torch.tensor([[-1, -1, 0]]), torch.tensor([[1, 1, 2]]))


def test_heads_merge_into_the_probe_and_bring_their_children():
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    store = StandDrafter(num_nodes=9, depth=4, topk=2, max_ngram=3, min_ngram=1)
    chain = PromptLookupDrafter(max_ngram=3, min_ngram=1, depth=4)
    d = HybridDrafter(store, chain, MaskModel(lambda ids: table[ids], lambda h: h @ table.T, table),
                      MaskSettings(num_masks=1), HybridSettings(10), heads=FakeHeads())
    assert d.proposers == ("ngram", "store", "esp", "heads") and d.heads_source == 3
    # no repeated suffix (no chain); the probe says 7 (0.5). The heads' 7 (0.6) is the probe's 7 under the root:
    # one node, estimate max(0.5, 0.6); the heads' 5 moves under it (0.6 * 0.5); the heads' 9 (0.2) stays.
    view = view_with_probe(d, [1, 2, 3, 4], {7: 0.5})
    b = d.propose(view, PassPlan(3))
    t = b.tree
    nodes = {(t.tokens[0, i].item(), t.tokens[0, t.parents[0, i]].item(), b.source[0, i].item())
             for i in range(1, 4) if t.valid[0, i]}
    assert nodes == {(7, 4, 2), (5, 7, 3), (9, 4, 3)}  # (token, parent's token, proposer): 7 stays esp's node
    assert [round(x, 3) for x in d.draft_mass(view)[0, :3].tolist()] == [0.6, 0.3, 0.2]
    # without a hidden state yet (cp_ok False) the heads offer nothing
    view = view_with_probe(d, [1, 2, 3, 4], {7: 0.5})
    view.state.cp_ok = torch.zeros(1, dtype=torch.bool)
    b = d.propose(view, PassPlan(3))
    assert b.tree.tokens[0][b.tree.valid[0]].tolist() == [4, 7] and b.source[0][b.tree.valid[0]].tolist() == [-1, 2]


def test_path_products_multiply_and_validate_along_each_path():
    """Pointer doubling gives each node the product along its path and whether the whole path is valid: the
    depth-by-depth recurrence's values (to rounding) on random topological pools of every depth."""
    from esp_worker.drafters.hybrid import path_products

    cond = torch.tensor([[0.5, 0.4, 0.9, 0.7]])
    cum, ok = path_products(cond, torch.tensor([[True, True, False, True]]), torch.tensor([[-1, 0, 1, 2]]), 4)
    assert torch.allclose(cum, torch.tensor([[0.5, 0.2, 0.18, 0.126]])) and ok.tolist() == [[True, True, False, False]]
    gen = torch.Generator().manual_seed(0)
    for depth in range(1, 12):
        b, p = 3, 24
        par = torch.full((b, p), -1)
        for r in range(b):
            dep = [1]
            for i in range(1, p):  # a random earlier parent whose depth leaves room, or the root
                cands = [-1] + [j for j in range(i) if dep[j] < depth]
                j = cands[int(torch.randint(len(cands), (1,), generator=gen))]
                par[r, i] = j
                dep.append(1 if j < 0 else dep[j] + 1)
        cond, valid = torch.rand((b, p), generator=gen), torch.rand((b, p), generator=gen) > 0.2
        want_cum, want_ok, root, up = cond, valid, par < 0, par.clamp(min=0)
        for _ in range(depth - 1):
            want_cum = torch.where(root, cond, cond * want_cum.gather(1, up))
            want_ok = want_ok & (root | want_ok.gather(1, up))
        cum, ok = path_products(cond, valid, par, depth)
        assert torch.equal(ok, want_ok) and torch.allclose(cum, want_cum, rtol=1e-6)
