"""block_complexity=auto: choose, per decode pass, the draft size that maximises committed tokens per second.

    rate(n) = sum over rows of E_b(n) / time(batch, Q(n), cache_len)
    E_b(n)  = 1 + alpha * sum of the n best node probabilities of row b (the drafter's `draft_mass`)

`time` comes from the measured cost curve of this model on this device (esp_worker.cost_model), so the same
code picks large trees on a GPU at small batch and small trees (or none) on a CPU or at large batch.
`alpha` calibrates the drafter's probabilities against what verification actually accepts (a running ratio
of accepted drafts to predicted mass). n = -1 is plain decoding (Q = 1), always a candidate.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from .cost_model import CostCurve, measure_cost_curve, powers_of_two
from .model_io import ModelRunner

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class BlockPolicy:
    """Owns the per-pass budget under block_complexity=auto: the engine asks `plan` for the pass's draft nodes
    and reports what was accepted with `observe_pass`; the cost curve, the calibration of the drafter's
    probabilities and the probe back-off (mask drafters after plain passes) live here."""

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
        self.base_interval = probe_interval
        self.probe_interval = probe_interval  # plain passes between re-probes; doubles while probes do not pay
        self._plain_streak = 0  # consecutive plain passes since the last probe
        self._probing = False  # the last plan was a probe (root + masks)
        self._mass: Optional[torch.Tensor] = None  # [B, max_nodes] of the last plan
        self._n = -1

    def plan(self, drafter, view) -> int:
        """Draft nodes for this pass (-1 = plain decoding, 0 = root + masks: a re-probe).

        Mask drafters (num_masks > 0) whose probe went stale after plain passes re-probe after
        `probe_interval` plain passes; each probe that still finds drafting not worth it doubles the
        interval (up to 64x). The plain path reads nothing from the device (drafter.probe_maybe is a host
        flag); hybrid drafts from its n-gram proposers without a probe, and then feeds masks again."""
        self._mass = None
        stale = bool(drafter.num_masks) and (not drafter.probe_maybe or not bool(view.state["has_probe"].any()))
        if stale and not drafter.drafts_without_probe:
            return self._stale_pass()
        mass = drafter.draft_mass(view)
        cache_len = int(view.hist_len.float().mean()) - 1
        n = self.choose(mass, len(view.seeds), cache_len)
        if stale and n < 0:
            return self._stale_pass()
        if self._probing:
            self._probing = False
            self.probe_interval = self.base_interval if n > 0 else min(2 * self.probe_interval, 64 * self.base_interval)
        self._mass, self._n = mass, n
        return n

    def _stale_pass(self) -> int:
        self._plain_streak += 1
        if self._plain_streak > self.probe_interval:
            self._plain_streak = 0
            self._probing = True
            return 0
        return -1

    def observe_pass(self, num_committed: torch.Tensor) -> None:
        """Calibrate with the pass just verified ([B] tokens committed per row)."""
        if self._mass is not None and self._n > 0:
            self.observe(float(self._mass[:, : self._n].sum()), float((num_committed - 1).sum()))

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

    def choose(self, mass: Optional[torch.Tensor], batch: int, cache_len: int) -> int:
        """Draft nodes for this pass (-1 = plain). mass: [B, max_nodes] best-first node probabilities."""
        if mass is None:
            return -1
        cum = torch.cat([torch.zeros(1), mass.float().sum(0).cumsum(0).cpu()])  # [max_nodes + 1]
        n = torch.tensor([max(s, 0) for s in self.sizes])
        expected = batch + self.alpha * cum[n.clamp(max=cum.shape[0] - 1)]  # [C]
        rate = expected / self.costs(batch, cache_len)
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
        [runner.loaded.name, str(runner.device), str(runner.dtype), torch.get_num_threads(), batches, cache_lens, blocks]
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
