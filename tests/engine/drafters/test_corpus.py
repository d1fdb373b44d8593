"""The job's n-grams (hybrid's "corpus" proposer): lookups against known stores, and the engine feeding it."""
from __future__ import annotations

import torch

from esp_worker.passes import PassPlan
from esp_worker import EngineConfig, GenerationParams, Request
from esp_worker.drafters.corpus import CorpusNgrams
from esp_worker.engine import Engine

from engine_helpers import tiny


def lookup(c: CorpusNgrams, rows: list[list[int]], depth: int = 4) -> list[list[int]]:
    """Valid continuation tokens per row."""
    width = max(len(r) for r in rows)
    hist = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    chain, ok = c.continuation(hist, torch.tensor([len(r) for r in rows]), depth)
    return [chain[i][ok[i]].tolist() for i in range(len(rows))]


def test_longest_match_wins_then_latest_and_a_request_end_stops_the_chain():
    c = CorpusNgrams(capacity=64, max_ngram=3, min_ngram=1)
    assert lookup(c, [[1, 2]]) == [[]]  # empty store: nothing
    c.add([5, 6, 7, 8])
    c.add([9, 6, 3, 4, 1])
    # [.. 5 6] matches [5 6] (n = 2) in the first request, not the later [6] alone; [.. 0 6] only the
    # latest [6] (n = 1) -> 3 4 1 then the end of that request; [.. 8] -> the first request's end
    assert lookup(c, [[5, 6], [0, 6], [2, 8], [2, 2]]) == [[7, 8], [3, 4, 1], [], []]
    c.add([2, 6, 11])
    assert lookup(c, [[0, 6], [5, 6]]) == [[11], [7, 8]]  # latest [6] is now the third request's


def test_a_request_longer_than_a_small_store_keeps_its_last_tokens():
    """A request keeps its latest capacity - 1 tokens (and a separator); a store of one token keeps none."""
    c = CorpusNgrams(capacity=4, max_ngram=2, min_ngram=1)
    c.add([1, 2, 3, 4, 5, 6])
    assert lookup(c, [[4], [0, 5], [2]]) == [[5, 6], [6], []]
    one = CorpusNgrams(capacity=1, max_ngram=2, min_ngram=1)
    one.add([1, 2, 3])
    assert one.empty and lookup(one, [[1], [2]]) == [[], []]


def test_a_row_shorter_than_the_ngram_and_a_bucket_of_another_ngram_do_not_match():
    c = CorpusNgrams(capacity=64, max_ngram=3, min_ngram=2)
    c.add([1, 2, 3, 4])
    assert lookup(c, [[3], [2, 3], [9, 3]]) == [[], [4], []]  # min_ngram 2: [3] alone is too short
    # every bucket points at a live position but holds another n-gram's hash: nothing matches
    c.stamps.fill_(2)
    c.hashes.add_(1)
    assert lookup(c, [[2, 3], [1, 2], [7, 8]]) == [[], [], []]
    # the bucket of a longer n-gram lost to another one: the shorter match still drafts
    c = CorpusNgrams(capacity=64, max_ngram=3, min_ngram=1)
    c.add([1, 2, 3, 4])
    h = c._hashes(torch.tensor([[1, 2, 3]]))[0, 0]
    c.hashes[h % c.num_buckets] = -5  # the 3-gram [1 2 3]'s slot (row 0 of the table)
    assert lookup(c, [[1, 2, 3]]) == [[4]]  # from the 2-gram [2 3]


def test_ring_buffer_wraps_and_forgets_overwritten_requests():
    c = CorpusNgrams(capacity=10, max_ngram=2, min_ngram=1)
    c.add([1, 2, 3, 4])  # offsets 0-4 (with its separator)
    c.add([5, 6, 7])  # 5-8
    c.add([1, 2, 9])  # does not fit behind: starts over at 0, overwriting the first request
    assert lookup(c, [[1, 2], [6], [3]]) == [[9], [7], []]
    c.reset()
    assert c.empty and lookup(c, [[6]]) == [[]]


def _engine(**kw) -> Engine:
    return Engine(tiny("llama"), EngineConfig(method="hybrid", block_complexity=10, max_batch_size=1, **kw))


def test_engine_drafts_from_finished_requests_and_forgets_them_between_calls():
    eng = _engine()
    prompt = list(range(40, 60))  # distinct tokens: the row's own history starts with no match
    params = GenerationParams(max_new_tokens=24)
    reqs = [Request(id=str(i), prompt_ids=prompt, params=params) for i in range(2)]
    first, second = eng.generate(reqs)
    assert first.token_ids == second.token_ids  # lossless whatever the drafts
    # the second request repeats the first: the corpus proposes its continuation and it is accepted
    assert "corpus" in second.stats.accepted_by_proposer
    assert second.stats.accepted_by_proposer["corpus"] > 0 and first.stats.accepted_by_proposer["corpus"] == 0
    assert second.stats.num_decode_passes < first.stats.num_decode_passes
    # a new generate() call is a new job: its first request drafts exactly as the first call's did
    again = eng.generate(reqs[:1])[0]
    assert again.token_ids == first.token_ids and again.stats.accepted_by_proposer == first.stats.accepted_by_proposer
    off = _engine(hybrid_corpus_tokens=0).generate(reqs)
    assert [o.token_ids for o in off] == [first.token_ids] * 2 and "corpus" not in off[1].stats.accepted_by_proposer


