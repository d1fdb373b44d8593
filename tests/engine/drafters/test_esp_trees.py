"""ESP tree construction from known candidate distributions: static, dynamic (top-1 and frontier), pruning, EMA."""
from __future__ import annotations

import math

import torch

from esp_worker.passes import PassPlan, PassRecord, RowsView
from esp_worker.drafters.common import topk_excluding
from esp_worker.drafters.esp import ESPDrafter, ESPState
from esp_worker.drafters.mask_probe import MaskModel, MaskSettings

V, D = 16, 4


def drafter(num_masks: int, block_complexity: int, tree: str = "dynamic", branches=None, expansion: str = "top1",
            **mask) -> ESPDrafter:
    table = torch.arange(V * D, dtype=torch.float32).reshape(V, D)
    model = MaskModel(embed=lambda ids: table[ids], logits=lambda h: h, embedding_table=table)
    return ESPDrafter(model, MaskSettings(num_masks=num_masks, **mask), block_complexity, tree=tree, branches=branches,
                      expansion=expansion)


def proposed_tree(d: ESPDrafter, root: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor, n: int):
    """The tree ESP proposes with at most n nodes from known candidates lp, ids [1, k, C] under `root` [1]."""
    view = RowsView(torch.stack([root, root], 1), torch.tensor([2]), torch.ones(1, dtype=torch.long), [0], ESPState(),
                    known_root=root)
    view.state.update(cand_lp=lp, cand_ids=ids, m=torch.zeros(1, 1, D), m_len=torch.tensor([2]),
                      has_probe=torch.ones(1, dtype=torch.bool))
    return d.propose(view, PassPlan(n)).tree


def cands(rows):
    """rows: per depth a list of (token, prob) sorted by prob -> cand_lp, cand_ids [1, k, C]."""
    c = max(len(r) for r in rows)
    lp = torch.full((1, len(rows), c), float("-inf"))
    ids = torch.zeros((1, len(rows), c), dtype=torch.long)
    for d, r in enumerate(rows):
        for j, (t, p) in enumerate(r):
            lp[0, d, j], ids[0, d, j] = math.log(p), t
    return lp, ids


def test_topk_excluding_replaces_parent_token():
    lp = torch.tensor([[-0.1, -0.5, -1.0]])
    ids = torch.tensor([[7, 3, 9]])
    out_lp, out_ids = topk_excluding(lp, ids, torch.tensor([7]), 2)
    assert out_ids.tolist() == [[3, 9]] and out_lp.tolist() == [[-0.5, -1.0]]
    assert topk_excluding(lp, ids, None, 2)[1].tolist() == [[7, 3]]


def observed(d: ESPDrafter, root: int, rows):
    """The candidates ESP's observe keeps after a pass that committed `root` (the next tree's root), from mask
    logits log(p) per (token, p) of each depth (every other token far below): cand_lp, cand_ids [1, k, C]."""
    logits = torch.full((1, len(rows), V), -30.0)
    for j, r in enumerate(rows):
        for t, p in r:
            logits[0, j, t] = math.log(p)
    view = RowsView(torch.tensor([[0, root]]), torch.tensor([2]), torch.ones(1, dtype=torch.long), [0], ESPState())
    view.state.update(m=torch.zeros(1, 1, D), m_len=torch.tensor([1]), has_probe=torch.zeros(1, dtype=torch.bool))
    d.observe(view, PassRecord(torch.tensor([[root]]), torch.tensor([1]), None, logits))  # logits: identity head
    return view.state.cand_lp, view.state.cand_ids


def test_static_tree_top1_expansion_with_pruning():
    d = drafter(num_masks=2, block_complexity=3 * 4, tree="static", branches=[2, 1], prune=True)
    lp, ids = observed(d, 5, [[(5, 0.5), (6, 0.3), (7, 0.1)], [(6, 0.6), (9, 0.2), (5, 0.1)]])
    # the root's token never becomes a depth-1 candidate; deeper it may (it is not their parent)
    assert 5 not in ids[0, 0].tolist() and ids[0, 0, :2].tolist() == [6, 7] and 5 in ids[0, 1].tolist()
    tree = proposed_tree(d, torch.tensor([5]), lp, ids, d.num_nodes)  # root token 5 is pruned at depth 1
    assert tree.tokens.tolist() == [[5, 6, 7, 9]]  # depth-2 child of 6 skips 6
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.valid.all()


