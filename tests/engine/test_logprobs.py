"""GenerationParams.logprobs: each generated token's log-probability is the model's own (its forward over the prompt
and the tokens before it, float32 log-softmax), whichever method drafted it, and asking for them changes no token."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, generated_logprobs, model_logprobs, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.logprobs import path_logprobs

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


def test_a_committed_token_s_log_probability_is_read_where_it_was_chosen():
    """committed[j] was chosen at path_slots[j]: an accepted draft at its parent's logits, the bonus at the deepest
    accepted node's; the log-softmax of the raw logits (before any temperature), and the likeliest tokens there."""
    logits = torch.randn(2, 4, 8)
    path = torch.tensor([[0, 2, 3], [0, 1, 1]])  # row 1 committed two tokens: its third entry is never read
    committed = torch.tensor([[2, 3, 7], [5, 1, 0]])
    got = path_logprobs(logits, path, committed, top=3)
    logp = logits.log_softmax(-1)
    assert torch.allclose(got.chosen[0], torch.stack([logp[0, 0, 2], logp[0, 2, 3], logp[0, 3, 7]]))
    assert torch.allclose(got.chosen[1, :2], torch.stack([logp[1, 0, 5], logp[1, 1, 1]]))
    assert got.chosen.dtype == torch.float32 and got.chosen.shape == (2, 3)
    best = logp.topk(3, -1)
    assert torch.equal(got.top_ids[0, 1], best.indices[0, 2].int()) and got.top_ids.dtype == torch.int32
    assert torch.allclose(got.top[0, 1], best.values[0, 2]) and got.top.shape == (2, 3, 3)
    assert path_logprobs(logits, path, committed).top is None


def _model_logprobs(lm, prompt: str, token_ids: list[int], top: int = 0):
    """The model's forward over prompt + generated tokens: each generated token's log-softmax where it was chosen
    (and the `top` likeliest tokens there, with theirs)."""
    logp = generated_logprobs(lm, prompt, token_ids)
    chosen = logp.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
    if not top:
        return chosen
    best = logp.topk(top, -1)
    return chosen, best.indices.tolist(), best.values.tolist()


def _generate(lm, cfg: EngineConfig, params: GenerationParams, asks=lambda i: True, top: int = 0):
    reqs = [Request(id=str(i), prompt=p, params=dataclasses.replace(params, logprobs=asks(i),
                                                                    top_logprobs=top if asks(i) else 0))
            for i, p in enumerate(PROMPTS)]
    return Engine(lm, cfg).generate(reqs)


def _check(lm, cfg: EngineConfig, params: GenerationParams, asks=lambda i: True, top: int = 0):
    """Rows `asks(i)` ask for their tokens' log-probabilities (with `top` alternatives, the others 0)."""
    outs = _generate(lm, cfg, params, asks, top)
    plain = _generate(lm, cfg, params, lambda i: False)  # the same engine settings, no row asking
    for i, (o, p, ref) in enumerate(zip(outs, PROMPTS, plain)):
        assert o.error is None, o.error
        assert o.token_ids == ref.token_ids, f"{cfg.method}: asking for log-probabilities changed the tokens"
        assert ref.logprobs is None
        if not asks(i):
            assert o.logprobs is None
            continue
        assert len(o.logprobs) == len(o.token_ids) > 0
        want = _model_logprobs(lm, p, o.token_ids, top)
        if top:
            want, want_ids, want_top = want
            assert len(o.top_logprobs) == len(o.token_ids) and all(len(x) == top for x in o.top_logprobs)
            for got, ids, lps in zip(o.top_logprobs, want_ids, want_top):
                assert [t for t, _ in got] == ids  # random weights: no near-ties among the likeliest few
                assert max(abs(a - b) for (_, a), b in zip(got, lps)) < ATOL
        else:
            assert o.top_logprobs is None
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


@pytest.mark.parametrize("setting", [0, 4, 7])
@pytest.mark.parametrize("graphs", [False, True])
def test_the_likeliest_tokens_where_each_was_chosen(setting, graphs):
    """GenerationParams.top_logprobs: the model's top alternatives at each generated position, best first."""
    cfg = EngineConfig(max_batch_size=4, cuda_graphs=graphs, **METHODS[setting])
    _check(tiny("qwen2"), cfg, GenerationParams(max_new_tokens=NEW), top=4)


