"""apply_stops: where each row's committed tokens end, and why (stop id, length, context)."""
import torch

from esp_worker.stops import REASONS, apply_stops, row_limits, stop_table

V = 10  # vocabulary of these tests


def stops(committed, n, stop_ids, hist_len, max_total, max_context=1000):
    limit, code = row_limits(torch.tensor(max_total), max_context)
    n_fin, reason = apply_stops(torch.tensor(committed), torch.tensor(n), stop_table(torch.tensor(stop_ids), V),
                                torch.tensor(hist_len), limit, code)
    return n_fin.tolist(), [REASONS[r] for r in reason.tolist()]


def test_first_stop_id_cuts_after_it():
    assert stops([[5, 9, 7]], [3], [[9]], [10], [100]) == ([2], ["stop"])
    assert stops([[9, 9, 7]], [3], [[7, 9]], [10], [100]) == ([1], ["stop"])


def test_stop_id_beyond_the_committed_tokens_is_ignored():
    # slot 2 holds a stop id, but only 2 tokens were committed: the row keeps running
    assert stops([[5, 6, 9]], [2], [[9]], [10], [100]) == ([2], [None])


def test_length_and_context_limits():
    assert stops([[5, 6, 7]], [3], [[-1]], [10], [12]) == ([2], ["length"])
    assert stops([[5, 6, 7]], [3], [[-1]], [10], [100], max_context=11) == ([1], ["context"])
    # both at the same token: the length (the context was not the reason the row stopped early)
    assert stops([[5, 6, 7]], [3], [[-1]], [10], [12], max_context=12) == ([2], ["length"])


def test_stop_id_wins_a_tie_with_the_limit():
    assert stops([[5, 9, 7]], [3], [[9]], [10], [12]) == ([2], ["stop"])
    # the limit exactly where the pass ends anyway: still finished by length
    assert stops([[5, 6, 7]], [3], [[-1]], [10], [13]) == ([3], ["length"])


def test_rows_are_independent():
    got = stops([[5, 9, 7], [1, 2, 3], [4, 4, 4]], [3, 3, 1], [[9, -1], [-1, -1], [4, 8]], [10, 10, 10], [100, 11, 100])
    assert got == ([2, 1, 1], ["stop", "length", "stop"])


def test_stop_ids_only_when_no_row_can_reach_its_limit():
    """With `limit_far` (the engine knows on the host that every row's room exceeds the pass's width) the stop
    ids alone decide: the same cuts and reasons as the full computation on random rows far from their limits,
    and a row that does reach its limit is what the flag must not be given for."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, p = 4, int(torch.randint(1, 6, (1,), generator=g))
        committed = torch.randint(0, 6, (b, p), generator=g)
        n = torch.randint(1, p + 1, (b,), generator=g)
        stop_ids = stop_table(torch.randint(-1, 6, (b, 2), generator=g), 6)
        hist_len = torch.randint(5, 20, (b,), generator=g)
        limit, code = row_limits(hist_len + p + 1 + torch.randint(0, 5, (b,), generator=g), 1000)
        full = apply_stops(committed, n, stop_ids, hist_len, limit, code)
        fast = apply_stops(committed, n, stop_ids, hist_len, limit, code, limit_far=True)
        assert torch.equal(full[0], fast[0]) and torch.equal(full[1], fast[1])
    # at its limit the flag would be wrong: the full computation cuts by length
    limit, code = row_limits(torch.tensor([12]), 1000)
    args = (torch.tensor([[5, 6, 7]]), torch.tensor([3]), stop_table(torch.tensor([[-1]]), V), torch.tensor([10]), limit, code)
    assert apply_stops(*args)[0].tolist() == [2] and apply_stops(*args, limit_far=True)[0].tolist() == [3]


def test_stop_table_marks_each_rows_ids_and_drops_ids_outside_the_vocabulary():
    table = stop_table(torch.tensor([[3, -1, 12], [0, 9, -1]]), V)
    assert table.shape == (2, V) and table.dtype == torch.bool
    assert table[0].nonzero().flatten().tolist() == [3] and table[1].nonzero().flatten().tolist() == [0, 9]
