"""A drafter's work after the pass as the last stage of the replayed pass (`graphs.hooks.StepHooks`,
`drafters.esp.ProbeStage`): ESP's and the hybrid's probe, the hybrid's logit store.

The stage computes, from the pass's own hidden states and logits, what the drafter's `observe` and the next
`propose` compute on the host after the replay: the mask EMA, the candidates (of the masks of the last accepted
slot, or of its mask owner), ESP's next static tree, the top K along the accepted path. So an engine whose passes
end with the stage drafts exactly what one whose drafter works on the host drafts (engine.cuda_graphs_probe=false):
the same tokens and the same per-request statistics (every accepted draft by proposer, every pass), greedy and
sampled, at batch 1 and 4, on a model that accepts drafts (the trained `esp-tiny-llama`) and on tiny random models
of every architecture.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine_helpers import ARCHS, PROMPTS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request
from esp_worker.model.load import load_model
from shared_data import REPO, TINY_LLAMA, TINY_PROMPTS, shared

HEADS = REPO / "heads" / "esp-tiny-llama-rank4-warm"  # CP heads trained on the trained model (heads/README.md)

SETTINGS = [
    dict(method="esp", num_masks=1, block_complexity=30, tree="static"),  # the benchmark's ESP: a fan of 14
    dict(method="esp", num_masks=2, block_complexity=60, tree="static"),  # the paper's deeper static tree
    dict(method="esp", num_masks=3, block_complexity=30, tree="dynamic"),  # candidates only: the host builds it
    dict(method="esp", num_masks=1, block_complexity="auto"),  # sizes other than the configured one
    dict(method="hybrid", num_masks=1, block_complexity=30),  # masks on some slots; the logit store's top K
    dict(method="hybrid", num_masks=2, block_complexity=30),
    dict(method="hybrid", num_masks=1, block_complexity="auto"),  # the default: plain passes and the n-gram set too
    dict(method="hybrid", num_masks=1, block_complexity=30, heads_path=str(HEADS)),  # trained heads as a proposer
]


def _outputs(lm, setting: dict, batch: int, params: list[GenerationParams], prompts, stage: bool):
    # engine.cuda_graphs_probe=false: the drafter probes on the host after each replay
    setting = {"cuda_graphs": True, **setting}
    eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs_probe=stage, **setting))
    outs = eng.generate([Request(id=str(i), prompt=p, params=x) for i, (p, x) in enumerate(zip(prompts, params))])
    assert all(o.error is None for o in outs)
    return outs, eng.stats.graphs


def _same_drafts(lm, setting: dict, batch: int, params: list[GenerationParams], prompts):
    """The staged engine's outputs and graph statistics, having checked them against the host probe's."""
    staged, graphs = _outputs(lm, setting, batch, params, prompts, True)
    host, host_graphs = _outputs(lm, setting, batch, params, prompts, False)
    assert host_graphs.probe_passes == 0
    if setting["block_complexity"] != "auto":  # (auto may decode plainly throughout where it measures no gain)
        assert graphs.probe_passes > 0
    for s, h in zip(staged, host):
        assert s.token_ids == h.token_ids and s.finish_reason == h.finish_reason, (setting, s.id)
        if setting["block_complexity"] != "auto":  # auto's sizes follow measured times: its drafts differ run to run
            assert dataclasses.replace(s.stats, time_s=0.0) == dataclasses.replace(h.stats, time_s=0.0), (setting, s.id)
    return staged, graphs


@pytest.fixture(scope="module")
def trained():
    return load_model(ModelConfig(name_or_path=str(shared(TINY_LLAMA))))


CASES = [(setting, batch, 0.0) for setting in range(len(SETTINGS)) for batch in (1, 4)] + \
    [(0, 4, 1.0), (1, 1, 1.0), (4, 4, 1.0)]  # seeded sampling


@pytest.mark.slow
@pytest.mark.parametrize("setting, batch, temperature", CASES)
def test_the_probe_stage_drafts_what_the_host_probe_drafts(trained, setting, batch, temperature):
    rows = [json.loads(line) for line in open(shared(TINY_PROMPTS))][:5]
    params = [GenerationParams(max_new_tokens=32, temperature=temperature, seed=5 + i) for i in range(len(rows))]
    outs, _ = _same_drafts(trained, SETTINGS[setting], batch, params, [r["prompt"] for r in rows])
    if SETTINGS[setting]["block_complexity"] != "auto":  # drafts were accepted: the comparison has teeth
        assert sum(o.stats.num_accepted_drafts for o in outs) > len(outs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", [1, 4])
def test_the_probe_stage_on_every_architecture_keeps_generates_tokens(arch, setting):
    lm = tiny(arch)
    params = [GenerationParams(max_new_tokens=64)] * len(PROMPTS)
    outs, _ = _same_drafts(lm, SETTINGS[setting], 4, params, PROMPTS)
    for o, r in zip(outs, reference(arch, "sdpa")):
        assert tuple(o.token_ids) == r, (arch, o.id)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [1, 4])
def test_staged_and_eager_passes_mix(trained, setting):
    """A slab pinned at 48 slots: passes of rows that outgrow it run eagerly (the drafter probes on the host), the
    slab grows and later passes end with the stage again; rows join and leave between them. The same drafts."""
    rows = [json.loads(line) for line in open(shared(TINY_PROMPTS))][:5]
    params = [GenerationParams(max_new_tokens=16 + 8 * i) for i in range(len(rows))]
    small = dict(SETTINGS[setting], cuda_graph_max_len=48)
    _, graphs = _same_drafts(trained, small, 2, params, [r["prompt"] for r in rows])
    assert graphs.eager_passes["capacity"] > 0 and graphs.probe_passes > 0
