"""engine.compile=true (esp_worker/compiled.py): compiled layers keep greedy decoding lossless on CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import PROMPTS, reference, run, tiny
from esp_worker import EngineConfig, GenerationParams
from esp_worker.model.compiled import CompileUnsupported
from esp_worker.model.errors import ModelLoadError
from esp_worker.model.runner import ModelRunner

GREEDY = GenerationParams(max_new_tokens=64)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_engine_matches_generate(arch):
    lm = tiny(arch)
    ref = reference(arch, "sdpa")
    for cfg, batch in [
        (EngineConfig(method="ar", compile=True), 4),
        (EngineConfig(method="esp", block_complexity=10, compile=True), 1),
        (EngineConfig(method="hybrid", block_complexity=30, compile=True), 4),
    ]:
        cfg.max_batch_size = batch
        outs = run(lm, cfg, GREEDY)
        for o, r in zip(outs, ref):
            assert o.error is None, o.error
            assert tuple(o.token_ids) == r, f"compiled {cfg.method} {arch} batch {batch}: diverged from generate"


@pytest.mark.slow
def test_compiled_layers_compute_the_direct_forward():
    """The compiled pieces run (a graph is made and timed) and give the eager hidden states up to rounding."""
    torch._dynamo.reset()  # compile here, not reuse graphs of an earlier test
    lm = tiny("llama")
    eager, comp = ModelRunner(lm), ModelRunner(lm, compile=True)
    from test_decoder import _passes

    outs = [_passes(r, 1) for r in (eager, comp)]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert comp.direct.compiled.graphs >= 2 and comp.direct.compiled.compile_s > 0


@pytest.mark.slow
def test_one_graph_each_serves_every_batch_block_and_length():
    """Prefills, tree passes, plain passes of several rows and of one row (a size of 1, which torch otherwise
    compiles apart) all run the same two graphs: one `pre`, one `post`."""
    from esp_worker import Engine, Request

    torch._dynamo.reset()  # count the graphs compiled here, not reuse an earlier test's
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="hybrid", block_complexity=30, compile=True, max_batch_size=4))
    ref = reference("llama", "sdpa")
    for prompts in ([0, 1, 2, 3], [1]):  # four rows, then a single row's plain passes
        outs = eng.generate([Request(id=str(i), prompt=PROMPTS[i], params=GREEDY) for i in prompts])
        assert [tuple(o.token_ids) for o in outs] == [ref[i] for i in prompts]
    assert eng.runner.direct.compiled.graphs == 2


def test_compile_needs_the_direct_forward():
    lm = dataclasses.replace(tiny("llama"), direct_forward=False)
    with pytest.raises(ModelLoadError, match="engine.compile needs the direct forward"):
        ModelRunner(lm, compile=True)
    assert issubclass(CompileUnsupported, ModelLoadError)
