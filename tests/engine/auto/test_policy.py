"""block_complexity=auto: the size policy on synthetic cost curves, and losslessness under it."""
from __future__ import annotations

import math
from collections import deque

import pytest
import torch

from cost_curves import BLOCKS, FLAT, STEEP, curve
from engine_helpers import ARCHS, reference, tiny
from model_time import model_time
from esp_worker import Engine, EngineConfig, GenerationParams
from esp_worker.auto.cost_model import CostCurve
from esp_worker.auto.policy import BlockPolicy, PolicySettings, _Decision, _Prepared, calibrate, look_vector
from esp_worker.auto.sizer import DraftSizer
from esp_worker.passes import PassPlan


class _Sizer(DraftSizer):
    """A sized drafter stand-in: trees of up to 29 nodes, each slot with k masks; no estimate of its own."""

    max_nodes = 29

    def __init__(self, k: int = 1):
        self.k = k

    def block_tokens(self, n: int) -> int:
        return 1 if n < 0 else (self.k + 1) * (n + 1)


def policy(c: CostCurve, k: int = 1, sizer: "DraftSizer | None" = None) -> BlockPolicy:
    return BlockPolicy(c, sizer or _Sizer(k), max_block=64)


def test_flat_cost_picks_the_largest_tree():
    mass = torch.full((2, 29), 0.05)
    assert policy(FLAT).choose(mass, 2, 100) == 29  # largest size with Q=60 <= 64


def test_steep_cost_falls_back_to_plain():
    mass = torch.full((2, 29), 0.3)
    assert policy(STEEP).choose(mass, 2, 100) == -1


def test_intermediate_cost_picks_intermediate_size():
    # cost grows slowly up to Q=8 then steeply; confident top nodes -> a small tree wins
    c = curve(lambda q: 1.0 + 0.02 * q if q <= 8 else 0.2 * q)
    mass = torch.tensor([[0.9, 0.5, 0.1] + [0.001] * 26])
    n = policy(c).choose(mass, 1, 100)
    assert 1 <= n <= 3


def test_no_mass_means_plain_and_alpha_calibrates():
    p = policy(FLAT)
    assert p.choose(None, 4, 10) == -1
    a0 = p.alpha
    for _ in range(50):
        p.observe(predicted=1.0, accepted=0.1)
    assert p.alpha < a0 and p.alpha == pytest.approx(0.1, abs=0.05)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,k", [("esp", 1), ("esp", 2), ("pld", 0)])
@pytest.mark.parametrize("cost", ["flat", "steep", "mixed"])
def test_auto_is_lossless(arch, method, k, cost):
    c = {"flat": FLAT, "steep": STEEP, "mixed": curve(lambda q: 1.0 + 0.05 * q)}[cost]
    lm = tiny(arch)
    cfg = EngineConfig(method=method, block_complexity="auto", num_masks=max(k, 1), max_batch_size=4, auto_probe_interval=2)
    eng = Engine(lm, cfg, cost_curve=c)
    from engine_helpers import PROMPTS
    from esp_worker import Request

    with model_time(lambda batch, tokens, prefill: c.time(batch, tokens, 100)):  # passes cost what the curve says
        outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64))
                             for i, p in enumerate(PROMPTS)])
    for o, r in zip(outs, reference(arch, "sdpa")):
        assert tuple(o.token_ids) == r
    sizes = set()
    for o in outs:
        sizes |= set(o.stats.block_size_histogram)
    if cost == "steep":
        assert 1 in sizes  # plain passes happen where drafting cannot pay
    if cost == "flat" and method == "esp":
        assert max(sizes) >= 32  # large trees where the block is free


