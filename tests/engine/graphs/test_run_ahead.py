"""engine.cuda_graphs_run_ahead: replayed passes launched before the last one's read (on a CPU over the static
buffers, eagerly). The tokens, finish reasons and per-request statistics are those of the engine that reads every
pass before the next, through stop ids that end rows mid-batch, limits, continuous batching, seeded sampling, the
context limit and rows that outgrow the pinned slab; for plain passes and for every drafter at a fixed block
complexity (greedy rows), on a model that accepts drafts too. (Where a drafter learns across rows, the hybrid, a
request that joins after a row ended at a stop id may draft differently: `test_random_jobs_...`.)"""
from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from cost_curves import FLAT
from engine_helpers import ARCHS, PROMPTS, generated_logprobs, reference, tiny
from model_time import model_time
from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request
from esp_worker import engine as engine_module
from esp_worker.model.load import load_model
from shared_data import REPO, TINY_LLAMA, TINY_PROMPTS, shared

MORE = PROMPTS + tuple(p[::-1] for p in PROMPTS) + ("a b c", "def f(x):")  # 10 prompts: rows come and go


def _generate(lm, ahead: bool, reqs, batch: int = 4, **cfg):
    eng = Engine(lm, EngineConfig(method="ar", max_batch_size=batch, cuda_graphs=True, cuda_graphs_run_ahead=ahead,
                                  **cfg))
    return eng, eng.generate(reqs)


def _same(outs, base):
    for o, b in zip(outs, base):
        assert (o.token_ids, o.finish_reason, o.error) == (b.token_ids, b.finish_reason, b.error), o.id
        assert dataclasses.replace(o.stats, time_s=0.0) == dataclasses.replace(b.stats, time_s=0.0), o.id


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_passes_run_ahead_with_generates_tokens(arch, batch):
    lm = tiny(arch)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    eng, outs = _generate(lm, True, reqs, batch)
    assert [tuple(o.token_ids) for o in outs] == list(reference(arch, "sdpa"))
    _same(outs, _generate(lm, False, reqs, batch)[1])
    g = eng.stats.graphs
    assert g.graph_passes == eng.stats.decode_passes and g.ahead_passes > 0.8 * eng.stats.decode_passes


def test_rows_that_stop_mid_batch_and_rows_that_join():
    """Stop ids end rows at passes the host cannot foresee (the pass after them runs over them and is read at
    once), limits at passes it can; ten requests through four rows."""
    lm = tiny("llama")
    ref = reference("llama", "sdpa")
    stops = [ref[0][20], ref[1][9]]
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=5 + 7 * i, stop_token_ids=stops))
            for i, p in enumerate(MORE)]
    eng, outs = _generate(lm, True, reqs)
    _same(outs, _generate(lm, False, reqs)[1])
    assert {o.finish_reason for o in outs} >= {"length", "stop"}
    assert eng.stats.graphs.ahead_passes > 0


def test_seeded_sampling_runs_ahead_with_the_same_uniforms():
    lm = tiny("llama")
    params = GenerationParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5)
    reqs = [Request(id=str(i), prompt=p, params=dataclasses.replace(params, temperature=0.0) if i == 2 else params)
            for i, p in enumerate(MORE)]
    eng, outs = _generate(lm, True, reqs, 3)
    _same(outs, _generate(lm, False, reqs, 3)[1])
    assert eng.stats.graphs.ahead_passes > 0


