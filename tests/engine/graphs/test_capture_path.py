"""The capture path of engine.cuda_graphs driven on a CPU: a stand-in for `torch.cuda.graph` whose replay runs the
captured function again into the capture's outputs. What runs is the CUDA path's own bookkeeping: plain passes
captured at start-up, other classes at their second pass (the first runs eagerly, counted and not timed for
`auto`), the warm-up and the capture executing the pass before its replay (a pass is idempotent), the graph
limit, the slab's growth dropping every graph, and the cost curve timed from captured chain passes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import PROMPTS, reference, tiny
from host_reads import SETTINGS
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker import engine as engine_module
from esp_worker.graphs import runner as graph_runner
from esp_worker.graphs.runner import batch_buckets, capacity_buckets

GREEDY = GenerationParams(max_new_tokens=64)


class _Replayed:
    """A captured function: replay computes it again into the capture's outputs, as a CUDA graph rewrites them."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.out.copy_(self.fn())
        self.replays += 1


def _capture(fn, pool, device):
    fn()  # the warm-up
    # the capture (a CUDA capture records; this one runs: a third run of the pass, as idempotent); its outputs are
    # the graph's own memory, which a replay rewrites in place: a copy here (a compiled step may return an expanded
    # constant, which a replay rewrites through its one element but copy_ cannot write)
    out = fn().clone()
    return _Replayed(fn, out), out


@pytest.fixture
def capturing(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_module, "CAPTURE_GRAPHS", True)
    monkeypatch.setattr(graph_runner, "capture_graph", _capture)
    monkeypatch.setenv("ESP_BATCH_CACHE", str(tmp_path))  # the cost curve of captured passes is measured here


def _run(batch: int, **setting):
    eng = Engine(tiny("llama"), EngineConfig(max_batch_size=batch, cuda_graphs=True, **setting))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GREEDY) for i, p in enumerate(PROMPTS)])
    return eng, outs


@pytest.mark.parametrize("setting", [dict(method="ar"), dict(method="pld", block_complexity=10),
                                     dict(method="esp", num_masks=2, block_complexity=30),
                                     dict(method="hybrid", block_complexity=30),
                                     dict(method="hybrid", block_complexity="auto")])
@pytest.mark.parametrize("batch", [1, 4])
def test_captured_passes_match_generate(capturing, setting, batch):
    eng, outs = _run(batch, **setting)
    for o, r in zip(outs, reference("llama", "sdpa")):
        assert tuple(o.token_ids) == r, setting
    g = eng.stats.graphs
    slots = eng.graphs.cache.slab.shape[4]
    start = [c for c in capacity_buckets(slots) if c <= graph_runner.START_CAPACITY]
    assert g.captured >= len(batch_buckets(batch)) * len(start)  # the plain passes, at start-up
    assert set(g.eager_passes) <= {"new_shape"}
    assert g.graph_passes + g.eager_passes["new_shape"] == eng.stats.decode_passes
    replays = sum(e.graph.replays for e in eng.graphs._entries.values())
    if setting.get("block_complexity") == "auto":
        assert replays > g.graph_passes  # and the cost curve's timed passes
    else:
        assert replays == g.graph_passes
    if setting["method"] == "ar":
        assert not g.eager_passes  # every plain class was captured at start-up


def test_a_class_is_captured_at_its_second_pass_and_its_first_is_not_timed(capturing, monkeypatch):
    eng, _ = _run(1, method="pld", block_complexity=10)
    new = eng.stats.graphs.eager_passes["new_shape"]
    chains = [s for s in eng.graphs._entries if s.num_slots > 1]
    assert chains and new == len(chains)  # one eager pass per class before its capture


def test_engines_in_turn_share_one_runners_graphs(capturing):
    first, _ = _run(4, method="hybrid", block_complexity=30)
    shared = first.graphs
    classes = set(shared._entries)
    settings = (dict(method="hybrid", block_complexity=30), dict(method="ar"), dict(method="pld", block_complexity=10))
    for setting in settings:
        eng = Engine(tiny("llama"), EngineConfig(max_batch_size=4, cuda_graphs=True, **setting), graphs=shared)
        assert eng.graphs is shared
        outs = eng.generate([Request(id=str(i), prompt=p, params=GREEDY) for i, p in enumerate(PROMPTS)])
        for o, r in zip(outs, reference("llama", "sdpa")):
            assert tuple(o.token_ids) == r, setting
        g = eng.stats.graphs  # this engine's own counters
        assert g.graph_passes + g.eager_passes["new_shape"] == eng.stats.decode_passes
        if setting["method"] != "pld":  # classes the first engine met: none runs a first pass eagerly again
            assert not g.eager_passes
        if setting["method"] == "ar":  # and the classes it captured are not captured again
            assert g.captured == 0 and eng.compile_s == 0.0
        classes |= set(shared._entries)
    assert len(shared._entries) == len(classes)
    with pytest.raises(ValueError, match="max_batch_size=2 against 4"):
        Engine(tiny("llama"), EngineConfig(max_batch_size=2, cuda_graphs=True), graphs=shared)
    with pytest.raises(ValueError, match="another model"):
        Engine(tiny("qwen2"), EngineConfig(max_batch_size=4, cuda_graphs=True), graphs=shared)


