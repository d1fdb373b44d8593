"""The engine's own counters (per-request statistics are counted per row, `batch.py`): decode time and the part
of it inside the model, passes, block sizes, rows per pass and the largest KV cache, as vLLM's
`SpecDecodingStats` keeps counters and leaves ratios to the report."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .batch import PassCounter


def now() -> float:
    """The host clock the engine's timings read (tests swap this module's `time` for a model-driven one)."""
    return time.perf_counter()


@dataclass
class PassClock:
    """A pass's start, read at its end (host clocks only: no device read)."""

    wall: float  # time.perf_counter() at the start
    model_s: float  # the runner's model seconds at the start
    compile_s: float  # seconds compiled so far (a pass that compiles a kernel is not timed for the policy)
    tokens: int  # the rows' total length at the start (host mirror)

    def seconds(self) -> float:
        """Wall seconds since the start."""
        return now() - self.wall


@dataclass
class GraphStats:
    """Counters of engine.cuda_graphs (reported with the engine's statistics)."""

    captured: int = 0  # graphs captured (each class once per slab)
    capture_s: float = 0.0  # seconds capturing (start-up and during the job)
    graph_bytes: int = 0  # device memory held by the graphs' pool
    graph_passes: int = 0  # passes run from a class's graph (on a CPU: over its static buffers)
    ahead_passes: int = 0  # of which launched before the last pass's read (engine.cuda_graphs_run_ahead)
    probe_passes: int = 0  # of which ended with the drafter's probe (ESP: `graphs.hooks.StepHooks`)
    kept_ended_passes: int = 0  # of which ran over rows that had ended, kept in the batch until the next join
    # passes that ran eagerly, by reason: stop_strings (the text is checked on the host), capacity (a row longer
    # than the slab's pinned slots), spilled (rows in buffers of their own: the grown slab did not fit the device),
    # new_shape (a class's first passes, before its capture), graph_limit
    eager_passes: collections.Counter = field(default_factory=collections.Counter)

    def record(self) -> dict[str, Any]:
        """For benchmarks and the job summary."""
        return dict(captured=self.captured, capture_s=round(self.capture_s, 3), graph_bytes=self.graph_bytes,
                    graph_passes=self.graph_passes, ahead_passes=self.ahead_passes, probe_passes=self.probe_passes,
                    kept_ended_passes=self.kept_ended_passes,
                    eager_passes=dict(self.eager_passes))


@dataclass
class EngineStats:
    decode_s: float = 0.0  # seconds in decode passes
    model_s: float = 0.0  # of which inside the model (forward and LM head, the drafter's LM-head calls included)
    decode_passes: int = 0
    prefill_s: float = 0.0  # seconds in prefills (forwards, first tokens, the rows' set-up)
    prefill_forwards: int = 0  # prefill forwards (chunks of admitted prompts: prefill_plan.py)
    prefill_tokens: int = 0  # prompt tokens the prefill forwards fed
    prefill_cached_tokens: int = 0  # prompt tokens whose keys and values were copied from a stored prefix instead
    peak_cache_bytes: int = 0  # the largest KV cache held
    # rows in the batch -> decode passes
    batch_histogram: collections.Counter = field(default_factory=collections.Counter)
    blocks: PassCounter = field(default_factory=PassCounter)  # passes and block sizes, for per-row statistics
    graphs: Optional[GraphStats] = None  # engine.cuda_graphs' counters (None: passes run eagerly)

    def reset_timing(self) -> None:
        """Zero the time and pass counters (a benchmark's warm-up is not measured)."""
        self.decode_s, self.model_s, self.decode_passes, self.peak_cache_bytes = 0.0, 0.0, 0, 0
        self.prefill_s, self.prefill_forwards, self.prefill_tokens, self.prefill_cached_tokens = 0.0, 0, 0, 0
        if self.graphs is not None:
            self.graphs.graph_passes = self.graphs.ahead_passes = self.graphs.probe_passes = 0
            self.graphs.kept_ended_passes = 0
            self.graphs.eager_passes.clear()

    def timing(self) -> dict[str, float]:
        """The time and pass counters as a record (benchmarks and reports)."""
        graphs = {} if self.graphs is None else dict(graph_passes=self.graphs.graph_passes,
                                                      ahead_passes=self.graphs.ahead_passes,
                                                      probe_passes=self.graphs.probe_passes,
                                                      kept_ended_passes=self.graphs.kept_ended_passes,
                                                      eager_passes=sum(self.graphs.eager_passes.values()))
        return dict(decode_s=self.decode_s, model_s=self.model_s, decode_passes=self.decode_passes,
                    prefill_s=self.prefill_s, prefill_forwards=self.prefill_forwards,
                    prefill_tokens=self.prefill_tokens, prefill_cached_tokens=self.prefill_cached_tokens,
                    peak_cache_bytes=self.peak_cache_bytes, **graphs)

    @staticmethod
    def start(model_s: float, compile_s: float, lens: list[int]) -> PassClock:
        return PassClock(now(), model_s, compile_s, sum(lens))

    def finish(self, clock: PassClock, model_s: float) -> tuple[float, float]:
        """Count a decode pass that started at `clock`: (its seconds, its model seconds)."""
        seconds, model = time.perf_counter() - clock.wall, model_s - clock.model_s
        self.decode_s += seconds
        self.model_s += model
        self.decode_passes += 1
        return seconds, model