def test_dynamic_tree_top1_by_cumulative_probability():
    # budget B = BC/(k+1) = 4 slots -> 3 nodes. depth1: a .5, b .3, c .2; depth2 under a: x .9, y .1
    d = drafter(num_masks=2, block_complexity=12, tree="dynamic", expansion="top1", prune=False)
    lp, ids = cands([[(1, 0.5), (2, 0.3), (3, 0.2), (4, 0.0001)], [(8, 0.9), (9, 0.1), (10, 0.0001), (11, 0.00001)]])
    tree = proposed_tree(d, torch.tensor([0]), lp, ids, d.num_nodes)
    # scores: a .5, b .3, c .2, a->x .45, a->y .05 -> keep a, x(.45), b(.3) in topological order
    assert tree.tokens.tolist() == [[0, 1, 2, 8]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]


def test_dynamic_tree_frontier_expands_several_parents():
    d = drafter(num_masks=2, block_complexity=15, tree="dynamic", expansion="frontier", prune=False)  # 5 slots
    lp, ids = cands([[(1, 0.4), (2, 0.4), (3, 0.2), (4, 0.001), (5, 0.001)], [(8, 0.9), (9, 0.1), (10, 0.001), (11, 0.001), (12, 0.001)]])
    tree = proposed_tree(d, torch.tensor([0]), lp, ids, d.num_nodes)
    # a .4, b .4, a->x .36, b->x .36, c .2 -> 4 nodes: a, b, a->x, b->x
    assert tree.tokens.tolist() == [[0, 1, 2, 8, 8]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    # with top-1 expansion only a expands: a, b, a->x, c
    d1 = drafter(num_masks=2, block_complexity=15, tree="dynamic", expansion="top1", prune=False)
    t1 = proposed_tree(d1, torch.tensor([0]), lp, ids, d1.num_nodes)
    assert t1.tokens.tolist() == [[0, 1, 2, 3, 8]]
    assert t1.parents.tolist() == [[-1, 0, 0, 0, 1]]


def test_dynamic_tree_pruning_skips_root_token():
    probs = [[(3, 0.6), (4, 0.3), (5, 0.1)]]
    d = drafter(num_masks=1, block_complexity=6, tree="dynamic", prune=True)  # 3 slots -> 2 nodes
    assert proposed_tree(d, torch.tensor([3]), *observed(d, 3, probs), d.num_nodes).tokens.tolist() == [[3, 4, 5]]
    d = drafter(num_masks=1, block_complexity=6, tree="dynamic", prune=False)
    assert proposed_tree(d, torch.tensor([3]), *observed(d, 3, probs), d.num_nodes).tokens.tolist() == [[3, 3, 4]]


def test_ema_update_per_committed_token_in_order():
    """After a pass, m has moved toward each committed token in order; after plain passes (no masks) the
    update waits and is replayed from the history when masks are fed again, with the same result."""
    lam = 0.1
    table = torch.arange(V * D, dtype=torch.float32).reshape(V, D)
    m0 = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    # row 0 committed [3, 5, 7] after a 1-token prompt, row 1 committed [2]
    hist = torch.tensor([[9, 3, 5, 7], [9, 2, 0, 0]])
    hist_len = torch.tensor([4, 2])
    expected = []
    for r, toks in enumerate([[3, 5, 7], [2]]):
        m = m0[r].clone()
        for t in toks:
            m = m + lam * (table[t] - m)
        expected.append(m)
    mask_hidden = torch.zeros((2, 1, V))
    for plain_first in (False, True):
        d = drafter(num_masks=1, block_complexity=10, ema_lambda=lam)
        view = RowsView(hist, hist_len, torch.ones(2, dtype=torch.long), [0, 0], ESPState())
        view.state.update(m=m0.clone().unsqueeze(1), m_len=torch.ones(2, dtype=torch.long), has_probe=torch.zeros(2, dtype=torch.bool))
        if plain_first:  # a plain pass defers the update; the next mask pass applies it
            d.observe(view, PassRecord(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long), None, None))
            assert torch.equal(view.state.m, m0.unsqueeze(1))
        # this pass's tokens as the engine passes them (hist[:, 1:4], valid up to [3, 1]): m was up to date before
        # it (without a plain pass first), so they are applied as they are
        d.observe(view, PassRecord(hist[:, 1:], torch.tensor([3, 1]), None, mask_hidden))
        for r in range(2):
            assert torch.allclose(view.state.m[r], expected[r], atol=1e-5)
        assert view.state.m_len.tolist() == [4, 2]