def test_rows_asking_for_fewer_alternatives_join_rows_asking_for_more():
    """The batch computes the most any row asks for; each row gets its own count, wherever it joined."""
    lm = tiny("llama")
    prompts = PROMPTS * 2
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=6 + 4 * i, top_logprobs=i % 4))
            for i, p in enumerate(prompts)]
    outs = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=3)).generate(reqs)
    for i, (o, p) in enumerate(zip(outs, prompts)):
        if i % 4 == 0:
            assert o.logprobs is None and o.top_logprobs is None
            continue
        chosen, ids, lps = _model_logprobs(lm, p, o.token_ids, i % 4)
        assert max(abs(a - b) for a, b in zip(o.logprobs, chosen)) < ATOL
        assert [[t for t, _ in x] for x in o.top_logprobs] == ids


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


def test_stop_strings_cut_them_with_the_tokens():
    lm = tiny("llama")
    outs = _check(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=4),
                  GenerationParams(max_new_tokens=NEW, stop_strings=("e",)))
    assert any(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("fields,problem", [
    (dict(logprobs=1), "logprobs=1 must be true or false"),
    (dict(top_logprobs=21), "top_logprobs=21 must be an integer in 0 .. 20"),
    (dict(top_logprobs=-1), "top_logprobs=-1"),
    (dict(top_logprobs=True), "top_logprobs=True"),
])
def test_bad_settings_are_one_line_problems(fields, problem):
    assert problem in GenerationParams(**fields).problem()
    assert GenerationParams(top_logprobs=20).problem() is None and GenerationParams(top_logprobs=2).wants_logprobs


def _prompt_logprobs(lm, prompt: str) -> list[float]:
    ids = lm.tokenizer(prompt)["input_ids"]
    return model_logprobs(lm, prompt, []).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", [dict(method="ar"), dict(method="esp", block_complexity=30, num_masks=2),
                                    dict(method="hybrid", block_complexity="auto")])
def test_prompt_log_probabilities_are_the_models(arch, method):
    """GenerationParams.prompt_logprobs: each prompt token's given the ones before it (None for the first), from the
    prefill that reads every position's hidden state, with prompts of other lengths padded beside it (and ESP's masks
    after it); the generated tokens stay plain decoding's."""
    lm = tiny(arch)
    params = GenerationParams(max_new_tokens=8, prompt_logprobs=True)
    outs = _generate(lm, EngineConfig(max_batch_size=4, **method), params, asks=lambda i: False)
    plain = _generate(lm, EngineConfig(max_batch_size=4, **method), dataclasses.replace(params, prompt_logprobs=False))
    for o, ref, p in zip(outs, plain, PROMPTS):
        assert o.token_ids == ref.token_ids and o.logprobs is None
        want = _prompt_logprobs(lm, p)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(want) + 1
        assert max((abs(a - b) for a, b in zip(o.prompt_logprobs[1:], want)), default=0) < ATOL
        assert ref.prompt_logprobs is None


def test_prompt_log_probabilities_in_chunks_with_the_generated_ones(monkeypatch):
    """The LM head over the prompts' positions a few at a time (logprobs.PROMPT_CHUNK_BYTES), and the generated
    tokens' log-probabilities beside them; a row that asks for neither gets neither."""
    from esp_worker import logprobs

    lm = tiny("qwen3")
    monkeypatch.setattr(logprobs, "PROMPT_CHUNK_BYTES", 3 * 4 * 4 * lm.model.config.vocab_size)  # 3 positions
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=10, prompt_logprobs=i != 2,
                                                                  logprobs=i % 2 == 0)) for i, p in enumerate(PROMPTS)]
    outs = Engine(lm, EngineConfig(method="pld", block_complexity=10, max_batch_size=4)).generate(reqs)
    for i, (o, p) in enumerate(zip(outs, PROMPTS)):
        if i == 2:
            assert o.prompt_logprobs is None and o.logprobs is not None
            continue
        want = _prompt_logprobs(lm, p)
        assert max((abs(a - b) for a, b in zip(o.prompt_logprobs[1:], want)), default=0) < ATOL
        assert (o.logprobs is not None) == (i % 2 == 0)
        if o.logprobs is not None:
            assert max(abs(a - b) for a, b in zip(o.logprobs, _model_logprobs(lm, p, o.token_ids))) < ATOL
