"""block_complexity=auto: the size policy on synthetic cost curves, and losslessness under it."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import ARCHS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams
from esp_worker.cost_model import CostCurve
from esp_worker.policy import BlockPolicy, calibrate

BLOCKS = [1, 2, 4, 8, 16, 32, 64]


def curve(cost_of_q) -> CostCurve:
    """A cost curve where one pass of Q tokens per row at batch b costs b-independent cost_of_q(Q)."""
    secs = [[[cost_of_q(q) * (1 + 0.1 * b) for q in BLOCKS] for _ in (64, 512)] for b in (1, 8)]
    return CostCurve([1, 8], [64, 512], BLOCKS, secs)


FLAT = curve(lambda q: 1.0)  # a GPU at small batch: the block is free
STEEP = curve(lambda q: float(q))  # pure compute-bound: a block of Q costs Q passes


def policy(c: CostCurve, k: int = 1) -> BlockPolicy:
    return BlockPolicy(c, lambda n: 1 if n < 0 else (k + 1) * (n + 1), max_nodes=29, max_block=64)


def test_flat_cost_picks_the_largest_tree():
    mass = torch.full((2, 29), 0.05)
    assert policy(FLAT).choose(mass, 2, 100) == 29  # largest size with Q=60 <= 64


def test_steep_cost_falls_back_to_plain():
    mass = torch.full((2, 29), 0.3)
    assert policy(STEEP).choose(mass, 2, 100) == -1


def test_intermediate_cost_picks_intermediate_size():
    # cost grows slowly up to Q=8 then steeply; confident top nodes -> a small tree wins
    c = curve(lambda q: 1.0 + 0.02 * q if q <= 8 else 0.2 * q)
    mass = torch.tensor([[0.9, 0.5, 0.1] + [0.001] * 26])
    n = policy(c).choose(mass, 1, 100)
    assert 1 <= n <= 3


def test_no_mass_means_plain_and_alpha_calibrates():
    p = policy(FLAT)
    assert p.choose(None, 4, 10) == -1
    a0 = p.alpha
    for _ in range(50):
        p.observe(predicted=1.0, accepted=0.1)
    assert p.alpha < a0 and p.alpha == pytest.approx(0.1, abs=0.05)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,k", [("esp", 1), ("esp", 2), ("pld", 0)])
@pytest.mark.parametrize("cost", ["flat", "steep", "mixed"])
def test_auto_is_lossless(arch, method, k, cost):
    c = {"flat": FLAT, "steep": STEEP, "mixed": curve(lambda q: 1.0 + 0.05 * q)}[cost]
    lm = tiny(arch)
    cfg = EngineConfig(method=method, block_complexity="auto", num_masks=max(k, 1), max_batch_size=4, auto_probe_interval=2)
    eng = Engine(lm, cfg, cost_curve=c)
    from engine_helpers import PROMPTS
    from esp_worker import Request

    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)])
    for o, r in zip(outs, reference(arch, "sdpa")):
        assert tuple(o.token_ids) == r
    sizes = set()
    for o in outs:
        sizes |= set(o.stats.block_size_histogram)
    if cost == "steep":
        assert 1 in sizes  # plain passes happen where drafting cannot pay
    if cost == "flat" and method == "esp":
        assert max(sizes) >= 32  # large trees where the block is free


def test_calibration_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ESP_BATCH_CACHE", str(tmp_path))
    eng_lm = tiny("llama")
    from esp_worker.model_io import ModelRunner

    runner = ModelRunner(eng_lm)
    c1 = calibrate(runner, max_batch=2, max_block=8)
    files = list(tmp_path.glob("cost-*.json"))
    assert len(files) == 1
    c2 = calibrate(runner, max_batch=2, max_block=8)
    assert c1.seconds == c2.seconds and c1.block_sizes == [1, 2, 4, 8] and c1.batch_sizes == [1, 2]
