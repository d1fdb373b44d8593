"""The shared models and data beside the checkout (../shared), for any test: `from shared_data import ...`."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"  # ../shared beside the checkout
SPEC_BENCH = SHARED_DATA / "spec_bench_dev.jsonl"
TINY_PROMPTS = SHARED_DATA / "tiny_prompts_dev.jsonl"
TINY_LLAMA = SHARED_DATA.parent / "models" / "esp-tiny-llama"  # a small trained model (MODEL_CARD.md there)

# offline: nothing in the tests downloads (models and tokenizers are local or tiny-random)
if "HF_HOME" not in os.environ:
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf-home-")
    atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)  # each test process's own, removed as it exits
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"


def shared(path: Path) -> Path:
    """A file under ../shared beside the checkout; the test skips (with the reason) where it is absent."""
    if not path.exists():
        pytest.skip(f"shared data {path} is not present beside this checkout")
    return path
