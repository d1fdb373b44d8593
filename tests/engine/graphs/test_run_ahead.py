"""engine.cuda_graphs_run_ahead: plain passes launched before the last one's read (on a CPU over the static buffers,
eagerly). The tokens, finish reasons and per-request statistics are those of the engine that reads every pass
before the next, through stop ids that end rows mid-batch, limits, continuous batching, seeded sampling, the
context limit and rows that outgrow the pinned slab."""
from __future__ import annotations

import dataclasses

import pytest

from engine_helpers import ARCHS, PROMPTS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request

MORE = PROMPTS + tuple(p[::-1] for p in PROMPTS) + ("a b c", "def f(x):")  # 10 prompts: rows come and go


def _generate(lm, ahead: bool, reqs, batch: int = 4, **cfg):
    eng = Engine(lm, EngineConfig(method="ar", max_batch_size=batch, cuda_graphs=True, cuda_graphs_run_ahead=ahead,
                                  **cfg))
    return eng, eng.generate(reqs)


def _same(outs, base):
    for o, b in zip(outs, base):
        assert (o.token_ids, o.finish_reason, o.error) == (b.token_ids, b.finish_reason, b.error), o.id
        assert dataclasses.replace(o.stats, time_s=0.0) == dataclasses.replace(b.stats, time_s=0.0), o.id


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_passes_run_ahead_with_generates_tokens(arch, batch):
    lm = tiny(arch)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    eng, outs = _generate(lm, True, reqs, batch)
    assert [tuple(o.token_ids) for o in outs] == list(reference(arch, "sdpa"))
    _same(outs, _generate(lm, False, reqs, batch)[1])
    g = eng.stats.graphs
    assert g.graph_passes == eng.stats.decode_passes and g.ahead_passes > 0.8 * eng.stats.decode_passes


def test_rows_that_stop_mid_batch_and_rows_that_join():
    """Stop ids end rows at passes the host cannot foresee (the pass after them runs over them and is read at
    once), limits at passes it can; ten requests through four rows."""
    lm = tiny("llama")
    ref = reference("llama", "sdpa")
    stops = [ref[0][20], ref[1][9]]
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=5 + 7 * i, stop_token_ids=stops))
            for i, p in enumerate(MORE)]
    eng, outs = _generate(lm, True, reqs)
    _same(outs, _generate(lm, False, reqs)[1])
    assert {o.finish_reason for o in outs} >= {"length", "stop"}
    assert eng.stats.graphs.ahead_passes > 0


def test_seeded_sampling_runs_ahead_with_the_same_uniforms():
    lm = tiny("llama")
    params = GenerationParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5)
    reqs = [Request(id=str(i), prompt=p, params=dataclasses.replace(params, temperature=0.0) if i == 2 else params)
            for i, p in enumerate(MORE)]
    eng, outs = _generate(lm, True, reqs, 3)
    _same(outs, _generate(lm, False, reqs, 3)[1])
    assert eng.stats.graphs.ahead_passes > 0


def test_context_limit_and_a_slab_that_grows():
    lm = dataclasses.replace(tiny("qwen2"), max_context=48)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    _, outs = _generate(lm, True, reqs)
    _same(outs, _generate(lm, False, reqs)[1])
    assert any(o.finish_reason == "context" for o in outs)
    lm = tiny("llama")
    eng, outs = _generate(lm, True, reqs, cuda_graph_max_len=24)
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    g = eng.stats.graphs
    assert g.eager_passes["capacity"] > 0 and g.ahead_passes > 0
    assert g.graph_passes + sum(g.eager_passes.values()) == eng.stats.decode_passes
    # a row that stops where its next pass has no graph (past the capacity of 24): that pass is not run, nor
    # counted as an eager pass (the stops were found by trying each position)
    ref = reference("llama", "sdpa")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64, stop_token_ids=[ref[i][k]]))
            for i, (p, k) in enumerate(zip(PROMPTS, (20, 7, 22, 12)))]
    eng, outs = _generate(lm, True, reqs, 1, cuda_graph_max_len=24)
    _same(outs, _generate(lm, False, reqs, 1, cuda_graph_max_len=24)[1])
    assert all(o.finish_reason == "stop" for o in outs)
    g = eng.stats.graphs
    assert g.graph_passes + sum(g.eager_passes.values()) == eng.stats.decode_passes


def test_other_methods_and_stop_strings_read_every_pass():
    lm = tiny("llama")
    reqs = [Request(id="0", prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=24))]
    eng = Engine(lm, EngineConfig(method="pld", block_complexity=10, cuda_graphs=True, cuda_graphs_run_ahead=True))
    eng.generate(reqs)
    assert eng.stats.graphs.ahead_passes == 0 and eng.stats.graphs.graph_passes > 0
    text = Engine(lm, EngineConfig(method="ar")).generate(reqs)[0].text
    stop = [Request(id="0", prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=24, stop_strings=[text[8:11]]))]
    eng, outs = _generate(lm, True, stop, 1)
    assert eng.stats.graphs.ahead_passes == 0 and outs[0].finish_reason == "stop"


def test_run_ahead_needs_graphs():
    with pytest.raises(ValueError, match="cuda_graphs_run_ahead"):
        EngineConfig(cuda_graphs=False, cuda_graphs_run_ahead=True).validate()
    with pytest.raises(ValueError, match="cuda_graphs_run_ahead"):
        EngineConfig(cuda_graphs_run_ahead="sometimes").validate()
    EngineConfig(cuda_graphs=False).validate()  # the default, auto, runs ahead only where passes are replayed


def test_replayed_plain_passes_run_ahead_by_default():
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="ar", max_batch_size=2, cuda_graphs=True))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=16))
                         for i, p in enumerate(PROMPTS)])
    assert eng.stats.graphs.ahead_passes > 0
    assert [tuple(o.token_ids) for o in outs] == [r[:16] for r in reference("llama", "sdpa")]
