"""The whole engine loop over static buffers (engine.cuda_graphs=true on a CPU runs the captured pass's function
eagerly, with a graph's reuse of output buffers): every method's tokens are `generate`'s and the eager engine's,
greedy and seeded sampling, batch 1 and 4, and the passes it cannot serve run eagerly and are counted."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, reference, run, tiny, windowed_mistral
from esp_worker import Engine, EngineConfig, GenerationParams, Request

GREEDY = GenerationParams(max_new_tokens=64)

METHODS = [
    dict(method="ar"),
    dict(method="pld", block_complexity=10),
    dict(method="esp", num_masks=1, block_complexity=30, tree="dynamic"),
    dict(method="esp", num_masks=2, block_complexity=60, tree="static"),
    dict(method="esp", num_masks=3, block_complexity=30, tree="dynamic", expansion="frontier"),
    dict(method="stand", block_complexity=30),
    dict(method="lade", block_complexity=30),
    dict(method="hybrid", num_masks=1, block_complexity=30),
    dict(method="hybrid", num_masks=2, block_complexity=10),
    dict(method="esp", num_masks=1, block_complexity="auto"),
    dict(method="hybrid", num_masks=1, block_complexity="auto"),
]


def _engine(lm, batch: int, graphs: bool, **setting) -> Engine:
    return Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=graphs, **setting))


def _generate(eng: Engine, params: GenerationParams, prompts=PROMPTS):
    return eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("setting", range(len(METHODS)))
@pytest.mark.parametrize("batch", [1, 4])
def test_every_method_over_static_buffers_matches_generate(setting, batch):
    lm = tiny("llama")
    eng = _engine(lm, batch, True, **METHODS[setting])
    outs = _generate(eng, GREEDY)
    for o, r in zip(outs, reference("llama", "sdpa")):
        assert o.error is None and tuple(o.token_ids) == r, (METHODS[setting], o.id)
    graphs = eng.stats.graphs
    assert graphs.graph_passes == eng.stats.decode_passes > 0 and not graphs.eager_passes


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_over_static_buffers_matches_generate(arch):
    lm = tiny(arch)
    for setting in (METHODS[1], METHODS[3], METHODS[7]):
        outs = _generate(_engine(lm, 4, True, **setting), GREEDY)
        for o, r in zip(outs, reference(arch, "sdpa")):
            assert tuple(o.token_ids) == r, (arch, setting)


@pytest.mark.parametrize("setting", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("batch", [1, 4])
def test_seeded_sampling_over_static_buffers_is_the_eager_engines(setting, batch):
    """The same uniforms, one per committed token in order: the same tokens as the eager engine. Where the drafts
    depend on tokens only (plain decoding, prompt lookup) the statistics are the same too."""
    lm = tiny("llama")
    params = GenerationParams(max_new_tokens=48, temperature=1.0, top_p=0.9, seed=11)
    mixed = [dataclasses.replace(params, temperature=0.0) if i == 1 else params for i in range(len(PROMPTS))]
    reqs = [Request(id=str(i), prompt=p, params=x) for i, (p, x) in enumerate(zip(PROMPTS, mixed))]
    eager = _engine(lm, batch, False, **METHODS[setting]).generate(reqs)
    static = _engine(lm, batch, True, **METHODS[setting]).generate(reqs)
    for e, s in zip(eager, static):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason, (METHODS[setting], s.id)
        if METHODS[setting]["method"] in ("ar", "pld"):
            assert dataclasses.replace(s.stats, time_s=0.0) == dataclasses.replace(e.stats, time_s=0.0)


def test_stop_ids_and_per_request_limits_over_static_buffers():
    lm = tiny("llama")
    ref = reference("llama", "sdpa")
    stop = ref[0][20]
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=5 + 13 * i, stop_token_ids=[stop]))
            for i, p in enumerate(PROMPTS)]
    for setting in (METHODS[0], METHODS[1], METHODS[3]):
        eager = _engine(lm, 4, False, **setting).generate(reqs)
        static = _engine(lm, 4, True, **setting).generate(reqs)
        assert [(o.token_ids, o.finish_reason) for o in static] == [(o.token_ids, o.finish_reason) for o in eager]
        assert {o.finish_reason for o in static} >= {"length", "stop"}


def test_stop_strings_run_eagerly_and_are_counted():
    lm = tiny("llama")
    text = run(lm, EngineConfig(method="ar"), GenerationParams(max_new_tokens=40))[0].text
    params = GenerationParams(max_new_tokens=40, stop_strings=[text[10:13]])
    eng = _engine(lm, 1, True, method="esp", num_masks=2, block_complexity=30)
    outs = _generate(eng, params)
    eager = _generate(_engine(lm, 1, False, method="esp", num_masks=2, block_complexity=30), params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager] and outs[0].finish_reason == "stop"
    assert eng.stats.graphs.eager_passes["stop_strings"] == eng.stats.decode_passes


def test_rows_past_the_pinned_slots_run_eagerly_then_the_grown_slab_serves_again():
    """A slab pinned at 48 slots: rows that outgrow it run eagerly (counted) and grow the slab; the static path
    then serves passes over the new slab. The tokens stay generate's."""
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=4, cuda_graphs=True,
                                  cuda_graph_max_len=48))
    outs = _generate(eng, GREEDY)
    for o, r in zip(outs, reference("llama", "sdpa")):
        assert tuple(o.token_ids) == r
    graphs = eng.stats.graphs
    assert graphs.eager_passes["capacity"] > 0 and graphs.graph_passes > 0
    assert eng.graphs.cache.slab.shape[4] > 48


