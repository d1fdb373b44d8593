"""engine.cuda_graphs on CUDA: passes replayed from graphs give the eager engine's tokens (float32: a few-layer
model of the Llama-3.2-1B shape, and seeded sampling on a tiny model), replay without synchronising, and report
captures and graph memory. Skipped without CUDA."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine_helpers import PROMPTS
from host_reads import strict_sync_passes
from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request, load_model
from esp_worker.model.load import SHIPPED_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

METHODS = [dict(method="ar"), dict(method="esp", num_masks=1, block_complexity=30),
           dict(method="esp", num_masks=2, block_complexity=30, tree="dynamic"), dict(method="pld", block_complexity=10),
           dict(method="hybrid", block_complexity=30), dict(method="hybrid", block_complexity="auto")]


@pytest.fixture(scope="module")
def few_layer_1b(tmp_path_factory):
    """The Llama-3.2-1B shape (hidden 2048, 32 heads, 8 key/value heads, vocabulary 128256, llama3 rotary) with two
    layers and random weights, float32 on CUDA."""
    raw = json.loads((SHIPPED_CONFIGS / "llama-1b.json").read_text())
    raw["num_hidden_layers"] = 2
    path = tmp_path_factory.mktemp("llama-1b-2l") / "config.json"
    path.write_text(json.dumps(raw))
    return load_model(ModelConfig(name_or_path=f"random:{path}", device="cuda", dtype="float32"))


def _generate(lm, graphs: bool, params: GenerationParams, batch: int = 4, **setting):
    eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=graphs, **setting))
    outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return eng, outs


@pytest.mark.parametrize("setting", range(len(METHODS)))
@pytest.mark.parametrize("batch", [1, 4])
def test_replayed_passes_are_the_eager_engines_float32_1b_shape(few_layer_1b, setting, batch):
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    eager = _generate(few_layer_1b, False, params, batch, **METHODS[setting])[1]
    eng, graphed = _generate(few_layer_1b, True, params, batch, **METHODS[setting])
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager], METHODS[setting]
    g = eng.stats.graphs
    assert g.captured > 0 and g.graph_bytes > 0 and g.graph_passes > 0
    assert g.graph_passes + sum(g.eager_passes.values()) == eng.stats.decode_passes
    assert set(g.eager_passes) <= {"new_shape"}  # nothing else keeps a pass from its graph here


@pytest.mark.parametrize("setting", [0, 4])
def test_replayed_log_probabilities_are_the_eager_engines_float32_1b_shape(few_layer_1b, setting):
    """GenerationParams.top_logprobs in replayed passes: the eager engine's tokens, log-probabilities to rounding."""
    params = GenerationParams(max_new_tokens=24, ignore_eos=True, top_logprobs=3)
    eager = _generate(few_layer_1b, False, params, **METHODS[setting])[1]
    eng, graphed = _generate(few_layer_1b, True, params, **METHODS[setting])
    assert eng.stats.graphs.graph_passes > 0
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4)
        assert [[t for t, _ in x] for x in g.top_logprobs] == [[t for t, _ in x] for x in e.top_logprobs]


