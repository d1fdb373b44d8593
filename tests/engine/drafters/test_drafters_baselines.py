"""STAND and LADE: greedy == model.generate on every tiny architecture, plus table tests of their parts."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, reference, run, tiny
from esp_worker.passes import PassPlan
from esp_worker import EngineConfig, GenerationParams
from esp_worker.passes import PassRecord, RowsView
from esp_worker.config import lade_sizes
from esp_worker.drafters.lade import LadeState, LookaheadDrafter, ngram_trie, window_layout
from esp_worker.drafters.stand import StandDrafter, StandState

GREEDY = GenerationParams(max_new_tokens=64)


# ---- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,bc,batch", [("stand", 30, 1), ("stand", 60, 4), ("lade", 10, 4), ("lade", 30, 1), ("lade", 60, 4)])
def test_matches_generate(arch, method, bc, batch):
    lm = tiny(arch)
    outs = run(lm, EngineConfig(method=method, block_complexity=bc, max_batch_size=batch), GREEDY)
    for o, r in zip(outs, reference(arch, "sdpa")):
        assert o.error is None, o.error
        assert tuple(o.token_ids) == r, f"{method} BC {bc} {arch} batch {batch}: diverged from generate"


def test_stand_and_lade_accept_drafts_on_repetitive_text():
    """The repeated sentence in the prompts is copied: both methods accept something."""
    lm = tiny("llama")
    for method in ("stand", "lade"):
        outs = run(lm, EngineConfig(method=method, block_complexity=30, max_batch_size=4), GREEDY)
        assert sum(o.stats.num_accepted_drafts for o in outs) > 0, method


def test_prompt_lookup_keeps_its_acceptance_rates_only_for_auto():
    """The per-depth rates only feed draft_mass (block_complexity=auto): a fixed block size skips them (the
    same tokens either way); with `auto` they count the chains offered."""
    from esp_worker import Engine, Request
    from esp_worker.auto.cost_model import CostCurve

    lm = tiny("llama")
    reqs = lambda: [Request(id=str(i), prompt=p, params=GREEDY) for i, p in enumerate(PROMPTS)]  # noqa: E731
    fixed = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=4))
    outs = fixed.generate(reqs())
    assert not fixed.drafter.mass_wanted and float(fixed.drafter.reached.sum()) == 0.0
    blocks = [1, 2, 4, 8, 16]
    curve = CostCurve([1, 8], [64, 512], blocks, [[[1.0 + 0.001 * q for q in blocks]] * 2] * 2)  # drafting is cheap
    auto = Engine(lm, EngineConfig(method="pld", block_complexity="auto", auto_max_block=16, max_batch_size=4),
                  cost_curve=curve)
    assert [o.token_ids for o in auto.generate(reqs())] == [o.token_ids for o in outs]
    assert auto.drafter.mass_wanted and float(auto.drafter.reached.sum()) > 0.0


# ---- LADE parts -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bc,sizes", [(10, (3, 4, 1)), (30, (4, 5, 5)), (60, (5, 8, 7)), (20, (3, 5, 5)), (45, (4, 8, 7)), (120, (5, 15, 15))]
)
def test_lade_sizes(bc, sizes):
    n, w, g = lade_sizes(bc)
    assert (n, w, g) == sizes
    assert (n - 1) * (w + g) <= bc


def test_lade_sizes_too_small():
    with pytest.raises(ValueError, match="too small"):
        lade_sizes(3)


def test_window_layout():
    vis, pos = window_layout(2, 2)  # order (0,0) (0,1) (1,0) (1,1)
    assert pos.tolist() == [0, 1, 1, 2]
    assert vis.int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]


@pytest.mark.parametrize(
    "cands,ok,tokens,parents,valid",
    [
        # shared first token merges; distinct second tokens become siblings; T = 1 + G * L, the rest padding
        ([[7, 8], [7, 9], [5, 6]], [1, 1, 1], [9, 7, 5, 8, 9, 6, 0], [-1, 0, 0, 1, 1, 2, 0], [1] * 6 + [0]),
        # identical n-grams collapse to one chain
        ([[4, 4], [4, 4]], [1, 1], [9, 4, 4, 0, 0], [-1, 0, 1, 0, 0], [1, 1, 1, 0, 0]),
        # candidates that are not ok are dropped
        ([[1, 2], [3, 4]], [0, 1], [9, 3, 4, 0, 0], [-1, 0, 1, 0, 0], [1, 1, 1, 0, 0]),
        # no candidate: the root and padding
        ([[1, 2]], [0], [9, 0, 0], [-1, 0, 0], [1, 0, 0]),
    ],
)
def test_ngram_trie(cands, ok, tokens, parents, valid):
    tree = ngram_trie(torch.tensor([9]), torch.tensor([cands]), torch.tensor([ok], dtype=torch.bool))
    assert tree.tokens[0].tolist() == tokens
    assert tree.parents[0].tolist() == parents
    assert tree.valid[0].int().tolist() == valid


def test_ngram_trie_pads_rows_to_one_shape():
    cands = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [1, 2]]])
    tree = ngram_trie(torch.tensor([9, 9]), cands, torch.ones(2, 2, dtype=torch.bool))
    assert tree.tokens.tolist() == [[9, 1, 3, 2, 4], [9, 1, 2, 0, 0]]
    assert tree.valid.int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert tree.parents[1, :3].tolist() == [-1, 0, 1]


def _pool_state(pool_size: int, n: int, passes: int = 0) -> LadeState:
    return LadeState(
        pool=torch.zeros((1, pool_size, n), dtype=torch.long),
        seen=torch.full((1, pool_size), -1, dtype=torch.long),
        passes=torch.tensor([passes]),
    )


def test_pool_insert_dedupes_and_evicts_least_recent():
    st = _pool_state(pool_size=3, n=2)
    LookaheadDrafter.insert(st, torch.tensor([[[1, 2], [1, 2], [3, 4]]]), torch.ones(1, 3, dtype=torch.bool))
    assert sorted(map(tuple, st.pool[0][st.seen[0] >= 0].tolist())) == [(1, 2), (3, 4)]
    # seen again at pass 1: (1, 2) refreshed, (5, 6) fills the empty entry, (7, 8) evicts (3, 4)
    st.passes = torch.tensor([1])
    LookaheadDrafter.insert(st, torch.tensor([[[1, 2], [5, 6], [7, 8]]]), torch.ones(1, 3, dtype=torch.bool))
    entries = {tuple(g): s for g, s in zip(st.pool[0].tolist(), st.seen[0].tolist())}
    assert entries == {(1, 2): 3, (5, 6): 4, (7, 8): 5}


def test_pool_insert_skips_not_ok():
    st = _pool_state(pool_size=4, n=3)
    LookaheadDrafter.insert(st, torch.tensor([[[1, 2, 3], [4, 5, 6]]]), torch.tensor([[False, True]]))
    assert st.pool[0][st.seen[0] >= 0].tolist() == [[4, 5, 6]]


def test_lade_proposes_most_recent_ngrams_for_the_root():
    d = LookaheadDrafter(lambda ids: torch.zeros(*ids.shape, 4), None, ngram=3, window=2, guess=2, pool_size=8)
    hist = torch.tensor([[5, 6, 7]])
    view = RowsView(hist, torch.tensor([3]), torch.tensor([3]), [0], LadeState())
    d.start_rows(view)
    st = view.state
    st.pool[0, :3] = torch.tensor([[7, 1, 2], [7, 3, 4], [7, 5, 6]])
    st.seen[0, :3] = torch.tensor([0, 2, 1])
    block = d.propose(view)
    # (7, 3, 4) and (7, 5, 6) are the two most recent with key 7 = root
    assert block.tree.tokens[0].tolist() == [7, 3, 5, 4, 6]
    assert block.tree.parents[0].tolist() == [-1, 0, 0, 1, 2]
    t, a = 5, 3  # tree slots, window tokens after the root
    assert block.aux_embeds.shape == (1, a, 4)
    assert block.layout.visible.shape == (1, t + a, t + a)
    assert block.layout.rel_pos[0].tolist() == [0, 1, 1, 2, 2, 1, 1, 2]
    assert not block.layout.visible[0, :t, t:].any() and not block.layout.visible[0, t:, 1:t].any()


# ---- STAND parts ------------------------------------------------------------------------------------
def _stand_view(hist: list[int], prompt_len: int) -> RowsView:
    h = torch.tensor([hist])
    return RowsView(h, torch.tensor([len(hist)]), torch.tensor([prompt_len]), [0], StandState())


def test_stand_store_one_hot_for_prompt():
    d = StandDrafter(num_nodes=9, depth=10, topk=3, max_ngram=3, min_ngram=1)
    view = _stand_view([5, 6, 7], 3)
    d.start_rows(view)
    assert view.state.store_ids[0, :2, 0].tolist() == [6, 7]
    assert view.state.store_lp[0, :2, 0].tolist() == [0.0, 0.0]
    assert view.state.store_lp[0, 2].tolist() == [float("-inf")] * 3  # no next token yet


@pytest.mark.parametrize(
    "num_nodes,tokens,parents",
    [
        # BC 4: the chain only (as pld): after [5 6 7 8 5 6 | 7] the match at 0 gives chain 7, 8, 5 ...
        (3, [6, 7, 8, 5], [-1, 0, 1, 2]),
        # a larger budget adds the stored alternatives after the chain (position 2's top-2: 8 then 9)
        (6, [6, 7, 8, 9, 5, 6, 3], [-1, 0, 1, 1, 2, 4, 4]),
    ],
)
def test_stand_tree_chain_then_branches(num_nodes, tokens, parents):
    d = StandDrafter(num_nodes=num_nodes, depth=4, topk=2, max_ngram=2, min_ngram=1)
    view = _stand_view([5, 6, 7, 8, 5, 6], 6)
    d.start_rows(view)
    # the model saw [8 (p 0.6), 9 (p 0.3)] after position 2 and [6 (p 0.5), 3 (p 0.1)] after position 4
    st = view.state
    st.store_ids[0, 2] = torch.tensor([8, 9])
    st.store_lp[0, 2] = torch.tensor([0.6, 0.3]).log()
    st.store_ids[0, 4] = torch.tensor([6, 3])
    st.store_lp[0, 4] = torch.tensor([0.5, 0.1]).log()
    tree = d.propose(view).tree
    assert tree.tokens[0].tolist() == tokens
    assert tree.parents[0].tolist() == parents
    assert tree.valid[0].all()


def test_stand_observe_stores_topk_along_the_accepted_path():
    d = StandDrafter(num_nodes=4, depth=4, topk=2, max_ngram=2, min_ngram=1)
    view = _stand_view([5, 6, 7, 0, 0, 0], 3)
    d.start_rows(view)
    view.hist_len = torch.tensor([5])  # root 7 at 2 + one accepted node at 3 + the bonus at 4
    logits = torch.full((1, 3, 10), -10.0)
    logits[0, 0, 4] = 5.0  # root slot -> 4
    logits[0, 2, 1] = 5.0  # accepted slot 2 -> 1
    logits[0, 2, 2] = 4.0
    res = PassRecord(
        committed=torch.tensor([[4, 1]]), num_committed=torch.tensor([2]), hidden=None, mask_hidden=None,
        slot_logits=logits, path_slots=torch.tensor([[0, 2]]),
    )
    d.observe(view, res)
    assert view.state.store_ids[0, 2].tolist()[0] == 4
    assert view.state.store_ids[0, 3].tolist() == [1, 2]
    assert view.state.store_ids[0, 1, 0].item() == 7  # prompt entries untouched


def test_find_continuation_equals_brute_force():
    """Longest n first, then the latest earlier match; -1 without one (random small histories)."""
    import random

    from esp_worker.drafters.common import find_continuation

    def brute(row: list[int], length: int, max_n: int, min_n: int) -> int:
        for n in range(max_n, min_n - 1, -1):
            if length < n + 1:
                continue
            suffix = row[length - n: length]
            for s in range(length - n - 1, -1, -1):  # the continuation s + n must exist before the end
                if row[s: s + n] == suffix:
                    return s + n
        return -1

    rng = random.Random(0)
    for _ in range(400):
        b, c, v = rng.randint(1, 4), rng.randint(1, 24), rng.randint(2, 5)
        max_n = rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        rows = [[rng.randrange(v) for _ in range(c)] for _ in range(b)]
        lengths = [rng.randint(1, c) for _ in range(b)]
        got = find_continuation(torch.tensor(rows), torch.tensor(lengths), max_n, min_n).tolist()
        assert got == [brute(r, n, max_n, min_n) for r, n in zip(rows, lengths)]


def test_pld_rates_forget_misses_at_depths_no_longer_offered():
    """The auto policy's lock-in: two early misses at depth 3 made every deeper chain look worthless, the
    policy kept to 2-node chains and never saw depth 3 again. The counts of depths not offered decay, and a
    depth's prior is the depth before it, so the chain's mass at depth 3 recovers while depth 1 keeps
    accepting (a fixed prior with per-offered-depth decay left it at 0.27 for good)."""
    from esp_worker.drafters.pld import PromptLookupDrafter

    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, depth=4)
    hist = torch.tensor([[4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5]])
    length = torch.tensor([12])

    def pass_(nodes: int, n_committed: int) -> None:
        view = RowsView(hist, length.clone(), torch.tensor([5]), [0])
        block = d.propose(view, PassPlan(nodes))
        d.observe(view, PassRecord(torch.zeros((1, nodes + 1), dtype=torch.long), torch.tensor([n_committed]), None,
                                   None, block=block))

    for _ in range(2):
        pass_(4, 3)  # depths 1 and 2 accepted, depth 3 missed
    view = RowsView(hist, length.clone(), torch.tensor([5]), [0])
    assert d.rates()[0, 2] < 0.35  # two misses at depth 3
    for _ in range(300):
        pass_(2, 3)  # the policy offers 2-node chains only: both accepted every time
    rates = d.rates()[0]
    assert rates[0] > 0.95 and rates[1] > 0.95
    assert rates[2] > 0.85 and rates[3] > 0.85  # the old misses faded; depths 3-4 follow depth 2's rate
    mass = d.draft_mass(view)[0]
    assert mass[2] > 0.8


def test_pld_rates_equal_the_recurrence():
    from esp_worker.drafters.pld import PromptLookupDrafter

    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, depth=6)
    g = torch.Generator().manual_seed(0)
    d.reached = torch.rand((2, 6), generator=g) * 100
    d.accepted = d.reached * torch.rand((2, 6), generator=g)
    want = torch.zeros(2, 6)
    for s in range(2):
        prev = 0.8
        for i in range(6):
            prev = (float(d.accepted[s, i]) + prev) / (float(d.reached[s, i]) + 1.0)
            want[s, i] = prev
    assert torch.allclose(d.rates(), want, rtol=1e-5)


@pytest.mark.parametrize("inference", [False, True])
def test_prompt_lookup_mass_follows_its_counters(inference):
    """draft_mass reuses the chain rates until the counters change (in place by observe, or replaced): always
    the value computed from the current counters. Also when the counters are inference tensors, as they are
    once start_rows moved them to a GPU under inference mode (they have no version counter: asking for one
    raised on an H200)."""
    from esp_worker.drafters.pld import PromptLookupDrafter

    d = PromptLookupDrafter(max_ngram=3, min_ngram=1, depth=4)
    d.mass_wanted = True
    view = RowsView(torch.tensor([[5, 6, 7, 8, 5, 6]]), torch.tensor([6]), torch.tensor([1]), [0])
    fresh = lambda: d.rates().cumprod(1)[:1]  # noqa: E731  (the row's own chain [7, 8, 5, 6]: 4 valid nodes)
    with torch.inference_mode(inference):
        if inference:
            d.reached, d.accepted = d.reached.clone(), d.accepted.clone()
            assert d.reached.is_inference()
        assert torch.allclose(d.draft_mass(view), fresh())
        before = fresh()
        block = d.propose(view, PassPlan(4))
        d.observe(view, PassRecord(torch.zeros((1, 5), dtype=torch.long), torch.tensor([3]), None, None, block=block))
        assert not torch.allclose(fresh(), before)  # observe changed the counters in place
        assert torch.allclose(d.draft_mass(view), fresh())
        d.accepted = torch.full((2, 4), 2.0)  # replaced
        assert torch.allclose(d.draft_mass(view), fresh())
