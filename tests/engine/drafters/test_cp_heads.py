"""CP heads: the equation-9 loss against brute force, the balancing loss, files, and the `cp_heads` drafter's
output against plain decoding (greedy on four architectures at batch 1 and 4, seeded sampling)."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, generated_logprobs, reference, run, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.model.heads import (CPHeads, CPHeadsConfig, HeadsLoadError, balance_loss, cp_log_likelihood,
                                   first_position_log_likelihood, heads_loss, load_heads, new_heads, save_heads,
                                   seed_experts)
from esp_worker.drafters.cp_heads import CPHeadsDrafter
from esp_worker.tree import best_nodes


# ---- losses -----------------------------------------------------------------------------------------
def _small_heads(rank: int, n: int, v: int = 5, e: int = 6, seed: int = 0) -> tuple[CPHeads, torch.nn.Linear]:
    torch.manual_seed(seed)
    cfg = CPHeadsConfig(base_model="toy", base_fingerprint="x", hidden_size=e, vocab_size=v, num_positions=n,
                        rank=rank, head_hidden=4)
    heads = CPHeads(cfg)
    torch.nn.init.normal_(heads.up, std=0.5)
    torch.nn.init.normal_(heads.gate.weight, std=1.0)
    return heads, torch.nn.Linear(e, v, bias=False)


@pytest.mark.parametrize("rank,n", [(1, 1), (1, 3), (3, 2), (4, 3)])
def test_eq9_matches_brute_force_mixture(rank, n):
    """log P(x_{t+1..t+n}) from equation 9 equals log sum_a w_a prod_s P_a^(s) computed in probability space,
    and the mixture is a distribution: it sums to 1 over all V^n continuations."""
    heads, lm = _small_heads(rank, n)
    e = torch.randn(3, 6)
    with torch.no_grad():
        log_w, log_p = heads(e, lm)  # [T, r], [T, r, n, V]
        w, p = log_w.exp().double(), log_p.exp().double()
        v = p.shape[-1]
        for t in range(e.shape[0]):
            total = 0.0
            for xs in itertools.product(range(v), repeat=n):
                prob = sum(float(w[t, a]) * math.prod(float(p[t, a, s, x]) for s, x in enumerate(xs)) for a in range(rank))
                total += prob
                c = log_p[t : t + 1].gather(-1, torch.tensor(xs)[None, None, :, None].expand(1, rank, n, 1))[..., 0]
                got = float(cp_log_likelihood(log_w[t : t + 1], c)[0])
                assert got == pytest.approx(math.log(prob), abs=1e-5)
                first = float(first_position_log_likelihood(log_w[t : t + 1], c)[0])
                assert first == pytest.approx(math.log(sum(float(w[t, a] * p[t, a, 0, xs[0]]) for a in range(rank))), abs=1e-5)
            assert total == pytest.approx(1.0, abs=1e-6)


def test_heads_loss_is_mean_negative_eq9_plus_balance():
    heads, lm = _small_heads(3, 2)
    e, targets = torch.randn(4, 6), torch.randint(0, 5, (4, 2))
    res = heads_loss(heads, e, targets, lm, balance_coef=0.5)
    log_w, log_p = heads(e, lm)
    c = torch.stack([log_p[t, :, torch.arange(2), targets[t]] for t in range(4)])  # [T, r, n]
    joint = -cp_log_likelihood(log_w, c).mean()
    assert float(res.joint_nll) == pytest.approx(float(joint.detach()), abs=1e-6)
    assert float(res.loss.detach()) == pytest.approx(float((joint + 0.5 * balance_loss(log_w)).detach()), abs=1e-6)
    res.loss.backward()
    assert heads.up.grad is not None and heads.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "w,expected",
    [
        ([[0.25, 0.25, 0.25, 0.25]] * 3, 0.0),  # uniform w: zero
        ([[1.0, 0.0], [0.0, 1.0]], 0.0),  # one-hot but balanced across tokens: zero
        ([[1.0, 0.0], [1.0, 0.0]], 0.5),  # one expert takes everything: (1 - 1/2)^2 + (0 - 1/2)^2
        ([[0.5, 0.5, 0.0]], 2 * (0.5 - 1 / 3) ** 2 + (1 / 3) ** 2),
    ],
)
def test_balance_loss_table(w, expected):
    log_w = torch.tensor(w).clamp(min=1e-30).log()
    assert float(balance_loss(log_w)) == pytest.approx(expected, abs=1e-6)


def test_fresh_heads_start_as_the_model():
    """U = 0 at initialisation: every factor is the model's own next-token distribution and w is uniform."""
    lm = tiny("llama")
    heads = new_heads(lm.model, "tiny-random-llama", num_positions=3, rank=4, head_hidden=8)
    h = torch.randn(2, lm.model.config.hidden_size)
    with torch.no_grad():
        log_w, log_p = heads(h, lm.model.get_output_embeddings())
        want = torch.log_softmax(lm.model.get_output_embeddings()(h), -1)
    assert torch.allclose(log_w.exp(), torch.full_like(log_w, 0.25), atol=0.05)
    assert torch.allclose(log_p, want[:, None, None, :].expand_as(log_p), atol=1e-5)