@pytest.mark.parametrize("setting", [1, 2, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_probe_stage_drafts_what_the_host_probe_drafts_on_cuda(few_layer_1b, setting, temperature):
    """ESP's and the hybrid's probe as the replayed pass's last stage (engine.cuda_graphs_probe) against the same
    engine probing on the host after each replay: the same tokens and per-request statistics on CUDA."""
    params = GenerationParams(max_new_tokens=40, ignore_eos=True, temperature=temperature, seed=3)
    eng, staged = _generate(few_layer_1b, True, params, 4, **METHODS[setting])
    host = _generate(few_layer_1b, True, params, 4, cuda_graphs_probe=False, **METHODS[setting])[1]
    assert eng.stats.graphs.probe_passes > 0
    for s, h in zip(staged, host):
        assert s.token_ids == h.token_ids, METHODS[setting]
        assert dataclasses.replace(s.stats, time_s=0.0) == dataclasses.replace(h.stats, time_s=0.0), METHODS[setting]


@pytest.mark.parametrize("backend", ["cudnn", "efficient", "math"])
@pytest.mark.parametrize("setting", [0, 1])
def test_attention_backends_replayed_are_the_eager_engines_float32_1b_shape(few_layer_1b, backend, setting):
    """engine.attention_backend: replayed passes give the eager engine's tokens under each decode attention kernel
    (float32: cudnn falls back to math)."""
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    setting = dict(METHODS[setting], attention_backend=backend)
    eager = _generate(few_layer_1b, False, params, 4, **setting)[1]
    eng, graphed = _generate(few_layer_1b, True, params, 4, **setting)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager], setting
    assert eng.stats.graphs.graph_passes > 0


def test_plain_replayed_decoding_is_generate_float32_1b_shape(few_layer_1b):
    lm = few_layer_1b
    eng, outs = _generate(lm, True, GenerationParams(max_new_tokens=40), 1, method="ar")
    assert eng.stats.graphs.eager_passes == {}  # plain passes are captured at start-up
    for p, o in zip(PROMPTS, outs):
        ids = lm.tokenizer(p, return_tensors="pt").input_ids.to("cuda")
        with torch.inference_mode():
            ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    eos_token_id=list(lm.eos_token_ids), pad_token_id=2)
        assert o.token_ids == ref[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("setting", [0, 1, 3, 4])
def test_seeded_sampling_replayed_is_the_eager_engines(setting):
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda", dtype="float32"))
    params = GenerationParams(max_new_tokens=48, temperature=1.0, top_p=0.9, seed=7)
    eager = _generate(lm, False, params, **METHODS[setting])[1]
    eng, graphed = _generate(lm, True, params, **METHODS[setting])
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert eng.stats.graphs.graph_passes > 0


@pytest.mark.parametrize("setting", range(len(METHODS)))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_synchronisation_inside_a_replayed_pass(monkeypatch, setting, temperature):
    """torch.cuda.set_sync_debug_mode("error") over every pass but its one Rows.read_back (and, under auto, a pass
    right after rows joined or left: tests/engine/test_host_sync.py); most passes are replayed graphs."""
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda"))
    params = GenerationParams(max_new_tokens=64, temperature=temperature, seed=1)
    with strict_sync_passes(monkeypatch, METHODS[setting].get("block_complexity") == "auto"):
        eng, outs = _generate(lm, True, params, **METHODS[setting])
    assert all(len(o.token_ids) > 0 for o in outs)
    g = eng.stats.graphs
    assert g.graph_passes > eng.stats.decode_passes // 2, (g.graph_passes, dict(g.eager_passes))


@pytest.mark.parametrize("setting", [0, 1, 3, 4, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_passes_run_ahead_are_the_engines_that_reads_each_float32_1b_shape(few_layer_1b, batch, setting):
    """engine.cuda_graphs_run_ahead: passes launched before the last one's read (its values copied to pinned host
    memory behind it), plain and drafting. Stop ids that end rows mid-batch and per-request limits: the same tokens,
    finish reasons and (at a fixed block complexity) statistics as reading every pass; passes ran ahead. Under
    `auto` (the hybrid's) the policy plans from the read before, so its sizes may differ, never its tokens."""
    lm = few_layer_1b
    first = _generate(lm, True, GenerationParams(max_new_tokens=40, ignore_eos=True), batch, method="ar")[1]
    stops = [first[0].token_ids[6], first[1].token_ids[15]]  # within rows 0 and 1's limits (10 and 19 tokens)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=10 + 9 * i, stop_token_ids=stops))
            for i, p in enumerate(PROMPTS)]
    outs = {}
    for ahead in (False, True):
        eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=True, cuda_graphs_run_ahead=ahead,
                                      **METHODS[setting]))
        outs[ahead] = eng.generate(reqs)
    auto = METHODS[setting].get("block_complexity") == "auto"
    for a, b in zip(outs[True], outs[False]):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        if not auto:
            assert a.stats.committed_histogram == b.stats.committed_histogram
            assert a.stats.num_decode_passes == b.stats.num_decode_passes
    assert "stop" in {o.finish_reason for o in outs[True]}
    # a drafting pass that may reach a row's limit is read before the next: fewer run ahead in these short rows
    assert eng.stats.graphs.ahead_passes > (0 if auto else eng.stats.decode_passes // (2 if setting == 0 else 4))


@pytest.mark.parametrize("setting", [0, 4])
def test_an_engine_that_raised_mid_batch_replays_the_next_batches_right_float32_1b_shape(few_layer_1b, setting):
    """A job's actor runs the rows of a batch the engine raised in again, alone, on the same engine
    (jobs/run/worker.py). After an error in the middle of a batch (here after its fifth pass, a plain pass run
    ahead for `ar`), the engine's graphs and pinned slab give the eager engine's tokens, alone and batched."""
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    eager = _generate(few_layer_1b, False, params, 4, **METHODS[setting])[1]
    eng = Engine(few_layer_1b, EngineConfig(max_batch_size=4, cuda_graphs=True, **METHODS[setting]))
    step, passes = eng._step, []

    def raising_once(rows):
        step(rows)
        passes.append(len(rows))
        if len(passes) == 5:
            raise RuntimeError("raised mid-batch")

    eng._step = raising_once
    reqs = [Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)]
    with pytest.raises(RuntimeError, match="raised mid-batch"):
        eng.generate(reqs)
    alone = [eng.generate([r])[0] for r in reqs]
    batched = eng.generate(reqs)
    want = [o.token_ids for o in eager]
    assert [o.token_ids for o in alone] == want and [o.token_ids for o in batched] == want, METHODS[setting]
    assert eng.stats.graphs.graph_passes > 0


