"""engine.compile_host=true (esp_worker/kernels/settle.py): a greedy pass's verification, stops, commit and counters
as one AOTInductor kernel give exactly the eager engine's tokens, finish reasons and statistics."""
from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch

from cost_curves import FLAT
from engine_helpers import PROMPTS, reference, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request
from esp_worker.kernels import aot
from esp_worker.model.errors import ModelLoadError
from esp_worker.kernels.settle import Settler


@pytest.fixture
def compile_at_once(monkeypatch):
    """Kernels compiled at a shape's first pass, so that every pass of a run goes through them."""
    monkeypatch.setattr(aot, "COMPILE_AFTER", 1)

GREEDY = GenerationParams(max_new_tokens=64)


def _run(lm, cfg: EngineConfig, params, prompts=PROMPTS):
    eng = Engine(lm, cfg)
    outs = eng.generate([Request(id=str(i), prompt=p, params=params(i) if callable(params) else params)
                         for i, p in enumerate(prompts)])
    return eng, outs


def _same(a, b, what: str) -> None:
    """Outputs equal token for token, in finish reason and in every statistic but time."""
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason, what
        sx, sy = dataclasses.asdict(x.stats), dataclasses.asdict(y.stats)
        sx.pop("time_s"), sy.pop("time_s")
        assert sx == sy, f"{what}: statistics differ"


SETTINGS = [  # (method, block complexity, masks, tree, batch): one kernel each
    ("ar", 1, 1, "static", 4),  # plain passes, one slot
    ("esp", 30, 1, "static", 1),  # one level of 14 nodes (the fan path)
    ("esp", 30, 2, "static", 2),  # a static tree two deep [7, 2]: the probe's kernel prepares its blocks
    ("esp", 24, 2, "dynamic", 3),  # per-row trees two deep (per-row layouts)
]  # (pld's chains and the hybrid's trees are checked on the trained model, where their drafts are accepted)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_settle_matches_eager_and_generate(arch, compile_at_once):
    lm = tiny(arch)
    ref = reference(arch, "sdpa")
    settings = SETTINGS if arch == "llama" else SETTINGS[:3]
    for method, bc, k, tree, batch in settings:
        cfg = EngineConfig(method=method, block_complexity=bc, num_masks=k, tree=tree, max_batch_size=batch)
        _, eager = _run(lm, cfg, GREEDY)
        eng, comp = _run(lm, dataclasses.replace(cfg, compile_host=True), GREEDY)
        what = f"{method} BC {bc} k {k} {tree} batch {batch} {arch}"
        assert eng.settler.passes == eng.stats.decode_passes > 0, f"{what}: not every pass ran the kernel"
        assert eng.compile_s > 0
        if tree == "dynamic":  # per-row layouts: the batch's last row keeps the batch's kernel
            assert eng.settler.kernels.compiled == 1, what
        if method == "esp" and tree == "static":  # the pass after each prefill proposes eagerly, then prepared blocks
            assert eng.drafter.prepared_blocks > eng.stats.decode_passes // 2, what
            if batch == 1:
                assert eng.drafter.prepared_blocks == eng.stats.decode_passes - len(PROMPTS), what
        _same(eager, comp, what)
        assert [tuple(o.token_ids) for o in comp] == list(ref), f"{what}: diverged from generate"


@pytest.mark.slow
def test_compiled_settle_cuts_at_stop_ids_and_limits(compile_at_once):
    """Per-request lengths and a stop id that the model emits: the kernel's cuts are the eager engine's, with
    rows of several lengths in one batch (one kernel serves every batch size)."""
    lm = tiny("llama")
    stop = reference("llama", "sdpa")[0][5]  # a token the first prompt's continuation emits
    params = lambda i: GenerationParams(max_new_tokens=(7, 64, 13, 30)[i], stop_token_ids=(stop,))  # noqa: E731
    cfg = EngineConfig(method="esp", block_complexity=30, num_masks=1, max_batch_size=3)
    _, eager = _run(lm, cfg, params)
    eng, comp = _run(lm, dataclasses.replace(cfg, compile_host=True), params)
    assert eng.settler.passes == eng.stats.decode_passes
    _same(eager, comp, "stops and limits")
    assert {o.finish_reason for o in comp} >= {"stop", "length"}


