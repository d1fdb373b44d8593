"""engine.cuda_graphs: decode passes replayed from CUDA graphs, one per shape class, over static buffers.

A pass's shape class (`ShapeClass`) is its batch bucket (1, 2, 4, .. up to engine.max_batch_size; rows past the
live batch are padding, never committed), its block (tree slots, auxiliary inputs, depth, whether the path moves
in the cache, one layout for every row or one per row), its capacity bucket (the key slots attention reads: the
smallest power of two from 128 that holds every row's cache and block, so a pass over short rows does not read
the whole slab) and whether it samples. Per class the runner keeps `StepInputs` (copied into before each pass)
and a graph captured from `decode_step`, whose outputs every replay overwrites.

Capture: at start-up the plain pass (Q = 1, greedy) of every batch bucket at the capacity buckets up to 4096
slots; any other class (a larger capacity, a drafter's block, sampling) when it has come `CAPTURE_AFTER` times
(one-off shapes never pay a capture), up to `MAX_GRAPHS`. A pass with no graph runs eagerly and is counted by
reason (`GraphStats.eager_passes`). All graphs share one memory pool and
read the KV slab the engine pinned (`KVCache.pin`); if rows outgrow it the slab is reallocated, every graph is
dropped and classes are captured again over the new one. Where the device cannot hold the grown slab, the rows
spill into buffers of their own (`KVCache.spilled`): their passes run eagerly until they fit the slab again, and
the graphs over it stay.

On a CPU (`engine.cuda_graphs=true` there) nothing is captured: each pass runs `decode_step` eagerly over the
same buffers and copies its results into one set of output buffers per class, as a replay would overwrite them,
so the CPU suite tests the static path of the whole engine loop (tokens, stops, statistics) and the reuse of
output buffers that a graph implies.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..batch import Rows
from ..consts import steps
from ..grad import inference
from ..kv_cache import KVCache
from ..passes import Block, ForwardOut, ProbeOut
from ..stats import GraphStats
from ..verify import VerifyResult
from .buffers import INTS, ModelDims, ShapeClass, StepInputs, StepOutput
from .hooks import StepProbe
from .step import StepFn, StepModel, decode_step

log = logging.getLogger(__name__)

CAPTURE_AFTER = 2  # passes of a class before it is captured (the first runs eagerly)
MAX_GRAPHS = 512  # graphs one engine keeps; later classes run eagerly
MIN_CAPACITY = 128  # the smallest capacity bucket (key slots)
START_CAPACITY = 4096  # plain passes are captured at start-up up to this capacity bucket, larger ones when they come


def batch_buckets(max_batch: int) -> list[int]:
    """[1, 2, 4, .., max_batch]: powers of two below max_batch, then max_batch. 12 -> [1, 2, 4, 8, 12]."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def capacity_buckets(slots: int) -> list[int]:
    """Key slots a class may read: powers of two from MIN_CAPACITY below `slots`, then `slots`. 1000 -> [128,
    256, 512, 1000]."""
    out, c = [], MIN_CAPACITY
    while c < slots:
        out.append(c)
        c *= 2
    return out + [slots]


def _bucket(sizes: list[int], n: int) -> Optional[int]:
    return next((s for s in sizes if s >= n), None)


def cuda_capture(fn: Callable[[], StepOutput], pool: Any, device: torch.device) -> tuple[Any, StepOutput]:
    """(graph, outputs): `fn` run once on a side stream (warm-up: lazy initialisations happen outside the capture),
    then captured as a CUDA graph into `pool`; every replay rewrites the outputs. A capture synchronises (once per
    class, not per pass), so the sync debug mode is lifted while it runs."""
    debug = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads may use CUDA
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(debug)
    return graph, out


