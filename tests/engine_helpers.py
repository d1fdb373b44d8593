"""Shared helpers for engine tests: cached tiny models and reference greedy outputs."""
from __future__ import annotations

import functools

import torch

from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request
from esp_worker.model.load import LoadedModel, load_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time",
    "x",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
)


SYSTEM = "You are a careful assistant. Answer in one short paragraph, and say so when you do not know. "
FEW_SHOT = ("Q: What is two plus two? A: Four. Q: Name a primary colour. A: Red. Q: What is the capital of "
            "France? A: Paris. ")
QUESTIONS = ("Q: Why is the sky blue? A:", "Q: How do magnets work?", "Tell me a story about a fox", "x",
             "Q: What is a prime number? A:", "Summarise the plot of Hamlet")
# prompts that share a system prompt, half of them few-shot examples after it too (engine.prefix_cache_tokens)
SHARED_PROMPTS = tuple(SYSTEM + (FEW_SHOT if i % 2 else "") + q for i, q in enumerate(QUESTIONS * 2))


@functools.lru_cache(maxsize=None)
def tiny(arch: str, attn: str = "sdpa") -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(name_or_path=f"tiny-random-{arch}", attn_implementation=attn))


@functools.lru_cache(maxsize=None)
def reference(arch: str, attn: str, max_new: int = 64, extra_eos: tuple = ()) -> tuple:
    """model.generate(do_sample=False) continuations of PROMPTS, one prompt at a time."""
    lm = tiny(arch, attn)
    outs = []
    for p in PROMPTS:
        ids = lm.tokenizer(p, return_tensors="pt").input_ids
        eos = list(lm.eos_token_ids) + list(extra_eos)
        with torch.inference_mode():
            out = lm.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                eos_token_id=eos, pad_token_id=2,
            )
        outs.append(tuple(out[0, ids.shape[1]:].tolist()))
    return tuple(outs)


def windowed_mistral(window: int = 6) -> LoadedModel:
    """A tiny Mistral whose attention sees only the last `window` positions (sdpa), on tiny("mistral")'s device."""
    import dataclasses

    from esp_worker.model.load import build_tiny_model

    model, tok = build_tiny_model("mistral", seed=3)
    model.config.sliding_window = window
    model.config._attn_implementation = "sdpa"
    base = tiny("mistral")
    return dataclasses.replace(base, model=model.to(base.device).eval(), tokenizer=tok)


def run(lm: LoadedModel, cfg: EngineConfig, params: GenerationParams, prompts=PROMPTS):
    eng = Engine(lm, cfg)
    reqs = [Request(id=str(i), prompt=p, params=params) for i, p in enumerate(prompts)]
    return eng.generate(reqs)


def model_logprobs(lm: LoadedModel, prompt: str, token_ids: list[int]) -> torch.Tensor:
    """[len(prompt ids) + len(token_ids) - 1, V] float32: the model's own log-softmax at each position of prompt +
    tokens, predicting the next one (row j - 1 holds token j's); the reference for GenerationParams.logprobs."""
    ids = lm.tokenizer(prompt)["input_ids"] + list(token_ids)
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def generated_logprobs(lm: LoadedModel, prompt: str, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: `model_logprobs` at the generated tokens' positions."""
    return model_logprobs(lm, prompt, token_ids)[len(lm.tokenizer(prompt)["input_ids"]) - 1:]
