"""engine.admission: when waiting requests join the batch. `auto` weighs the slots left idle against a prefill
forward's fixed cost (rent or buy, esp_worker/admission.py); `eager`, or an unmeasured cost (a CPU), joins at once.
The rows' tokens are the same either way."""
from __future__ import annotations

import dataclasses

import pytest

from engine_helpers import PROMPTS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.admission import Admission
from esp_worker.auto.cost_model import PrefillCost
from esp_worker.stats import now
from model_time import model_time


def test_idle_slots_pay_for_a_forward_before_requests_join():
    a = Admission(fixed_s=2.0)
    assert a.due(0)  # nothing in flight: nothing to stall
    assert not a.due(3)  # buy: 2 s x 3 rows stalled
    a.passed(1, 1.0)
    a.passed(2, 2.0)  # rent: 1 + 4 slot-seconds
    assert a.due(2) and not a.due(3)
    a.joined()
    assert not a.due(1)
    assert Admission().due(5)  # no fixed cost: at once


FORWARD_S, DECODE_S = 3.0, 1.0  # a prefill forward's fixed cost, and a decode pass's


def _cost(batch: int, tokens: int, prefill: bool) -> float:
    return FORWARD_S + 0.001 * batch * tokens if prefill else DECODE_S


def _run(admission: str):
    """Twelve requests of 4 .. 48 new tokens through 4 rows, each forward costing what `_cost` says (prompts are
    grouped into forwards by that cost too, as on CUDA). Returns the engine, outputs, requests and seconds."""
    lm = dataclasses.replace(tiny("llama"), prefill_cost=PrefillCost(fixed_s=FORWARD_S, token_s=0.001))
    eng = Engine(lm, EngineConfig(method="pld", block_complexity=4, max_batch_size=4, admission=admission,
                                  prefill_forward_tokens=FORWARD_S / 0.001))
    prompts = PROMPTS * 3
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=4 + (i * 7) % 45))
            for i, p in enumerate(prompts)]
    with model_time(_cost):
        start = now()
        outs = eng.generate(reqs)
        seconds = now() - start
    return eng, outs, reqs, seconds


def test_auto_admission_joins_fewer_times_with_the_same_tokens():
    eager, eager_outs, reqs, eager_s = _run("eager")
    auto, auto_outs, _, auto_s = _run("auto")
    ref = reference("llama", "sdpa")
    for o, r in zip(auto_outs, reqs):
        assert tuple(o.token_ids) == ref[int(o.id) % len(PROMPTS)][: r.params.max_new_tokens]
    assert [o.token_ids for o in auto_outs] == [o.token_ids for o in eager_outs]
    assert auto.stats.prefill_forwards < eager.stats.prefill_forwards
    assert auto_s < eager_s  # on this synthetic machine the forwards saved outweigh the idle slots


def test_admission_is_auto_or_eager():
    with pytest.raises(ValueError, match="engine.admission='soon' is unknown; choose auto or eager"):
        EngineConfig(admission="soon").validate()