@pytest.mark.slow
def test_passes_the_kernel_does_not_cover_run_eagerly(compile_at_once):
    """Sampled rows and stop strings are settled eagerly (no settle kernel is compiled for them), with the same
    output as without compile_host (the probe's kernel still prepares ESP's blocks: drafting does not sample)."""
    lm = tiny("llama")
    cfg = EngineConfig(method="esp", block_complexity=30, num_masks=1, max_batch_size=2)
    for params in (GenerationParams(max_new_tokens=24, temperature=1.0, seed=3),
                   GenerationParams(max_new_tokens=24, stop_strings=("the",))):
        _, eager = _run(lm, cfg, params)
        eng, comp = _run(lm, dataclasses.replace(cfg, compile_host=True), params)
        assert eng.settler.passes == 0 and eng.settler.compile_s == 0
        _same(eager, comp, "uncovered passes")


@pytest.mark.slow
def test_a_shape_is_compiled_after_it_recurs():
    """By default a block shape gets its kernel at its COMPILE_AFTER-th pass: the passes before run eagerly,
    the rest through the kernel; a shape that does not recur (here: the prompts' first passes) costs nothing."""
    lm = tiny("llama")
    cfg = EngineConfig(method="esp", block_complexity=30, num_masks=1, max_batch_size=1, compile_host=True)
    eng, outs = _run(lm, cfg, GREEDY)
    assert eng.stats.decode_passes > aot.COMPILE_AFTER
    assert eng.settler.passes == eng.stats.decode_passes - (aot.COMPILE_AFTER - 1)
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    eng, _ = _run(lm, cfg, GenerationParams(max_new_tokens=8), PROMPTS[:2])  # 14 passes: never compiled
    assert eng.settler.passes == 0 and eng.compile_s == 0
    # the packages' libraries were unpacked under our own temporary directory (removed at exit), not left in /tmp
    assert glob.glob(os.path.join(aot._packages(), "aotinductor_*"))


def test_compile_host_is_for_cpu_runs():
    with pytest.raises(ModelLoadError, match="engine.compile_host=false"):
        Settler(torch.device("cuda"))


@pytest.mark.slow
def test_compiled_settle_on_the_trained_model(compile_at_once):
    """The trained esp-tiny-llama accepts drafts (random models accept nothing): ESP BC 30 at batch 1, pld at
    batch 4 and the hybrid at batch 2 on dev prompts, compiled and eager, agree in tokens and statistics (the
    hybrid's accepted drafts per proposer too), with drafts accepted. (`block_complexity=auto` under compile_host,
    whose every block size is a kernel of its own, is `test_auto_block_sizes_with_compile_host`'s.)"""
    from shared_data import SHARED_DATA, TINY_PROMPTS, shared
    from esp_worker import ModelConfig
    from esp_worker.model.load import load_model

    model_dir = shared(SHARED_DATA.parent / "models" / "esp-tiny-llama")
    prompts = [json.loads(line)["prompt"] for line in shared(TINY_PROMPTS).read_text().splitlines()[:6]]
    torch.set_num_threads(1)
    lm = load_model(ModelConfig(name_or_path=str(model_dir)))
    for cfg in (EngineConfig(method="esp", block_complexity=30, num_masks=1, max_batch_size=1),
                EngineConfig(method="pld", block_complexity=10, max_batch_size=4),
                EngineConfig(method="hybrid", block_complexity=30, max_batch_size=2)):
        _, eager = _run(lm, cfg, GenerationParams(max_new_tokens=48), prompts)
        eng, comp = _run(lm, dataclasses.replace(cfg, compile_host=True), GenerationParams(max_new_tokens=48), prompts)
        what = f"trained {cfg.method} BC {cfg.block_complexity}"
        assert eng.settler.passes == eng.stats.decode_passes
        if cfg.method == "hybrid":  # per-row trees: the batch's last row keeps the batch's kernel
            assert eng.settler.kernels.compiled == 1, what
        if cfg.method != "pld":  # ESP's mask EMA was computed by the kernel
            assert eng.settler.ema_passes > eng.settler.passes // 2, (eng.settler.ema_passes, eng.settler.passes)
        if cfg.method == "esp":  # and ESP's blocks were prepared by the probe's kernel
            assert eng.drafter.prepared_blocks == eng.stats.decode_passes - len(prompts)
        _same(eager, comp, what)
        assert sum(o.stats.num_accepted_drafts for o in comp) > 0