def test_context_limit_and_a_slab_that_grows():
    lm = dataclasses.replace(tiny("qwen2"), max_context=48)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    _, outs = _generate(lm, True, reqs)
    _same(outs, _generate(lm, False, reqs)[1])
    assert any(o.finish_reason == "context" for o in outs)
    lm = tiny("llama")
    eng, outs = _generate(lm, True, reqs, cuda_graph_max_len=24)
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    g = eng.stats.graphs
    assert g.eager_passes["capacity"] > 0 and g.ahead_passes > 0
    assert g.graph_passes + sum(g.eager_passes.values()) == eng.stats.decode_passes
    # a row that stops where its next pass has no graph (past the capacity of 24): that pass is not run, nor
    # counted as an eager pass (the stops were found by trying each position)
    ref = reference("llama", "sdpa")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64, stop_token_ids=[ref[i][k]]))
            for i, (p, k) in enumerate(zip(PROMPTS, (20, 7, 22, 12)))]
    eng, outs = _generate(lm, True, reqs, 1, cuda_graph_max_len=24)
    _same(outs, _generate(lm, False, reqs, 1, cuda_graph_max_len=24)[1])
    assert all(o.finish_reason == "stop" for o in outs)
    g = eng.stats.graphs
    assert g.graph_passes + sum(g.eager_passes.values()) == eng.stats.decode_passes


def test_sampled_drafting_and_stop_strings_read_every_pass():
    """What a pass run ahead could not know: a sampling row's uniforms after a drafting pass (refilled at a
    host-known position), stop strings (checked on the host)."""
    lm = tiny("llama")
    reqs = [Request(id="0", prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=24))]
    sampled = [Request(id="0", prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=24, temperature=1.0, seed=3))]
    eng = Engine(lm, EngineConfig(method="pld", block_complexity=10, cuda_graphs=True, cuda_graphs_run_ahead=True))
    eng.generate(sampled)
    assert eng.stats.graphs.ahead_passes == 0 and eng.stats.graphs.graph_passes > 0
    text = Engine(lm, EngineConfig(method="ar")).generate(reqs)[0].text
    stop = [Request(id="0", prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=24, stop_strings=[text[8:11]]))]
    eng, outs = _generate(lm, True, stop, 1)
    assert eng.stats.graphs.ahead_passes == 0 and outs[0].finish_reason == "stop"


DRAFTING = [dict(method="pld", block_complexity=6), dict(method="esp", num_masks=1, block_complexity=10),
            dict(method="esp", num_masks=2, block_complexity=12, tree="dynamic"),
            dict(method="hybrid", num_masks=1, block_complexity=16), dict(method="stand", block_complexity=10),
            dict(method="lade", block_complexity=10)]


def _same_ahead(lm, setting: dict, batch: int, reqs):
    """Run-ahead against reading every pass: the same outputs and statistics; returns the run-ahead engine's."""
    runs = []
    for ahead in (True, False):
        eng = Engine(lm, EngineConfig(max_batch_size=batch, cuda_graphs=True, cuda_graphs_run_ahead=ahead, **setting))
        runs.append((eng, eng.generate(reqs)))
    _same(runs[0][1], runs[1][1])
    return runs[0]


@pytest.mark.parametrize("setting", range(len(DRAFTING)))
@pytest.mark.parametrize("batch", [1, 4])
def test_drafting_passes_run_ahead_with_generates_tokens(setting, batch):
    """A drafting pass's lengths are bounds until its read (it commits 1 .. depth + 1 tokens a row): the next pass
    is launched over them, the history written at device lengths."""
    lm = tiny("llama")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    eng, outs = _same_ahead(lm, DRAFTING[setting], batch, reqs)
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    assert eng.stats.graphs.ahead_passes > 0.5 * eng.stats.decode_passes


@pytest.mark.parametrize("arch", ARCHS[1:])
def test_drafting_passes_run_ahead_on_every_architecture(arch):
    lm = tiny(arch)
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    for setting in (DRAFTING[1], DRAFTING[3]):
        _, outs = _same_ahead(lm, setting, 4, reqs)
        assert [tuple(o.token_ids) for o in outs] == list(reference(arch, "sdpa")), setting


HEADS = REPO / "heads" / "esp-tiny-llama-rank4-warm"  # CP heads trained on the trained model (heads/README.md)
TRAINED = [dict(method="pld", block_complexity=10), dict(method="esp", num_masks=1, block_complexity=30),
           dict(method="esp", num_masks=2, block_complexity=30), dict(method="hybrid", num_masks=1, block_complexity=30),
           dict(method="hybrid", num_masks=1, block_complexity=30, heads_path=str(HEADS)),
           dict(method="cp_heads", block_complexity=10, heads_path=str(HEADS))]


