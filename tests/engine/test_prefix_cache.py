"""engine.prefix_cache_tokens: prompt prefixes that requests share are prefilled once, and the tokens stay those of
plain decoding and of `generate` (float32) for every method, architecture and batch size."""
from __future__ import annotations

import functools

import pytest
import torch

from engine_helpers import (ARCHS, FEW_SHOT, QUESTIONS, SHARED_PROMPTS, SYSTEM, model_logprobs, tiny,
                            windowed_mistral)
from esp_worker import Engine, EngineConfig, GenerationParams, Request, sample_requests
from esp_worker.feed import RequestFeed
from esp_worker.prefix_cache import MIN_SHARE, PrefixCache, shared_prefixes, worth_copying

PROMPTS = SHARED_PROMPTS
MAX_NEW = 24
METHODS = [dict(method="ar"), dict(method="pld", block_complexity=10), dict(method="esp", num_masks=2),
           dict(method="hybrid"), dict(method="stand", block_complexity=10), dict(method="lade", block_complexity=10)]


@functools.lru_cache(maxsize=None)
def _reference(arch: str) -> tuple:
    lm = tiny(arch)
    outs = []
    for p in PROMPTS:
        ids = lm.tokenizer(p, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=list(lm.eos_token_ids), pad_token_id=2)
        outs.append(tuple(out[0, ids.shape[1]:].tolist()))
    return tuple(outs)


def _run(arch: str, params: GenerationParams = GenerationParams(max_new_tokens=MAX_NEW), prompts=PROMPTS, **cfg):
    eng = Engine(tiny(arch), EngineConfig(**cfg))
    outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(prompts)])
    for o in outs:
        assert o.error is None, o.error
    return eng, outs


# ---- which prefixes, and the store ------------------------------------------------------------------
def test_shared_prefixes_are_each_groups_longest_common_prefix_then_its_subgroups():
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 8, 9], [9, 9, 9]]
    assert shared_prefixes(prompts, min_tokens=2) == [(1, 2, 3), (1, 2, 3, 4, 5)]
    assert shared_prefixes(prompts, min_tokens=4) == [(1, 2, 3, 4, 5)]  # (1 2 3) is too short
    assert shared_prefixes(prompts, min_tokens=6) == []


def test_a_shared_prefix_leaves_every_prompt_its_last_token():
    assert shared_prefixes([[5, 6, 7, 8], [5, 6, 7, 8]], min_tokens=2) == [(5, 6, 7)]
    assert shared_prefixes([[5, 6, 7, 8, 9], [5, 6, 7, 8]], min_tokens=2) == [(5, 6, 7)]
    assert shared_prefixes([[5, 6, 7], [5, 6, 7, 1]], min_tokens=3) == []  # the shorter keeps its last token


def test_lookup_finds_the_longest_stored_prefix_short_of_the_last_token():
    store = PrefixCache(budget_tokens=100)
    kv = torch.zeros(1)
    store.add((1, 2), kv)
    store.add((1, 2, 3, 4), kv)
    assert store.lookup([1, 2, 3, 4, 5]).ids == (1, 2, 3, 4)
    assert store.lookup([1, 2, 3, 4]).ids == (1, 2)  # all four would leave nothing to feed
    assert store.lookup([1, 2, 9, 9]).ids == (1, 2)
    assert store.lookup([7, 1, 2, 3]) is None


def test_past_the_budget_the_least_recently_used_prefix_leaves_first():
    store = PrefixCache(budget_tokens=6)
    kv = torch.zeros(1)
    store.add((1, 1, 1), kv)
    store.add((2, 2, 2), kv)
    assert store.lookup([1, 1, 1, 0]) is not None  # (1 1 1) used last
    store.add((3, 3, 3), kv)
    assert store.lookup([2, 2, 2, 0]) is None and store.lookup([1, 1, 1, 0]) is not None
    assert store.tokens == 6 and len(store) == 2
    assert store.add(tuple(range(7)), kv) is None and len(store) == 2  # larger than the whole budget: not kept


