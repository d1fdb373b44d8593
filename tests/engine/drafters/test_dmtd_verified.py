"""dmtd_verified (drafters/dmtd_verified.py): a copy of the last D layers drafts tau - 1 tokens per pass and the
model verifies them. Greedy equals model.generate on four architectures at batch 1 and 4, seeded sampling equals
plain sampling, and every draft is what the copy computes teacher-forced over the committed tokens with the
pass's cycle starts (so its incremental keys and values are right)."""
from __future__ import annotations

import functools

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, generated_logprobs, reference, run, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.drafters.dmtd_verified import DmtdVerifiedDrafter
from esp_worker.model.dmtd import DmtdConfig, DmtdConfigError, cyclic_forward, load_draft, new_draft_layers, save_draft


@functools.lru_cache(maxsize=None)
def copy_dir(arch: str, root: str, tau: int = 3, noise: float = 0.0, encoding: int = 0) -> str:
    """An (untrained) copy of the tiny model's last layer saved as train-dmtd writes one; `noise` perturbs it."""
    lm = tiny(arch)
    cfg = DmtdConfig.split(2, tau, 1, encoding)
    layers = new_draft_layers(lm.model.get_decoder(), cfg)
    if noise:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in layers.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    path = f"{root}/{arch}-tau{tau}-e{encoding}-n{noise}"
    save_draft(path, layers, cfg, lm.model, {"base_model": f"tiny-random-{arch}"})
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dmtd_copies"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_generate(root, arch, batch):
    lm = tiny(arch)
    outs = run(lm, EngineConfig(method="dmtd_verified", dmtd_path=copy_dir(arch, root), max_batch_size=batch),
               GenerationParams(max_new_tokens=64))
    for o, r in zip(outs, reference(arch, "sdpa")):
        assert o.error is None, o.error
        assert tuple(o.token_ids) == r, f"{arch} batch {batch}: diverged from generate"
    assert all(o.stats.num_drafted_tokens > 0 for o in outs)


@pytest.mark.parametrize("tau", [2, 4])
def test_other_cycle_lengths_and_eos(root, tau):
    """engine.dmtd_tau sets the drafts per pass; a stop id inside the horizon ends the row where generate does."""
    lm = tiny("qwen3")
    stop = reference("qwen3", "sdpa")[0][20]
    ref = reference("qwen3", "sdpa", 64, (stop,))
    outs = run(lm, EngineConfig(method="dmtd_verified", dmtd_path=copy_dir("qwen3", root), dmtd_tau=tau, max_batch_size=4),
               GenerationParams(max_new_tokens=64, stop_token_ids=[stop]))
    assert [tuple(o.token_ids) for o in outs] == list(ref)
    assert max(max(o.stats.block_size_histogram) for o in outs) == tau


def test_seeded_sampling_equals_plain(root):
    lm = tiny("llama")
    params = [GenerationParams(max_new_tokens=48, temperature=t, top_p=p, seed=s)
              for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.8)])]
    reqs = [Request(id=str(i), prompt=PROMPTS[i % 4], params=p) for i, p in enumerate(params)]
    plain = Engine(lm, EngineConfig(method="ar", max_batch_size=3)).generate(reqs)
    got = Engine(lm, EngineConfig(method="dmtd_verified", dmtd_path=copy_dir("llama", root), max_batch_size=3)).generate(reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]


def test_drafts_are_the_copy_teacher_forced(root, monkeypatch):
    """Each pass's drafts equal the copy run over the committed tokens (then its own drafts) with every cycle start
    so far: the prompt's positions % tau == 0 and each earlier pass's last accepted slot."""
    lm = tiny("llama")
    path = copy_dir("llama", root, tau=3, noise=0.3)
    seen = []
    propose = DmtdVerifiedDrafter.propose

    def recorded(self, view, plan=None):
        block = propose(self, view) if plan is None else propose(self, view, plan)
        seen.append((view.hist.clone(), view.hist_len.clone(), block.tree.tokens.clone()))
        return block

    monkeypatch.setattr(DmtdVerifiedDrafter, "propose", recorded)
    outs = run(lm, EngineConfig(method="dmtd_verified", dmtd_path=path, max_batch_size=2), GenerationParams(max_new_tokens=24),
               PROMPTS[:2])
    layers, cfg = load_draft(path, lm.model)
    base = lm.model.get_decoder()
    ids = [lm.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    starts: list[set[int]] = [{s for s in range(len(i)) if s % cfg.tau == 0} for i in ids]
    checked = 0
    for hist, hist_len, tokens in seen:
        for r in range(hist.shape[0]):
            n = int(hist_len[r])
            if n - 1 >= len(ids[r]) + len(outs[r].token_ids):
                continue  # the row's last pass (past its end)
            p = n - 2
            starts[r].add(p)
            seq = hist[r, :n].tolist() + tokens[r, 1:-1].tolist()  # committed, then the drafts fed back
            mask = torch.tensor([[s in starts[r] for s in range(len(seq))]])
            with torch.no_grad():
                h = cyclic_forward(base, cfg, torch.tensor([seq]), decoding_layers=layers, starts=mask)
                want = lm.model.lm_head(h).argmax(-1)[0, n - 1:].tolist()
            assert tokens[r, 1:].tolist() == want, f"row {r} at length {n}"
            checked += 1
    assert checked > 10


def test_errors(root):
    lm = tiny("qwen2")
    with pytest.raises(DmtdConfigError, match="not this model"):
        Engine(lm, EngineConfig(method="dmtd_verified", dmtd_path=copy_dir("llama", root)))
    with pytest.raises(DmtdConfigError, match="holds no"):
        Engine(lm, EngineConfig(method="dmtd_verified", dmtd_path=root))
    with pytest.raises(DmtdConfigError, match="E = 0"):
        Engine(tiny("llama"), EngineConfig(method="dmtd_verified", dmtd_path=copy_dir("llama", root, encoding=1)))


def test_log_probabilities_are_the_models(root):
    """GenerationParams.logprobs: the model's own, whichever copy drafted the tokens."""
    lm = tiny("qwen2")
    outs = run(lm, EngineConfig(method="dmtd_verified", dmtd_path=copy_dir("qwen2", root, noise=0.05), max_batch_size=4),
               GenerationParams(max_new_tokens=24, logprobs=True))
    for o, p in zip(outs, PROMPTS):
        want = generated_logprobs(lm, p, o.token_ids).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4)