@pytest.fixture(scope="module")
def trained():
    return load_model(ModelConfig(name_or_path=str(shared(TINY_LLAMA))))


def _stopping(trained, limit) -> list[Request]:
    """Six development prompts, request i with limit(i) new tokens and two stop ids the first and fourth prompts'
    plain decoding meets (rows that end where the host cannot foresee it; at batch 4 two requests join as rows end)."""
    prompts = [json.loads(line)["prompt"] for line in open(shared(TINY_PROMPTS))][:6]
    first = Engine(trained, EngineConfig(method="ar")).generate(
        [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=40)) for i, p in enumerate(prompts[:4])])
    stops = [first[0].token_ids[15], first[3].token_ids[9]]
    return [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=limit(i), stop_token_ids=stops))
            for i, p in enumerate(prompts)]


@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(TRAINED)))
@pytest.mark.parametrize("batch", [1, 4])
def test_drafting_run_ahead_on_a_model_that_accepts_drafts(trained, setting, batch):
    """Six requests through `batch` rows, stop ids ending rows where the host cannot foresee it (the pass after runs
    over them, masked, and the drafters learn nothing there: the hybrid's calibration, its corpus hints) and
    limits where it can: the same tokens and statistics, drafts accepted."""
    eng, outs = _same_ahead(trained, TRAINED[setting], batch, _stopping(trained, lambda i: 10 + 4 * i))
    assert {o.finish_reason for o in outs} == {"length", "stop"}
    assert sum(o.stats.num_accepted_drafts for o in outs) > len(outs) and eng.stats.graphs.ahead_passes > 0


AUTO = [dict(method="pld"), dict(method="esp", num_masks=1), dict(method="esp", num_masks=2, tree="dynamic"),
        dict(method="hybrid", num_masks=1)]


def _auto(lm, setting: dict, batch: int, reqs, ahead: bool = True):
    """block_complexity=auto over a free block (FLAT: every size costs a plain pass), the looks' masses riding in
    the reads as on an accelerator, each pass costing what the curve says (the same decisions on any machine)."""
    eng = Engine(lm, EngineConfig(block_complexity="auto", max_batch_size=batch, cuda_graphs=True,
                                  cuda_graphs_run_ahead=ahead, **setting), cost_curve=FLAT)
    with pytest.MonkeyPatch.context() as mp, model_time(lambda b, q, prefill: FLAT.time(b, q, 100)):
        mp.setattr(engine_module, "PREPARE_LOOKS", True)
        outs = eng.generate(reqs)
    sizes = collections.Counter()
    for o in outs:
        sizes.update(o.stats.block_size_histogram)
    return eng, outs, sizes


@pytest.mark.parametrize("setting", range(len(AUTO)))
@pytest.mark.parametrize("batch", [1, 4])
def test_auto_passes_run_ahead_with_generates_tokens(setting, batch):
    """block_complexity=auto plans a pass before the read of the one in flight, from the look that came with the
    read before (`BlockPolicy.plan`): its sizes may differ from reading every pass, never its tokens."""
    lm = tiny("llama")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)]
    eng, outs, sizes = _auto(lm, AUTO[setting], batch, reqs)
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    assert eng.stats.graphs.ahead_passes > 0.5 * eng.stats.decode_passes
    assert max(sizes) > 1, sizes  # it drafted


@pytest.mark.slow
@pytest.mark.parametrize("setting", [*AUTO, dict(method="hybrid", num_masks=1, heads_path=str(HEADS))])
@pytest.mark.parametrize("batch", [1, 4])
def test_auto_run_ahead_on_a_model_that_accepts_drafts(trained, setting, batch):
    """`auto` run ahead through rows that stop where the host cannot foresee it: the tokens of the engine that
    reads every pass, drafts accepted, most passes run ahead (but those that may reach a row's limit: a tree's
    depth is the most it commits)."""
    reqs = _stopping(trained, lambda i: 20 + 4 * i)
    eng, outs, _ = _auto(trained, setting, batch, reqs)
    base = _auto(trained, setting, batch, reqs, ahead=False)[1]
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(b.token_ids, b.finish_reason) for b in base]
    assert {o.finish_reason for o in outs} == {"length", "stop"}
    assert sum(o.stats.num_accepted_drafts for o in outs) > 0
    assert eng.stats.graphs.ahead_passes > 0.3 * eng.stats.decode_passes