def test_a_prefix_is_copied_where_it_covers_enough_to_pay_for_the_mask_it_brings():
    assert worth_copying(15, 100, masked_anyway=False) == (15 >= MIN_SHARE * 100)
    assert not worth_copying(1, 100, masked_anyway=False) and worth_copying(1, 100, masked_anyway=True)
    assert not worth_copying(0, 100, masked_anyway=True)


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_every_method_matches_generate_over_shared_prefixes(arch, batch):
    ref = _reference(arch)
    for method in METHODS:
        eng, outs = _run(arch, max_batch_size=batch, **method)
        for o, r in zip(outs, ref):
            assert tuple(o.token_ids) == r, f"{method} {arch} batch {batch}: row {o.id} diverged from generate"
        # the system prompt is prefilled once or twice, not per prompt (batch 1: from the second prompt's row)
        assert eng.stats.prefill_cached_tokens > (len(PROMPTS) - 2) * len(tiny(arch).tokenizer(SYSTEM).input_ids) // 2


def test_the_prefill_feeds_only_what_no_stored_prefix_covers():
    lm = tiny("llama")
    eng, outs = _run("llama", max_batch_size=4)
    assert sum(o.stats.num_cached_prompt_tokens for o in outs) == eng.stats.prefill_cached_tokens  # each row's
    total = sum(len(lm.tokenizer(p).input_ids) for p in PROMPTS)
    off, _ = _run("llama", max_batch_size=4, prefix_cache_tokens=0)
    assert off.stats.prefill_cached_tokens == 0 and off.stats.prefill_tokens == total
    assert eng.stats.prefill_cached_tokens > total // 2
    # what a forward of its own computed is fed too (counted once), and the rest comes from the store
    assert eng.stats.prefill_tokens < total - eng.stats.prefill_cached_tokens + 2 * len(lm.tokenizer(SYSTEM + FEW_SHOT).input_ids)


def test_a_prompt_admitted_alone_reuses_what_it_shares_with_the_prompts_before_it():
    lm = tiny("llama")
    same = (SYSTEM + "x",) * 5  # identical prompts: all but the last token is shared
    eng, outs = _run("llama", prompts=same, max_batch_size=1, method="ar")
    n = len(lm.tokenizer(same[0]).input_ids)
    assert eng.stats.prefill_cached_tokens == 3 * (n - 1)  # the second prompt's row gives it to the last three
    assert len({tuple(o.token_ids) for o in outs}) == 1


def test_a_prompt_admitted_alone_keeps_what_it_shares_with_the_requests_still_to_come():
    """Requests given as token ids (as a job gives them: the samples of one prompt, joining one by one) are looked
    ahead: the first prompt's row gives its prefix to the four after it, given as a list and as a feed."""
    lm = tiny("llama")
    ids = lm.tokenizer(SYSTEM + "x").input_ids
    params = GenerationParams(max_new_tokens=MAX_NEW, temperature=0.8, n=5)
    reqs = sample_requests(Request("s", prompt_ids=ids, params=params), 0)
    for given in (lambda: reqs, lambda: _closed_feed(reqs)):
        eng = Engine(lm, EngineConfig(method="hybrid", max_batch_size=1))
        outs = {o.id: o for o in eng.generate_iter(given())}
        assert eng.stats.prefill_cached_tokens == 4 * (len(ids) - 1) and eng.stats.prefill_tokens == len(ids) + 4
        alone = Engine(lm, EngineConfig(method="hybrid", max_batch_size=1, prefix_cache_tokens=0))
        assert [outs[r.id].token_ids for r in reqs] == [o.token_ids for o in alone.generate(reqs)]


def _closed_feed(reqs: list) -> RequestFeed:
    feed = RequestFeed()
    feed.put(reqs)
    feed.close()
    return feed