def pool_bytes(pool: Any, device: torch.device) -> int:
    """Device memory the allocator holds in `pool` (a graph pool handle): the sum of its segments. Not a difference of
    `memory_reserved` around a capture, which another pool's release (a collected engine's graphs) can cancel."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == tuple(pool))


# how a class is captured (tests replace it to drive the capture path on a CPU)
capture_graph: Callable[[Callable[[], StepOutput], Any, torch.device], tuple[Any, StepOutput]] = cuda_capture


@dataclass
class GraphPass:
    """A pass run over static buffers, as the engine continues it: the forward's outputs (hidden states; no slot
    logits), the verification, and the stops' cut. Tensors are rows 0 .. b-1; the hidden states and the
    verification's committed tokens and path are views of the class's output buffers (read before the next
    pass), the per-row integers a fresh copy."""

    out: ForwardOut
    verified: VerifyResult
    num_kept: torch.Tensor  # [b] tokens committed after the stops
    reason: torch.Tensor  # [b] finish reason code
    probe: Optional[ProbeOut] = None  # the probe stage's results, a copy the drafter keeps (classes with one)


@dataclass
class _Entry:
    """One shape class: its buffers, and its graph once captured (CUDA)."""

    inp: StepInputs
    out: Optional[StepOutput] = None  # the capture's outputs (CUDA) / the buffers eager results land in (CPU)
    graph: Optional[Any] = None  # torch.cuda.CUDAGraph
    rows_of: Optional[torch.Tensor] = None  # the rows' stop table the per-row inputs were copied from (held)
    live: int = 0  # rows copied last time (rows past it are padding)
    layout_of: Optional[Any] = None  # the shared layout last copied (held)
    parents_of: Optional[torch.Tensor] = None  # the parents last copied (held)


class GraphRunner:
    """Shape classes, their buffers and graphs, and the replay of a pass (see the module docstring)."""

    def __init__(self, model: StepModel, dims: ModelDims, cache: KVCache, max_batch: int, capture: bool,
                 compiled: Optional[StepFn] = None):
        self.model, self.dims, self.cache = model, dims, cache
        self.compiled = compiled  # engine.cuda_graphs_compile: decode_step under Inductor (None: as it is)
        self.batches = batch_buckets(max_batch)
        self.capture = capture  # CUDA: capture graphs; CPU: run the static path eagerly
        self.stats = GraphStats()
        self._entries: dict[ShapeClass, _Entry] = {}
        self._seen: collections.Counter = collections.Counter()  # class -> passes before its capture
        self._slab = cache.slab
        self.capacities = capacity_buckets(cache.slab.shape[4])  # key slots a class may read
        cuda = dims.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if capture and cuda else None
        # the last pass ran eagerly as a class's pass before its capture: not what the class costs (the `auto` policy
        # does not time it)
        self.last_uncaptured = False
        self._declined: Optional[str] = None  # the reason `run` last counted for a pass it declined

    def misfit(self, decoder: Any, dims: ModelDims, max_batch: int, slots: int, compiled: bool) -> Optional[str]:
        """Why an engine of this model (its direct decoder), dims, batch size, slots and engine.cuda_graphs_compile
        cannot take over this runner (None: it can)."""
        if compiled != (self.compiled is not None):
            return f"engine.cuda_graphs_compile={compiled} against {self.compiled is not None}"
        if decoder.base is not self.model.decoder.base:
            return "another model"
        if decoder.attention_backend != self.model.decoder.attention_backend:
            return f"engine.attention_backend={decoder.attention_backend} against {self.model.decoder.attention_backend}"
        if dims != self.dims:
            return f"model dimensions {dims} against {self.dims}"
        if max_batch != self.batches[-1]:
            return f"engine.max_batch_size={max_batch} against {self.batches[-1]}"
        if slots > self._slab.shape[4]:
            return f"{slots} slots per row against {self._slab.shape[4]}"
        return None

    def bucket(self, rows: int) -> Optional[int]:
        """The batch bucket of `rows` rows (None: more than the largest)."""
        return _bucket(self.batches, rows)

    def restart_stats(self) -> GraphStats:
        """Fresh counters for the engine taking this runner over (its graphs stay): that engine's captures and
        passes are counted from here."""
        self.stats = GraphStats()
        return self.stats

    def _new_entry(self, shape: ShapeClass) -> _Entry:
        """A class's buffers, registered; under engine.cuda_graphs_compile its batch and capacity are marked dynamic
        (`StepInputs.mark_dynamic`) where the step holds them symbolic (`StepModel.dynamic_shapes`)."""
        inp = StepInputs.allocate(shape, self.dims)
        if self.compiled is not None and self.model.dynamic_shapes:
            inp.mark_dynamic()
        entry = self._entries[shape] = _Entry(inp)
        return entry

    def _step(self, inp: StepInputs, shape: ShapeClass) -> StepOutput:
        """The class's pass over its buffers: decode_step, or its compiled form."""
        return (self.compiled or decode_step)(self.model, self._slab, inp, shape)

    # ---- the pass ----------------------------------------------------------------------------------
    def run(self, rows: Rows, block: Block, probe: Optional[StepProbe] = None) -> Optional[GraphPass]:
        """The pass over its class's buffers (replayed, or on a CPU run eagerly), or None: the caller runs it
        eagerly (counted by reason). probe: the stage the pass ends with (`StepHooks.step_probe`), or None."""
        self.last_uncaptured, self._declined = False, None
        shape = self._shape(rows, block, probe)
        if isinstance(shape, str):
            self._decline(shape)
            return None
        entry = self._entries.get(shape)
        if entry is None or (self.capture and entry.graph is None):
            entry = self._admit(shape)
            if entry is None:
                self.last_uncaptured = True
                return None
        b = len(rows)
        self._fill(entry, rows, block, shape, probe)
        if entry.graph is None:  # capture pending on CUDA (filled now), or the eager static path on a CPU
            if self.capture:
                self._capture(shape, entry)
            else:
                res = self._step(entry.inp, shape)
                # buffers of the class's own (a result may hold shared constants, e.g. a chain's path slots)
                entry.out = res.clone() if entry.out is None else entry.out.copy_(res)
        if entry.graph is not None:
            entry.graph.replay()
        self.stats.graph_passes += 1
        out = entry.out
        ints = out.ints.narrow(1, 0, b).clone()  # [5, b] fresh: the rows keep their lengths and reasons
        num, last_slot, last_token, n_fin, reason = ints.unbind(0)
        if shape.sampling:  # every row consumed one uniform per committed token
            rows.uniforms.ptr += num
        logprobs = None if out.logprobs is None else out.logprobs.map(lambda t: t.narrow(0, 0, b))
        verified = VerifyResult(out.committed.narrow(0, 0, b), num, out.path_slots.narrow(0, 0, b), last_slot,
                                last_token, logprobs)
        fwd = ForwardOut(out.hidden.narrow(0, 0, b), None)
        got = None
        if out.probe is not None:  # the drafter's state from here: its own copy (the next replay overwrites these)
            got = out.probe.map(lambda t: t.narrow(0, 0, b).clone())
            self.stats.probe_passes += 1
        return GraphPass(fwd, verified, n_fin, reason, got)

    def _decline(self, reason: str) -> None:
        self.stats.eager_passes[reason] += 1
        self._declined = reason

    def withdraw(self) -> None:
        """The pass `run` last declined was not run after all (its rows ended first): it is not counted."""
        if self._declined is not None:
            counts, reason = self.stats.eager_passes, self._declined
            counts[reason] -= 1
            if not counts[reason]:
                del counts[reason]
            self._declined = None

    def _shape(self, rows: Rows, block: Block, probe: Optional[StepProbe]):
        """The pass's class, or why it has none (a reason string)."""
        if rows.has_stop_strings:
            return "stop_strings"
        if self.cache.spilled:  # the rows live outside the slab the graphs read
            return "spilled"
        if self.cache.slab is not self._slab:  # the slab grew: graphs over the old one are gone
            self._reset(self.cache.slab)
        tree, lay = block.tree, block.layout
        b, q = len(rows), block.num_inputs
        batch = _bucket(self.batches, b)
        capacity = _bucket(self.capacities, max(rows.lens) - 1 + q)
        if batch is None or batch > self._slab.shape[2]:
            return "batch"
        if capacity is None:
            return "capacity"
        lead = {lay.visible.shape[0], lay.rel_pos.shape[0], lay.depth.shape[0]}
        if len(lead) != 1:
            return "layout"
        sampling = rows.sampling
        return ShapeClass(batch=batch, num_slots=tree.num_slots, num_aux=q - tree.num_slots, capacity=capacity,
                          max_depth=block.max_depth, in_place=tree.num_slots == 1 or tree.path_in_place,
                          shared_layout=lead == {1}, sampling=sampling, logprobs=rows.logprobs_top,
                          probe=None if probe is None else probe.stage)

    def _admit(self, shape: ShapeClass) -> Optional[_Entry]:
        """The class's entry, made now when it may have one (on CUDA, its capture follows in `run`)."""
        entry = self._entries.get(shape)
        if entry is not None:
            return entry
        if self.capture:
            self._seen[shape] += 1
            if self._seen[shape] < CAPTURE_AFTER:
                self._decline("new_shape")
                return None
            if len(self._entries) >= MAX_GRAPHS:
                self._decline("graph_limit")
                return None
        entry = self._new_entry(shape)
        return entry

    def _fill(self, entry: _Entry, rows: Rows, block: Block, shape: ShapeClass, probe: Optional[StepProbe]) -> None:
        """Copy the pass's inputs into rows 0 .. b-1 of the class's buffers: the rows' own (stop table, limits,
        sampling parameters) when the rows changed, the block's and the probe stage's every pass (a shared layout and
        constant parents only when they are not the ones copied last)."""
        inp, t, b = entry.inp, rows.t, len(rows)
        if entry.rows_of is not t.stop_table or entry.live != b:
            if b < entry.live:
                inp.clear_rows(b)
            for name in ("stop_table", "limit", "limit_code") + (("temperature", "top_p", "top_k") if shape.sampling else ()):
                getattr(inp, name).narrow(0, 0, b).copy_(getattr(t, name))
            entry.rows_of, entry.live = t.stop_table, b
        tree, lay = block.tree, block.layout
        inp.tokens.narrow(0, 0, b).copy_(tree.tokens)
        inp.valid.narrow(0, 0, b).copy_(tree.valid)
        if entry.parents_of is not tree.parents:
            inp.parents.narrow(0, 0, b).copy_(tree.parents)
            entry.parents_of = tree.parents
        if inp.aux is not None:
            inp.aux.narrow(0, 0, b).copy_(block.aux_embeds)
        if not shape.shared_layout:
            inp.visible.narrow(0, 0, b).copy_(lay.visible)
            inp.rel_pos.narrow(0, 0, b).copy_(lay.rel_pos)
            inp.depth.narrow(0, 0, b).copy_(lay.depth)
        elif entry.layout_of is not lay:
            inp.visible.copy_(lay.visible)
            inp.rel_pos.copy_(lay.rel_pos)
            inp.depth.copy_(lay.depth)
            entry.layout_of = lay
        inp.hist_len.narrow(0, 0, b).copy_(t.hist_len)
        if probe is not None and probe.m is not None:
            inp.m.narrow(0, 0, b).copy_(probe.m)
        if probe is not None and probe.mask_owner is not None:
            inp.mask_owner.narrow(0, 0, b).copy_(probe.mask_owner.expand(b, -1))
        if shape.sampling:
            s = shape.commit_width
            rows.uniforms.ensure(s, rows.consumed())
            u = rows.uniforms
            inp.uniforms.narrow(0, 0, b).copy_(u.buf.gather(1, u.ptr.unsqueeze(1) + steps(s, u.ptr.device)))

    # ---- capture (CUDA) ----------------------------------------------------------------------------
    @inference
    def _capture(self, shape: ShapeClass, entry: _Entry) -> None:
        """Capture `decode_step` over the class's buffers into the shared pool (`capture_graph`). Its warm-up runs
        on the pass's real inputs: a pass is idempotent (its KV writes depend only on the cached prefix, which it
        does not touch), so the replay that follows computes the same pass again."""
        t0 = time.perf_counter()
        dev = self.dims.device
        entry.graph, entry.out = capture_graph(lambda: self._step(entry.inp, shape), self._pool, dev)
        self.stats.captured += 1
        self.stats.graph_bytes = pool_bytes(self._pool, dev) if self._pool is not None else 0
        self.stats.capture_s += time.perf_counter() - t0

    def capture_plain(self) -> None:
        """Start-up: the plain pass (Q = 1, greedy) of every batch bucket and capacity bucket up to START_CAPACITY,
        over padding rows (their KV writes land in rows no request holds yet). Not with a compiled step: each
        capture would be a compile, so its classes come as the job meets them."""
        if not self.capture or self.compiled is not None:
            return
        for batch in self.batches:
            if batch > self._slab.shape[2]:
                break
            for capacity in [c for c in self.capacities if c <= START_CAPACITY] or self.capacities[:1]:
                shape = ShapeClass(batch=batch, num_slots=1, num_aux=0, capacity=capacity, max_depth=0,
                                   in_place=True, shared_layout=True, sampling=False)
                entry = self._new_entry(shape)
                self._capture(shape, entry)

    @inference
    def pass_timer(self, batch: int, cache_len: int, q: int) -> Optional[Callable[[], Any]]:
        """One pass of a chain of q tokens at `batch` rows behind cache_len cached slots, run as its class runs it
        (the replay of its graph on CUDA): what engine.cuda_graphs' cost curve times (`measure_cost_curve`). None
        when the pinned slab cannot hold it. It writes the slab's first rows: for start-up, before any request."""
        bucket, capacity = _bucket(self.batches, batch), _bucket(self.capacities, cache_len + q)
        if bucket is None or capacity is None or bucket > self._slab.shape[2]:
            return None
        shape = ShapeClass(batch=bucket, num_slots=q, num_aux=0, capacity=capacity, max_depth=q - 1, in_place=True,
                           shared_layout=True, sampling=False)
        entry = self._entries.get(shape)
        if entry is None:
            entry = self._new_entry(shape)
        inp, dev = entry.inp, self.dims.device
        inp.parents.copy_(torch.arange(-1, q - 1, device=dev).expand(bucket, q))
        inp.valid.fill_(True)
        inp.visible.copy_(torch.ones((q, q), dtype=torch.bool, device=dev).tril()[None])
        inp.rel_pos.copy_(torch.arange(q, device=dev)[None])
        inp.depth.copy_(torch.arange(q, device=dev)[None])
        inp.hist_len.fill_(1)
        inp.hist_len.narrow(0, 0, batch).fill_(cache_len + 1)
        entry.rows_of, entry.live = None, batch
        if not self.capture:
            return lambda: self._step(inp, shape)
        if entry.graph is None:
            self._capture(shape, entry)
        return entry.graph.replay

    def _reset(self, slab: torch.Tensor) -> None:
        """The cache's slab was reallocated: drop every graph (they read the old one) and start over on the new."""
        self._entries.clear()
        self._seen.clear()
        self._slab = slab
        self.capacities = capacity_buckets(slab.shape[4])
        self.model = self.model.covering(slab.shape[4])  # positions up to the new slots
        if self.capture:
            log.info("engine.cuda_graphs: the KV slab grew to %d slots per row; graphs are captured again",
                     slab.shape[4])

    def summary(self) -> dict[str, Any]:
        return self.stats.record()


__all__ = ["GraphPass", "GraphRunner", "GraphStats", "INTS", "batch_buckets", "capacity_buckets"]