def test_run_ahead_needs_graphs():
    with pytest.raises(ValueError, match="cuda_graphs_run_ahead"):
        EngineConfig(cuda_graphs=False, cuda_graphs_run_ahead=True).validate()
    with pytest.raises(ValueError, match="cuda_graphs_run_ahead"):
        EngineConfig(cuda_graphs_run_ahead="sometimes").validate()
    EngineConfig(cuda_graphs=False).validate()  # the default, auto, runs ahead only where passes are replayed


def test_replayed_plain_passes_run_ahead_by_default():
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="ar", max_batch_size=2, cuda_graphs=True))
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=16))
                         for i, p in enumerate(PROMPTS)])
    assert eng.stats.graphs.ahead_passes > 0
    assert [tuple(o.token_ids) for o in outs] == [r[:16] for r in reference("llama", "sdpa")]


RANDOM_SETTINGS = [dict(method="ar"), dict(method="pld", block_complexity=6), dict(method="esp", num_masks=1, block_complexity=10),
                   dict(method="esp", num_masks=2, block_complexity=12, tree="dynamic"), dict(method="stand", block_complexity=10),
                   dict(method="lade", block_complexity=10), dict(method="hybrid", num_masks=1, block_complexity=16),
                   dict(method="pld"), dict(method="esp", num_masks=1), dict(method="hybrid", num_masks=1),
                   dict(method="hybrid", num_masks=2)]  # no block_complexity: auto
SHARED_STATE = ("hybrid",)  # drafters that learn across rows (calibration, the corpus of finished requests)