def test_sampled_rows_draw_the_same_tokens_with_and_without_the_store():
    params = GenerationParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=3)
    for method in (dict(method="ar"), dict(method="hybrid")):
        _, on = _run("qwen2", params, max_batch_size=4, **method)
        _, off = _run("qwen2", params, max_batch_size=4, prefix_cache_tokens=0, **method)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_the_static_buffer_path_matches_generate_over_shared_prefixes():
    eng, outs = _run("llama", max_batch_size=4, method="hybrid", cuda_graphs=True)
    assert [tuple(o.token_ids) for o in outs] == list(_reference("llama"))
    assert eng.stats.prefill_cached_tokens > 0


def test_a_row_asking_for_prompt_logprobs_is_prefilled_whole_beside_rows_that_reuse():
    lm = tiny("llama")
    scored = GenerationParams(max_new_tokens=8, prompt_logprobs=True)
    eng = Engine(lm, EngineConfig(max_batch_size=2, method="ar"))
    reqs = [Request(id=str(i), prompt=p, params=scored if i == 3 else GenerationParams(max_new_tokens=8))
            for i, p in enumerate(PROMPTS[:6])]
    outs = {o.id: o for o in eng.generate(reqs)}
    assert eng.stats.prefill_cached_tokens > 0
    o = outs["3"]
    ids = lm.tokenizer(PROMPTS[3]).input_ids
    want = model_logprobs(lm, PROMPTS[3], [])[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert o.prompt_logprobs[0] is None
    assert torch.allclose(torch.tensor(o.prompt_logprobs[1:]), want, atol=1e-4)


def test_a_short_header_on_long_prompts_is_copied_only_where_the_prefill_takes_a_mask_anyway():
    long_prompts = [SYSTEM[:40] + f"{i} " + QUESTIONS[i % 6] * 12 for i in range(6)]
    plain, outs = _run("llama", prompts=long_prompts, max_batch_size=4, method="ar")
    assert plain.stats.prefill_cached_tokens == 0  # causal attention needs no mask: feeding them costs less
    lm = tiny("llama", "eager")
    eng = Engine(lm, EngineConfig(max_batch_size=4, method="ar"))
    eager = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=MAX_NEW))
                          for i, p in enumerate(long_prompts)])
    assert eng.stats.prefill_cached_tokens > 0  # eager attention takes a mask whatever it is fed
    assert [o.token_ids for o in eager] == [o.token_ids for o in outs]


def test_a_prefix_larger_than_the_budget_is_not_kept():
    eng, outs = _run("llama", max_batch_size=4, method="ar", prefix_cache_tokens=8)
    assert eng.stats.prefill_cached_tokens == 0
    assert [tuple(o.token_ids) for o in outs] == list(_reference("llama"))


def test_methods_whose_prefill_reads_every_position_keep_no_prefixes():
    assert Engine(tiny("llama"), EngineConfig(method="dmtd", dmtd_decoding_layers=1, dmtd_tau=2)).prefixes is None
    assert Engine(tiny("llama"), EngineConfig(prefix_cache_tokens=0)).prefixes is None


def test_a_bad_budget_is_one_line():
    with pytest.raises(ValueError, match="engine.prefix_cache_tokens=-1 must be"):
        EngineConfig(prefix_cache_tokens=-1).validate()


def test_a_sliding_window_model_matches_generate_over_shared_prefixes():
    """A Mistral with a 6-token attention window: a prompt's first fed token sees only the stored prefix's last few."""
    lm = windowed_mistral(6)
    model, tok = lm.model, lm.tokenizer
    for method in (dict(method="ar"), dict(method="esp", num_masks=2, block_complexity=30)):
        eng = Engine(lm, EngineConfig(max_batch_size=4, **method))
        outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=MAX_NEW))
                             for i, p in enumerate(PROMPTS)])
        assert eng.stats.prefill_cached_tokens > 0
        for p, o in zip(PROMPTS, outs):
            ids = tok(p, return_tensors="pt").input_ids.to(lm.device)
            with torch.inference_mode():
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                     pad_token_id=2)
            assert o.token_ids == ref[0, ids.shape[1]:].tolist(), f"{method}: row {o.id} diverged from generate"
