"""Synthetic cost curves for block_complexity=auto tests (tests/engine/auto, tests/engine/test_lossless.py)."""
from __future__ import annotations

from esp_worker.auto.cost_model import CostCurve

BLOCKS = [1, 2, 4, 8, 16, 32, 64]


def curve(cost_of_q) -> CostCurve:
    """A cost curve where one pass of Q tokens per row at batch b costs b-independent cost_of_q(Q)."""
    secs = [[[cost_of_q(q) * (1 + 0.1 * b) for q in BLOCKS] for _ in (64, 512)] for b in (1, 8)]
    return CostCurve([1, 8], [64, 512], BLOCKS, secs)


FLAT = curve(lambda q: 1.0)  # a GPU at small batch: the block is free
STEEP = curve(lambda q: float(q))  # pure compute-bound: a block of Q costs Q passes
