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
