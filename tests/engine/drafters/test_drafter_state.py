"""Typed per-row drafter state: rows move with the batch, widths pad with each field's fill, typos raise."""
from __future__ import annotations

import pytest
import torch

from esp_worker.drafters.hybrid import HybridState
from esp_worker.drafters.stand import StandState
from esp_worker.row_state import RowState

NEG = float("-inf")


def test_select_keeps_rows_in_order_and_leaves_unset_fields_alone():
    st = StandState(store_ids=torch.tensor([[[1]], [[2]], [[3]]]), store_lp=torch.zeros(3, 1, 1))
    st.select(torch.tensor([2, 0]))
    assert st.store_ids.flatten().tolist() == [3, 1] and st.store_lp.shape == (2, 1, 1)
    hybrid = HybridState()
    hybrid.select(torch.tensor([0]))  # nothing set yet: nothing to move
    assert hybrid.tensors() == {}


def test_extend_pads_each_field_with_its_own_fill():
    a = StandState(store_ids=torch.ones(1, 2, 1, dtype=torch.long), store_lp=torch.zeros(1, 2, 1))
    b = StandState(store_ids=torch.ones(1, 3, 1, dtype=torch.long), store_lp=torch.zeros(1, 3, 1))
    a.extend(b)
    assert a.store_ids[:, :, 0].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert a.store_lp[:, :, 0].tolist() == [[0.0, 0.0, NEG], [0.0, 0.0, 0.0]]  # "no candidate", not log-prob 0


def test_unknown_fields_and_one_sided_joins_raise():
    st = HybridState()
    st.m = torch.zeros(1, 4)
    st.store_ids = torch.zeros(1, 2, 1)  # a hybrid keeps ESP's and STAND's fields
    with pytest.raises(AttributeError, match="has no field 'store_idz'"):
        st.store_idz = torch.zeros(1)
    with pytest.raises(AttributeError):
        RowState().m = torch.zeros(1)
    with pytest.raises(ValueError, match="one side"):
        st.extend(HybridState(m=torch.zeros(1, 4)))


def test_memo_computes_once_per_key_until_cleared():
    from esp_worker.drafters.common import Memo

    made = []
    memo: Memo[int] = Memo()
    make = lambda v: lambda: made.append(v) or v  # noqa: E731
    assert memo.get((1, False), make(10)) == 10 and memo.get((1, False), make(11)) == 10
    assert memo.get((1, True), make(12)) == 12  # another key: computed anew
    memo.clear()
    assert memo.get((1, True), make(13)) == 13 and made == [10, 12, 13]


def test_a_lookup_serves_the_look_and_the_propose_of_one_state_of_the_rows(monkeypatch):
    """Prompt lookup's match is found once per state of the rows (`RowsView.version`): the policy's look
    (draft_mass) and the pass's propose share it; rows in another state (a commit) get their own."""
    from esp_worker.drafters import pld
    from esp_worker.drafters.base import RowsView
    from esp_worker.passes import PassPlan

    calls = []
    found = pld.find_continuation
    monkeypatch.setattr(pld, "find_continuation", lambda *a: calls.append(1) or found(*a))
    d = pld.PromptLookupDrafter(max_ngram=2, min_ngram=1, depth=3)
    d.mass_wanted = True
    hist, length = torch.tensor([[5, 6, 7, 8, 5, 6, 0]]), torch.tensor([6])
    view = RowsView(hist, length, torch.tensor([1]), [0])
    d.draft_mass(view)
    assert d.propose(view, PassPlan(3)).tree.tokens.tolist() == [[6, 7, 8, 5]] and len(calls) == 1
    hist[0, 6] = 7  # committed: a new state of the rows (the engine makes a new version with every commit)
    after = RowsView(hist, torch.tensor([7]), torch.tensor([1]), [0])
    assert d.propose(after, PassPlan(3)).tree.tokens.tolist() == [[7, 8, 5, 6]] and len(calls) == 2


def test_candidate_pool_best_tree_and_mass():
    """A pool's best tree keeps its most probable entries as a tree; its mass is their probabilities, best first,
    0 for rows that cannot use the pool and past the pool's end."""
    import math

    from esp_worker.drafters.common import CandidatePool

    lp = [math.log(x) for x in (0.6, 0.3, 0.5 * 0.6, 0.1)]  # entry 2 is entry 0's child
    pool = CandidatePool(torch.tensor([lp, [NEG, NEG, NEG, NEG]]), torch.tensor([[4, 5, 6, 7]] * 2),
                         torch.tensor([[-1, -1, 0, -1]] * 2))
    tree = pool.best_tree(torch.tensor([9, 9]), 3)
    assert tree.tokens[0].tolist() == [9, 4, 5, 6] and tree.parents[0].tolist() == [-1, 0, 0, 1]
    assert tree.valid.tolist() == [[True] * 4, [True, False, False, False]]  # a row with no candidate: root only
    mass = pool.top_mass(6, torch.tensor([True, True]))
    assert [round(x, 4) for x in mass[0].tolist()] == [0.6, 0.3, 0.3, 0.1, 0.0, 0.0] and mass[1].sum() == 0
    assert pool.top_mass(2, torch.tensor([False, True]))[0].tolist() == [0.0, 0.0]