def test_probe_candidates_rank_by_logits_and_exclude_the_root():
    """The probe's candidates: each mask's best tokens by logit with their log-probabilities, mask 1 never holding
    the root's own token (pruning), padded with NEG past a small vocabulary; the kernel's function builds the
    static tree and the block's embeddings from them exactly as the eager drafter does."""
    from esp_worker.drafters.common import NEG
    from esp_worker.drafters.esp import ProbeSpec, probe_block, probe_candidates, static_tree_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50)
    root = logits[:, 0].argmax(-1)  # the best token at mask 1 is the root's own: pruned
    lp, ids = probe_candidates(logits.clone(), root, 6, prune=True)
    full = torch.log_softmax(logits, -1)
    assert (ids[:, 0] != root[:, None]).all()
    assert torch.equal(ids[:, 1], full[:, 1].topk(6).indices)  # mask 2: no pruning
    assert torch.allclose(lp, full.gather(2, ids), atol=1e-6)
    assert (lp.diff(dim=-1) <= 0).all()
    small_lp, small_ids = probe_candidates(torch.randn(3, 1, 4), root % 4, 6, prune=False)
    assert small_lp.shape == (3, 1, 6) and (small_lp[..., 4:] == NEG).all() and (small_ids[..., 4:] == 0).all()

    weight, m = torch.randn(50, 8), torch.randn(3, 1, 8)
    c_lp, c_ids, tokens, valid, embeds = probe_block(logits.clone(), root, m, weight,
                                                     ProbeSpec(6, True, (3, 2), 2, torch.float32))
    assert torch.equal(c_lp, lp) and torch.equal(c_ids, ids)
    t_ref, v_ref = static_tree_tokens(root, lp, ids, [3, 2], prune=True)
    assert torch.equal(tokens, t_ref) and torch.equal(valid, v_ref) and tokens.shape == (3, 6)
    assert torch.equal(embeds, torch.cat([weight[tokens], m.expand(-1, 12, -1)], 1))


@pytest.mark.slow
def test_auto_block_sizes_with_compile_host(compile_at_once):
    """block_complexity=auto with engine.compile_host: the probe's kernel prepares the largest tree; only a pass of
    that size with every row freshly probed and m up to date takes it; other sizes, plain passes (after which m
    owes their tokens) and row changes build their block eagerly (blocks free by the curve: the policy drafts the
    largest tree where its measured times allow, and on this CPU also decodes plainly and tries other sizes). Output
    stays generate's. A pass that compiled a kernel (seconds) is not timed for the policy, which would otherwise
    take the compile for its mode's cost."""
    lm = tiny("llama")
    cfg = EngineConfig(method="esp", block_complexity="auto", num_masks=1, max_batch_size=2, auto_probe_interval=2,
                       compile_host=True)
    eng = Engine(lm, cfg, cost_curve=FLAT)
    timed, observe_pass, compiled = [], eng.policy.observe_pass, [eng.compile_s]

    def spy(committed, seconds=None, model_seconds=None, **rows):  # (seconds handed to the policy, the pass compiled)
        timed.append((seconds, eng.compile_s != compiled[-1]))
        compiled.append(eng.compile_s)
        observe_pass(committed, seconds, model_seconds, **rows)

    eng.policy.observe_pass = spy
    outs = eng.generate([Request(id=str(i), prompt=p, params=GREEDY) for i, p in enumerate(PROMPTS)])
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    assert eng.drafter.kernel_probes > 0 and eng.compile_s > 0  # kernels compiled inside passes
    assert any(c for _, c in timed) and len(timed) == eng.stats.decode_passes
    assert all((seconds is None) == c for seconds, c in timed)  # exactly the passes that compiled are not timed


def test_a_killed_process_leaves_no_temporary_directory(tmp_path):
    """Every actor imports the kernels' module; the packages' directory is made at the first compile, so a process
    killed without compiling (most actors: compile_host is off by default) leaves nothing in TMPDIR."""
    import subprocess
    import sys

    code = "import os, esp_worker, esp_worker.kernels.settle, esp_worker.drafters.esp; os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []
