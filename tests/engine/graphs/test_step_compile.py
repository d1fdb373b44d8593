"""The captured pass under torch.compile(fullgraph=True, dynamic=False): one graph, no break, no recompilation.

`decode_step` must be one graph per shape class (what a CUDA graph captures is then exactly that graph's
kernels). Traced through AOTAutograd (`aot_eager`: the traced graph runs the same aten ops) its results are
bitwise the eager step's, which `test_step.py` holds to today's eager pass; with Inductor (its own fused
reductions) the integers are bitwise and the floats agree to rounding. Over 200 passes of one class with other
values (tokens, lengths, trees) nothing recompiles. Inputs are a real job's buffers (a class's last pass).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.graphs.step import decode_step

pytestmark = pytest.mark.slow


def _a_class(arch: str, batch: int, temperature: float, method: dict, logprobs: Optional[int] = None):
    """(graph runner, shape class, its buffers) after a short job: the tree class of the largest bucket (for ESP and
    the hybrid, one that ends with the drafter's stage)."""
    eng = Engine(tiny(arch), EngineConfig(max_batch_size=batch, cuda_graphs=True, **method))
    params = GenerationParams(max_new_tokens=12, temperature=temperature, seed=5, logprobs=logprobs is not None,
                              top_logprobs=logprobs or 0)
    eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
    g = eng.graphs
    shape = max((s for s in g._entries if s.num_slots > 1), key=lambda s: (s.batch, s.capacity))
    assert shape.sampling == (temperature > 0) and shape.batch == batch and shape.logprobs == logprobs
    assert (shape.probe is not None) == (method["method"] in ("esp", "hybrid"))
    return g, shape, g._entries[shape].inp


def _compare(g, shape, inp, fn, bitwise: bool) -> None:
    """fn(step) vs the eager step from the same slab: outputs and the slab after."""
    slab = g.cache.slab
    before = slab.clone()
    with torch.inference_mode():
        ref = decode_step(g.model, slab, inp, shape).clone()
        ref_slab = slab.clone()
        slab.copy_(before)
        got = fn(g.model, slab, inp, shape)
    for name in ("ints", "committed", "path_slots"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert (got.probe is None) == (ref.probe is None) == (shape.probe is None)
    assert (got.logprobs is None) == (ref.logprobs is None) == (shape.logprobs is None)
    if ref.logprobs is not None:  # the chosen tokens' and the alternatives' (ids bitwise)
        for a, b in zip(got.logprobs.tensors(), ref.logprobs.tensors()):
            if a is not None and (bitwise or not a.is_floating_point()):
                assert torch.equal(a, b)
            elif a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if ref.probe is not None:  # the drafter's stage: candidates, trees and ids bitwise, m and log-probs to rounding
        for a, b in zip(got.probe.tensors(), ref.probe.tensors()):
            if a is not None and (bitwise or not a.is_floating_point()):
                assert torch.equal(a, b)
            elif a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if bitwise:
        assert torch.equal(got.hidden, ref.hidden)
        assert torch.equal(slab, ref_slab)
    else:
        torch.testing.assert_close(got.hidden, ref.hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(slab, ref_slab, rtol=1e-4, atol=1e-4)


def _compiled(backend: str):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backend)


def _one_graph() -> None:
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_graph_bitwise_the_eager_step(arch, batch, temperature):
    """ESP with two masks and dynamic trees (per-row layouts, KV moves): one graph, bitwise the eager step."""
    g, shape, inp = _a_class(arch, batch, temperature, dict(method="esp", num_masks=2, block_complexity=30))
    _compare(g, shape, inp, _compiled("aot_eager"), bitwise=True)
    _one_graph()


@pytest.mark.parametrize("temperature,top", [(0.0, 0), (1.0, 3)])
def test_a_class_computing_log_probabilities_is_one_graph(temperature, top):
    """Rows asking for their tokens' log-probabilities (GenerationParams.logprobs, top_logprobs): the step computes
    them in the same graph, bitwise the eager step's."""
    g, shape, inp = _a_class("qwen2", 4, temperature, dict(method="hybrid", block_complexity=30), logprobs=top)
    _compare(g, shape, inp, _compiled("aot_eager"), bitwise=True)
    _one_graph()


def _vary(inp, shape, gen: torch.Generator) -> None:
    """Other values of one class's inputs: tokens, each row's length (its block within the capacity), validity,
    uniforms."""
    b, t, q = shape.batch, shape.num_slots, shape.num_inputs
    inp.tokens.copy_(torch.randint(0, inp.stop_table.shape[1], (b, t), generator=gen))
    inp.hist_len.copy_(torch.randint(1, shape.capacity - q + 2, (b,), generator=gen))
    valid = torch.rand((b, t), generator=gen) < 0.8
    valid[:, 0] = True
    inp.valid.copy_(valid)
    if inp.uniforms is not None:
        inp.uniforms.copy_(torch.rand(inp.uniforms.shape, generator=gen))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_recompilation_over_200_passes_of_one_class(temperature):
    g, shape, inp = _a_class("llama", 4, temperature, dict(method="hybrid", block_complexity=30))
    fn = _compiled("aot_eager")
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for _ in range(200):
            _vary(inp, shape, gen)
            fn(g.model, g.cache.slab, inp, shape)
    _one_graph()


def test_inductor_one_graph_tokens_of_the_eager_step():
    """The real compiler: the same tokens, floats to rounding, no recompilation over 200 passes of the class."""
    g, shape, inp = _a_class("llama", 4, 0.0, dict(method="esp", num_masks=1, block_complexity=30))
    fn = _compiled("inductor")
    _compare(g, shape, inp, fn, bitwise=False)
    gen = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for _ in range(200):
            _vary(inp, shape, gen)
            _compare(g, shape, inp, fn, bitwise=False) if _ % 50 == 0 else fn(g.model, g.cache.slab, inp, shape)
    _one_graph()


def test_compiled_step_writes_the_slab_in_place():
    """The KV writes reach the compiler as index_put on the slab itself (which Inductor keeps in place), not as
    scatters into views of it: those became a chain of whole-slab copies per layer, so a compiled pass cost
    time in proportion to the slab (and ran slower than the eager kernels on a GPU)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    g, shape, inp = _a_class("llama", 4, 0.0, dict(method="esp", num_masks=1, block_complexity=30))
    graphs = []

    def keep_forward(gm, example_inputs):
        def forward(fx, _):
            graphs.append(fx)
            return fx.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward)

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(decode_step, fullgraph=True, dynamic=False, backend=keep_forward)(g.model, g.cache.slab, inp,
                                                                                         shape)
    layer_slab = g.cache.slab[0, 0].numel()  # one layer's keys
    big = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"
           and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= layer_slab]
    copies = [op for op in big if any(w in op for w in ("scatter", "copy", "clone", "cat", "stack"))]
    assert not copies, copies
    assert big.count("aten.index_put.default") >= g.model.decoder.base.config.num_hidden_layers  # a write per layer