@pytest.mark.parametrize("setting", [0, 4])
def test_rows_spilled_from_the_pinned_slab_then_back_float32_1b_shape(few_layer_1b, monkeypatch, setting):
    """Rows past the pinned slots whose grown slab would not fit the device (free memory patched below 8 rows of
    their length) run eagerly in a cache of their own; the next batch, short enough for the slab, moves back and
    replays its graphs. Both give the eager engine's tokens."""
    import esp_worker.memory

    long, short = GenerationParams(max_new_tokens=40, ignore_eos=True), GenerationParams(max_new_tokens=8, ignore_eos=True)
    prompts = [PROMPTS[:2], PROMPTS[1:3]]
    eager = Engine(few_layer_1b, EngineConfig(max_batch_size=8, cuda_graphs=False, **METHODS[setting]))
    want = [[o.token_ids for o in eager.generate([Request(id=str(i), prompt=p, params=params)
                                                   for i, p in enumerate(batch)])]
            for batch, params in zip(prompts, (long, short))]
    eng = Engine(few_layer_1b, EngineConfig(max_batch_size=8, cuda_graphs=True, cuda_graph_max_len=64,
                                            **METHODS[setting]))
    monkeypatch.setattr(esp_worker.memory, "free_bytes", lambda device: 400 * eng.slot_bytes)
    got = []
    for batch, params in zip(prompts, (long, short)):
        got.append([o.token_ids for o in eng.generate([Request(id=str(i), prompt=p, params=params)
                                                       for i, p in enumerate(batch)])])
        if not got[1:]:
            assert eng.stats.graphs.eager_passes["spilled"] > 0 and eng.graphs.cache.pinned_slab.shape[4] == 64
            eng.stats.reset_timing()
    assert got == want, METHODS[setting]
    assert not eng.graphs.cache.spilled and eng.stats.graphs.graph_passes > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_synchronisation_in_passes_run_ahead(monkeypatch, temperature):
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda"))
    params = GenerationParams(max_new_tokens=64, temperature=temperature, seed=1)
    with strict_sync_passes(monkeypatch, False):
        eng, outs = _generate(lm, True, params, method="ar", cuda_graphs_run_ahead=True)
    assert all(len(o.token_ids) > 0 for o in outs)
    assert eng.stats.graphs.ahead_passes > eng.stats.decode_passes // 2


def test_bfloat16_replayed_1b_shape_finishes_with_consistent_statistics(tmp_path):
    raw = json.loads((SHIPPED_CONFIGS / "llama-1b.json").read_text())
    raw["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    lm = load_model(ModelConfig(name_or_path=f"random:{tmp_path}", device="cuda", dtype="bfloat16"))
    for setting in METHODS:
        eng, outs = _generate(lm, True, GenerationParams(max_new_tokens=32, ignore_eos=True), **setting)
        for o in outs:
            st = o.stats
            assert len(o.token_ids) == 32 == st.num_generated_tokens and o.finish_reason == "length"
            assert st.num_accepted_drafts <= st.num_drafted_tokens
        assert eng.stats.graphs.graph_passes > 0


@pytest.mark.parametrize("attention", ["torch", "flex"])
@pytest.mark.parametrize("setting", [0, 3])
def test_compiled_replayed_passes_float32_1b_shape(few_layer_1b, setting, attention):
    """engine.cuda_graphs_compile: Inductor's kernels captured and replayed, with SDPA's kernel or FlexAttention's
    (engine.attention_backend=flex). Float32 on the 1B shape: the tokens of the eager engine (Inductor and Flex
    round differently, so this is the check that they do not flip a choice here) and no graph break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    params = GenerationParams(max_new_tokens=40, ignore_eos=True)
    eager = _generate(few_layer_1b, False, params, 2, **METHODS[setting])[1]
    eng, compiled = _generate(few_layer_1b, True, params, 2, cuda_graphs_compile=True, attention_backend=attention,
                              **METHODS[setting])
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager], METHODS[setting]
    assert not torch._dynamo.utils.counters["graph_break"]
    g = eng.stats.graphs
    assert g.captured > 0 and g.graph_passes > 0 and set(g.eager_passes) <= {"new_shape"}