def test_ema_replays_long_gaps_and_short_ones_after_them():
    """A gap longer than the weight table built so far (after many plain passes) grows it; shorter gaps after
    it use the same table. m equals the token-by-token EMA in float64 each time."""
    lam = 0.1
    table = torch.arange(V * D, dtype=torch.float64).reshape(V, D) / (V * D)
    hist = torch.tensor([[3] + [(7 * i) % V for i in range(1, 60)]])
    d = drafter(num_masks=1, block_complexity=10, ema_lambda=lam)
    d.probe.embed = lambda ids: table.float()[ids]
    m0 = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    view = RowsView(hist, torch.tensor([1]), torch.ones(1, dtype=torch.long), [0], ESPState())
    view.state.update(m=m0.clone().unsqueeze(1), m_len=torch.ones(1, dtype=torch.long), has_probe=torch.zeros(1, dtype=torch.bool))
    ref = m0[0].double()
    seen = 1
    for length in (38, 41, 42, 59):  # gaps 37 (a table of 64), 3, 1, 17
        view = RowsView(hist, torch.tensor([length]), torch.ones(1, dtype=torch.long), [0], view.state)
        d.observe(view, PassRecord(hist[:, seen:length], torch.tensor([length - seen]), None, torch.zeros((1, 1, V))))
        for t in hist[0, seen:length].tolist():
            ref = ref + lam * (table[t] - ref)
        seen = length
        assert torch.allclose(view.state.m[0].double(), ref, atol=1e-5), (length, view.state.m, ref)
        assert view.state.m_len.tolist() == [length]


def test_ema_owed_for_longer_than_its_window_or_table_replays_in_bounded_work(monkeypatch):
    """A host bound far above what any row owes (it outlives the rows it was counted for) costs no more than
    the history, a gap longer than the EMA's window starts from the window (older tokens weigh < 2^-40), and a
    window wider than the largest table is replayed in chunks: m equals the token-by-token EMA in float64, and
    the weight table never grows past EMA_TABLE_MAX."""
    from esp_worker.drafters import mask_probe
    monkeypatch.setattr(mask_probe, "EMA_TABLE_MAX", 16)
    table = torch.arange(V * D, dtype=torch.float64).reshape(V, D) / (V * D)
    hist = torch.tensor([[3] + [(7 * i + i * i) % V for i in range(1, 300)], [5] + [(3 * i) % V for i in range(1, 300)]])
    for lam, lengths in ((0.5, (30, 200, 230)), (0.05, (90, 300))):  # windows 40 and 541 tokens
        d = drafter(num_masks=1, block_complexity=10, ema_lambda=lam)
        d.probe.embed = lambda ids: table.float()[ids]
        m0 = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 0.0, -2.0, 3.0]])
        state = ESPState()
        state.update(m=m0.clone().unsqueeze(1), m_len=torch.tensor([1, 1]), has_probe=torch.zeros(2, dtype=torch.bool))
        ref = [m0[r].double() for r in range(2)]
        seen = [1, 1]
        for step, length in enumerate(lengths):
            lens = torch.tensor([length, length - 10 * step])  # row 1 owes less than row 0
            view = RowsView(hist, lens, torch.ones(2, dtype=torch.long), [0, 0], state)
            d.probe.catch_up(view, 10_000)  # a bound far above every gap
            for r in range(2):
                for t in hist[r, seen[r]: lens[r]].tolist():
                    ref[r] = ref[r] + lam * (table[t] - ref[r])
                seen[r] = int(lens[r])
                assert torch.allclose(state.m[r].double(), ref[r], atol=1e-5), (lam, length, r, state.m[r], ref[r])
            assert state.m_len.tolist() == lens.tolist()
            assert d.probe.ema_table_size <= 16


