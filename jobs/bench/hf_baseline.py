"""Hugging Face `model.generate` on the bench's prompts, as a user would run it: a baseline row of every bench.

`hf generate` is eager generate. `hf generate compiled` is generate with a static KV cache and its decoding
forward compiled, as transformers documents it (`cache_implementation="static"` with a `CompileConfig`:
torch.compile, Inductor, mode "reduce-overhead", i.e. CUDA graphs): the fair baseline on a GPU, where eager
generate is bound by launching kernels. transformers compiles only on accelerators unless told otherwise; on
a CPU the bench asks for it explicitly (mode "default": there are no CUDA graphs to reduce overhead with).
Every call of the compiled baseline is left-padded to the bench's longest prompt, so each batch size is one
shape (transformers' advice against recompiling per prompt length; the attention mask hides the padding).

Batch 1: one prompt at a time. Batch B: prompts in input order, B at a time, left-padded with an attention
mask; each batch runs to its longest request's `max_new_tokens` (generate takes one value per call), and each
row's output is then cut at its own `max_new_tokens` and first stop id, so the tokens counted are the tokens
that row asked for. Sampling (temperature > 0) uses generate's own sampler, seeded once per batch.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .results import SettingRun


def compile_config(device: Any) -> Any:
    """transformers' CompileConfig for `hf generate compiled`: its defaults (Inductor, reduce-overhead) on an
    accelerator; on a CPU mode "default", with the flag that makes generate compile there."""
    from transformers import CompileConfig

    if device.type != "cpu":
        return CompileConfig()
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


def hf_generate(loaded: Any, prompts: list[Any], generation: dict[str, Any], batch: int,
                compiled: bool = False, pad_to: int = 0) -> dict[str, list[int]]:
    """{prompt id: generated token ids} for `prompts` (each a bench Prompt with .id, .ids, .params); compiled:
    generate with a static cache and a compiled decoding forward. pad_to: left-pad every batch to at least this
    many tokens."""
    model, tok = loaded.model, loaded.tokenizer
    static = dict(cache_implementation="static", compile_config=compile_config(loaded.device)) if compiled else {}
    pad = tok.pad_token_id if tok.pad_token_id is not None else (loaded.eos_token_ids or (0,))[0]
    out: dict[str, list[int]] = {}
    for i in range(0, len(prompts), batch):
        chunk = prompts[i: i + batch]
        params = [{**generation, **p.params} for p in chunk]
        longest = max([len(p.ids) for p in chunk] + [pad_to])
        ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):  # left padding
            ids[r, longest - len(p.ids):] = torch.tensor(p.ids)
            mask[r, longest - len(p.ids):] = 1
        temp = float(params[0].get("temperature", 0.0))
        kw: dict[str, Any] = dict(do_sample=False)
        if temp > 0:
            torch.manual_seed(i)
            kw = dict(do_sample=True, temperature=temp, top_p=float(params[0].get("top_p", 1.0)),
                      top_k=int(params[0].get("top_k", 0)) or None)
        with torch.inference_mode():
            gen = model.generate(ids.to(loaded.device), attention_mask=mask.to(loaded.device), pad_token_id=pad,
                                 max_new_tokens=max(int(x["max_new_tokens"]) for x in params),
                                 eos_token_id=list(loaded.eos_token_ids) or None, **static, **kw)
        for r, (p, x) in enumerate(zip(chunk, params)):
            row = gen[r, longest:].tolist()[: int(x["max_new_tokens"])]
            stops = set(x.get("stop_token_ids", ())) | (set() if x.get("ignore_eos") else set(loaded.eos_token_ids))
            end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            out[p.id] = row[:end]
    return out


def run_hf(loaded: Any, batch: int, prompts: list[Any], generation: dict[str, Any], warmup: int,
           compiled: bool = False) -> SettingRun:
    """bench.run_setting's result for hf generate: outputs (RequestOutput per id), seconds per category.
    compiled: `hf generate compiled` (its compiles happen in the warm-up prompts and rounds, and in the first
    call of each new shape)."""
    from .turns import all_turns

    pad_to = max(len(p.ids) for p in prompts) if compiled else 0
    if warmup:
        hf_generate(loaded, prompts[:warmup], generation, batch, compiled, pad_to)
    outputs, seconds = {}, {}
    for cat in dict.fromkeys(p.category for p in prompts):
        ps = [p for p in prompts if p.category == cat]
        t0 = time.perf_counter()
        outputs.update(all_turns(ps, lambda turn: _outputs(
            loaded, turn, hf_generate(loaded, turn, generation, batch, compiled, pad_to))))
        seconds[cat] = time.perf_counter() - t0
    return SettingRun(outputs, seconds)


def _outputs(loaded: Any, prompts: list[Any], got: dict[str, list[int]]) -> dict[str, Any]:
    """generate's token ids as the engine's RequestOutputs (one decode pass per token after the first)."""
    from esp_worker import RequestOutput, RequestStats

    out = {}
    for p in prompts:
        n = len(got[p.id])
        stats = RequestStats(num_prompt_tokens=len(p.ids), num_generated_tokens=n, num_decode_passes=max(n - 1, 0),
                             num_decode_tokens=max(n - 1, 0), block_size_histogram={1: max(n - 1, 0)})
        text = loaded.tokenizer.decode(got[p.id], skip_special_tokens=True)  # a later turn's history
        out[p.id] = RequestOutput(id=p.id, token_ids=got[p.id], text=text, finish_reason=None, stats=stats)
    return out
