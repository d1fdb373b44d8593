"""block_complexity=auto: choose, per decode pass, the draft size that maximises committed tokens per second.

    rate(n) = sum over rows that go on of E_b(n) / time(batch, Q(n), cache_len)
    E_b(n)  = 1 + alpha * sum of the n best node probabilities of row b (the drafter's `draft_mass`)

(`batch` counts the rows that ended and stay in the batch while passes run ahead: they cost what the others do.)

`time` comes from the measured cost curve of this model on this device (esp_worker.auto.cost_model), so the same
code picks large trees on a GPU at small batch and small trees (or none) on a CPU or at large batch.
`alpha` calibrates the drafter's probabilities against what verification actually accepts (a running ratio
of accepted drafts to predicted mass). n = -1 is plain decoding (Q = 1), always a candidate.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..memory import kv_bytes_per_slot, pass_bytes, require
from ..passes import PassPlan
from .cost_model import CostCurve, PassFactory, measure_cost_curve, powers_of_two
from .sizer import DraftSizer
from ..model.runner import ModelRunner

log = logging.getLogger(__name__)

EXCESS_TOLERANCE = 1.25  # a drafting pass's model time beyond the curve counts once it is this far above plain's
EXCESS_REFRESH = 8  # while an excess counts, a plain pass at least every this many passes re-measures plain's
CURVE_VERSION = 4  # bump when what a pass runs changes, so cached curves are measured again (4: packed GQA attention)
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class _Look:
    """A look's draft mass on the host: what `choose` weighs."""

    cum: list[float]  # [max_nodes + 1] the batch's cumulative mass of the n best nodes per row, n = 0 .. max_nodes
    rows: float  # the rows it covers: those whose requests go on (rows that ended may stay in the batch)

    @staticmethod
    def of(values: list[float]) -> "_Look":
        """From the host copy of `look_vector`'s [max_nodes + 2]."""
        return _Look(values[:-1], values[-1])


def look_vector(mass: torch.Tensor, going: Optional[torch.Tensor]) -> torch.Tensor:
    """[max_nodes + 2] on the device, read with a pass's one host read: 0, the cumulative mass over the rows
    that go on, then their count. mass [B, max_nodes] (`DraftSizer.draft_mass`); going [B] bool or None (all).
    A row that ended can accept nothing: its mass would count drafts no pass can commit."""
    m = mass.float()
    if going is None:
        count = m.new_full((1,), float(m.shape[0]))
    else:
        m = torch.where(going[:, None], m, 0.0)
        count = going.sum(0, keepdim=True).float()
    total = m.sum(0).cumsum(0)
    return torch.cat([total.new_zeros(1), total, count])


_NO_MASS = _Look([], 0.0)  # `prepare` looked, and the drafter had no mass to offer (choose: plain)


@dataclass(frozen=True)
class PolicySettings:
    """The policy's tuning (the defaults are what the engine uses)."""

    prior_alpha: float = 0.5  # prior ratio of accepted drafts to the drafter's predicted mass
    prior_weight: float = 4.0  # its weight in passes
    decay: float = 0.98  # per pass, of the running calibration
    probe_interval: int = 8  # base wait of mask drafters between looks (a look costs them a probe pass)
    explore_every: int = 64  # while one mode wins, the other gets one pass in this many
    min_samples: int = 3  # looks that draft whatever the estimate says (both modes get measured)
    arm_min_passes: int = 16  # passes each proposer set runs before their speeds are compared
    local_decay: float = 0.7  # per pass, of a proposer set's local speed
    pair_weight: int = 20  # paired comparisons a set's lead averages over
    # decide each pass at the end of the one before, so that its look's mass rides in that pass's one host read
    # (on an accelerator, where a read drains the device's queue; on a CPU a read costs nothing)
    prepare_looks: bool = False


@dataclass
class _Planned:
    """The pass just planned, for `observe_pass` to learn from."""

    mode: str  # "plain" | "draft" (a probe pass drafts nothing but pays the drafting path)
    model_s: float  # the curve's model seconds for it
    plain_s: float  # the curve's seconds of a plain pass at its batch and cache length
    batch: int  # rows it runs over (rows that ended included: they cost what the others do)
    arm: "_Arm"  # the proposer set in charge
    looked: bool  # a look chose it (its host time holds the look's work)
    mass: Optional[_Look] = None  # the look's mass, when it had one
    nodes: int = -1  # the draft nodes it chose