def test_seeded_experts_start_as_the_source_heads():
    """A rank-4 run started from rank-1 heads: at noise 0 its joint likelihood is the source's (any gate, since
    every expert is the same); with noise the first copy is exact and the others differ from it."""
    src, unembed = _small_heads(1, 3, seed=1)
    cfg = CPHeadsConfig(**{**src.cfg.__dict__, "rank": 4})
    e, x = torch.randn(7, 6), torch.randint(0, 5, (7, 3))
    with torch.no_grad():
        want = cp_log_likelihood(*src(e, unembed, x))
        exact = CPHeads(cfg)
        torch.nn.init.normal_(exact.gate.weight, std=1.0)  # a non-uniform w changes nothing when experts agree
        seed_experts(exact, src, noise=0.0)
        assert torch.allclose(cp_log_likelihood(*exact(e, unembed, x)), want, atol=1e-5)
        noisy = CPHeads(cfg)
        seed_experts(noisy, src, noise=0.1, seed=3)
    assert torch.equal(noisy.down[0], src.down[0]) and torch.equal(noisy.up[0], src.up[0])
    for a in range(1, 4):
        assert not torch.equal(noisy.down[a], noisy.down[0]) and not torch.equal(noisy.up[a], noisy.up[0])
        rel = (noisy.down[a] - src.down[0]).detach().std() / src.down[0].std()
        assert 0.05 < float(rel) < 0.2
    other = CPHeads(CPHeadsConfig(**{**src.cfg.__dict__, "rank": 4, "num_positions": 2}))
    with pytest.raises(HeadsLoadError, match="num_positions"):
        seed_experts(other, src, noise=0.1)


# ---- files ------------------------------------------------------------------------------------------
def test_save_load_roundtrip_and_other_model_refused(tmp_path):
    lm = tiny("llama")
    heads = new_heads(lm.model, "tiny-random-llama", 3, 2, 8, seed=1)
    torch.nn.init.normal_(heads.up, std=0.1)
    save_heads(heads, tmp_path / "h")
    back = load_heads(tmp_path / "h", lm.model)
    for k, v in heads.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    with pytest.raises(HeadsLoadError) as err:
        load_heads(tmp_path / "h", tiny("qwen2").model)  # same shapes, other weights
    assert "\n" not in str(err.value) and "tiny-random-llama" in str(err.value)
    with pytest.raises(HeadsLoadError):
        load_heads(tmp_path / "missing", lm.model)


# ---- the drafter's tree -----------------------------------------------------------------------------
def test_best_tree_table():
    """The shared selection (tree.best_nodes) on a cp_heads-style pool: log-prob scores, parents first."""
    root = torch.tensor([9])
    score = torch.tensor([[-1.0, -2.0, -1.5, -3.0]])
    tok = torch.tensor([[4, 5, 6, 7]])
    par = torch.tensor([[-1, -1, 0, 2]])
    ok = torch.ones_like(score, dtype=torch.bool)
    tree, _ = best_nodes(root, score, ok, tok, par, 3)
    assert tree.tokens.tolist() == [[9, 4, 5, 6]] and tree.parents.tolist() == [[-1, 0, 0, 1]]
    tree, _ = best_nodes(root, score, ok, tok, par, 2)
    assert tree.tokens.tolist() == [[9, 4, 6]] and tree.parents.tolist() == [[-1, 0, 1]]