def test_chains_from_the_corpus_keep_their_own_acceptance_rate():
    """Row 0 matches its own history, row 1 only the corpus; every pass accepts row 0's whole chain and
    nothing of row 1's: the draft mass follows each source's record (one shared rate would give both the
    average)."""
    from esp_worker.passes import PassRecord, RowsView
    from esp_worker.drafters.pld import PromptLookupDrafter

    corpus = CorpusNgrams(capacity=64, max_ngram=2, min_ngram=1)
    corpus.add([7, 8, 1, 2, 3])
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, depth=3, corpus=corpus)
    hist = torch.tensor([[4, 5, 6, 4, 5, 6, 4, 5], [9, 7, 8, 0, 0, 0, 0, 0]])
    length = torch.tensor([8, 3])
    for _ in range(30):
        view = RowsView(hist, length.clone(), torch.tensor([2, 2]), [0, 0])
        block = d.propose(view, PassPlan(3))
        assert d._used.tolist() == [False, True]
        n = torch.tensor([4, 1])  # row 0: 3 drafts + bonus; row 1: the bonus only
        d.observe(view, PassRecord(torch.zeros((2, 4), dtype=torch.long), n, None, None, block=block))
    view = RowsView(hist, length.clone(), torch.tensor([2, 2]), [0, 0])
    mass = d.draft_mass(view)
    assert mass[0].min() > 0.9 and mass[1].max() < 0.1


def test_row_hints_skip_the_corpus_only_when_every_row_has_its_own_match(monkeypatch):
    """The hint (each row's own match, read back after the commit) lets the next lookup skip the corpus when no
    row could take its continuation; a row without a match of its own still gets it."""
    from esp_worker.drafters.base import RowsView
    from esp_worker.drafters.pld import PromptLookupDrafter

    corpus = CorpusNgrams(capacity=64, max_ngram=2, min_ngram=1)
    corpus.add([7, 8, 1, 2, 3])
    calls = []
    cont = CorpusNgrams.continuation
    monkeypatch.setattr(CorpusNgrams, "continuation", lambda self, *a: calls.append(1) or cont(self, *a))
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, depth=3, corpus=corpus)
    hist = torch.tensor([[4, 5, 6, 4, 5, 6, 4, 5], [9, 7, 8, 0, 0, 0, 0, 0]])
    for rows, skipped in (([0], True), ([0, 1], False), ([1], False)):
        view = RowsView(hist[rows], torch.tensor([8, 3])[rows], torch.tensor([2] * len(rows)), [0] * len(rows))
        hints = d.row_hints(view).tolist()  # what the engine reads back after a commit
        assert [h >= 0 for h in hints] == [r == 0 for r in rows]
        unhinted = d.propose(view, PassPlan(3)).tree.tokens
        calls.clear()
        hinted = d.propose(RowsView(view.hist, view.hist_len, view.prompt_len, view.seeds, hints=hints), PassPlan(3))
        assert torch.equal(hinted.tree.tokens, unhinted) and (not calls) == skipped


def test_engine_hints_change_the_work_not_the_drafts(monkeypatch):
    """A job run with and without row hints: the same tokens, passes and accepted drafts per proposer, and
    fewer corpus lookups with them (most passes have a match of their own)."""
    from esp_worker.drafters.hybrid import HybridDrafter

    prompt = list(range(40, 60)) + list(range(45, 52))  # a repeat: own matches from the start
    reqs = [Request(id=str(i), prompt_ids=prompt, params=GenerationParams(max_new_tokens=40)) for i in range(3)]
    calls = []
    cont = CorpusNgrams.continuation
    monkeypatch.setattr(CorpusNgrams, "continuation", lambda self, *a: calls.append(1) or cont(self, *a))
    hinted = _engine().generate(reqs)
    with_hints = len(calls)
    calls.clear()
    monkeypatch.setattr(HybridDrafter, "row_hints", lambda self, view: None)
    plain = _engine().generate(reqs)
    assert [o.token_ids for o in hinted] == [o.token_ids for o in plain]
    assert [o.stats.num_decode_passes for o in hinted] == [o.stats.num_decode_passes for o in plain]
    assert [o.stats.accepted_by_proposer for o in hinted] == [o.stats.accepted_by_proposer for o in plain]
    assert 0 < with_hints < len(calls)