@dataclass(frozen=True)
class _Decision:
    """What a pass does before any draft mass is known (`BlockPolicy._decide`)."""

    kind: str  # "plain" | "probe" (root + masks: a mask drafter's look) | "look" (read the draft mass, then size)
    trial: bool = False  # a look by a proposer set that is not the best (`_pick_arm`)


_PLAIN, _PROBE = _Decision("plain"), _Decision("probe")


@dataclass
class _Prepared:
    """A coming pass's decision, made at the end of a pass (`prepare`): the next one's, or with passes run ahead of
    their reads, the one after it."""

    decision: _Decision
    arm: "_Arm"  # the proposer set it picked, and its name
    variant: str
    # the look's mass on the host (`receive`), _NO_MASS, or None: read it at `plan`
    host_mass: Optional[_Look] = None
    waiting: bool = False  # its mass rides in a pass's read not yet taken (`receive` brings it)


class _Arm:
    """One proposer set of the drafter (a variant): its candidate sizes, costs, calibration and record."""

    def __init__(self, block_tokens: Callable[[int], int], max_nodes: int, max_block: int, prior_alpha: float,
                 prior_weight: float):
        fits = [n for n in sorted(set(SIZES) | {max_nodes}) if 1 <= n <= max_nodes and block_tokens(n) <= max_block]
        self.sizes = [-1] + fits  # -1 = plain decoding
        self.q = [float(block_tokens(n)) for n in self.sizes]  # tokens fed per sequence of each candidate
        self.block_tokens = block_tokens
        self.cost: dict[tuple[int, int], torch.Tensor] = {}  # (batch, cache bucket) -> [C] curve seconds
        self.pred = prior_weight  # running predicted accepted drafts (decayed)
        self.acc = prior_alpha * prior_weight  # running accepted drafts (decayed)
        # host seconds per pass (curve units) of this set's drafting and plain passes: a set's plain pass
        # can cost more than another's (the hybrid's merged set keeps its logit store and probe up to date)
        self.over: collections.deque = collections.deque(maxlen=15)
        self.plain_over: collections.deque = collections.deque(maxlen=15)
        # measured / curve model seconds of this set's drafting passes (over the latest plain pass's ratio: what
        # the curve does not see of them, e.g. a block shape that selects a slower kernel)
        self.excess: collections.deque = collections.deque(maxlen=15)
        # speed of this set's passes: tokens committed per row / seconds in units of the curve's plain pass at
        # that batch and cache length (a speed relative to plain decoding, so that batch occupancy and context
        # length, which change throughput whatever the set, do not bias the comparison). `local_*`: over its
        # latest passes (decayed per pass of the job, so after another set's run only its newest passes count)
        self.local_tokens = 0.0
        self.local_seconds = 0.0
        self.local_at = 0  # the policy's pass count at its last pass
        # log speed relative to the other sets, from paired comparisons on the same text (`BlockPolicy._pair`)
        self.lead = 0.0
        self.passes = 0
        self.last_trial = 0  # the policy's look count at this set's last trial

    @property
    def alpha(self) -> float:
        return self.acc / self.pred

    @property
    def local_rate(self) -> float:
        return self.local_tokens / self.local_seconds if self.local_seconds else 0.0