def test_calibration_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ESP_BATCH_CACHE", str(tmp_path))
    eng_lm = tiny("llama")
    from esp_worker.model.runner import ModelRunner

    runner = ModelRunner(eng_lm)
    c1 = calibrate(runner, max_batch=2, max_block=8)
    files = list(tmp_path.glob("cost-*.json"))
    assert len(files) == 1
    c2 = calibrate(runner, max_batch=2, max_block=8)
    assert c1.seconds == c2.seconds and c1.block_sizes == [1, 2, 4, 8] and c1.batch_sizes == [1, 2]
    # another decode attention kernel (engine.attention_backend) is another machine: measured and cached apart
    calibrate(ModelRunner(eng_lm, attention_backend="math"), max_batch=2, max_block=8)
    assert len(list(tmp_path.glob("cost-*.json"))) == 2
    # flex is the kernel of compiled replayed passes only: eager passes under it are torch's, so is their curve
    assert calibrate(ModelRunner(eng_lm, attention_backend="flex"), max_batch=2, max_block=8).seconds == c1.seconds
    assert len(list(tmp_path.glob("cost-*.json"))) == 2
    # a damaged file (a full disk, a machine that went down mid-write) is measured again and replaced
    files[0].write_text('{"block_sizes": [1, 2')
    c3 = calibrate(runner, max_batch=2, max_block=8)
    assert c3.block_sizes == [1, 2, 4, 8] and calibrate(runner, max_batch=2, max_block=8).seconds == c3.seconds
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".json"]  # no temporary file left


def test_a_largest_block_beyond_half_the_context_is_half_the_context(tmp_path, monkeypatch):
    """auto's cost curve times blocks behind up to half the context of cache: a larger engine.auto_max_block is
    taken as half the context (it stopped the engine's start before), and the tokens are still generate's."""
    from engine_helpers import PROMPTS
    from esp_worker import Request

    monkeypatch.setenv("ESP_BATCH_CACHE", str(tmp_path))
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="pld", block_complexity="auto", auto_max_block=100_000, max_batch_size=2))
    assert eng.cfg.auto_max_block == lm.max_context // 2 == 512
    outs = eng.generate([Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=64)) for i, p in enumerate(PROMPTS)])
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))


class _Drafter(_Sizer):
    """A drafter stand-in: fixed mass, drafts without a probe."""

    def __init__(self, mass: torch.Tensor):
        super().__init__()
        self.mass = mass

    def draft_mass(self, view, variant: str = "") -> torch.Tensor:
        return self.mass


def _run(p: BlockPolicy, passes: int, seconds) -> list[int]:
    """Plan `passes` passes; each takes seconds(n) and commits 2 tokens per row when it drafts (one draft
    accepted), 1 when plain."""
    from types import SimpleNamespace

    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    plans = []
    for _ in range(passes):
        n = p.plan(view).num_nodes
        plans.append(n)
        p.observe_pass(torch.full((2,), 1 + int(n > 0)), seconds(n))
    return plans


def test_measured_overhead_turns_a_costly_drafter_off_and_explores():
    # the curve says a block is free, but every drafting pass (2 tokens per row) really takes 3x a plain one
    p = policy(FLAT, sizer=_Drafter(torch.full((2, 29), 0.5)))
    plans = _run(p, 300, lambda n: 1.1 if n < 0 else 3.3)
    assert all(n > 0 for n in plans[:3])  # the first looks draft: both modes get measured
    model_s = FLAT.time(2, 1, 100)  # the curve's pass time at batch 2 (the same for every block)
    assert p.overhead("draft") == pytest.approx(3.3 - model_s) and p.overhead("plain") == 0.0
    later = plans[10:]
    assert later.count(-1) > 0.95 * len(later)  # then plain decoding wins on measured time
    assert any(n > 0 for n in later)  # but drafting is re-measured now and then


def test_cheap_drafter_keeps_drafting_and_measures_plain():
    p = policy(FLAT, sizer=_Drafter(torch.full((2, 29), 0.5)))
    plans = _run(p, 200, lambda n: 1.3 if n < 0 else 1.35)
    assert 0 < plans.count(-1) <= 200 // p.explore_every + 1  # only the exploring plain passes
    assert p.overhead("plain") == pytest.approx(1.3 - FLAT.time(2, 1, 100))  # which measured the plain path


def test_nothing_to_draft_looks_again_next_pass_but_one():
    p = policy(FLAT, sizer=_Drafter(torch.zeros((2, 29))))
    plans = _run(p, 10, lambda n: 1.0)
    assert plans == [-1] * 10


class _TwoSets(_Drafter):
    """A drafter with two proposer sets: "slow" drafts 4-token blocks, "fast" chains of 1 + n."""

    variants = ("slow", "fast")

    def sizes(self, variant: str):
        return (lambda n: 1 + max(n, 0)), 29


