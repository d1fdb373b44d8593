"""Prefill chunks (esp_worker/prefill_plan.py): the grouping that minimises forwards x a forward's worth in tokens +
padded tokens, and the engine's use of it (lossless whatever the grouping)."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import PROMPTS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.auto.cost_model import PrefillCost, measure_prefill_cost
from esp_worker.model.runner import ModelRunner
from esp_worker.prefill_plan import CPU_FORWARD_TOKENS, plan_chunks


def _cost(lengths, chunks, forward_tokens):
    return sum(forward_tokens + len(c) * max(lengths[i] for i in c) for c in chunks)


def _partitions(items):
    """Every set partition of `items` (small lists only)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def test_the_plan_is_the_cheapest_grouping_of_all():
    """Against every set partition (not only runs of the sorted lengths) of small random batches."""
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 7))]
        forward_tokens = rng.choice([0, 3, 16, 40, 500])
        cap = rng.choice([60, 120, 10_000])
        plan = plan_chunks(lengths, forward_tokens, cap)
        assert sorted(i for c in plan for i in c) == list(range(len(lengths)))
        assert all(len(c) == 1 or len(c) * max(lengths[i] for i in c) <= cap for c in plan)
        best = min(_cost(lengths, p, forward_tokens) for p in _partitions(list(range(len(lengths))))
                   if all(len(c) == 1 or len(c) * max(lengths[i] for i in c) <= cap for c in p))
        assert _cost(lengths, plan, forward_tokens) == best


def test_a_forward_worth_many_tokens_merges_up_to_the_cap_and_a_cheap_one_splits():
    lengths = [300, 10, 290, 12, 150]
    assert plan_chunks(lengths, 16, 8192) == [[0, 2], [4], [3, 1]]  # longest first
    assert plan_chunks(lengths, 2000, 8192) == [[0, 2, 4, 3, 1]]
    assert plan_chunks(lengths, 2000, 600) == [[0, 2], [4, 3, 1]]  # 2 x 300 and 3 x 150 padded tokens
    assert plan_chunks([700, 5], 2000, 600) == [[0], [1]]  # a prompt longer than the cap is a chunk of its own
    assert plan_chunks([4, 4, 4], 0, 8192) == [[0], [1], [2]]  # nothing to save: one per forward
    assert plan_chunks([], 16, 8192) == []


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", [dict(method="ar"), dict(method="esp", block_complexity=10, num_masks=2),
                                     dict(method="hybrid", block_complexity="auto")])
def test_engine_prefill_chunks_follow_the_setting_and_stay_lossless(arch, setting):
    """Prompts of four lengths: one forward when a forward is worth many tokens (padded prompts under plain causal
    attention, or with ESP's masks after the padding a mask that hides it), one per length when it is worth none;
    tokens are generate's either way. On a CPU `auto` is CPU_FORWARD_TOKENS."""
    lm = tiny(arch)
    ref = reference(arch, "sdpa", 16)
    params = GenerationParams(max_new_tokens=16)
    passes = []
    for value, forwards in ((10_000, 1), (0, len({len(lm.tokenizer(p).input_ids) for p in PROMPTS}))):
        eng = Engine(lm, EngineConfig(max_batch_size=4, prefill_forward_tokens=value, **setting))
        outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
        assert [tuple(o.token_ids) for o in outs] == [r[:16] for r in ref]
        assert eng.stats.prefill_forwards == forwards and eng.stats.timing()["prefill_forwards"] == forwards
        assert eng.stats.prefill_s > 0
        passes.append([o.stats.committed_per_pass for o in outs])
    if setting["method"] == "esp":  # the masks saw their own prompt either way, so they drafted the same trees
        assert passes[0] == passes[1]
    assert Engine(lm, EngineConfig(method="ar")).prefill_forward_tokens == CPU_FORWARD_TOKENS


@pytest.mark.parametrize("value", [-1, "many", True])
def test_bad_prefill_forward_tokens_is_one_line(value):
    with pytest.raises(ValueError, match="engine.prefill_forward_tokens"):
        EngineConfig(prefill_forward_tokens=value).validate()


def test_measured_prefill_cost_is_a_line_through_two_forwards():
    """The start-up measurement CUDA's `auto` uses, on the CPU: non-negative parts and the tokens a forward is
    worth (no assertion on their size: timings depend on the machine)."""
    torch.set_num_threads(1)
    cost = measure_prefill_cost(ModelRunner(tiny("llama")), short=4, long=64, repeats=1)
    assert cost.fixed_s >= 0 and cost.token_s >= 0
    assert PrefillCost(0.01, 0.0).forward_tokens == PrefillCost(0.01, 1e-15).forward_tokens == 1e9
    assert PrefillCost(0.01, 1e-5).forward_tokens == pytest.approx(1000)
