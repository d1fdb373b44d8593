"""GenerationParams.logprobs: each generated token's log-probability is the model's own (its forward over the prompt
and the tokens before it, float32 log-softmax), whichever method drafted it, and asking for them changes no token."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request

NEW = 24
# tiny random models' log-probabilities sit near -log(V); a tree pass adds its keys in another order than a
# one-token forward, so the floats agree to rounding, not bitwise
ATOL = 1e-4
METHODS = [
    dict(method="ar"),
    dict(method="pld", block_complexity=10),
    dict(method="stand", block_complexity=10),
    dict(method="lade", block_complexity=10),
    dict(method="esp", block_complexity=30, num_masks=2),
    dict(method="esp", block_complexity="auto"),
    dict(method="hybrid", block_complexity=30),
    dict(method="hybrid", block_complexity="auto"),
]


def _model_logprobs(lm, prompt: str, token_ids: list[int]) -> list[float]:
    """The model's forward over prompt + generated tokens: each generated token's log-softmax where it was chosen."""
    ids = lm.tokenizer(prompt)["input_ids"]
    seq = torch.tensor([ids + token_ids])
    with torch.inference_mode():
        logp = lm.model(seq).logits[0].float().log_softmax(-1)
    return logp[len(ids) - 1: -1].gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()


def _generate(lm, cfg: EngineConfig, params: GenerationParams, asks=lambda i: True):
    reqs = [Request(id=str(i), prompt=p, params=dataclasses.replace(params, logprobs=asks(i)))
            for i, p in enumerate(PROMPTS)]
    return Engine(lm, cfg).generate(reqs)


def _check(lm, cfg: EngineConfig, params: GenerationParams, asks=lambda i: True):
    outs = _generate(lm, cfg, params, asks)
    plain = _generate(lm, cfg, params, lambda i: False)  # the same engine settings, no row asking
    for i, (o, p, ref) in enumerate(zip(outs, PROMPTS, plain)):
        assert o.error is None, o.error
        assert o.token_ids == ref.token_ids, f"{cfg.method}: asking for log-probabilities changed the tokens"
        assert ref.logprobs is None
        if not asks(i):
            assert o.logprobs is None
            continue
        assert len(o.logprobs) == len(o.token_ids) > 0
        want = _model_logprobs(lm, p, o.token_ids)
        worst = max(abs(a - b) for a, b in zip(o.logprobs, want))
        assert worst < ATOL, f"{cfg.method} row {i}: {worst} from the model's own log-probabilities"
    return outs


@pytest.mark.parametrize("setting", range(len(METHODS)))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_method_returns_the_models_log_probabilities(setting, temperature):
    batch = 1 if setting % 2 else 4
    cfg = EngineConfig(max_batch_size=batch, **METHODS[setting])
    _check(tiny("llama"), cfg, GenerationParams(max_new_tokens=NEW, temperature=temperature, seed=3))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture(arch):
    for method in (dict(method="ar"), dict(method="hybrid", block_complexity=30)):
        _check(tiny(arch), EngineConfig(max_batch_size=4, **method), GenerationParams(max_new_tokens=NEW))


@pytest.mark.parametrize("method", [dict(method="ar"), dict(method="esp", block_complexity=30),
                                    dict(method="hybrid", block_complexity="auto")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_passes_compute_them_too(method, temperature):
    """engine.cuda_graphs=true (on a CPU the static buffers, eagerly): a class with rows asking for them computes
    them in the step; its run-ahead passes and the rows kept after they end change nothing."""
    cfg = EngineConfig(max_batch_size=4, cuda_graphs=True, **method)
    params = GenerationParams(max_new_tokens=NEW, temperature=temperature, seed=5, stop_token_ids=(7, 11, 13))
    _check(tiny("qwen3"), cfg, params)


def test_only_the_rows_that_ask_get_them():
    _check(tiny("llama"), EngineConfig(method="hybrid", block_complexity=10, max_batch_size=4),
           GenerationParams(max_new_tokens=NEW), asks=lambda i: i % 2 == 0)


def test_rows_joining_and_leaving():
    """More requests than rows: rows of different lengths leave and join while the others go on."""
    lm = tiny("mistral")
    prompts = PROMPTS * 2
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=8 + 5 * i, logprobs=True))
            for i, p in enumerate(prompts)]
    outs = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=3)).generate(reqs)
    for o, p in zip(outs, prompts):
        want = _model_logprobs(lm, p, o.token_ids)
        assert len(o.logprobs) == len(want) and max(abs(a - b) for a, b in zip(o.logprobs, want)) < ATOL


def test_the_compiled_settle_leaves_such_passes_to_the_eager_one():
    """engine.compile_host's kernel computes no log-probabilities: passes over rows that ask run the eager settle."""
    cfg = EngineConfig(method="esp", block_complexity=10, max_batch_size=2, compile_host=True)
    _check(tiny("llama"), cfg, GenerationParams(max_new_tokens=NEW))


def test_stop_strings_cut_them_with_the_tokens():
    lm = tiny("llama")
    outs = _check(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=4),
                  GenerationParams(max_new_tokens=NEW, stop_strings=("e",)))
    assert any(o.finish_reason == "stop" for o in outs)