def test_proposer_set_with_more_tokens_per_second_wins_and_the_other_is_explored():
    d = _TwoSets(torch.full((2, 29), 0.5))
    p = policy(FLAT, sizer=d)
    used = []

    def seconds(n: int) -> float:
        used.append(p.variant if n > 0 else "plain")
        return 1.3 if n < 0 else (2.0 if p.variant == "slow" else 1.4)  # same tokens, "slow" costs more

    _run(p, 400, seconds)
    late = used[100:]
    assert late.count("fast") > 0.8 * len(late)
    assert 0 < late.count("slow") < 0.1 * len(late)  # explored now and then
    assert p.arms["fast"].lead > p.arms["slow"].lead


def test_proposer_sets_are_compared_on_the_same_text():
    """"slow" is always 0.75x as fast as "fast" on the same text, and the text alternates between stretches
    where every drafting pass commits 4 tokens per row (code) and stretches where it commits 1.5 (verse).
    Each set's speed decayed over its own passes compared text with text: the set in charge on easy text
    outran the other's record from hard text and ran on; the paired comparison keeps "slow" to its trials."""
    from types import SimpleNamespace

    p = policy(FLAT, sizer=_TwoSets(torch.full((2, 29), 0.5)))
    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    used = []
    for i in range(3000):
        plan = p.plan(view)
        n = plan.num_nodes
        easy = (i // 150) % 2 == 0
        tokens = 1.0 if n < 0 else (4.0 if easy else 1.5)
        used.append(plan.variant if n > 0 else "plain")
        secs = 1.3 if n < 0 else (1.4 / 0.75 if plan.variant == "slow" else 1.4)
        p.observe_pass(int(2 * tokens), secs)
    late = used[300:]
    assert late.count("slow") < 0.05 * len(late)
    assert p.arms["fast"].lead - p.arms["slow"].lead == pytest.approx(-math.log(0.75), abs=0.1)


def test_an_exploring_look_drafts_even_with_a_low_alpha():
    p = policy(STEEP)
    for _ in range(200):
        p.observe(predicted=1.0, accepted=0.0)  # alpha ~0: the estimate says drafting never pays
    mass = torch.full((2, 29), 0.5)
    assert p.choose(mass, 2, 100) == -1  # measured: plain wins
    assert p.choose(mass, 2, 100, measured=False) > 0  # exploring: a tree, so alpha is measured again
    assert p.choose(torch.zeros((2, 29)), 2, 100, measured=False) == -1  # nothing to draft: plain


def test_a_trial_of_the_other_proposer_set_starts_no_back_off():
    d = _TwoSets(torch.full((2, 29), 0.5))
    p = policy(STEEP, sizer=d)  # every tree loses on the curve; "fast" is the best set, "slow" the one on trial
    from types import SimpleNamespace

    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    p.arm_min_passes = 0
    p.arms["slow"] = _arm = type(p.arm)(*d.sizes("slow"), p.max_block, *p._prior)
    p.arms["fast"] = type(p.arm)(*d.sizes("fast"), p.max_block, *p._prior)
    p.arms["fast"].lead = math.log(2.0)  # twice as fast as "slow" (lead 0)
    p.arm = p.arms["fast"]
    for a in p.arms.values():
        a.over.extend([0.0] * p.min_samples)  # measured: no exploring looks
    p._looks = int(p._trial_interval(p.arms, "fast", "slow")) - 1  # the next look is the trial of "slow"
    assert p.plan(view, [100, 100]) == PassPlan(-1, "slow")
    assert p._wait == 0  # the best set looks again at the next pass
    p.observe_pass(2, 1.0)
    assert p.plan(view, [100, 100]) == PassPlan(-1, "fast")
    assert p._wait >= 1  # the best set's own plain choice backs off


def test_proposer_sets_compare_speed_relative_to_plain_not_raw_tokens_per_second():
    """The same per-row speed (1.5x plain) at batch 8 and at batch 2 (a job's tail) rates the same."""
    p = policy(FLAT, sizer=_TwoSets(torch.full((8, 29), 0.5)))
    p._pick_arm()
    rates = []
    for batch in (8, 2):
        plain_s = FLAT.time(batch, 1, 96)  # the curve's plain pass at this batch (cache bucket of 100 tokens)
        arm = p.arm
        arm.local_tokens = arm.local_seconds = 0.0
        p._planned(-1, batch, 100)
        p.observe_pass(int(1.5 * batch), plain_s)  # 1.5 tokens per row in one plain pass's time
        rates.append(arm.local_rate)
    assert rates[0] == pytest.approx(rates[1]) == pytest.approx(1.5)


def _run_timed(p: BlockPolicy, passes: int, speed, draft_excess: float = 1.0) -> list[int]:
    """Like _run, with the model's own time reported: pass i's model takes the curve's time x speed(i) (the
    machine drifting), x draft_excess when drafting, and its host work 0.3 s x speed(i) when drafting,
    0.1 s x speed(i) when plain."""
    from types import SimpleNamespace

    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    plans = []
    for i in range(passes):
        n = p.plan(view).num_nodes
        plans.append(n)
        model_s = p._unobserved[-1].model_s * speed(i) * (draft_excess if n >= 0 else 1.0)
        host = (0.3 if n > 0 else 0.1) * speed(i)
        p.observe_pass(torch.full((2,), 1 + int(n > 0)), model_s + host, model_s)
    return plans


def test_machine_drift_is_not_taken_for_a_mode_overhead():
    """The machine slows down by half while the policy drafts: the drafting overhead stays the host time it
    was (in the curve's units), the drift factor takes the slowdown, and drafting goes on. Charging the whole
    wall time beyond the curve to the mode that ran (without the model's own time) made drafting look 1.5 s
    dearer per pass and switched it off."""
    mass = torch.full((2, 29), 0.5)
    p = policy(FLAT, sizer=_Drafter(mass))
    plans = _run_timed(p, 200, lambda i: 1.0 if i < 100 else 2.5)
    assert p.drift == pytest.approx(2.5, rel=1e-3)
    assert p.overhead("draft") == pytest.approx(0.3, rel=1e-3) and p.overhead("plain") == pytest.approx(0.1, rel=1e-3)
    assert sum(n > 0 for n in plans[100:]) > 0.95 * 100  # drafting pays on this curve, drift or not
    # without the model's time the slowdown lands on drafting's overhead
    q = policy(FLAT, sizer=_Drafter(mass))
    _run(q, 100, lambda n: 2.5 * (FLAT.time(2, 60, 100) + 0.3))
    assert q.overhead("draft") > 1.5


def test_drafting_passes_slower_than_the_curve_turn_drafting_off():
    """The curve says a block is free, the host overheads are small, but every drafting pass's model calls take
    7x the curve's time (on an H100, hybrid's passes under auto: their extra time was inside the model calls,
    invisible to the host overheads). The measured excess makes plain decoding win; with no excess the same
    policy drafts; a machine slowing down as a whole is not taken for an excess (the drift test above)."""
    mass = torch.full((2, 29), 0.5)
    p = policy(FLAT, sizer=_Drafter(mass))
    plans = _run_timed(p, 400, lambda i: 1.0, draft_excess=7.0)
    assert p.model_excess() == pytest.approx(7.0, rel=1e-3)
    assert sum(n > 0 for n in plans[100:]) < 0.1 * 300  # only the exploration passes draft
    assert p.drift == pytest.approx(1.0, rel=1e-3)  # the excess is not taken for the machine's speed
    q = policy(FLAT, sizer=_Drafter(mass))
    plans = _run_timed(q, 400, lambda i: 1.0)
    assert q.model_excess() == 1.0 and sum(n > 0 for n in plans[100:]) > 0.95 * 300
    # an excess within the VM's noise is not counted
    r = policy(FLAT, sizer=_Drafter(mass))
    _run_timed(r, 200, lambda i: 1.0, draft_excess=1.2)
    assert r.model_excess() == 1.0


def test_a_slower_proposer_set_is_tried_less_often():
    """Trials of the set that is not the best: every explore_every // 2 looks when it measured as fast,
    a quarter as often when half as fast."""
    def trials(slow_rate: float) -> int:
        p = policy(STEEP, sizer=_TwoSets(torch.full((2, 29), 0.5)))
        p._pick_arm()  # creates both sets
        for name, rate in (("fast", 2.0), ("slow", slow_rate)):
            a = p.arms[name]
            a.passes, a.lead = p.arm_min_passes, math.log(rate)
        picks = [p._pick_arm() for _ in range(1024)]
        return sum(picks)

    base = 1024 // (policy(STEEP).explore_every // 2)
    assert trials(2.0) == pytest.approx(base, abs=2)
    assert trials(1.0) == pytest.approx(base / 4, abs=2)


class _Probing(_Drafter):
    """An ESP-like drafter: k = 1 (trees one level deep), a probe pass before every look."""

    needs_probe_to_draft = True
    depth_limit = 1

    def __init__(self, mass: torch.Tensor):
        super().__init__(mass)
        self.fresh = False

    def needs_probe(self, view) -> bool:
        return not self.fresh


def _probes(c: CostCurve, passes: int = 2000) -> int:
    d = _Probing(torch.full((2, 29), 0.03))
    p = policy(c, sizer=d)
    from types import SimpleNamespace

    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    probes = 0
    for _ in range(passes):
        n = p.plan(view, [100, 100]).num_nodes
        probes += n == 0
        d.fresh = n >= 0  # a probe or a tree feeds masks; a plain pass leaves the probe stale
        model_s = p._unobserved[-1].model_s
        p.observe_pass(torch.full((2,), 1), model_s, model_s)
    return probes


def test_a_look_that_cannot_pay_costs_no_probe_pass():
    """Under a compute-bound curve (a block of Q costs Q passes) a one-level tree commits at most
    1 + alpha tokens per row for at least twice a plain pass's time: looks are skipped without their probe
    pass, except one real look at the longest back-off. Where blocks are free the probes go on."""
    steep = _probes(STEEP)
    assert steep <= 2000 // (64 * 8) + 1
    assert _probes(FLAT) > 3 * steep


def test_engine_stops_drafting_when_its_drafting_forwards_are_slow():
    """End to end on the engine with the trained esp-tiny-llama (random models accept nothing, so auto would
    not draft anyway): the curve says a block is free, but every decode forward of more than one token per row
    (a drafting pass) takes 20 plain passes' time. The engine reports each pass's model time, the policy
    measures the excess and decodes plainly except for its exploration passes; without the excess the same
    job drafts. The engine's clocks read a fake clock that only the model's calls advance (one plain pass:
    the curve's 1.1 s), so the decisions do not depend on how busy the machine is.

    Why 20x: a drafting pass then costs more than a chain of at most 10 drafts can commit, so no pass may
    draft on the estimate."""
    import json

    from shared_data import SHARED_DATA, TINY_PROMPTS, shared
    from esp_worker import ModelConfig, Request
    from esp_worker.model.load import load_model

    model_dir = shared(SHARED_DATA.parent / "models" / "esp-tiny-llama")
    prompts = [json.loads(line)["prompt"] for line in shared(TINY_PROMPTS).read_text().splitlines()[:4]]
    torch.set_num_threads(1)
    lm = load_model(ModelConfig(name_or_path=str(model_dir)))

    def drafting_share(slow: bool) -> float:
        cfg = EngineConfig(method="pld", block_complexity="auto", max_batch_size=1)
        eng = Engine(lm, cfg, cost_curve=FLAT)

        def cost(batch: int, tokens: int, prefill: bool) -> float:  # a drafting forward: > 1 token per row
            return FLAT.time(1, 1, 100) * (20 if slow and tokens > 1 and not prefill else 1)

        reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=96)) for i, p in enumerate(prompts)]
        with model_time(cost):
            outs = eng.generate(reqs)
        hist: dict = {}
        for o in outs:
            assert o.error is None
            for q, c in o.stats.block_size_histogram.items():
                hist[q] = hist.get(q, 0) + c
        return 1 - hist.get(1, 0) / sum(hist.values())

    fast, slow = drafting_share(False), drafting_share(True)
    assert fast > 0.3, fast  # on a free block prompt lookup's chains pay on this model's text
    assert slow < 0.15, (slow, fast)