def test_ema_lambda_zero_freezes_mask():
    d = drafter(num_masks=1, block_complexity=10, ema_lambda=0.0)
    view = RowsView(torch.tensor([[1, 3, 0, 0]]), torch.tensor([2]), torch.ones(1, dtype=torch.long), [0], ESPState())
    view.state.update(m=torch.ones((1, 1, D)), m_len=torch.ones(1, dtype=torch.long), has_probe=torch.zeros(1, dtype=torch.bool))
    d.observe(view, PassRecord(torch.tensor([[3]]), torch.tensor([1]), None, torch.zeros((1, 1, V))))
    assert torch.equal(view.state.m, torch.ones((1, 1, D)))


def test_mask_inits():
    hist = torch.tensor([[1, 2, 3, 0]])
    view = lambda: RowsView(hist, torch.tensor([3]), torch.tensor([3]), [5], ESPState())
    table = torch.arange(V * D, dtype=torch.float32).reshape(V, D)
    v = view()
    drafter(num_masks=1, block_complexity=10, mask_init="mean").start_rows(v)
    assert torch.allclose(v.state.m[0], table[[1, 2, 3]].mean(0))
    v = view()
    drafter(num_masks=1, block_complexity=10, mask_init="last_k", mask_init_last_k=2).start_rows(v)
    assert torch.allclose(v.state.m[0], table[[2, 3]].mean(0))
    v = view()
    drafter(num_masks=1, block_complexity=10, mask_init="offset", mask_init_offset=5.0).start_rows(v)
    assert torch.allclose(v.state.m[0], table.mean(0) + 5 * table.std(0))
    v1, v2 = view(), view()
    drafter(num_masks=1, block_complexity=10, mask_init="sample").start_rows(v1)
    drafter(num_masks=1, block_complexity=10, mask_init="sample").start_rows(v2)
    assert torch.equal(v1.state.m, v2.state.m)  # seeded per request


def test_probe_candidates_rank_by_logits_and_exclude_the_root():
    """The probe's candidates: each mask's best tokens by logit with their log-probabilities, mask 1 never holding
    the root's own token (pruning), padded with NEG past a small vocabulary; the replayed pass's probe function
    builds the static tree from them exactly as the eager drafter does."""
    from esp_worker.drafters.common import NEG
    from esp_worker.drafters.esp import ProbeSpec, probe_tree, static_tree_tokens
    from esp_worker.drafters.mask_probe import probe_candidates

    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50)
    root = logits[:, 0].argmax(-1)  # the best token at mask 1 is the root's own: pruned
    lp, ids = probe_candidates(logits.clone(), root, 6, prune=True)
    full = torch.log_softmax(logits, -1)
    assert (ids[:, 0] != root[:, None]).all()
    assert torch.equal(ids[:, 1], full[:, 1].topk(6).indices)  # mask 2: no pruning
    assert torch.allclose(lp, full.gather(2, ids), atol=1e-6)
    assert (lp.diff(dim=-1) <= 0).all()
    small_lp, small_ids = probe_candidates(torch.randn(3, 1, 4), root % 4, 6, prune=False)
    assert small_lp.shape == (3, 1, 6) and (small_lp[..., 4:] == NEG).all() and (small_ids[..., 4:] == 0).all()

    c_lp, c_ids, tokens, valid = probe_tree(logits.clone(), root, ProbeSpec(6, True, (3, 2), 2))
    assert torch.equal(c_lp, lp) and torch.equal(c_ids, ids)
    t_ref, v_ref = static_tree_tokens(root, lp, ids, [3, 2], prune=True)
    assert torch.equal(tokens, t_ref) and torch.equal(valid, v_ref) and tokens.shape == (3, 6)