def test_pool_is_the_best_joint_continuations():
    """The drafted tree holds exactly the N most probable (depth 1 and 2) continuations of the mixture
    conditioned on the root, enumerated by brute force."""
    heads, lm = _small_heads(3, 3, v=5, e=6, seed=2)
    drafter = CPHeadsDrafter(heads, lm, num_nodes=6)
    from esp_worker.drafters.base import RowsView

    h = torch.randn(1, 6)
    root = 3
    view = RowsView(torch.tensor([[0, root]]), torch.tensor([2]), torch.tensor([1]), [0],
                    drafter.state_type(cp_h=h, cp_ok=torch.ones(1, dtype=torch.bool)))
    tree = drafter.propose(view).tree
    with torch.no_grad():
        log_w, log_p = heads(h, lm)
    w, p = log_w.exp()[0].double(), log_p.exp()[0].double()  # [r], [r, n, V]
    post = w * p[:, 0, root]
    post = post / post.sum()
    joint = {}
    for x in range(5):
        joint[(x,)] = float((post * p[:, 1, x]).sum())
        for y in range(5):
            joint[(x, y)] = float((post * p[:, 1, x] * p[:, 2, y]).sum())
    best = sorted(joint.values(), reverse=True)[:6]
    toks, pars = tree.tokens[0].tolist(), tree.parents[0].tolist()
    paths = []
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        paths.append(tuple(reversed(path)))
    assert sorted((joint[q] for q in paths), reverse=True) == pytest.approx(best)


# ---- lossless ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def random_heads(arch: str, rank: int, tmp: str) -> str:
    """Heads with random (not trained) weights for a tiny model, so that trees vary from pass to pass."""
    lm = tiny(arch)
    heads = new_heads(lm.model, f"tiny-random-{arch}", num_positions=3, rank=rank, head_hidden=16, seed=5)
    torch.nn.init.normal_(heads.up, std=0.3)
    torch.nn.init.normal_(heads.gate.weight, std=0.5)
    return str(save_heads(heads, f"{tmp}/{arch}-r{rank}"))


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("heads"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_cp_heads_greedy_matches_generate(arch, batch, heads_dir):
    lm = tiny(arch)
    ref = reference(arch, "sdpa")
    for rank, bc in [(1, 10), (4, 30)]:
        cfg = EngineConfig(method="cp_heads", heads_path=random_heads(arch, rank, heads_dir), block_complexity=bc,
                           max_batch_size=batch)
        outs = run(lm, cfg, GenerationParams(max_new_tokens=64))
        for o, r in zip(outs, ref):
            assert o.error is None, o.error
            assert tuple(o.token_ids) == r, f"cp_heads r{rank} BC{bc} {arch} batch {batch}: diverged from generate"
        assert sum(o.stats.num_drafted_tokens for o in outs) > 0


@pytest.mark.parametrize("slope", [0.0, 0.3])
def test_cp_heads_auto_block_matches_generate(heads_dir, slope):
    """block_complexity=auto under a flat cost curve (large trees) and a steep one (small trees / plain)."""
    from esp_worker.auto.cost_model import CostCurve

    blocks = [1, 2, 4, 8, 16]
    secs = [[[1.0 + slope * q for q in blocks] for _ in (64, 512)] for _ in (1, 8)]
    lm = tiny("llama")
    cfg = EngineConfig(method="cp_heads", heads_path=random_heads("llama", 4, heads_dir), block_complexity="auto",
                       auto_max_block=16, max_batch_size=4)
    eng = Engine(lm, cfg, cost_curve=CostCurve([1, 8], [64, 512], blocks, secs))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)])
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))


def test_cp_heads_seeded_sampling_equals_plain(heads_dir):
    lm = tiny("llama")
    params = [GenerationParams(max_new_tokens=48, temperature=t, top_p=tp, seed=s)
              for s, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.8)])]
    reqs = [Request(id=str(i), prompt=PROMPTS[i % 4], params=p) for i, p in enumerate(params)]
    plain = [o.token_ids for o in Engine(lm, EngineConfig(method="ar", max_batch_size=3)).generate(reqs)]
    for rank in (1, 4):
        cfg = EngineConfig(method="cp_heads", heads_path=random_heads("llama", rank, heads_dir), block_complexity=10,
                           max_batch_size=3)
        got = [o.token_ids for o in Engine(lm, cfg).generate(reqs)]
        assert got == plain


def test_cp_heads_needs_heads_path():
    with pytest.raises(ValueError, match="heads_path"):
        EngineConfig(method="cp_heads").validate()