def test_next_is_plain_during_a_back_off_and_after_a_prepared_plain_decision():
    p = policy(STEEP)
    assert not p.next_is_plain()  # nothing decided, no wait: the next pass may look
    p._wait = 2  # a back-off: the next pass decodes plainly whatever happens
    assert p.next_is_plain()
    p._wait = 0
    p._prepared = deque([_Prepared(_Decision("plain"), p.arm, p.variant)])
    assert p.next_is_plain()
    p._prepared = deque([_Prepared(_Decision("look"), p.arm, p.variant)])
    assert not p.next_is_plain()
    p._prepared = deque([_Prepared(_Decision("probe"), p.arm, p.variant)])
    assert not p.next_is_plain()  # a probe pass is no lookup either, but only a plain one is promised


@pytest.mark.parametrize("prepare", [False, True])
def test_hybrid_auto_skips_its_row_hints_before_plain_passes(monkeypatch, prepare):
    """On a model that accepts nothing auto decodes plainly and backs off; the hybrid's row hints (its
    own-match search over every row's history, needed only by the next lookup) are not computed before a
    pass known to be plain, and the output is still plain decoding's. Passes cost what the steep curve says (a
    fake clock): under the real one the decisions follow the passes the machine measures, which depend on how
    busy it is."""
    from esp_worker import engine as engine_module
    from esp_worker.drafters.hybrid import HybridDrafter

    monkeypatch.setattr(engine_module, "PREPARE_LOOKS", prepare)
    calls = [0]
    hints = HybridDrafter.row_hints

    def counted(self, view):
        calls[0] += 1
        return hints(self, view)

    monkeypatch.setattr(HybridDrafter, "row_hints", counted)
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="hybrid", block_complexity="auto", max_batch_size=2), cost_curve=STEEP)
    from engine_helpers import PROMPTS
    from esp_worker import Request

    params = GenerationParams(max_new_tokens=160)
    with model_time(lambda batch, tokens, prefill: STEEP.time(batch, tokens, 100)):  # the curve's own costs
        outs = eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS[:2])])
    passes = eng.stats.decode_passes
    assert passes > 150
    # the proposer sets take turns looking early on (~30 passes), then each plain look doubles the wait
    assert calls[0] < passes / 2, (calls[0], passes)
    plain = Engine(lm, EngineConfig(method="ar", max_batch_size=2)).generate(
        [Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS[:2])])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


