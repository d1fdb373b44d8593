"""`random:<shape>` builds a real architecture with random weights offline (shipped shapes or a config.json)."""
from __future__ import annotations

import json

import pytest

from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request
from esp_worker.model.load import SHIPPED_CONFIGS, load_model, random_config_path
from esp_worker.model.errors import ModelLoadError


@pytest.mark.parametrize("shape", ["llama-1b", "llama-3b", "llama-8b", "qwen3-1.7b", "qwen3-8b"])
def test_shipped_shapes_are_valid_configs(shape):
    from transformers import AutoConfig

    raw = json.loads(random_config_path(shape).read_text())
    cfg = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if not k.startswith("_")})
    assert cfg.num_hidden_layers >= 16 and cfg.hidden_size >= 2048


def test_random_model_from_local_config_runs_every_method(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(ModelConfig(name_or_path=f"random:{tmp_path}", device="cpu"))
    assert type(lm.model).__name__ == "Qwen3ForCausalLM" and lm.model.config.vocab_size == 1000
    params = GenerationParams(max_new_tokens=12)
    ref = Engine(lm, EngineConfig(method="ar")).generate([Request("a", prompt="hello", params=params)])[0].token_ids
    assert len(ref) == 12
    got = Engine(lm, EngineConfig(method="esp", block_complexity=10)).generate([Request("a", prompt="hello", params=params)])
    assert got[0].token_ids == ref


def test_random_unknown_shape_says_what_exists():
    with pytest.raises(ModelLoadError, match="llama-1b"):
        load_model(ModelConfig(name_or_path="random:gpt-17", device="cpu"))
    assert (SHIPPED_CONFIGS / "llama-1b.json").is_file()
