"""This hardware's cost curve: the time of one decode pass as a function of batch, block size and cache length.

One decode pass feeds Q new tokens per row behind a KV cache of S tokens. On a GPU small Q costs about the
same as Q = 1 (memory-bound); on a CPU the cost grows with Q much sooner. A method that commits tau tokens
per pass with blocks of Q tokens is then expected to run at

    speedup over plain decoding = tau / relative_cost(batch, Q, S),  relative_cost = time(Q) / time(1)

(`predict_speedup`). The prediction leaves out the drafter's own work (building trees, n-gram lookups,
Python), the prefill and the verification; the benchmark reports how far the measured speedup is from it.

Pure torch: the caller pins torch threads (`torch.set_num_threads`) before measuring.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .. import kv_cache
from ..model.attention import attention_bias
from ..model.runner import ModelRunner

FILL_ROWS = 16  # rows a calibration cache is prefilled at a time (its bias grows with rows x cache length squared)


@dataclass
class CostCurve:
    """Median seconds of one pass (model forward + LM head over the Q tokens) on a grid."""

    batch_sizes: list[int]
    cache_lens: list[int]
    block_sizes: list[int]
    # [batch][cache_len][block] median seconds per pass
    seconds: list[list[list[float]]]
    device: str = "cpu"
    torch_threads: int = 1

    def time(self, batch: float, block: float, cache_len: float) -> float:
        """Seconds per pass, linearly interpolated along each axis (clamped to the measured range)."""
        ib = _bracket(self.batch_sizes, batch)
        ic = _bracket(self.cache_lens, cache_len)
        iq = _bracket(self.block_sizes, block)
        total = 0.0
        for b, wb in ib:
            for c, wc in ic:
                for q, wq in iq:
                    total += wb * wc * wq * self.seconds[b][c][q]
        return total

    def relative_cost(self, batch: float, block: float, cache_len: float) -> float:
        """time(Q = block) / time(Q = 1) at the same batch size and cache length."""
        return self.time(batch, block, cache_len) / self.time(batch, 1, cache_len)

    def records(self) -> list[dict[str, Any]]:
        """One flat record per grid point (for JSON / CSV)."""
        out = []
        for i, b in enumerate(self.batch_sizes):
            for j, c in enumerate(self.cache_lens):
                base = self.seconds[i][j][self.block_sizes.index(1)] if 1 in self.block_sizes else None
                for k, q in enumerate(self.block_sizes):
                    s = self.seconds[i][j][k]
                    out.append(
                        dict(batch_size=b, cache_len=c, block_size=q, seconds=s, relative_cost=(s / base if base else None))
                    )
        return out

    def to_dict(self) -> dict[str, Any]:
        return dict(
            batch_sizes=self.batch_sizes, cache_lens=self.cache_lens, block_sizes=self.block_sizes,
            seconds=self.seconds, device=self.device, torch_threads=self.torch_threads,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostCurve":
        return cls(**d)


def _bracket(xs: Sequence[float], x: float) -> list[tuple[int, float]]:
    """Indices and weights of the two grid points around x (sorted xs), clamped at the ends.

    Example: xs [1, 2, 4], x 3 -> [(1, 0.5), (2, 0.5)]; x 8 -> [(2, 1.0)].
    """
    if x <= xs[0]:
        return [(0, 1.0)]
    if x >= xs[-1]:
        return [(len(xs) - 1, 1.0)]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return [(lo, 1.0 - w), (hi, w)]


def predict_speedup(tau: float, block: float, curve: CostCurve, batch: float = 1, cache_len: Optional[float] = None) -> float:
    """Expected speedup over plain decoding of a method committing `tau` tokens per pass of `block` tokens.

    cache_len None = the middle of the measured cache lengths.
    Example: tau 2.0 with relative_cost(Q=16) = 1.6 -> 1.25.
    """
    if cache_len is None:
        cache_len = (curve.cache_lens[0] + curve.cache_lens[-1]) / 2
    return tau / curve.relative_cost(batch, block, cache_len)


def powers_of_two(max_block: int) -> list[int]:
    """[1, 2, 4, ..., <= max_block]."""
    out, q = [], 1
    while q <= max_block:
        out.append(q)
        q *= 2
    return out


# (batch, cache length, Q) -> a function running one such pass, or None where it has none (engine.cuda_graphs:
# `GraphRunner.pass_timer`, a captured chain pass of the shape)
PassFactory = Callable[[int, int, int], Optional[Callable[[], Any]]]


@torch.inference_mode()
def measure_cost_curve(
    runner: ModelRunner,
    batch_sizes: Sequence[int] = (1,),
    cache_lens: Sequence[int] = (128, 512),
    block_sizes: Sequence[int] = tuple(powers_of_two(128)),
    repeats: int = 5,
    warmup: int = 2,
    passes: Optional[PassFactory] = None,
) -> CostCurve:
    """Time one pass of Q new tokens (causal among themselves, seeing the whole cache) on every grid point.

    For each (batch, cache length) a cache is filled once by a prefill of token-id-0 inputs; every timed
    pass writes Q tokens at slots s .. s+Q-1 (overwritten by the next), so all passes see the same cache. Each point is the
    median of `repeats` passes after `warmup` untimed ones. Block sizes must include 1 (the baseline).
    With `passes` (engine.cuda_graphs) a point the factory serves is timed as that pass (a replayed graph: the
    forward, the LM head and the settle, as the engine runs it); the others as the eager forward and LM head.
    """
    if 1 not in block_sizes:
        raise ValueError("block_sizes must include 1 (plain decoding is the reference)")
    batch_sizes, cache_lens, block_sizes = sorted(batch_sizes), sorted(cache_lens), sorted(block_sizes)
    limit = runner.loaded.max_context
    if cache_lens[-1] + block_sizes[-1] > limit:
        raise ValueError(f"cache length {cache_lens[-1]} + block {block_sizes[-1]} exceeds the model's context {limit}")
    dev = runner.device
    seconds: list[list[list[float]]] = []
    for b in batch_sizes:
        per_cache = []
        for s in cache_lens:
            eager = _eager_passes(runner, b, s, block_sizes[-1])
            per_block = []
            for q in block_sizes:
                run = (passes(b, s, q) if passes is not None else None) or eager(q)
                per_block.append(_median_seconds(run, dev, warmup, repeats))
            per_cache.append(per_block)
        seconds.append(per_cache)
    return CostCurve(
        list(batch_sizes), list(cache_lens), list(block_sizes), seconds, device=str(dev), torch_threads=torch.get_num_threads()
    )


def _eager_passes(runner: ModelRunner, b: int, s: int, max_block: int) -> Callable[[int], Callable[[], Any]]:
    """q -> one eager pass of q tokens at b rows behind s cached slots (a cache of its own, filled lazily by a
    prefill of token-id-0 inputs at the first pass asked for)."""
    dev = runner.device
    cache = None

    def make(q: int) -> Callable[[], Any]:
        nonlocal cache
        if cache is None:
            cache = kv_cache.new_cache(runner.model.config.get_text_config().num_hidden_layers)
            cache.reserve(b, s + max_block)
            cache.add_rows(b)
            causal = torch.ones((s, s), dtype=torch.bool, device=dev).tril()[None]
            for row0 in range(0, b, FILL_ROWS):  # a prefill's bias is [rows, s, s]: a full batch's can outgrow the cache
                n = min(FILL_ROWS, b - row0)
                ids = torch.zeros((n, s), dtype=torch.long, device=dev)
                pos = torch.arange(s, device=dev)[None].expand(n, -1)
                cache.plan(row0, n, s, 0)
                runner.forward(runner.embed_ids(ids), attention_bias(causal, None, pos, s, runner.dtype), pos, cache)
        new = torch.zeros((b, q), dtype=torch.long, device=dev)
        qpos = (s + torch.arange(q, device=dev))[None].expand(b, -1)
        in_block = torch.ones((q, q), dtype=torch.bool, device=dev).tril()[None]
        cache_len = torch.full((b,), s, dtype=torch.long, device=dev)

        def run() -> None:
            cache.plan(0, b, s + q, s)  # the block overwrites slots s .. s+q-1 every time
            bias = attention_bias(in_block, cache_len, qpos, s + q, runner.dtype)
            hidden = runner.forward(runner.embed_ids(new), bias, qpos, cache)
            runner.logits(hidden)

        return run

    return make


def _median_seconds(run: Callable[[], Any], dev: torch.device, warmup: int, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `run` after `warmup` untimed ones, the device synchronised around
    each (a measurement, never inside a pass)."""
    times = []
    for i in range(warmup + repeats):
        _sync(dev)
        t0 = time.perf_counter()
        run()
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class PrefillCost:
    """One eager forward of Q new tokens costs about fixed_s + Q * token_s (a prefill pads each prompt of a
    chunk to the longest, so a chunk of R prompts costs fixed_s + R * longest * token_s)."""

    fixed_s: float
    token_s: float

    @property
    def forward_tokens(self) -> float:
        """What one more forward costs, in padded prompt tokens (a forward bound by its launches: thousands)."""
        return min(self.fixed_s / self.token_s, 1e9) if self.token_s > 0 else 1e9


@torch.inference_mode()
def measure_prefill_cost(runner: ModelRunner, short: int = 16, long: int = 1024, repeats: int = 3) -> PrefillCost:
    """Time eager forwards (with the LM head) of `short` and `long` tokens at one row, the median of `repeats`
    after one untimed each, and fit the line through them. Synchronises: a start-up measurement, not a pass."""
    room = runner.loaded.max_context - 2  # positions after the one cached token
    short = max(1, min(short, room // 4))
    long = max(short + 1, min(long, room))
    make = _eager_passes(runner, 1, 1, long)
    seconds = [_median_seconds(make(q), runner.device, 1, repeats) for q in (short, long)]
    token_s = max(seconds[1] - seconds[0], 0.0) / (long - short)
    return PrefillCost(fixed_s=max(seconds[0] - short * token_s, 0.0), token_s=token_s)
