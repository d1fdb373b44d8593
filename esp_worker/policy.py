"""block_complexity=auto: choose, per decode pass, the draft size that maximises committed tokens per second.

    rate(n) = sum over rows of E_b(n) / time(batch, Q(n), cache_len)
    E_b(n)  = 1 + alpha * sum of the n best node probabilities of row b (the drafter's `draft_mass`)

`time` comes from the measured cost curve of this model on this device (esp_worker.cost_model), so the same
code picks large trees on a GPU at small batch and small trees (or none) on a CPU or at large batch.
`alpha` calibrates the drafter's probabilities against what verification actually accepts (a running ratio
of accepted drafts to predicted mass). n = -1 is plain decoding (Q = 1), always a candidate.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import statistics
from pathlib import Path
from typing import Callable, Optional

import torch

from .cost_model import CostCurve, measure_cost_curve, powers_of_two
from .model_io import ModelRunner

CURVE_VERSION = 2  # bump when what a pass runs changes, so cached curves are measured again
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class BlockPolicy:
    """Owns the per-pass budget under block_complexity=auto: the engine asks `plan` for the pass's draft nodes
    and reports what was accepted and how long the pass took with `observe_pass`; the cost curve, the
    calibration of the drafter's probabilities, the measured overheads and the back-off of looks (and
    probes) while plain decoding wins live here.

    Measured overheads: the cost curve times the model alone; a real pass also runs the drafter (tree
    building, lookups, verification) and the engine's bookkeeping. Each pass's wall time minus the curve's
    prediction is kept per mode (plain, drafting); the median of the last few is added to the curve when
    choosing, so a drafter whose own work eats its gain loses to plain decoding on measured time. Both modes
    stay measured: the first `min_samples` looks draft whatever the estimate says, and while one mode wins,
    the other gets one pass in `explore_every` (plain; or a tree, when a look finds something to draft).

    Back-off: a look (draft_mass, and for mask drafters a probe pass first) costs time too. After a look
    chooses plain decoding although there was something to draft, the next look waits `wait` plain passes,
    doubling up to 64x the base while looks keep choosing plain; a look that drafts resets it."""

    def __init__(
        self,
        curve: CostCurve,
        block_tokens: Callable[[int], int],  # draft nodes -> tokens fed per sequence
        max_nodes: int,
        max_block: int,
        prior_alpha: float = 0.5,
        prior_weight: float = 4.0,
        decay: float = 0.98,
        probe_interval: int = 8,
        explore_every: int = 64,
        min_samples: int = 3,
    ):
        self.curve = curve
        self.block_tokens = block_tokens
        max_block = min(max_block, max(curve.block_sizes))  # never extrapolate the curve beyond what was measured
        fits = [n for n in sorted(set(SIZES) | {max_nodes}) if 1 <= n <= max_nodes and block_tokens(n) <= max_block]
        self.sizes = [-1] + fits  # -1 = plain decoding
        self.q = torch.tensor([float(block_tokens(n)) for n in self.sizes])  # [C]
        self.pred = prior_weight  # running predicted accepted drafts (decayed)
        self.acc = prior_alpha * prior_weight  # running accepted drafts (decayed)
        self.decay = decay
        self._cost: dict[tuple[int, int], torch.Tensor] = {}
        # per mode: the last seconds per pass beyond the curve (overhead() is their median)
        self._over: dict[str, collections.deque] = {m: collections.deque(maxlen=15) for m in ("plain", "draft")}
        self.explore_every = explore_every
        self.min_samples = min_samples
        self._since = {"plain": 0, "draft": 0}  # passes since the last one of each mode
        self.probe_interval = probe_interval  # base wait of mask drafters (a look costs them a probe pass)
        self._wait = 0  # plain passes left before the next look
        self._next_wait = 0  # wait after the next look that chooses plain
        self._last: Optional[tuple[str, float]] = None  # (mode, predicted model seconds) of the planned pass
        self._mass: Optional[torch.Tensor] = None  # [B, max_nodes] of the last plan
        self._n = -1

    def plan(self, drafter, view) -> int:
        """Draft nodes for this pass: -1 = plain decoding, 0 = root + masks (a probe), n > 0 = a tree."""
        self._mass = None
        batch, cache_len = len(view.seeds), int(view.hist_len.float().mean()) - 1
        if self._wait > 0 or self._since["plain"] >= self.explore_every:
            self._wait = max(self._wait - 1, 0)
            return self._planned(-1, batch, cache_len)
        if drafter.needs_probe(view):  # a mask drafter after plain passes: look with a probe pass
            return self._planned(0, batch, cache_len)
        mass = drafter.draft_mass(view)
        explore = len(self._over["draft"]) < self.min_samples or self._since["draft"] >= self.explore_every
        n = self.choose(mass, batch, cache_len, measured=not explore)
        base = self.probe_interval if drafter.needs_probe_to_draft else 1
        if n > 0:
            self._next_wait = base
        elif mass is not None and bool(mass.sum() > 0):  # drafting was possible but does not pay: back off
            self._wait = self._next_wait or base
            self._next_wait = min(2 * self._wait, 64 * base)
        else:  # nothing to draft right now (no match, no probe): look again soon
            self._wait = base
        self._mass, self._n = mass, n
        return self._planned(n, batch, cache_len)

    def _planned(self, n: int, batch: int, cache_len: int) -> int:
        i = self.sizes.index(n) if n in self.sizes else 0
        q = float(self.block_tokens(n))
        model_s = float(self.costs(batch, cache_len)[i]) if n in self.sizes else self.curve.time(batch, q, cache_len)
        mode = "plain" if n < 0 else "draft"
        self._last = (mode, model_s)
        for m in self._since:
            self._since[m] = 0 if m == mode else self._since[m] + 1
        return n

    def observe_pass(self, num_committed: torch.Tensor, seconds: Optional[float] = None) -> None:
        """Calibrate with the pass just verified ([B] tokens committed per row) and its wall time."""
        if self._mass is not None and self._n > 0:
            self.observe(float(self._mass[:, : self._n].sum()), float((num_committed - 1).sum()))
        if seconds is not None and self._last is not None:
            mode, model_s = self._last
            self._over[mode].append(max(seconds - model_s, 0.0))
        self._last = None

    def overhead(self, mode: str) -> float:
        """Measured seconds per pass beyond the cost curve in `mode` (plain | draft): the median of the last
        few passes (robust to a first pass's one-off costs); 0 until measured."""
        obs = self._over[mode]
        return statistics.median(obs) if obs else 0.0

    @property
    def alpha(self) -> float:
        return self.acc / self.pred

    def costs(self, batch: int, cache_len: int) -> torch.Tensor:
        """[C] seconds per pass for each candidate (cache length bucketed to 64 tokens for reuse)."""
        bucket = int(cache_len) // 64 * 64 + 32
        key = (batch, bucket)
        if key not in self._cost:
            self._cost[key] = torch.tensor([self.curve.time(batch, float(q), bucket) for q in self.q.tolist()])
        return self._cost[key]

    def choose(self, mass: Optional[torch.Tensor], batch: int, cache_len: int, measured: bool = True) -> int:
        """Draft nodes for this pass (-1 = plain). mass: [B, max_nodes] best-first node probabilities.
        measured=False: the cost curve alone (exploring), without the measured overheads."""
        if mass is None:
            return -1
        cum = torch.cat([torch.zeros(1), mass.float().sum(0).cumsum(0).cpu()])  # [max_nodes + 1]
        n = torch.tensor([max(s, 0) for s in self.sizes])
        expected = batch + self.alpha * cum[n.clamp(max=cum.shape[0] - 1)]  # [C]
        extra = torch.tensor([self.overhead("plain")] + [self.overhead("draft")] * (len(self.sizes) - 1)) * measured
        rate = expected / (self.costs(batch, cache_len) + extra)
        return self.sizes[int(rate.argmax())]

    def observe(self, predicted: float, accepted: float) -> None:
        """Calibrate alpha with one pass: predicted mass of the drafted nodes vs drafts accepted."""
        self.pred = self.decay * self.pred + predicted
        self.acc = self.decay * self.acc + accepted


def cache_dir() -> Path:
    return Path(os.environ.get("ESP_BATCH_CACHE", Path.home() / ".cache" / "esp-batch"))


def calibrate(runner: ModelRunner, max_batch: int, max_block: int, path: str = "") -> CostCurve:
    """The cost curve for this model, device, dtype and thread count: loaded from `path` or the cache
    directory when present, else measured (a few seconds) and cached."""
    if path:
        return CostCurve.from_dict(json.loads(Path(path).read_text()))
    batches = sorted({1, max_batch} | {b for b in (2, 4, 8, 16, 32, 64) if b < max_batch})
    ctx = runner.loaded.max_context
    cache_lens = sorted({min(64, ctx // 4), min(512, ctx // 2)})
    blocks = sorted(set(powers_of_two(max_block)) | {max_block})
    key = json.dumps(
        [CURVE_VERSION, runner.loaded.name, str(runner.device), str(runner.dtype), torch.get_num_threads(),
         runner.direct is not None, batches, cache_lens, blocks]
    )
    file = cache_dir() / f"cost-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    if file.exists():
        return CostCurve.from_dict(json.loads(file.read_text()))
    curve = measure_cost_curve(runner, batches, cache_lens, blocks, repeats=3, warmup=1)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(curve.to_dict()))
        tmp.replace(file)
    except OSError:
        pass  # a read-only home: measure again next time
    return curve
