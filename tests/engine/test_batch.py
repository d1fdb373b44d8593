"""Per-row statistics counters (Rows.count on the device, finish_stats on the host at retire)."""
import types

import torch

from esp_worker.batch import STAT_WIDTH, Rows, RowTensors, finish_stats, new_counters
from esp_worker.types import RequestStats


def rows_with(counters) -> Rows:
    return Rows(seqs=[], t=RowTensors(**counters), state=None, uniforms=None, cache=None)


def test_counters_give_the_request_statistics():
    rows = rows_with(new_counters(2, torch.device("cpu"), num_proposers=3))
    passes = [  # (n_fin, n_raw, drafted, max_committed, source, path_slots)
        ([3, 1], [3, 1], [4, 4], 5, torch.tensor([[-1, 0, 0, 2, 1]]), torch.tensor([[0, 1, 3, 0, 0], [0, 2, 1, 0, 0]])),
        ([2, 4], [4, 4], [9, 9], 5, torch.tensor([[0], [2]]), torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 3, 0]])),
        ([1, 1], [1, 1], [0, 0], 1, None, None),
    ]
    for n_fin, n_raw, drafted, top, source, path in passes:
        rows.count(torch.tensor(n_fin), torch.tensor(n_raw), torch.tensor(drafted), top, source, path)
    t = rows.t
    st = [RequestStats(), RequestStats()]
    for r in range(2):
        finish_stats(st[r], t.drafted[r].tolist(), t.hists[r].tolist(), 7, 3, {})
    # row 0 kept 2, 2 (a stop cut its 3 accepted drafts at 2 tokens), 0 drafts; row 1 kept 0, 3, 0
    assert [s.num_accepted_drafts for s in st] == [4, 3]
    assert st[0].accepted_per_depth == [2, 2] and st[1].accepted_per_depth == [1, 1, 1]
    assert st[0].committed_histogram == [0, 1, 1, 1] and st[1].committed_histogram == [0, 2, 0, 0, 1]
    assert [s.num_drafted_tokens for s in st] == [13, 13]
    assert [s.num_drafts for s in st] == [2, 2]  # the third pass fed no draft token (vLLM's num_drafts)
    # accepted drafts by proposer: row 0's path slots 1, 3 (proposers 0, 2) then a chain of proposer 0 (2 kept);
    # row 1 nothing, then a chain of proposer 2 (3 kept)
    assert t.accepted_by.tolist() == [[3, 0, 1], [0, 0, 3]]


def test_counters_widen_for_deeper_blocks_and_keep_their_counts():
    rows = rows_with(new_counters(1, torch.device("cpu")))
    rows.count(torch.tensor([2]), torch.tensor([3]), torch.tensor([2]), 3)  # a stop cut 3 tokens at 2
    deep = STAT_WIDTH + 5
    rows.count(torch.tensor([deep]), torch.tensor([deep]), torch.tensor([deep]), deep)
    st = RequestStats()
    finish_stats(st, rows.t.drafted[0].tolist(), rows.t.hists[0].tolist(), deep + 3, 2, {})
    assert st.num_accepted_drafts == 2 + deep - 1 and st.accepted_per_depth == [2, 2] + [1] * (deep - 3)
    assert st.committed_histogram == [0, 0, 1] + [0] * (deep - 3) + [1]


def test_rows_of_different_counter_widths_join_with_their_counts():
    """A batch whose counters widened for a deep block takes new rows at the narrow width: the joined rows
    keep every count at its (n_raw, n_fin) pair."""
    for wide_first in (True, False):
        wide = rows_with(new_counters(1, torch.device("cpu")))
        wide.count(torch.tensor([STAT_WIDTH + 1]), torch.tensor([STAT_WIDTH + 1]), None, STAT_WIDTH + 1)
        narrow = rows_with(new_counters(1, torch.device("cpu")))
        narrow.count(torch.tensor([2]), torch.tensor([3]), None, 3)
        a, b, r = (wide, narrow, 1) if wide_first else (narrow, wide, 0)
        a.t.extend(b.t)
        joined = a.t.hists
        st = [RequestStats(), RequestStats()]
        for i in range(2):
            finish_stats(st[i], [0, 0], joined[i].tolist(), 3, 1, {})
        assert st[r].committed_histogram == [0, 0, 1] and st[r].num_accepted_drafts == 2
        assert st[1 - r].committed_histogram == [0] * (STAT_WIDTH + 1) + [1]


