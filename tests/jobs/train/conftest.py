"""The training tests: Ray Train's controller polls its workers every 0.2 s here (2 s by default: seconds of
waiting at every start and end of a few-step run)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