def test_bench_grid_has_one_cp_heads_setting_per_heads_dir():
    from omegaconf import OmegaConf

    from jobs.bench.settings import grid
    from jobs.bench.config import BenchSection

    b = OmegaConf.structured(BenchSection(methods=["ar", "cp_heads"], block_complexities=[10, 30],
                                          heads_paths=["heads/a-rank1", "heads/a-rank4"], hf_baseline=False))
    assert [s.label for s in grid(b)] == [
        "ar", "cp_heads a-rank1 BC10", "cp_heads a-rank4 BC10", "cp_heads a-rank1 BC30", "cp_heads a-rank4 BC30",
    ]


# ---- the heads as a proposer inside hybrid ----------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_with_heads_matches_generate(arch, batch, heads_dir):
    lm = tiny(arch)
    ref = reference(arch, "sdpa")
    for rank, bc, k in [(1, 10, 1), (4, 30, 2)]:
        cfg = EngineConfig(method="hybrid", heads_path=random_heads(arch, rank, heads_dir), block_complexity=bc,
                           num_masks=k, max_batch_size=batch)
        outs = run(lm, cfg, GenerationParams(max_new_tokens=64))
        for o, r in zip(outs, ref):
            assert o.error is None, o.error
            assert tuple(o.token_ids) == r, f"hybrid+heads r{rank} BC{bc} k{k} {arch} batch {batch}: diverged"
        assert sum(o.stats.accepted_by_proposer.get("heads", 0) for o in outs) > 0  # the heads' nodes were kept


def test_hybrid_with_heads_auto_and_sampling(heads_dir):
    from esp_worker.auto.cost_model import CostCurve

    lm = tiny("llama")
    blocks = [1, 2, 4, 8, 16, 32]
    secs = [[[1.0 + 0.01 * q for q in blocks] for _ in (64, 512)] for _ in (1, 8)]
    cfg = EngineConfig(method="hybrid", heads_path=random_heads("llama", 4, heads_dir), block_complexity="auto",
                       auto_max_block=32, max_batch_size=4, auto_probe_interval=2)
    eng = Engine(lm, cfg, cost_curve=CostCurve([1, 8], [64, 512], blocks, secs))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)])
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    params = [GenerationParams(max_new_tokens=48, temperature=t, top_p=tp, seed=s)
              for s, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.8)])]
    reqs = [Request(id=str(i), prompt=PROMPTS[i % 4], params=p) for i, p in enumerate(params)]
    plain = [o.token_ids for o in Engine(lm, EngineConfig(method="ar", max_batch_size=3)).generate(reqs)]
    cfg = EngineConfig(method="hybrid", heads_path=random_heads("llama", 4, heads_dir), block_complexity=30,
                       max_batch_size=3)
    assert [o.token_ids for o in Engine(lm, cfg).generate(reqs)] == plain


def test_bench_settings_hybrid_with_each_heads_dir():
    from omegaconf import OmegaConf

    from jobs.bench.settings import grid
    from jobs.bench.config import BenchSection, load_bench_config
    from jobs.config import ConfigError

    b = OmegaConf.structured(BenchSection(settings=["hybrid:auto", "hybrid+heads:auto"], hf_baseline=False,
                                          heads_paths=["heads/a-rank1", "heads/a-rank4"]))
    assert [s.label for s in grid(b)] == ["ar", "hybrid BCauto", "hybrid+heads a-rank1 BCauto", "hybrid+heads a-rank4 BCauto"]
    assert [s.heads_path for s in grid(b)] == ["", "", "heads/a-rank1", "heads/a-rank4"]
    with pytest.raises(ConfigError, match="give bench.heads_paths"):
        load_bench_config(overrides=["bench.settings=[hybrid+heads:30]"])


def test_cp_heads_log_probabilities_are_the_models(heads_dir):
    """GenerationParams.top_logprobs: the model's own at each generated position, whatever the heads drafted."""
    lm = tiny("qwen3")
    cfg = EngineConfig(method="cp_heads", heads_path=random_heads("qwen3", 4, heads_dir), block_complexity=10,
                       max_batch_size=4)
    outs = run(lm, cfg, GenerationParams(max_new_tokens=24, top_logprobs=2))
    assert sum(o.stats.num_accepted_drafts for o in outs) > 0
    for o, p in zip(outs, PROMPTS):
        logp = generated_logprobs(lm, p, o.token_ids)
        want = logp.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4)
        assert [[t for t, _ in x] for x in o.top_logprobs] == logp.topk(2, -1).indices.tolist()