def test_root_only_tree_with_a_row_source_counts_nothing():
    """A [B, 1] source of a root-only tree is the root's -1: no draft was kept, and the scatter must not index -1."""
    rows = rows_with(new_counters(2, torch.device("cpu"), num_proposers=2))
    rows.count(torch.tensor([1, 1]), torch.tensor([1, 1]), torch.tensor([0, 0]), 1,
               torch.tensor([[-1], [-1]]), torch.tensor([[0], [0]]))
    assert rows.t.accepted_by.tolist() == [[0, 0], [0, 0]]


def _rows(hist, hist_len, prompt_len) -> Rows:
    from esp_worker.row_state import RowState

    t = RowTensors(hist=torch.tensor(hist), hist_len=torch.tensor(hist_len), prompt_len=torch.tensor(prompt_len))
    return Rows(seqs=[], t=t, state=RowState(), uniforms=None, cache=None, reason=torch.zeros(len(hist_len)))


def test_rows_view_reads_the_roots_from_the_history_unless_a_commit_gave_them():
    rows = _rows([[5, 6, 7, 0], [1, 2, 0, 0]], [3, 2], [2, 1])
    assert rows.view().root.tolist() == [7, 2]
    rows.t.hist.scatter_(1, torch.tensor([[3], [2]]), torch.tensor([[8], [9]]))  # a commit: tokens, then lengths
    known = torch.tensor([8, 9])
    rows.advance(rows.t.hist_len + 1, known, torch.zeros(2, dtype=torch.long))
    assert rows.view().root is known
    rows.advance(rows.t.hist_len, None, torch.zeros(2, dtype=torch.long))  # a commit without them (sampling)
    assert rows.view().root.tolist() == [8, 9]
    rows.hints = [0, -1]  # a host read brings new hints
    assert rows.view().hints == [0, -1]


def test_known_roots_follow_the_rows_that_stay():
    rows = _rows([[5, 6, 7, 0], [1, 2, 0, 0], [3, 4, 0, 0]], [3, 2, 2], [2, 1, 1])
    rows.seqs, rows.lens, rows.limits, rows.done = [types.SimpleNamespace(seed=0)] * 3, [3, 2, 2], [9, 9, 9], [0, 1, 0]
    rows.uniforms = _NoStreams()
    rows.cache = _NoCache()
    rows.roots = torch.tensor([7, 2, 4])
    rows.drop([1])
    assert rows.roots.tolist() == [7, 4] and rows.view().root.tolist() == [7, 4]


class _NoStreams:
    def select(self, rows, keep):
        pass


class _NoCache:
    def select_rows(self, keep):
        pass


def test_common_length_follows_the_host_lengths():
    rows = rows_with({})
    rows.lens = [5, 5, 5]
    assert rows.common_length() == 5
    rows.lens = [5, 6]  # a host read replaces the list
    assert rows.common_length() is None
    rows.lens = [7]
    assert rows.common_length() == 7
    rows.lens_exact = False  # bounds while a drafting pass runs ahead of its read: never one known length
    assert rows.common_length() is None


def test_a_pass_counts_nothing_in_rows_it_does_not_count_for():
    """A pass run ahead over a row the pass before ended (live False) adds no pass and no drafts there."""
    rows = rows_with(new_counters(2, torch.device("cpu"), num_proposers=2))
    live = torch.tensor([True, False])
    rows.count(torch.tensor([3, 0]), torch.tensor([3, 2]), torch.tensor([4, 4]), 4, torch.tensor([[0], [1]]),
               torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), live)
    t = rows.t
    assert t.drafted.tolist() == [[4, 1], [0, 0]] and t.hists[1].sum() == 0 and t.hists[0].sum() == 1
    assert t.accepted_by.tolist() == [[2, 0], [0, 0]]