def test_graph_limit_and_slab_growth(capturing, monkeypatch):
    monkeypatch.setattr(graph_runner, "MAX_GRAPHS", 4)
    eng, outs = _run(4, method="esp", num_masks=1, block_complexity=30)
    assert eng.stats.graphs.eager_passes["graph_limit"] > 0
    for o, r in zip(outs, reference("llama", "sdpa")):
        assert tuple(o.token_ids) == r
    monkeypatch.setattr(graph_runner, "MAX_GRAPHS", 512)
    eng = Engine(tiny("llama"), EngineConfig(method="pld", block_complexity=10, max_batch_size=4, cuda_graphs=True,
                                             cuda_graph_max_len=48))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GREEDY) for i, p in enumerate(PROMPTS)])
    for o, r in zip(outs, reference("llama", "sdpa")):
        assert tuple(o.token_ids) == r
    assert eng.stats.graphs.eager_passes["capacity"] > 0
    assert all(e.out is not None for e in eng.graphs._entries.values())
    assert {s.capacity for s in eng.graphs._entries} <= set(capacity_buckets(eng.graphs.cache.slab.shape[4]))


def test_the_auto_policy_calibrates_on_captured_passes(capturing, tmp_path):
    eng, _ = _run(2, method="pld", block_complexity="auto", auto_max_block=8)
    curves = list(tmp_path.glob("cost-*.json"))
    assert len(curves) == 1  # measured with the graphs' passes and cached apart from the eager curve
    chains = {s.num_slots for s in eng.graphs._entries if s.in_place}
    assert {1, 2, 4, 8} <= chains  # the curve's chain passes (Q = 1 .. 8) were captured


def test_a_curve_of_compiled_passes_is_cached_apart(capturing, tmp_path):
    """The cost curve's cache key tells the replayed passes of engine.cuda_graphs_compile from the plain replayed
    ones (another machine again): each kind is measured and cached on its own."""
    from esp_worker.auto.policy import calibrate

    eng, _ = _run(1, method="pld", block_complexity=10)
    passes = eng.graphs.pass_timer
    calibrate(eng.runner, 1, 4, passes=passes)
    calibrate(eng.runner, 1, 4, passes=passes, passes_kind="graphs+compiled")
    calibrate(eng.runner, 1, 4, passes=passes)  # found in the cache
    assert len(list(tmp_path.glob("cost-*.json"))) == 2


def test_the_rotary_table_grows_with_the_slab():
    """After the slab grows, the step's rotary table covers the new slots (the same values where both have them)."""
    from esp_worker.graphs.step import StepModel
    from esp_worker.model.runner import ModelRunner

    runner = ModelRunner(tiny("llama"))
    model = StepModel.of(runner, 100)
    assert model.rope.cos.shape[0] >= 100 and model.covering(100) is model
    grown = model.covering(900).rope
    assert grown.cos.shape[0] >= 900 and grown.signed_sin.shape[0] >= 900
    n = model.rope.cos.shape[0]
    assert torch.equal(grown.cos[:n], model.rope.cos) and torch.equal(grown.signed_sin[:n], model.rope.signed_sin)
    capped = model.covering(10**6)  # never past the model's context (1024 positions)
    assert capped.rope.cos.shape[0] >= 1024


