"""Sampling stays lossless: seeded speculative requests reproduce seeded plain sampling, and the sampled
distribution matches the model's own (temperature / top-k adjusted) distribution."""
from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

from engine_helpers import PROMPTS, run, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request, sample_requests
from esp_worker.sampling import choose_tokens


def test_seeded_speculative_equals_seeded_plain():
    lm = tiny("llama")
    for temp, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20)]:
        params = [GenerationParams(max_new_tokens=48, temperature=temp, top_p=top_p, top_k=top_k, seed=s) for s in range(4)]
        outs = {}
        for method, extra in [("ar", {}), ("esp", dict(num_masks=2, block_complexity=30)), ("esp", dict(tree="static")),
                              ("pld", {}), ("hybrid", dict(num_masks=1, block_complexity=30)),
                              ("hybrid", dict(num_masks=2, block_complexity=10))]:
            eng = Engine(lm, EngineConfig(method=method, max_batch_size=3, **extra))
            res = eng.generate([Request(id=str(i), prompt=PROMPTS[i % 4], params=p) for i, p in enumerate(params)])
            outs[(method, tuple(extra.items()))] = [r.token_ids for r in res]
        ref = outs[("ar", ())]
        assert len(set(map(tuple, ref))) == 4  # different seeds, different samples
        for key, got in outs.items():
            assert got == ref, f"{key} at T={temp} top_p={top_p} top_k={top_k}"


def test_seed_reproducible_and_different_seeds_differ():
    lm = tiny("qwen3")
    cfg = EngineConfig(method="esp")
    a = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=1.0, seed=7))
    b = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=1.0, seed=7))
    c = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=1.0, seed=8))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_samples_of_a_request_are_seeded_requests_and_sample_0_is_the_single_answer():
    """sample_requests: n requests, sample i seeded seed + i (from the id when the request gives no seed); run in
    one batch they give what each gives alone, and sample 0 is what the request with n = 1 gives."""
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="hybrid", max_batch_size=4))
    sampled = GenerationParams(max_new_tokens=24, temperature=0.9, n=3)
    for seed in (None, 5, (1 << 64) - 2):  # the last: sample 2's seed wraps back into the 64-bit range
        req = Request(id="q", prompt=PROMPTS[2], params=replace(sampled, seed=seed))
        reqs = sample_requests(req, eng.cfg.seed)
        assert [r.id for r in reqs] == ["q", "q#1", "q#2"] and all(r.params.n == 1 for r in reqs)
        if seed is not None:
            assert [r.params.seed for r in reqs] == [seed, seed + 1, (seed + 2) % (1 << 64)]
        together = [o.token_ids for o in eng.generate(reqs)]
        assert len(set(map(tuple, together))) == 3  # three different samples
        alone = [eng.generate([r])[0].token_ids for r in reqs]
        assert together == alone
        single = eng.generate([Request(id="q", prompt=PROMPTS[2], params=replace(sampled, seed=seed, n=1))])
        assert single[0].token_ids == together[0]
    logged = GenerationParams(temperature=1.0, n=2, prompt_logprobs=True)
    assert [r.params.prompt_logprobs for r in sample_requests(Request("p", "Hi", params=logged), 0)] == [True, False]
    assert sample_requests(req := Request("one", "Hi"), 0) == [req]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["esp", "hybrid"])
def test_sampled_distribution_matches_model(method):
    """Chi-square of ESP's (and hybrid's) first two sampled tokens (many seeds) against the exact model probabilities."""
    lm = tiny("llama")
    temp, top_k, n = 0.7, 3, 1500
    prompt = PROMPTS[1]
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        p1 = _filtered_probs(lm.model(ids).logits[0, -1], temp, top_k)
        exact = {}
        for t1 in p1.nonzero().flatten().tolist():
            ids2 = torch.cat([ids, torch.tensor([[t1]])], 1)
            p2 = _filtered_probs(lm.model(ids2).logits[0, -1], temp, top_k)
            for t2 in p2.nonzero().flatten().tolist():
                exact[(t1, t2)] = float(p1[t1] * p2[t2])
    eng = Engine(lm, EngineConfig(method=method, num_masks=1, block_complexity=30, max_batch_size=64))
    reqs = [Request(id=str(s), prompt=prompt, params=GenerationParams(max_new_tokens=2, temperature=temp, top_k=top_k, seed=s))
            for s in range(n)]
    counts = collections.Counter(tuple(o.token_ids[:2]) for o in eng.generate(reqs))
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    # 9 outcomes -> 8 degrees of freedom; 26.1 is the 0.999 quantile
    assert chi2 < 26.1, (chi2, counts, exact)
    # and the speculative path really was taken: the decode pass verified drafts
    assert len(exact) == 9


def _filtered_probs(logits, temp, top_k):
    logits = logits.float() / temp
    kth = logits.topk(top_k).values[-1]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)


def test_choose_tokens_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    # u just below 1 picks the last token of the nucleus: top_p 0.8 keeps {0, 1}
    tok = choose_tokens(logits, one, torch.tensor([0.8]), torch.zeros(1, dtype=torch.long), torch.tensor([0.999]))
    assert tok.item() == 1
    tok = choose_tokens(logits, one, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([0.999]))
    assert tok.item() == 1
    tok = choose_tokens(logits, one, torch.tensor([1.0]), torch.zeros(1, dtype=torch.long), torch.tensor([0.999]))
    assert tok.item() == 3
    tok = choose_tokens(logits, torch.zeros(1), torch.tensor([1.0]), torch.zeros(1, dtype=torch.long), torch.tensor([0.999]))
    assert tok.item() == 0  # temperature 0 is greedy


def test_grouped_argmax_is_argmax_with_ties_and_nan():
    from esp_worker.sampling import argmax_last

    torch.manual_seed(0)
    for shape in [(30, 4096), (4, 30, 4096), (1, 1, 4096), (2, 200, 320)]:  # grouped but (1, 1, 4096)
        x = torch.randn(shape)
        ties = (x * 2).round()  # many equal maxima: the first one must win, as in argmax
        nan = x.clone()
        nan[..., 100] = float("nan")
        nan[..., 200] = float("nan")
        for y in (x, ties, nan, x.bfloat16()):
            assert torch.equal(argmax_last(y), y.argmax(-1)), shape
