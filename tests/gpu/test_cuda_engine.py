"""The engine on CUDA: lossless in float32 (every method's tokens are plain decoding's and `generate`'s), and
bfloat16 runs that finish every row with consistent statistics. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import PROMPTS, SHARED_PROMPTS
from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request, load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

METHODS = [dict(method="ar"), dict(method="esp", block_complexity=30), dict(method="pld", block_complexity=10),
           dict(method="hybrid", block_complexity=30), dict(method="hybrid", block_complexity="auto")]


def _generate(lm, cfg: EngineConfig, max_new_tokens: int = 32, prompts=PROMPTS):
    eng = Engine(lm, cfg)
    params = GenerationParams(max_new_tokens=max_new_tokens)
    return eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("prompts", [PROMPTS, SHARED_PROMPTS], ids=["prompts", "shared_prefixes"])
def test_float32_on_cuda_is_plain_decoding_and_generate(arch, prompts):
    """Also over prompts that share a system prompt and few-shot examples (engine.prefix_cache_tokens)."""
    lm = load_model(ModelConfig(name_or_path=f"tiny-random-{arch}", device="cuda", dtype="float32"))
    ref = []
    for p in prompts:
        ids = lm.tokenizer(p, return_tensors="pt").input_ids.to("cuda")
        with torch.inference_mode():
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                    eos_token_id=list(lm.eos_token_ids), pad_token_id=2)
        ref.append(out[0, ids.shape[1]:].tolist())
    for setting in METHODS:
        outs = _generate(lm, EngineConfig(max_batch_size=4, **setting), prompts=prompts)
        for o, r in zip(outs, ref):
            assert o.error is None, o.error
            assert o.token_ids == r, (setting, o.id)


def test_bfloat16_on_cuda_finishes_every_row_with_consistent_statistics():
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda", dtype="bfloat16"))
    for setting in METHODS:
        for o in _generate(lm, EngineConfig(max_batch_size=4, **setting)):
            st = o.stats
            assert o.error is None and o.finish_reason in ("stop", "length"), (setting, o.error)
            assert 0 < len(o.token_ids) <= 32 and st.num_generated_tokens == len(o.token_ids)
            assert st.num_accepted_drafts <= st.num_drafted_tokens
            assert st.num_decode_tokens <= st.num_accepted_drafts + st.num_decode_passes  # a pass: drafts + bonus


def test_prefill_forward_tokens_is_measured_once_per_model_on_cuda():
    """engine.prefill_forward_tokens=auto on CUDA: timed once per loaded model (every engine over it then groups
    prompts alike, and engine.admission weighs its fixed cost), and the engine's prompts of four lengths stay
    generate's whatever the grouping."""
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda", dtype="float32"))
    first = Engine(lm, EngineConfig(method="ar", max_batch_size=4))
    cost = lm.prefill_cost
    assert cost is not None and cost.fixed_s > 0 and first.prefill_forward_tokens == cost.forward_tokens > 0
    second = Engine(lm, EngineConfig(method="ar", max_batch_size=4))
    assert lm.prefill_cost is cost and second.prefill_forward_tokens == first.prefill_forward_tokens
    # engine.admission=auto weighs idle slots against that forward's fixed cost; eager joins at once
    assert first.admission.fixed_s == cost.fixed_s
    assert Engine(lm, EngineConfig(method="ar", max_batch_size=4, admission="eager")).admission.fixed_s == 0
    merged = _generate(lm, EngineConfig(method="ar", max_batch_size=4, prefill_forward_tokens=1e6))
    apart = _generate(lm, EngineConfig(method="ar", max_batch_size=4, prefill_forward_tokens=0))
    assert [o.token_ids for o in merged] == [o.token_ids for o in apart]


def test_shared_prefixes_are_copied_on_cuda():
    """Where a forward of its own is worth thousands of tokens (CUDA), a shared prefix is taken from a prompt's cache
    row after its prefill, and the prompts admitted later copy it."""
    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda", dtype="bfloat16"))
    eng = Engine(lm, EngineConfig(max_batch_size=4, method="hybrid"))
    params = GenerationParams(max_new_tokens=16)
    outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(SHARED_PROMPTS)])
    assert all(o.error is None for o in outs)
    assert eng.stats.prefill_cached_tokens > 0