@pytest.mark.parametrize("setting, ahead", [(i, False) for i, s in enumerate(SETTINGS) if s["method"] != "dmtd"]
                         + [(i, True) for i, s in enumerate(SETTINGS)
                            if s["method"] == "ar" or s.get("block_complexity") == "auto"])  # dmtd: eager
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_at_most_one_host_read_per_captured_pass(capturing, monkeypatch, setting, temperature, ahead):
    """tests/engine/test_host_sync.py's count (tests/host_reads.py) over the capture path: the copies into a class's buffers, its
    capture and replay, and the eager end of the pass read nothing from the device but the pass's one read. Plain
    passes run ahead (engine.cuda_graphs_run_ahead, on by default) read the pass before instead; a pass after
    which rows ended is read at once as well (so is one that may reach a row's limit), so such a step makes two
    reads; no pass is read twice. Under `auto` run ahead, the looks' masses ride in those reads too."""
    from host_reads import count_reads_per_pass

    from esp_worker import sampling

    monkeypatch.setattr(engine_module, "PREPARE_LOOKS", True)
    monkeypatch.setattr(sampling, "UNIFORM_CHUNK", 32)  # sampled rows refill their uniforms inside passes
    eng = Engine(tiny("llama"), EngineConfig(max_batch_size=4, cuda_graphs=True, cuda_graphs_run_ahead=ahead,
                                             **SETTINGS[setting]))
    params = GenerationParams(max_new_tokens=32, temperature=temperature, seed=1)
    with count_reads_per_pass(monkeypatch) as seen:
        outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
    assert all(o.error is None for o in outs) and seen["passes"] > 0
    auto = SETTINGS[setting].get("block_complexity") == "auto"
    over = [(i, n, changed) for i, (n, changed) in enumerate(seen["per_pass"]) if n > 1 + (auto and changed)]
    if ahead:  # a step may take two reads (the pass before, and its own), but no pass is read twice
        sampled_drafting = temperature > 0 and SETTINGS[setting]["method"] != "ar"  # read every pass
        assert (eng.stats.graphs.ahead_passes > 0) != sampled_drafting and all(n == 2 for _, n, _ in over), over
        reads = sum(n for n, _ in seen["per_pass"])
        looks = sum(changed for _, changed in seen["per_pass"]) if auto else 0  # a look's own read, after rows changed
        assert reads <= eng.stats.decode_passes + looks, (reads, eng.stats.decode_passes, looks)
    else:
        assert not over, (over[:5], seen["where"])
    assert eng.stats.graphs.graph_passes > 0


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(method="ar"), dict(method="pld", block_complexity=10)])
def test_compiled_steps_are_captured_and_match_generate(capturing, setting):
    """engine.cuda_graphs_compile: each class's pass is decode_step under Inductor, captured (here: the stand-in)
    as it comes (no start-up captures: each would be a compile), with no graph break; the tokens are generate's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = Engine(tiny("llama"), EngineConfig(max_batch_size=4, cuda_graphs=True, cuda_graphs_compile=True, **setting))
    # rows that end one after another (batch buckets 4, 2, 1) and one that goes on past 256 slots (capacities)
    lengths = (40, 64, 20, 300)
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=n))
                         for i, (p, n) in enumerate(zip(PROMPTS, lengths))])
    for o, r, n in zip(outs, reference("llama", "sdpa"), lengths):
        assert tuple(o.token_ids[:64]) == r[:n], setting
    g = eng.stats.graphs
    assert eng.graphs.compiled is not None and g.captured == len(eng.graphs._entries) >= 1
    assert g.graph_passes + g.eager_passes["new_shape"] == eng.stats.decode_passes
    assert not torch._dynamo.utils.counters["graph_break"]
    # batch and capacity are dynamic from the first compile (StepInputs.mark_dynamic): one compile per block, per
    # batch of one row or more, and per capacity of the slab's whole row or less (a view of a whole row is
    # contiguous, which torch specialises on); not one more each time a size changes
    slab = eng.graphs.cache.slab.shape[4]
    kinds = {(dataclasses.replace(s, batch=0, capacity=0), s.batch == 1, s.capacity == slab)
             for s in eng.graphs._entries}
    assert len({s.batch for s in eng.graphs._entries}) > 1 and len({s.capacity for s in eng.graphs._entries}) > 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= len(kinds)
    with pytest.raises(ValueError, match="cuda_graphs_compile=False against True"):
        Engine(tiny("llama"), EngineConfig(max_batch_size=2, cuda_graphs=True), graphs=eng.graphs)


@pytest.mark.slow
def test_flex_attention_steps_match_generate(capturing):
    """engine.attention_backend=flex: the compiled replayed passes attend through FlexAttention's block mask (its
    visibility is tested against the bias in tests/engine/model/test_flex.py), each class compiled with its own
    sizes; the tokens are generate's (ESP's trees with masks, one row at a time: each class is a compile)."""
    arch, batch, setting = "llama", 1, dict(method="esp", num_masks=2, block_complexity=30)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lm = tiny(arch)
    eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=True, cuda_graphs_compile=True,
                                  attention_backend="flex", **setting))
    assert eng.graphs.model.flex and not eng.graphs.model.dynamic_shapes
    lengths = (40, 24)
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=n))
                         for i, (p, n) in enumerate(zip(PROMPTS, lengths))])
    for o, r, n in zip(outs, reference(arch, "sdpa"), lengths):
        assert o.error is None and tuple(o.token_ids) == r[:n], setting
    g = eng.stats.graphs
    assert g.captured == len(eng.graphs._entries) >= 1 and g.graph_passes > 0
    assert not torch._dynamo.utils.counters["graph_break"]
    with pytest.raises(ValueError, match="attention_backend=torch against flex"):  # its graphs hold flex kernels
        Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=True, cuda_graphs_compile=True), graphs=eng.graphs)


def test_flex_attention_needs_compiled_graphs():
    with pytest.raises(ValueError, match="attention_backend=flex .* needs engine.cuda_graphs_compile=true"):
        EngineConfig(attention_backend="flex").validate()


def test_compiled_steps_need_graphs():
    with pytest.raises(ValueError, match="needs engine.cuda_graphs=auto or true"):
        EngineConfig(cuda_graphs=False, cuda_graphs_compile=True).validate()