def _random_job(seed: int, trained):
    """A job drawn from `seed`: architecture (or the trained model), setting, batch, admission, a context limit,
    and requests with their own limits, stop ids that plain decoding meets and seeded sampling."""
    import random

    from esp_worker.auto.cost_model import PrefillCost

    rnd = random.Random(seed)
    arch = rnd.choice([*ARCHS, "trained"])
    lm = trained if arch == "trained" else tiny(arch)
    if rnd.random() < 0.2:
        lm = dataclasses.replace(lm, max_context=rnd.choice([40, 64, 90]))
    admission = rnd.choice(["auto", "eager"])
    if admission == "auto":  # rent or buy, as on CUDA where the prefill's fixed cost is measured
        lm = dataclasses.replace(lm, prefill_cost=PrefillCost(fixed_s=rnd.choice([0.3, 1.0, 3.0, 8.0]), token_s=1e-3))
    pool = [json.loads(line)["prompt"] for line in open(shared(TINY_PROMPTS))][:40] if arch == "trained" else MORE
    prompts = [rnd.choice(pool) for _ in range(rnd.randint(1, 12))]
    plain = Engine(lm, EngineConfig(method="ar")).generate(
        [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        kw = dict(max_new_tokens=rnd.randint(1, 64))
        if rnd.random() < 0.4 and plain[i].token_ids:
            kw["stop_token_ids"] = [rnd.choice(plain[i].token_ids)]
        if rnd.random() < 0.25:
            kw.update(temperature=rnd.choice([0.7, 1.0]), seed=rnd.randint(0, 99), top_p=rnd.choice([1.0, 0.9]))
        reqs.append(Request(id=str(i), prompt=p, params=GenerationParams(**kw)))
    setting = dict(rnd.choice(RANDOM_SETTINGS), max_batch_size=rnd.randint(1, 5), admission=admission)
    return lm, setting, reqs


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_jobs_run_ahead_as_they_read_each_pass(trained, seed):
    """Features together, drawn at random: passes run ahead give the tokens and finish reasons of reading each pass
    and of eager passes, greedy rows those of plain decoding. Per-request statistics are equal too where the
    drafter's state is the row's own; where it learns across rows (the hybrid) a request that joins after a row
    ended at a stop id joins one pass later than when reading each pass, so its drafts may differ, never its greedy
    tokens. Under `auto` the sizes may differ too; where trees differ a sampled row is compared by its tokens' law
    elsewhere (`test_sampling.py`), not token for token: a draw within rounding of a boundary may flip."""
    lm, setting, reqs = _random_job(seed, trained)
    auto = "block_complexity" not in setting
    cfg = dict(setting, block_complexity="auto") if auto else setting
    runs = []
    for graphs, ahead in ((True, True), (True, False), (False, False)):
        eng = Engine(lm, EngineConfig(cuda_graphs=graphs, cuda_graphs_run_ahead=ahead, **cfg),
                     cost_curve=FLAT if auto else None)
        with pytest.MonkeyPatch.context() as mp, model_time(lambda b, q, prefill: FLAT.time(b, q, 100)):
            mp.setattr(engine_module, "PREPARE_LOOKS", True)
            runs.append(eng.generate(reqs))
    plain = Engine(lm, EngineConfig(method="ar")).generate(reqs)
    ahead, read, eager = runs
    for r, a, b, e, p in zip(reqs, ahead, read, eager, plain):
        same_trees = not auto and setting["method"] not in SHARED_STATE
        if r.params.temperature == 0 or same_trees:  # (README, "Rounding": other trees may flip a near-tie draw)
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), (setting, r.id)
        if same_trees:
            assert dataclasses.replace(a.stats, time_s=0.0) == dataclasses.replace(b.stats, time_s=0.0), (setting, r.id)
        if r.params.temperature == 0:
            assert (a.token_ids, a.finish_reason) == (p.token_ids, p.finish_reason) == (e.token_ids, e.finish_reason), \
                (setting, r.id)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_jobs_return_the_models_log_probabilities(trained, seed):
    """GenerationParams.logprobs / top_logprobs drawn per request over a random job (passes run ahead, rows kept
    after they end, admission, context limits, auto): every row's are its model's own, as a forward over its prompt
    and tokens gives them."""
    import random

    import torch

    lm, setting, reqs = _random_job(seed, trained)
    rnd = random.Random(seed)
    reqs = [dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs=rnd.random() < 0.7,
                                                             top_logprobs=rnd.choice([0, 0, 1, 3]))) for r in reqs]
    auto = "block_complexity" not in setting
    eng = Engine(lm, EngineConfig(cuda_graphs=True, **dict(setting, block_complexity="auto") if auto else setting),
                 cost_curve=FLAT if auto else None)
    with pytest.MonkeyPatch.context() as mp, model_time(lambda b, q, prefill: FLAT.time(b, q, 100)):
        mp.setattr(engine_module, "PREPARE_LOOKS", True)
        outs = eng.generate(reqs)
    for r, o in zip(reqs, outs):
        if o.error is not None or not r.params.wants_logprobs:
            assert o.logprobs is None and o.top_logprobs is None
            continue
        logp = generated_logprobs(lm, r.prompt, o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), logp.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        if r.params.top_logprobs:
            best = logp.topk(r.params.top_logprobs, -1).values
            torch.testing.assert_close(torch.tensor([[lp for _, lp in x] for x in o.top_logprobs]), best, atol=1e-4,
                                       rtol=0)


