"""apply_stops: where each row's committed tokens end, and why (stop id, length, context)."""
import torch

from esp_worker.stops import REASONS, apply_stops, row_limits


def stops(committed, n, stop_ids, hist_len, max_total, max_context=1000):
    limit, code = row_limits(torch.tensor(max_total), max_context)
    n_fin, reason = apply_stops(torch.tensor(committed), torch.tensor(n), torch.tensor(stop_ids),
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