class _CostlyLook(_Drafter):
    """A drafter whose look (its draft mass) is host work and finds something to draft every other time, as an
    n-gram lookup does on text that repeats in places: `looked` says whether the pass being planned looked."""

    looked = False
    looks = 0

    def draft_mass(self, view, variant: str = "") -> torch.Tensor:
        self.looked = True
        self.looks += 1
        return self.mass if self.looks % 2 else torch.zeros_like(self.mass)


def test_a_costly_look_is_not_charged_to_plain_decoding():
    """Each look costs 2 s of host work, a drafting pass (2 tokens per row) 2.2 s in all, plain decoding 0.1 s:
    plain decoding wins (1 token per 1.3 s against 2 per 3.4 s). A look that finds nothing chooses plain and looks
    again soon, so many plain passes paid a look; charged to plain decoding, they made it look dearer than
    drafting. Plain's cost is that of the passes that did not look, and the policy drafts only to re-measure."""
    from types import SimpleNamespace

    mass = torch.zeros((2, 29))
    mass[:, 0] = 1.0  # one sure draft per row: alpha ~1, drafting commits 2 tokens per row
    sizer = _CostlyLook(mass)
    p = policy(FLAT, sizer=sizer)
    view = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([100, 100]), going=None)
    plans = []
    for _ in range(600):
        sizer.looked = False
        n = p.plan(view).num_nodes
        plans.append(n)
        model_s = p._unobserved[-1].model_s
        host = 2.2 if n > 0 else (2.0 if sizer.looked else 0.1)
        p.observe_pass(torch.full((2,), 1 + int(n > 0)), model_s + host, model_s)
    assert p.overhead("plain") == pytest.approx(0.1)
    # the first looks draft (both modes get measured), then plain decoding wins at once; charging the looks to
    # plain decoding drafted 8 times in the first 60 passes
    assert sum(n > 0 for n in plans[:60]) == p.min_samples
    later = plans[100:]
    assert sum(n > 0 for n in later) < 0.05 * len(later)
    assert any(n > 0 for n in later)  # drafting is still re-measured now and then


