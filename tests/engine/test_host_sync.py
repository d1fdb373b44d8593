"""A decode pass reads the device at most once (Rows.read_back): no .item() / .tolist() / bool() between
propose and commit. On CPU the reads are counted by wrapping the Tensor methods that copy a value to the
host; on a GPU, torch.cuda.set_sync_debug_mode("error") makes any synchronisation inside the pass raise."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import reference, run, tiny
from esp_worker import EngineConfig, GenerationParams
from esp_worker import engine as engine_module
from esp_worker import sampling
from host_reads import SETTINGS, count_reads_per_pass, strict_sync_passes


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_at_most_one_host_read_per_decode_pass(monkeypatch, setting, batch, temperature):
    monkeypatch.setattr(engine_module, "PREPARE_LOOKS", True)  # auto's looks as on an accelerator
    monkeypatch.setattr(sampling, "UNIFORM_CHUNK", 32)  # sampled rows refill their uniforms inside passes
    lm = tiny("llama")
    cfg = EngineConfig(max_batch_size=batch, **SETTINGS[setting])
    with count_reads_per_pass(monkeypatch) as seen:
        outs = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=temperature, seed=1))
    assert all(o.error is None for o in outs)
    assert seen["passes"] > 0
    # one read per pass; under block_complexity=auto the policy's look comes with the previous pass's read,
    # except right after rows joined or left (the mass it prepared was for other rows): then it reads it
    auto = SETTINGS[setting].get("block_complexity") == "auto"
    over = [(i, n, changed) for i, (n, changed) in enumerate(seen["per_pass"]) if n > 1 + (auto and changed)]
    assert not over, (over[:5], seen["where"])
    if temperature == 0 and cfg.lossless:
        assert [tuple(o.token_ids) for o in outs] == [r[:32] for r in reference("llama", "sdpa")]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dmtd_verified_one_host_read_per_decode_pass(monkeypatch, tmp_path, batch, temperature):
    """dmtd_verified's copy drafts inside the pass (its tau - 1 forwards) without reading the device."""
    from esp_worker.model.dmtd import DmtdConfig, new_draft_layers, save_draft

    lm = tiny("llama")
    split = DmtdConfig.split(2, 3, 1)
    save_draft(tmp_path, new_draft_layers(lm.model.get_decoder(), split), split, lm.model, {})
    cfg = EngineConfig(method="dmtd_verified", dmtd_path=str(tmp_path), max_batch_size=batch)
    with count_reads_per_pass(monkeypatch) as seen:
        outs = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=temperature, seed=1))
    assert all(o.error is None for o in outs) and seen["passes"] > 0
    assert all(n <= 1 for n, _ in seen["per_pass"]), seen["where"]
    if temperature == 0:
        assert [tuple(o.token_ids) for o in outs] == [r[:32] for r in reference("llama", "sdpa")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_synchronisation_inside_a_pass_on_gpu(monkeypatch, setting, temperature):
    """Any synchronising CUDA call inside Engine._step raises, except in the pass's one Rows.read_back (and,
    under block_complexity=auto, in a pass right after rows joined or left: see the CPU test)."""
    from esp_worker import ModelConfig
    from esp_worker.model.load import load_model

    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda"))
    params = GenerationParams(max_new_tokens=64, temperature=temperature, seed=1)  # past a uniform refill
    with strict_sync_passes(monkeypatch, SETTINGS[setting].get("block_complexity") == "auto"):
        outs = run(lm, EngineConfig(max_batch_size=4, **SETTINGS[setting]), params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert all(len(o.token_ids) > 0 for o in outs)


@pytest.mark.parametrize("method", [dict(method="ar"), dict(method="hybrid", block_complexity=30)])
@pytest.mark.parametrize("graphs", [False, True])
def test_log_probabilities_add_no_host_read(monkeypatch, method, graphs):
    """GenerationParams.logprobs / top_logprobs / prompt_logprobs: computed and written on the device, read when a
    row finishes, with its tokens: each pass reads what the same job without them reads (one read; passes run
    ahead of their reads read two where a row ends)."""
    cfg = EngineConfig(max_batch_size=4, cuda_graphs=graphs, **method)
    reads = []
    for top in (0, 2):
        with count_reads_per_pass(monkeypatch) as seen:
            outs = run(tiny("llama"), cfg, GenerationParams(max_new_tokens=32, temperature=1.0, seed=1, top_logprobs=top,
                                                            prompt_logprobs=top > 0))
        assert all(o.error is None for o in outs) and seen["passes"] > 0
        reads.append(list(seen["per_pass"]))  # (the counting stays patched in until the test ends)
    assert all(len(o.top_logprobs) == len(o.token_ids) for o in outs)
    assert reads[1] == reads[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", [dict(method="ar"), dict(method="hybrid", block_complexity="auto")])
def test_log_probabilities_synchronise_nothing_inside_a_pass_on_gpu(monkeypatch, method):
    from esp_worker import ModelConfig
    from esp_worker.model.load import load_model

    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda"))
    params = GenerationParams(max_new_tokens=48, temperature=1.0, seed=1, top_logprobs=2)
    with strict_sync_passes(monkeypatch, method.get("block_complexity") == "auto"):
        outs = run(lm, EngineConfig(max_batch_size=4, **method), params)
    assert all(o.error is None and len(o.top_logprobs) == len(o.token_ids) > 0 for o in outs)
