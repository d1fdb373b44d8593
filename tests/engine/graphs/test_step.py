"""The captured pass (`graphs.step.decode_step`) against today's eager pass, pass by pass, from the same state.

Every decode pass of a job runs twice from one snapshot of the rows and the KV slab: the eager forward and settle,
then the static step over its shape class's buffers. The integers (committed tokens, path, counts, stops) are
bitwise equal; with the class's capacity set to the eager view's key count the hidden states, logits and KV
slab are bitwise equal too, and over the capacity bucket (more key slots, masked) they agree to float rounding.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.graphs.step import decode_step

SETTINGS = [
    dict(method="ar"),
    dict(method="pld", block_complexity=10),
    dict(method="esp", num_masks=1, block_complexity=30, tree="dynamic"),
    dict(method="esp", num_masks=2, block_complexity=30, tree="static"),
    dict(method="hybrid", num_masks=1, block_complexity=30),
]


def _snapshot(rows):
    u = rows.uniforms
    return rows.cache.slab.clone(), u.buf.clone(), u.ptr.clone(), list(u.base)


def _restore(rows, snap):
    slab, buf, ptr, base = snap
    rows.cache.slab.copy_(slab)
    u = rows.uniforms
    u.buf, u.ptr, u.base = buf.clone(), ptr.clone(), list(base)


class _Twin:
    """Patches Engine._replay: each pass first runs eagerly, is compared, then the state is restored and the static
    path runs (and is compared) as the job's pass."""

    def __init__(self):
        self.passes = 0
        self.exact = 0  # passes whose exact-capacity step was compared bitwise

    def replay(self, engine, rows, block, original):
        b = len(rows)
        snap = _snapshot(rows)
        view_len = max(rows.lens) - 1 + block.num_inputs
        out = engine._forward(rows, block)
        res = engine._verify(rows, block, out.slot_logits)
        n_fin, reason = engine._stops(rows, res.committed, res.num_committed)
        rows.keep_path(block.tree, res.path_slots)
        eager_slab = rows.cache.slab[:, :, :b, :, :view_len].clone()
        eager_ptr = rows.uniforms.ptr.clone()
        _restore(rows, snap)

        graphed = original(rows, block)
        assert graphed is not None
        v = graphed.verified
        assert torch.equal(v.committed, res.committed) and torch.equal(v.num_committed, res.num_committed)
        assert torch.equal(v.path_slots, res.path_slots) and torch.equal(v.last_slot, res.last_slot)
        if res.last_token is not None:
            assert torch.equal(v.last_token, res.last_token)
        assert torch.equal(graphed.num_kept, n_fin) and torch.equal(graphed.reason, reason)
        assert torch.equal(rows.uniforms.ptr, eager_ptr)
        torch.testing.assert_close(graphed.out.hidden, out.hidden, rtol=1e-5, atol=1e-5)
        if graphed.out.slot_logits is not None:  # a drafter that reads them (the graph keeps none)
            torch.testing.assert_close(graphed.out.slot_logits, out.slot_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows.cache.slab[:, :, :b, :, :view_len], eager_slab, rtol=1e-5, atol=1e-5)

        # the same step reading exactly the eager view's key slots: bitwise the eager pass
        graphs = engine.graphs
        shape = next(s for s, e in graphs._entries.items() if e.out is not None and e.out.hidden.data_ptr()
                     == graphed.out.hidden.data_ptr())
        after = _snapshot(rows)
        _restore(rows, snap)
        inp = graphs._entries[shape].inp
        exact = decode_step(graphs.model, rows.cache.slab, dataclasses.replace(inp, key_slots=inp.key_slots[:view_len]),
                            dataclasses.replace(shape, capacity=view_len))
        if block.num_inputs == 1 and rows.common_length() is not None:
            # the eager plain pass over rows of one length passes no mask (transformers' attention, the keys repeated
            # per query head); the step always masks (query heads packed per key head): rounding apart
            same = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5) or True  # noqa: E731
        else:
            same = torch.equal
            self.exact += 1
        logits = graphs.model.head(exact.hidden[:b, :block.tree.num_slots])  # the step's own LM head
        assert same(exact.hidden[:b], out.hidden) and same(logits, out.slot_logits)
        assert same(rows.cache.slab[:, :, :b, :, :view_len], eager_slab)
        assert torch.equal(exact.committed[:b], res.committed) and torch.equal(exact.ints[3, :b], n_fin)
        _restore(rows, after)
        rows.uniforms.ptr = eager_ptr  # as the static pass left it
        self.passes += 1
        return graphed


def _run_twin(monkeypatch, arch, setting, batch, temperature):
    twin = _Twin()
    original = Engine._replay

    def replay(self, rows, block):
        return twin.replay(self, rows, block, lambda r, b: original(self, r, b))

    monkeypatch.setattr(Engine, "_replay", replay)
    lm = tiny(arch)
    eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=True, **setting))
    params = GenerationParams(max_new_tokens=24, temperature=temperature, seed=3)
    outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
    assert all(o.error is None for o in outs)
    assert twin.passes == eng.stats.decode_passes > 0
    return twin


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_step_is_the_eager_pass_every_architecture(monkeypatch, arch, batch, temperature):
    """ESP with a dynamic tree (masks, per-row layouts, KV moves) on Llama, Qwen2, Qwen3 and Mistral, greedy and
    seeded sampling: every pass's static step against the eager pass."""
    _run_twin(monkeypatch, arch, SETTINGS[2], batch, temperature)


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("batch", [1, 4])
def test_static_step_is_the_eager_pass_every_block_kind(monkeypatch, setting, batch):
    """Root-only, chains, one-mask fans, static and dynamic trees with several masks, the hybrid's trees."""
    twin = _run_twin(monkeypatch, "llama", SETTINGS[setting], batch, 0.0)
    if setting:  # a block of several inputs is masked eagerly too: every pass was compared bitwise
        assert twin.exact == twin.passes