def test_rows_whose_grown_slab_does_not_fit_spill_then_return_to_the_pinned_slab(monkeypatch):
    """A slab pinned at 48 slots for 8 rows, and the device's free memory (patched) too small for 8 rows past that
    but enough for the 2 live ones: their passes run eagerly in a cache of their own (counted as spilled) and the
    pinned slab stays as it was; a later batch that fits it moves back and is served by the static path again.
    The tokens stay generate's."""
    import esp_worker.memory

    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=8, cuda_graphs=True,
                                  cuda_graph_max_len=48))
    pinned = eng.graphs.cache.slab
    monkeypatch.setattr(esp_worker.memory, "free_bytes", lambda device: 400 * eng.slot_bytes)  # < 8 x 64 slots
    outs = _generate(eng, GREEDY, PROMPTS[:2])
    for o, r in zip(outs, reference("llama", "sdpa")[:2]):
        assert o.error is None and tuple(o.token_ids) == r
    graphs, cache = eng.stats.graphs, eng.graphs.cache
    assert graphs.eager_passes["spilled"] == eng.stats.decode_passes > 0  # the long prompt outgrew it at once
    assert cache.spilled and cache.pinned_slab is pinned and pinned.shape[4] == 48  # neither grown nor replaced
    eng.stats.reset_timing()
    short = GenerationParams(max_new_tokens=8)
    _generate(eng, short, PROMPTS[1:3])
    assert not cache.spilled and cache.slab is pinned
    assert graphs.graph_passes == eng.stats.decode_passes > 0 and not graphs.eager_passes


def test_context_limit_over_static_buffers():
    lm = dataclasses.replace(tiny("qwen2"), max_context=30)
    eager = run(lm, EngineConfig(method="esp", num_masks=2, block_complexity=30, max_batch_size=4), GREEDY)
    static = run(lm, EngineConfig(method="esp", num_masks=2, block_complexity=30, max_batch_size=4,
                                  cuda_graphs=True), GREEDY)
    assert [(o.token_ids, o.finish_reason, o.error) for o in static] == \
        [(o.token_ids, o.finish_reason, o.error) for o in eager]
    assert any(o.finish_reason == "context" for o in static)


def test_sliding_window_over_static_buffers_matches_generate():
    lm = windowed_mistral(6)
    model, tok = lm.model, lm.tokenizer
    eng = Engine(lm, EngineConfig(method="esp", num_masks=2, block_complexity=30, max_batch_size=4, cuda_graphs=True))
    outs = _generate(eng, GREEDY)
    assert eng.stats.graphs.graph_passes == eng.stats.decode_passes
    for p, o in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt").input_ids.to(lm.device)
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                 pad_token_id=2)
        assert o.token_ids == ref[0, ids.shape[1]:].tolist()


def test_continuous_batching_over_static_buffers():
    """More requests than rows, mixed lengths: rows leave and join, the batch bucket changes, padding rows
    are never committed; every output equals the eager engine's."""
    lm = tiny("mistral")
    reqs = [Request(id=str(i), prompt=PROMPTS[i % 4] * (1 + i % 3), params=GenerationParams(max_new_tokens=5 + 7 * i))
            for i in range(9)]
    for setting in (METHODS[2], METHODS[7]):
        eager = {o.id: o.token_ids for o in _engine(lm, 3, False, **setting).generate(reqs)}
        eng = _engine(lm, 3, True, **setting)
        static = {o.id: o.token_ids for o in eng.generate(reqs)}
        assert static == eager
        assert {s.batch for s in eng.graphs._entries} == {1, 2, 3}


def test_graphs_config_is_checked_and_auto_is_off_on_a_cpu():
    lm = tiny("llama")
    assert Engine(lm, EngineConfig(method="ar")).graphs is None  # auto: CUDA only
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(lm, EngineConfig(method="ar", cuda_graphs="sometimes"))
    from esp_worker.model.errors import ModelLoadError

    direct_off = dataclasses.replace(lm, direct_forward=False)
    with pytest.raises(ModelLoadError, match="cuda_graphs=true cannot capture"):
        Engine(direct_off, EngineConfig(method="ar", cuda_graphs=True))