class _MassSizer(_Sizer):
    """A stand-in whose every node is half likely to be accepted (no probe needed): a flat curve drafts."""

    def draft_mass(self, view, variant: str = ""):
        return torch.full((len(view.seeds), self.max_nodes), 0.5)


def _view(b: int = 1):
    return type("View", (), {"seeds": [0] * b, "hist_len": torch.full((b,), 40), "going": None})()


def test_passes_run_ahead_plan_from_the_read_before_the_one_in_flight():
    """With a pass in flight, the decision it prepared waits for its read: the plan takes the one prepared before it
    (a pass staler), or with none, the last look's mass; only with neither does the engine take the read first."""
    p = BlockPolicy(FLAT, _MassSizer(), max_block=64, settings=PolicySettings(prepare_looks=True))
    view = _view()
    assert p.plan(view, [40]).num_nodes == 29  # no decision prepared: a look that reads its mass here
    look = p.prepare(view, [41])  # the end of pass 0, launched: its look's mass rides in its read
    assert look is not None and p._prepared[0].waiting
    assert not p.wants_read()  # pass 1 can look with pass 0's mass (the last look's)
    assert p.plan(view, [41]).num_nodes == 29
    assert len(p._prepared) == 1  # pass 0's decision still waits for its read
    p.prepare(view, [42])  # pass 1 launched: two decisions wait
    p.receive(look.tolist())  # pass 0's read
    p.observe_pass(2, 0.01, 0.01)
    assert [d.waiting for d in p._prepared] == [False, True]
    assert p.plan(view, [42]).num_nodes == 29  # pass 2 takes pass 0's decision, pass 1's still waits
    assert [d.waiting for d in p._prepared] == [True]
    assert len(p._unobserved) == 2  # passes 1 and 2, observed in order at their reads
    p.observe_pass(None)  # a pass that ran over rows the one before ended says nothing
    assert len(p._unobserved) == 1
    p.rows_changed()  # every pass was read: the decision stands, its mass is the old rows'
    assert [(d.waiting, d.host_mass) for d in p._prepared] == [(False, None)] and not p._unobserved
    p._prepared.clear()
    p._wait = 1  # a back-off: the next pass decodes plainly
    p.prepare(view, [43])
    assert p.plan(view, [43]).num_nodes == -1
    p.prepare(view, [44])  # then a look, whose mass rides in the read of the plain pass in flight
    assert p._prepared[0].waiting and p.wants_read()  # no look's mass on the host to use instead: read first