class BlockPolicy:
    """block_complexity=auto's planner: each pass it picks the draft size (plain decoding included) that maximises
    committed tokens per second, and learns from what the pass committed and how long it took (`observe_pass`).

    - Cost: the model's cost curve (`cost_model`), plus each mode's (plain, drafting) measured host time per pass
      (the wall time minus the model's own time, in the curve's units; plain's from passes that did not look),
      plus a drafting pass's model-time excess over the curve (a slower kernel for the block's shape) once it
      exceeds `EXCESS_TOLERANCE`. Machine-wide slowdowns are tracked as one drift factor for every mode: charged
      to the mode that happened to run, they would switch a mode off with nothing to correct the estimate later.
    - Gain: 1 + alpha * the drafter's own mass of the n best nodes per row (`DraftSizer.draft_mass`), alpha being a
      running ratio of accepted drafts to predicted mass.
    - Exploration: the first `min_samples` looks draft whatever the estimate says, and while one mode wins the
      other runs one pass in `explore_every`, so neither cost goes stale.
    - Proposer sets (`DraftSizer.variants`, hybrid: merged | ngram): each look uses the set with the best speed
      relative to plain decoding, from paired comparisons on the same text (when the set changes between two
      passes); comparing each set's speed over its own passes compared easy text with hard text. The sets take
      turns for `arm_min_passes` passes, then the others get trials, rarer the slower they measured.
    - Back-off: a look costs time too (a mask drafter's look costs a probe pass). After a look chooses plain
      decoding although there was something to draft, the next look waits, doubling up to 64x while looks keep
      choosing plain; a look that drafts resets the wait. A look that cannot pay at the best alpha is skipped."""

    def __init__(self, curve: CostCurve, sizer: DraftSizer, max_block: int, settings: PolicySettings = PolicySettings()):
        self.curve = curve
        self.sizer = sizer
        self.max_block = min(max_block, max(curve.block_sizes))  # never extrapolate the curve beyond what was measured
        self.prepare_looks = settings.prepare_looks
        self._prior = (settings.prior_alpha, settings.prior_weight)
        self.variant = ""  # the proposer set in charge ("": the drafter's default until a look picks one)
        self.arms: dict[str, _Arm] = {self.variant: _Arm(*sizer.sizes(self.variant), self.max_block, *self._prior)}
        self.arm = self.arms[self.variant]
        self.decay, self.local_decay, self.pair_weight = settings.decay, settings.local_decay, settings.pair_weight
        explore_every, min_samples, arm_min_passes = settings.explore_every, settings.min_samples, settings.arm_min_passes
        probe_interval = settings.probe_interval
        self._passes = 0  # passes observed (the clock of the sets' local speeds)
        self._pairs = 0  # paired comparisons of proposer sets so far
        self._prev_arm: Optional[_Arm] = None  # the set of the last pass observed
        self.drift = 1.0  # measured / predicted model seconds (decayed): the machine's speed against the curve's
        self._drift_w = 0.0
        self._plain_ratio: Optional[float] = None  # measured / predicted model seconds of the latest plain pass
        self.explore_every = explore_every
        self.min_samples = min_samples
        self.arm_min_passes = arm_min_passes  # passes each proposer set runs before their speeds are compared
        self._since = {"plain": 0, "draft": 0}  # passes since the last one of each mode
        self.probe_interval = probe_interval  # base wait of mask drafters (a look costs them a probe pass)
        self._wait = 0  # plain passes left before the next look
        self._next_wait = 0  # wait after the next look that chooses plain
        self._looks = 0
        # the passes planned and not yet observed, oldest first: one, or two while a pass runs ahead of its read
        self._unobserved: collections.deque[_Planned] = collections.deque()
        # decisions made at the end of a pass (`prepare`), oldest first: the next pass's, or while passes run ahead
        # of their reads, also the one after it (its look's mass comes with a read still to be taken)
        self._prepared: collections.deque[_Prepared] = collections.deque()
        # the last plan's look with its mass on the host, while nothing newer is: a pass planned before the read
        # that brings its own look's mass looks with this one (a pass staler) rather than wait for that read
        self._reuse: Optional[_Prepared] = None
        self._mass: Optional[_Look] = None  # the last plan's look (host)

    @property
    def sizes(self) -> list[int]:
        return self.arm.sizes

    @property
    def alpha(self) -> float:
        return self.arm.alpha

    def plan(self, view, lens: Optional[list[int]] = None) -> PassPlan:
        """This pass's plan: draft nodes -1 = plain decoding, 0 = root + masks (a probe), n > 0 = a tree, from the
        proposer set in charge.
        lens: the rows' history lengths on the host (the engine's mirror); read from view.hist_len if None.

        A look needs the draft mass on the host. When a pass before prepared this one (`prepare`, the engine's
        way) for the same rows, the mass came with that pass's one host read and this pass reads nothing. While
        passes run ahead of their reads, the decision prepared at the end of the pass in flight waits for its read:
        this pass takes the one before it (made a pass earlier, its mass a pass staler: the drafts of the pass in
        flight, not of this one); with none, it looks with the last plan's mass (`wants_read` says when the engine
        must take the read first). Otherwise (the first pass after rows joined or left, or a caller that does not
        prepare) the look reads the mass here."""
        self._mass = None
        batch = len(view.seeds)
        cache_len = self._cache_len(view, lens)
        prepared = self._prepared.popleft() if self._prepared and not self._prepared[0].waiting else None
        if prepared is None and self._prepared and self._reuse is not None:
            prepared = self._reuse  # the head waits for its read: the last look's mass, a pass staler
        self._reuse = None
        if prepared is not None:
            self.variant, self.arm = prepared.variant, prepared.arm
        decision = prepared.decision if prepared is not None else self._decide(view, batch, cache_len)
        if decision.kind != "plain" and self._wait > 0:  # decided before a later look started a back-off
            self._wait -= 1
            decision = _PLAIN
        if decision.kind != "look":
            return PassPlan(self._planned(-1 if decision.kind == "plain" else 0, batch, cache_len), self.variant)
        fresh = prepared is not None and prepared.host_mass is not None
        mass = prepared.host_mass if fresh else self._read_look(view)
        n = self.choose(mass, batch, cache_len, measured=not self._exploring())
        if self._mass is not None:
            self._reuse = _Prepared(_Decision("look"), self.arm, self.variant, self._mass)
        return PassPlan(self._after_look(n, decision.trial, batch, cache_len), self.variant)

    def wants_read(self) -> bool:
        """With a pass in flight, before `plan`: True when the next plan needs that pass's read first (the decision
        it prepared is a look whose mass rides in it, and no earlier look's mass is on the host to use instead)."""
        return bool(self._prepared) and self._prepared[0].waiting and self._reuse is None

    def rows_changed(self) -> None:
        """Rows joined or left the batch since `prepare` (every pass before was read): the prepared draft mass was
        the old rows' (the next decision stands, and reads its mass at `plan`), and every plan was observed."""
        while len(self._prepared) > 1:
            self._prepared.pop()
        for p in self._prepared:
            p.host_mass, p.waiting = None, False
        self._reuse = None
        self._unobserved.clear()  # a pass planned and then withdrawn before it ran (rows had ended)

    def prepare(self, view, lens: Optional[list[int]] = None) -> Optional[torch.Tensor]:
        """At the end of a pass (its rows committed and observed), decide a coming pass's kind now (the next one's,
        or while passes run ahead of their reads, the one after it: `plan`), and for a look start its draft mass:
        returns `look_vector` (device) for the engine to read with the pass's one host read and hand back with
        `receive`, or None when that pass does not look. The decision uses the statistics up to the passes
        already read (this pass's `observe_pass` comes after its read)."""
        if not self.prepare_looks:
            return None
        batch = len(view.seeds)
        decision = self._decide(view, batch, self._cache_len(view, lens))
        cum = None
        if decision.kind == "look":
            mass = self.sizer.draft_mass(view, self.variant)
            if mass is not None:
                cum = look_vector(mass, view.going)
        self._prepared.append(_Prepared(decision, self.arm, self.variant,
                                        _NO_MASS if decision.kind == "look" and cum is None else None, cum is not None))
        return cum

    def next_is_plain(self) -> bool:
        """Known now, at the end of a pass: the next pass decodes plainly (its decision was prepared, or a back-off
        wait is running), so it looks nothing up and the drafter's row hints for it would go unused."""
        if self._prepared:
            return self._prepared[0].decision.kind == "plain"
        return self._wait > 0

    def receive(self, cum: Optional[list[float]]) -> None:
        """The host copy of the mass `prepare` returned (read with its pass's lengths, passes in order; None: it
        returned none)."""
        if cum is None:
            return
        for p in self._prepared:
            if p.waiting:
                p.host_mass, p.waiting = _Look.of(cum), False
                return

    def _read_look(self, view) -> Optional[_Look]:
        """The look's mass of the proposer set in charge, read here (one device read)."""
        mass = self.sizer.draft_mass(view, self.variant)
        return None if mass is None else _Look.of(look_vector(mass, view.going).tolist())

    @staticmethod
    def _cache_len(view, lens: Optional[list[int]]) -> int:
        return (sum(lens) // len(lens) if lens else int(view.hist_len.float().mean())) - 1

    def _exploring(self) -> bool:
        return len(self.arm.over) < self.min_samples or self._since["draft"] >= self.explore_every

    def _decide(self, view, batch: int, cache_len: int) -> _Decision:
        """What the next pass does before any draft mass is known (waits, back-off, the bound on what drafting
        could pay, a probe first, the proposer set)."""
        # a plain pass re-measures plain's model time while an excess counts, and measures it at all once drafting
        # passes could show one (without it the excess is unknown, and a job drafting on a free-looking curve would
        # otherwise run `explore_every` slow drafting passes before its first plain pass)
        unmeasured = self._plain_ratio is None and len(self.arm.excess) >= self.min_samples
        refresh = self._since["plain"] >= EXCESS_REFRESH and (unmeasured or self.model_excess() > 1.0)
        if self._wait > 0 or self._since["plain"] >= self.explore_every or refresh:
            self._wait = max(self._wait - 1, 0)
            return _PLAIN
        base = self.probe_interval if self.sizer.needs_probe_to_draft else 1
        if self._next_wait < 64 * base and not self._may_pay(batch, cache_len):
            # no size could beat plain decoding even with every depth's mass at its bound: skip the look (for a
            # mask drafter, its probe pass) and back off as a look that chose plain would; at the longest
            # back-off a real look still runs, so alpha and the overheads are measured again
            self._wait = self._next_wait or base
            self._next_wait = min(2 * self._wait, 64 * base)
            return _PLAIN
        if self.sizer.needs_probe(view):  # a mask drafter after plain passes: look with a probe pass
            return _PROBE
        return _Decision("look", self._pick_arm())

    def _after_look(self, n: int, trial: bool, batch: int, cache_len: int) -> int:
        base = self.probe_interval if self.sizer.needs_probe_to_draft else 1
        if n > 0:
            self._next_wait = base
        elif trial:  # a trial of another proposer set that would not draft: the best set looks next pass
            pass
        elif self._mass is not None and self._mass.cum[-1] > 0:  # drafting was possible but does not pay: back off
            self._wait = self._next_wait or base
            self._next_wait = min(2 * self._wait, 64 * base)
        else:  # nothing to draft right now (no match, no probe): look again soon
            self._wait = base
        return self._planned(n, batch, cache_len, looked=True)

    def _may_pay(self, batch: int, cache_len: int) -> bool:
        """Whether some drafting size could beat plain decoding at the calibrated alpha. Nodes at one depth are
        alternatives, so a tree's draft mass is at most one per depth: a row commits at most 1 + alpha *
        min(n, depth_limit) tokens a pass. Only drafters with a depth limit (ESP: k) are bounded; for the others
        the bound is the node count and always true. Host arithmetic over the few sizes, no device read."""
        limit = self.sizer.depth_limit
        if limit is None or len(self.sizer.variants) > 1:
            return True
        costs = self.costs(batch, cache_len)
        plain = batch / (costs[0] + self.overhead("plain"))
        over, alpha, excess = self.overhead("draft"), self.alpha, self.model_excess()
        return any(batch * (1 + alpha * min(s, limit)) / (c * excess + over) > plain
                   for s, c in zip(self.arm.sizes[1:], costs[1:]))

    def _pick_arm(self) -> bool:
        """Select the proposer set for this look (the drafter's own when it has one). True when the look is a
        trial of a set that is not the best (still sampling it, or exploring): its choosing plain decoding says
        nothing about the best set, so it starts no back-off."""
        names = self.sizer.variants
        if len(names) == 1:
            return False
        self._looks += 1
        for v in names:
            if v not in self.arms:
                self.arms[v] = _Arm(*self.sizer.sizes(v), self.max_block, *self._prior)
        tried = {v: self.arms[v] for v in names}
        new = [v for v, a in tried.items() if a.passes < self.arm_min_passes]
        if new:  # the sets take turns until each has its passes: both are measured on the same text
            pick, best = min(new, key=lambda v: tried[v].passes), None
        else:
            best = max(tried, key=lambda v: tried[v].lead)
            due = [v for v in names if v != best and self._looks - tried[v].last_trial >= self._trial_interval(tried, best, v)]
            pick = min(due, key=lambda v: tried[v].last_trial) if due else best
            tried[pick].last_trial = self._looks
        self.variant, self.arm = pick, self.arms[pick]
        return pick != best

    def _trial_interval(self, arms: dict[str, "_Arm"], best: str, other: str) -> float:
        """Looks between trials of a set that is not the best: `explore_every // 2`, times the square of how much
        slower it measured (at most 8x): a set half as fast is tried a quarter as often (each trial costs
        what it loses), one nearly as fast about as often as before."""
        base = max(self.explore_every // 2, 1)
        slower = math.exp(min(arms[best].lead - arms[other].lead, 10.0))
        return base * min(8.0, max(1.0, slower * slower))

    def _planned(self, n: int, batch: int, cache_len: int, looked: bool = False) -> int:
        arm = self.arm
        if n in arm.sizes:
            model_s = self.costs(batch, cache_len)[arm.sizes.index(n)]
        else:
            model_s = self.curve.time(batch, float(arm.block_tokens(n)), cache_len)
        mode = "plain" if n < 0 else "draft"
        plain_s = self.costs(batch, cache_len)[0]  # sizes[0]: plain
        self._unobserved.append(_Planned(mode, model_s, plain_s, batch, arm, looked, self._mass, n))
        for m in self._since:
            self._since[m] = 0 if m == mode else self._since[m] + 1
        return n

    def observe_pass(self, num_committed: "torch.Tensor | int | None", seconds: Optional[float] = None,
                     model_seconds: Optional[float] = None, rows: Optional[int] = None) -> None:
        """Calibrate with the oldest pass planned and not yet observed, once it is read (tokens committed: [B] per
        row, or their sum as a host int, which costs no device read; None: the pass says nothing), its wall time
        and the part of it the model took (without it, the wall time beyond the curve's prediction counts as host
        time and no drift is tracked). rows: how many rows it could commit to, when rows that had ended ran in it
        too (None: every row it ran over; 0: it says nothing)."""
        if not self._unobserved:
            return
        last = self._unobserved.popleft()
        if num_committed is None or rows == 0:
            return
        # the pass's own proposer set: `prepare` may already have picked the next pass's
        current, self.arm = self.arm, last.arm
        try:
            self._observe_pass(last, num_committed, seconds, model_seconds, last.batch if rows is None else rows)
        finally:
            self.arm = current

    def _observe_pass(self, last: _Planned, num_committed, seconds: Optional[float],
                      model_seconds: Optional[float], going: int) -> None:
        arm, mode, model_s, plain_s = last.arm, last.mode, last.model_s, last.plain_s
        committed = num_committed if isinstance(num_committed, int) else int(num_committed.sum())
        look = last.mass
        # alpha learns only where the look covered the rows the pass committed to (a row that ended after the look,
        # in a pass in flight, was in its mass and could accept nothing)
        if look is not None and last.nodes > 0 and look.rows == going:
            self.observe(look.cum[min(last.nodes, len(look.cum) - 1)], float(committed - going))
        if seconds is None:
            return
        excess = self.model_excess() if mode == "draft" else 1.0
        if model_seconds is None:
            host = max(seconds - model_s, 0.0)
        else:
            self._observe_excess(mode, model_seconds, model_s)
            self._track_drift(model_seconds / excess, model_s)  # the machine's speed, not the mode's excess
            host = max(seconds - model_seconds, 0.0) / self.drift
        if mode == "draft":
            arm.over.append(host)
        elif not last.looked:
            # plain decoding's own cost: a plain pass a look chose also paid the look (the draft mass, the row
            # hints), which plain decoding in a back-off does not; counted, it made plain decoding look dearer
            # than it is, and drafting won where it lost (a drafting pass pays its look either way)
            arm.plain_over.append(host)
        if len(self.arms) > 1:  # speed of the proposer set in charge, compared with the other's on the same text
            tokens, secs = committed / going, (model_s * excess + host) / plain_s
            self._pair(arm, tokens / secs if secs > 0 else 0.0)
            self._passes += 1
            keep = self.local_decay ** (self._passes - arm.local_at)
            arm.local_tokens, arm.local_seconds = keep * arm.local_tokens + tokens, keep * arm.local_seconds + secs
            arm.local_at = self._passes
            arm.passes += 1
            self._prev_arm = arm

    def _pair(self, arm: "_Arm", speed: float) -> None:
        """When the set changed since the last pass: this pass's speed against the other set's latest passes
        (the same text), one sample of the log ratio of their speeds; their leads move apart by its error."""
        prev = self._prev_arm
        if prev is None or prev is arm or prev.local_rate <= 0 or speed <= 0:
            return
        self._pairs += 1
        err = math.log(speed / prev.local_rate) - (arm.lead - prev.lead)
        step = err / min(self._pairs, self.pair_weight) / 2
        arm.lead += step
        prev.lead -= step

    def _observe_excess(self, mode: str, measured: float, predicted: float) -> None:
        if predicted <= 0 or measured <= 0:
            return
        ratio = measured / predicted
        if mode == "plain":
            self._plain_ratio = ratio
        else:
            self.arm.excess.append(ratio)

    def model_excess(self) -> float:
        """Factor on the curve's model time of the current proposer set's drafting passes: the median measured
        excess once there are `min_samples` and it is above EXCESS_TOLERANCE, else 1."""
        obs = self.arm.excess
        if len(obs) < self.min_samples or self._plain_ratio is None:
            return 1.0
        m = statistics.median(obs) / self._plain_ratio
        return m if m > EXCESS_TOLERANCE else 1.0

    def _track_drift(self, measured: float, predicted: float, decay: float = 0.9) -> None:
        """Decayed ratio of measured to predicted model seconds (a weighted mean: the first pass sets it)."""
        if predicted <= 0 or measured <= 0:
            return
        self._drift_w = decay * self._drift_w + 1.0
        self.drift += (measured / predicted - self.drift) / self._drift_w

    def overhead(self, mode: str) -> float:
        """Measured host seconds per pass (in units of the curve's machine speed) in `mode` (plain | draft, the
        current proposer set's): the median of the last few passes (robust to a first pass's one-off costs);
        0 until measured."""
        obs = self.arm.plain_over if mode == "plain" else self.arm.over
        return statistics.median(obs) if obs else 0.0

    def costs(self, batch: int, cache_len: int) -> list[float]:
        """[C] seconds per pass for each candidate (cache length bucketed to 64 tokens for reuse)."""
        bucket = int(cache_len) // 64 * 64 + 32
        key = (batch, bucket)
        arm = self.arm
        if key not in arm.cost:
            arm.cost[key] = [float(self.curve.time(batch, q, bucket)) for q in arm.q]
        return arm.cost[key]

    def choose(self, mass: "_Look | torch.Tensor | None", batch: int, cache_len: int, measured: bool = True) -> int:
        """Draft nodes for this pass (-1 = plain) over `batch` rows. mass: the look (host), or [B, max_nodes]
        best-first node probabilities of rows that all go on (read here). measured=False (exploring): the best
        drafting size by the cost curve alone, without the measured overheads, whenever there is something to
        draft, so that alpha and the drafting overhead are measured again even while plain decoding wins (an
        estimate that only learns from the passes it chooses would never recover from a low alpha). Host
        arithmetic over the few sizes. Rows that ended cost what the others do and commit nothing."""
        if mass is None or mass is _NO_MASS:
            self._mass = None
            return -1
        look = mass if isinstance(mass, _Look) else _Look.of(look_vector(mass, None).tolist())
        self._mass = look
        cum, alpha, top = look.cum, self.alpha, len(look.cum) - 1
        plain, draft = (self.overhead("plain"), self.overhead("draft")) if measured else (0.0, 0.0)
        excess = self.model_excess() if measured else 1.0
        best, best_rate = -1, -1.0
        for s, cost in zip(self.arm.sizes, self.costs(batch, cache_len)):
            if s < 0 and not measured and cum[-1] > 0:
                continue  # exploring: draft
            rate = (look.rows + alpha * cum[min(max(s, 0), top)]) / (cost + plain if s < 0 else cost * excess + draft)
            if rate > best_rate:  # the first of equal rates, as argmax
                best, best_rate = s, rate
        return best

    def observe(self, predicted: float, accepted: float) -> None:
        """Calibrate alpha with one pass: predicted mass of the drafted nodes vs drafts accepted."""
        self.arm.pred = self.decay * self.arm.pred + predicted
        self.arm.acc = self.decay * self.arm.acc + accepted


def cache_dir() -> Path:
    return Path(os.environ.get("ESP_BATCH_CACHE", Path.home() / ".cache" / "esp-batch"))


def _forward_kind(runner: ModelRunner, replayed: bool) -> str:
    """Which forward a pass runs (the cost curve is per forward): the model's, the direct one, or compiled, and
    the decode attention's kernel where it is not torch's own choice (engine.attention_backend; `flex` is only
    replayed passes' kernel, eager ones keep torch's)."""
    if runner.direct is None:
        return "model"
    kind = "direct+compiled" if runner.direct.compiled is not None else "direct"
    backend = runner.direct.attention_backend
    if backend == "torch" or (backend == "flex" and not replayed):
        return kind
    return f"{kind}+attention_{backend}"


def calibrate(runner: ModelRunner, max_batch: int, max_block: int, path: str = "",
              passes: Optional[PassFactory] = None, passes_kind: str = "graphs") -> CostCurve:
    """The cost curve for this model, device, dtype and thread count: loaded from `path` or the cache
    directory when present, else measured (a few seconds) and cached. passes: engine.cuda_graphs' passes (the
    curve of replayed passes, which on a GPU is a different machine from the eager one's); passes_kind names
    them in the cache key (replayed compiled passes are another machine again)."""
    if path:
        return CostCurve.from_dict(json.loads(Path(path).read_text()))
    batches = sorted({1, max_batch} | {b for b in (2, 4, 8, 16, 32, 64) if b < max_batch})
    ctx = runner.loaded.max_context
    cache_lens = sorted({min(64, ctx // 4), min(512, ctx // 2)})
    blocks = sorted(set(powers_of_two(max_block)) | {max_block})
    key = json.dumps(
        [CURVE_VERSION, runner.loaded.name, str(runner.device), str(runner.dtype), torch.get_num_threads(),
         _forward_kind(runner, passes is not None) + (f"+{passes_kind}" if passes is not None else ""), batches,
         cache_lens, blocks]
    )
    file = cache_dir() / f"cost-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    try:
        return CostCurve.from_dict(json.loads(file.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged file (a full disk, say): measured again
        log.warning("the cached cost curve %s did not load (%s: %s); measuring it again", file, type(e).__name__, e)
    text, slots = runner.loaded.model.config.get_text_config(), cache_lens[-1] + blocks[-1]
    require(f"engine.max_batch_size={max_batch}: the auto policy's calibration ({max_batch} rows of {slots} "
            f"positions, passes of up to {blocks[-1]} tokens a row)",
            max_batch * slots * kv_bytes_per_slot(text, runner.dtype)
            + pass_bytes(text, runner.dtype, max_batch, blocks[-1], slots),
            "lower engine.max_batch_size (or engine.auto_max_block), or give engine.cost_curve_path a curve",
            runner.device)
    curve = measure_cost_curve(runner, batches, cache_lens, blocks, repeats=3, warmup=1, passes=passes)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")  # the actors of one machine calibrate at once: one file each
        tmp.write_text(json.dumps(curve.to_dict()))
        tmp.replace(file)
    except OSError:
        pass  # a read-only home: measure again next time
    return curve