@pytest.mark.parametrize("end", ["stop", "length"])
def test_rows_that_end_stay_in_the_batch_until_requests_join(end):
    """Where a prefill's fixed cost is measured (CUDA), requests join once idle slots have cost a forward
    (`engine.admission`): until then a row that ended (at a stop id, or at its length limit, which the host
    foresees) stays in the batch, masked, and passes keep running ahead of their reads rather than reading the pass
    in flight to let it leave at once. Same tokens, finish reasons and per-request statistics as reading each pass;
    more passes run ahead than when rows leave at once."""
    from esp_worker.auto.cost_model import PrefillCost

    lm = dataclasses.replace(tiny("llama"), prefill_cost=PrefillCost(fixed_s=3.0, token_s=1e-3))
    ref = reference("llama", "sdpa")
    if end == "stop":
        reqs = [Request(id=str(i), prompt=p, params=GenerationParams(
            max_new_tokens=64, stop_token_ids=[ref[i % 4][5 + 4 * i]])) for i, p in enumerate(MORE)]
    else:
        reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=6 + 7 * i % 40, ignore_eos=True))
                for i, p in enumerate(MORE)]
    runs = {}
    for ahead in (True, False):
        eng = Engine(lm, EngineConfig(method="ar", max_batch_size=4, cuda_graphs=True, cuda_graphs_run_ahead=ahead))
        with model_time(lambda b, q, prefill: 1.0):  # a pass costs one second, a forward's fixed cost three
            runs[ahead] = eng, eng.generate(reqs)
    (eng, outs), (read_each, base) = runs[True], runs[False]
    _same(outs, base)
    assert sum(o.finish_reason == end for o in outs) >= 4
    g = eng.stats.graphs
    assert g.kept_ended_passes > 0 and g.ahead_passes > g.kept_ended_passes
    if end == "length":  # rows that would leave at their limits (requests join) still leave at once: no pass more
        assert eng.stats.decode_passes == read_each.stats.decode_passes


@pytest.mark.parametrize("setting", [dict(method="pld"), dict(method="hybrid", num_masks=1)])
def test_rows_that_end_stay_in_the_batch_under_auto(setting):
    """The same under block_complexity=auto: while ended rows stay, the policy's looks weigh the rows that go on
    against the whole batch's cost and it learns from the passes over them. Same tokens and finish reasons as
    reading each pass (the sizes may differ: a pass run ahead plans from an older read)."""
    from esp_worker.auto.cost_model import PrefillCost

    lm = dataclasses.replace(tiny("llama"), prefill_cost=PrefillCost(fixed_s=3.0, token_s=1e-3))
    ref = reference("llama", "sdpa")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(
        max_new_tokens=64, stop_token_ids=[ref[i % 4][5 + 4 * i]])) for i, p in enumerate(MORE)]
    runs = {}
    for ahead in (True, False):
        eng = Engine(lm, EngineConfig(block_complexity="auto", max_batch_size=4, cuda_graphs=True,
                                      cuda_graphs_run_ahead=ahead, **setting), cost_curve=FLAT)
        seen, observe_pass = [], eng.policy.observe_pass

        def spy(committed, seconds=None, model_seconds=None, rows=None, seen=seen, observe_pass=observe_pass):
            seen.append(rows)
            observe_pass(committed, seconds, model_seconds, rows=rows)

        eng.policy.observe_pass = spy
        with pytest.MonkeyPatch.context() as mp, model_time(lambda b, q, prefill: 1.0):
            mp.setattr(engine_module, "PREPARE_LOOKS", True)
            runs[ahead] = eng, eng.generate(reqs), seen
    (eng, outs, seen), (_, base, _) = runs[True], runs[False]
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(b.token_ids, b.finish_reason) for b in base]
    assert sum(o.finish_reason == "stop" for o in outs) >= 4
    assert eng.stats.graphs.kept_ended_passes > 0
    assert any(rows is not None and 0 < rows < 4 for rows in seen)  # passes over kept rows, observed
    assert max(max(o.stats.block_size_histogram) for o in outs) > 1  # it drafted


def test_rows_that_end_stay_when_no_request_is_left_to_join():
    """With the input taken to its end, nothing would join: rows that end (at their limits here, with requests
    joining at once, as on a CPU) stay in the batch until the last live row ends, and the tokens and statistics are
    those of reading each pass."""
    lm = tiny("llama")
    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=6 + 3 * i, ignore_eos=True))
            for i, p in enumerate(MORE)]
    (eng, outs), (_, base) = _generate(lm, True, reqs, batch=8), _generate(lm, False, reqs, batch=8)
    _same(outs, base)
    assert eng.stats.graphs.kept_ended_passes > 0
    assert [len(o.token_ids) for o in outs] == [6 + 3 * i for i in range(len(MORE))]