def test_a_look_leaves_out_rows_that_ended():
    """Rows that ended may stay in the batch while passes run ahead of their reads (masked, committing nothing): a
    look weighs the mass and the count of the rows that go on against the whole batch's cost, and alpha learns
    only from passes that committed to the rows their look covered; the pass's time counts either way."""
    mass = torch.tensor([[0.5, 0.25], [0.9, 0.9]])
    assert look_vector(mass, torch.tensor([True, False])).tolist() == [0.0, 0.5, 0.75, 1.0]
    assert look_vector(mass, None).tolist() == pytest.approx([0.0, 1.4, 2.55, 2.0])

    from types import SimpleNamespace

    p = BlockPolicy(FLAT, _MassSizer(), max_block=64, settings=PolicySettings(prepare_looks=True))
    one = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([40, 40]), going=torch.tensor([True, False]))
    p.receive(p.prepare(one, [40, 40]).tolist())  # the look rode in a read: one row goes on
    n = p.plan(one, [40, 40]).num_nodes
    assert n == 29 and p._unobserved[-1].batch == 2  # the cost: both rows
    pred, acc = p.arm.pred, p.arm.acc
    p.observe_pass(1 + 3, 0.01, 0.01, rows=1)  # the row that went on had 3 drafts accepted
    assert (p.arm.pred, p.arm.acc) == pytest.approx((p.decay * pred + 0.5 * n, p.decay * acc + 3))

    both = SimpleNamespace(seeds=[0, 0], hist_len=torch.tensor([41, 41]), going=None)
    assert p.plan(both, [41, 41]).num_nodes == 29  # a look over both rows, read here
    pred, acc, timed = p.arm.pred, p.arm.acc, len(p.arm.over)
    p.observe_pass(1, 0.02, 0.01, rows=1)  # one of them had ended in the pass in flight: no alpha from it
    assert (p.arm.pred, p.arm.acc) == (pred, acc) and len(p.arm.over) == timed + 1

    p.plan(one, [42, 42])
    p.observe_pass(0, 0.01, 0.01, rows=0)  # every row had ended: the pass says nothing
    assert not p._unobserved and len(p.arm.over) == timed + 1


def test_a_pass_run_ahead_is_timed_by_its_own_model_calls():
    from esp_worker.model.runner import ModelClock

    clock = ModelClock(torch.device("cpu"))
    a = clock.mark()
    clock.stop(clock.start())
    b = clock.mark()
    clock.stop(clock.start())
    c = clock.mark()
    first, second = clock.between(a, b), clock.between(b, c)
    assert first is not None and second is not None and first + second == pytest.approx(clock.seconds())
    assert clock.between(a, b) is None  # forgotten once read
