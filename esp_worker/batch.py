"""Batch-row bookkeeping: the rows in flight, their tensors, host mirrors and per-row statistics counters.

Every tensor in `Rows.t` (RowTensors) / `Rows.state` (the drafter's typed RowState) is [B, ...] and moves with `select`
(rows leave) and `extend` (rows join). Statistics are counted on the device with tensor ops (`count`) and
turned into a RequestStats once, when a row retires; passes and block sizes are the same for every row of a
pass, so they are counted once per pass on the host and each row keeps the counts it saw at admission.
"""
from __future__ import annotations

import array
import collections
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .consts import ones, steps
from .passes import RowsView, new_version
from .row_state import RowState, row_field
from .kv_cache import KVCache
from .prefix_cache import Prefix
from .sampling import UniformStreams
from .tree import DraftTree
from .types import Request, RequestStats

STAT_WIDTH = 16  # initial width of the per-depth / per-count histograms (grown when a deeper block comes)


@dataclass
class Seq:
    req: Request
    prompt_ids: list[int]
    seed: int
    stats: RequestStats
    t0: float = 0.0
    passes0: int = 0  # engine decode passes before this row joined
    sizes0: dict[int, int] = field(default_factory=dict)  # block size -> passes, before this row joined
    prefix: Optional[Prefix] = None  # the stored prompt prefix its prefill copies instead of feeding (prefix_cache.py)


@dataclass
class PassCounter:
    """Decode passes and block sizes seen by the whole batch (host side, one update per pass)."""

    passes: int = 0
    sizes: collections.Counter = field(default_factory=collections.Counter)

    def add(self, block_size: int) -> None:
        self.passes += 1
        self.sizes[block_size] += 1

    def since(self, seq: Seq) -> tuple[int, dict[int, int]]:
        sizes = {q: n - seq.sizes0.get(q, 0) for q, n in self.sizes.items()}
        return self.passes - seq.passes0, {q: n for q, n in sorted(sizes.items()) if n}


@dataclass
class RowTensors(RowState):
    """The engine's own [B, ...] tensors of the rows (the drafter keeps its own in a RowState of its type)."""

    hist: Optional[torch.Tensor] = row_field()  # [B, C] prompt + committed tokens, valid up to hist_len
    # beside `hist`, written in passes where some row asks for them (GenerationParams.logprobs, top_logprobs):
    # [B, C] float32 each generated token's log-probability (a prompt's positions: its own, where a row of its
    # prefill asked for them, else zeros), and [B, C, K] the K likeliest tokens where each was chosen (int32) with
    # theirs (float32), K the most a row of the batch asked for
    logprobs: Optional[torch.Tensor] = row_field()
    top_ids: Optional[torch.Tensor] = row_field()
    top_logprobs: Optional[torch.Tensor] = row_field()
    hist_len: Optional[torch.Tensor] = row_field()  # [B]
    prompt_len: Optional[torch.Tensor] = row_field()  # [B]
    limit: Optional[torch.Tensor] = row_field()  # [B] most tokens the row may hold
    limit_code: Optional[torch.Tensor] = row_field()  # [B] the finish reason when it gets there
    temperature: Optional[torch.Tensor] = row_field()  # [B]
    top_p: Optional[torch.Tensor] = row_field()  # [B]
    top_k: Optional[torch.Tensor] = row_field()  # [B]
    stop_table: Optional[torch.Tensor] = row_field()  # [B, V] bool: token ids that stop the row
    drafted: Optional[torch.Tensor] = row_field()  # [B, 2] draft tokens fed, passes that fed at least one
    # [B, W * W] int32: passes that committed n_raw tokens before the stops and n_fin after them, at n_raw * W + n_fin
    hists: Optional[torch.Tensor] = row_field()
    accepted_by: Optional[torch.Tensor] = row_field()  # [B, P] accepted drafts per proposer (P > 0 only)

    def extend(self, other: "RowTensors") -> None:
        """Append `other`'s rows; the pass counts first brought to one width (the same counts at the same pairs)."""
        if self.hists.shape[1] != other.hists.shape[1]:
            width = math.isqrt(max(self.hists.shape[1], other.hists.shape[1]))
            self.hists, other.hists = widen_counts(self.hists, width), widen_counts(other.hists, width)
        super().extend(other)


@dataclass(frozen=True)
class RowModes:
    """What the rows' requests ask of every pass over them, from their parameters (which never change)."""

    sampling: bool  # some row samples (temperature > 0)
    stop_strings: bool  # some row has stop strings (checked on the host after each pass)
    logprobs_top: Optional[int]  # None: no row asks for its tokens' log-probabilities; else the most alternatives

    @classmethod
    def of(cls, seqs: list[Seq]) -> "RowModes":
        params = [s.req.params for s in seqs]
        asks = [p.top_logprobs for p in params if p.wants_logprobs]
        return cls(any(p.temperature > 0 for p in params), any(p.stop_strings for p in params),
                   max(asks) if asks else None)


@dataclass
class Rows:
    """The rows in flight: their tensors, the drafter's state, and host mirrors refreshed by the pass's one read."""

    seqs: list[Seq]
    t: RowTensors
    state: RowState  # the drafter's per-row state (its own dataclass; the engine only moves rows of it)
    uniforms: UniformStreams
    cache: KVCache
    reason: Optional[torch.Tensor] = None  # [B] finish reason code (0 = running)
    lens: list[int] = field(default_factory=list)  # host copy of hist_len (a bound while `lens_exact` is False)
    # False while a drafting pass runs ahead of its read (engine.cuda_graphs_run_ahead): `lens` are then upper bounds
    lens_exact: bool = True
    limits: list[int] = field(default_factory=list)  # host copy of t.limit (fixed per row)
    done: list[int] = field(default_factory=list)  # host copy of reason
    hints: Optional[list[int]] = None  # host copy of the drafter's row_hints (None: it gives none)
    # [B] each row's last committed token where the last commit gave it (verification's bonus), else None
    roots: Optional[torch.Tensor] = None
    # changes whenever the rows or their lengths do (a commit, rows leaving or joining); unique across batches
    version: int = field(default_factory=lambda: new_version())
    # the requests' modes (`RowModes`), worked out when first asked after the rows were made, joined or left: a
    # pass asks several times, and walking 64 rows' requests each time costs tens of microseconds
    _modes: Optional[RowModes] = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.seqs)

    def live(self) -> int:
        """Rows not known on the host to have ended (ended rows may stay in the batch while passes run on)."""
        return len(self.seqs) - sum(1 for code in self.done if code)

    @property
    def modes(self) -> RowModes:
        if self._modes is None:
            self._modes = RowModes.of(self.seqs)
        return self._modes

    @property
    def sampling(self) -> bool:
        return self.modes.sampling

    @property
    def logprobs_top(self) -> Optional[int]:
        """None: no row returns its tokens' log-probabilities; else the pass computes them for every row, with the
        most alternatives a row asks for (0: none)."""
        return self.modes.logprobs_top

    @property
    def has_stop_strings(self) -> bool:
        return self.modes.stop_strings

    def view(self) -> RowsView:
        """The drafter's view of the rows as they are now."""
        t = self.t
        return RowsView(t.hist, t.hist_len, t.prompt_len, [s.seed for s in self.seqs], self.state, self.hints,
                        self.roots, version=self.version, lens=self.lens, reason=self.reason)

    def advance(self, hist_len: torch.Tensor, last_token: Optional[torch.Tensor], reason: torch.Tensor) -> None:
        """After a commit: the rows' new lengths [B], last committed tokens [B] (None: read from the history when
        asked; only rows that go on need theirs exact) and finish reasons [B]."""
        self.t.hist_len = hist_len
        self.roots = last_token
        self.reason = reason
        self.version = new_version()

    def common_length(self) -> Optional[int]:
        """The length every row has (host mirror), or None when lengths differ or are bounds only (batch 1: one
        length, known unless a drafting pass is in flight)."""
        lens = self.lens
        return lens[0] if lens and self.lens_exact and min(lens) == max(lens) else None

    def keep_path(self, tree: DraftTree, path_slots: torch.Tensor) -> None:
        """Cache: the accepted nodes move right behind each row's root (the root and a chain are in place), before
        the commit. path_slots [B, S]: slot 0, then the accepted path. Path steps past a row's accepted count copy a
        slot of the block to a slot past its new length, where slots are stale anyway: no mask is needed (every
        source is read before any slot is written)."""
        p = path_slots.shape[1] - 1  # path steps after the root
        if tree.path_in_place or p < 1:
            return
        length = self.common_length()
        if length is not None:  # rows of one length: the path lands at slots length .. (host-known)
            self.cache.keep(length, path_slots.narrow(1, 1, p) + (length - 1))
            return
        hist_len = self.t.hist_len.unsqueeze(1)  # [B, 1] before the commit: the root's slot + 1
        dst = hist_len + steps(p, hist_len.device)  # [B, P-1] slots hist_len ..
        src = path_slots.narrow(1, 1, p) + (hist_len - 1)  # the block wrote tree slot i at hist_len - 1 + i
        self.cache.keep(dst, src)

    def consumed(self) -> list[int]:
        """Uniforms each row has consumed: one per generated token (host mirror, no read)."""
        return [n - len(s.prompt_ids) for n, s in zip(self.lens, self.seqs)]

    def read_back(self, hints: Optional[torch.Tensor] = None, extra: Optional[torch.Tensor] = None) -> Optional[list[float]]:
        """The one host read of a pass: lengths, finish reasons and the drafter's row hints [B] (or None), as
        one small tensor; with `extra` (the policy's next look, [E] float) the same read returns its values."""
        parts = [self.t.hist_len, self.reason] + ([] if hints is None else [hints])
        rows, look = unpack_read(pack_read(parts, extra).tolist(), len(self), len(parts))
        self.lens, self.done, self.lens_exact = rows[0], rows[1], True
        self.hints = None if hints is None else rows[2]
        return look

    def read_finished(self, rows: list[int]) -> list["Finished"]:
        """Rows `rows`' generated tokens and statistics counters on the host, in one device read for all of them
        (on a GPU each read is a round trip: four per row, read apart, cost a batch of finishing rows milliseconds)."""
        t = self.t
        starts, ends = [len(self.seqs[r].prompt_ids) for r in rows], [self.lens[r] for r in rows]
        lo, hi = min(starts), max(ends)
        idx = torch.tensor(rows, device=t.hist.device)
        parts = [t.hist[:, lo:hi], t.drafted, t.hists] + ([t.accepted_by] if t.accepted_by is not None else [])
        widths = [p.shape[1] for p in parts] + [0] * (4 - len(parts))
        asked = [self.seqs[r].req.params for r in rows]
        wants = any(p.wants_logprobs or p.prompt_logprobs for p in asked)
        k = max(p.top_logprobs for p in asked)
        first = 1 if any(p.prompt_logprobs for p in asked) else lo  # a prompt's from its second token
        if wants:  # the float32 bits ride in the same read, as integers
            parts.append(t.logprobs[:, first:hi].view(torch.int32))
        if k:
            parts += [x[:, lo:hi, :k] for x in (t.top_ids, t.top_logprobs.view(torch.int32))]
        widths += [hi - first if wants else 0] + [(hi - lo) * k] * 2
        packed = torch.cat([p.index_select(0, idx).reshape(len(rows), -1).long() for p in parts], 1).tolist()
        out = []
        for params, values, start, end in zip(asked, packed, starts, ends):
            tokens, drafted, hists, by, bits, top_ids, top_bits = (
                values[a - w: a] for a, w in zip(itertools.accumulate(widths), widths))
            fin = Finished(tokens[start - lo: end - lo], drafted, hists, by)
            if params.wants_logprobs:
                fin.logprobs = _floats(bits[start - first: end - first])
            if params.prompt_logprobs:
                fin.prompt_logprobs = [None] + _floats(bits[: start - 1])
            if params.top_logprobs:
                a, z, mine = (start - lo) * k, (end - lo) * k, params.top_logprobs
                ids, lps = top_ids[a:z], _floats(top_bits[a:z])
                fin.top_logprobs = [list(zip(ids[i: i + mine], lps[i: i + mine])) for i in range(0, z - a, k)]
            out.append(fin)
        return out

    def drop(self, gone: list[int]) -> None:
        """Rows `gone` leave the batch; the last rows that stay take their places (`drop_order`)."""
        self.select(drop_order(len(self), gone))

    def select(self, keep: list[int]) -> None:
        """Keep rows `keep`, in that order (row keep[i] becomes row i)."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.reason.device)
        self.seqs = [self.seqs[i] for i in keep]
        self._modes = None
        self.lens = [self.lens[i] for i in keep]
        self.limits = [self.limits[i] for i in keep]
        self.done = [self.done[i] for i in keep]
        self.hints = None if self.hints is None else [self.hints[i] for i in keep]
        self.t.select(rows)
        self.roots = None if self.roots is None else self.roots.index_select(0, rows)
        self.state.select(rows)
        self.uniforms.select(rows, keep)
        self.cache.select_rows(keep)
        self.reason = self.reason.index_select(0, rows)
        self.version = new_version()

    def extend(self, other: "Rows") -> None:
        """Append `other`'s rows (prefilled into this batch's cache, rows len(self) ..)."""
        self.cache.add_rows(len(other))
        self.version = new_version()
        self._modes = None
        if not self.seqs:
            self.seqs, self.t, self.state, self.reason = other.seqs, other.t, other.state, other.reason
            self.uniforms, self.lens, self.done, self.hints = other.uniforms, other.lens, other.done, other.hints
            self.limits, self.roots = other.limits, other.roots  # the prefill's tokens are the roots
            return
        self.seqs = self.seqs + other.seqs
        self.lens, self.done, self.limits = self.lens + other.lens, self.done + other.done, self.limits + other.limits
        self.hints = None if self.hints is None or other.hints is None else self.hints + other.hints
        self.t.extend(other.t)
        self.roots = None if self.roots is None or other.roots is None else torch.cat([self.roots, other.roots])
        self.state.extend(other.state)
        self.uniforms.append_from(other.uniforms)
        self.reason = torch.cat([self.reason, other.reason])

    def ensure_capacity(self, extra: int) -> None:
        """Room in `hist` for `extra` more tokens per row (host-known lengths: no read)."""
        hist = self.t.hist
        need = max(self.lens) + extra
        if need > hist.shape[1]:
            t, more = self.t, max(need, 2 * hist.shape[1]) - hist.shape[1]
            t.hist, t.logprobs = (torch.nn.functional.pad(x, (0, more)) for x in (hist, t.logprobs))
            t.top_ids, t.top_logprobs = (torch.nn.functional.pad(x, (0, 0, 0, more))  # [B, C, K]: C is dim 1
                                         for x in (t.top_ids, t.top_logprobs))

    # ---- statistics --------------------------------------------------------------------------------
    def count(self, n_fin: torch.Tensor, n_raw: torch.Tensor, drafted: Optional[torch.Tensor], max_committed: int,
              source: Optional[torch.Tensor] = None, path_slots: Optional[torch.Tensor] = None,
              live: Optional[torch.Tensor] = None) -> None:
        """Add one pass to the per-row counters (tensor ops only, 4 of them). n_fin, n_raw: [B] tokens committed
        after / before the stops; drafted [B] (None: no draft this pass).
        source [B, T] (proposer of each tree slot, -1 = root; [B, 1]: of every draft of the row) and
        path_slots [B, S]: split the kept accepted drafts by proposer into accepted_by [B, P].
        live [B] bool: the rows the pass counts for (None: all); a plain pass run ahead of the last one's read
        (no drafts) also runs over rows that pass ended."""
        t = self.t
        width = self.count_width(max_committed)  # first: it may replace t.hists by a wider one
        count_pass(t.hists, width, t.drafted, n_fin, n_raw, drafted, live)
        if source is not None and t.accepted_by is not None:
            count_by_proposer(t.accepted_by, source, path_slots, n_raw, n_fin)

    def count_width(self, max_committed: int) -> int:
        """The pass counts' width W, first widened when a pass may commit max_committed tokens (host-known: a
        deeper block than any before), so that every (n_raw, n_fin) pair of the pass has its place."""
        hists = self.t.hists  # [B, W * W]: passes by (n_raw, n_fin), the accepted drafts kept follow from both
        width = math.isqrt(hists.shape[1])
        if max_committed + 1 > width:
            hists = self.t.hists = widen_counts(hists, max(max_committed + 1, 2 * width))
            width = math.isqrt(hists.shape[1])
        return width


def count_pass(hists: torch.Tensor, width: int, drafted_total: torch.Tensor, n_fin: torch.Tensor, n_raw: torch.Tensor,
               drafted: Optional[torch.Tensor], live: Optional[torch.Tensor] = None) -> None:
    """One pass into the counters, in place: hists [B, W * W] += 1 at n_raw * W + n_fin, drafted_total [B, 2] +=
    (drafted [B], drafted > 0) (None: no draft this pass); only in the `live` rows [B] bool where given. Tensor ops
    only (also inside the compiled settle, `settle.py`)."""
    if drafted is not None:
        if live is not None:
            drafted = drafted * live
        drafted_total += torch.stack((drafted, drafted.gt(0).to(drafted.dtype)), 1)
    idx = n_fin.add(n_raw, alpha=width).unsqueeze(1)  # [B, 1]
    add = ones(idx.shape, hists.dtype, idx.device) if live is None else live.to(hists.dtype).unsqueeze(1)
    hists.scatter_add_(1, idx, add)


def count_by_proposer(accepted_by: torch.Tensor, source: torch.Tensor, path_slots: torch.Tensor, n_raw: torch.Tensor,
                      n_fin: torch.Tensor) -> None:
    """accepted_by [B, P] += the accepted drafts each proposer had kept this pass, in place. source [B|1, T]
    (proposer of each tree slot, -1 = root; [B|1, 1]: of every draft of the row), path_slots [B, S]."""
    acc = torch.minimum(n_raw - 1, n_fin)  # [B] accepted drafts that were kept
    if source.shape[1] == 1:  # one proposer per row: all of its kept drafts (-1: a root-only tree, none kept)
        accepted_by.scatter_add_(1, source.expand(acc.shape[0], -1).clamp(min=0), acc[:, None])
        return
    step = torch.arange(path_slots.shape[1], device=acc.device)[None]
    kept = ((step >= 1) & (step <= acc[:, None])).long()  # path steps 1..acc are the kept drafts
    src = source.expand(acc.shape[0], -1).gather(1, path_slots).clamp(min=0)  # [B, S]
    accepted_by.scatter_add_(1, src, kept)


@dataclass
class PendingRead:
    """A pass's host read enqueued behind it instead of waited for (engine.cuda_graphs_run_ahead): the rows'
    lengths and finish reasons (and the policy's look, as `Rows.read_back` takes it) copied into host memory by
    the device's stream, so that the host can launch the next pass first and take these values when that one is
    queued."""

    values: torch.Tensor  # [2, B] lengths, finish reasons; with a look, [2 * B + E] float64 (pinned on CUDA)
    rows: int  # B
    copied: Optional[Any] = None  # torch.cuda.Event recorded after the copy; None: the copy is complete (CPU)

    @classmethod
    def of(cls, rows: "Rows", extra: Optional[torch.Tensor] = None) -> "PendingRead":
        """extra: [E] float, the policy's next look (`Planner.prepare`), read with the lengths."""
        both = pack_read([rows.t.hist_len, rows.reason], extra)
        if both.device.type != "cuda":
            return cls(both, len(rows))
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, len(rows), event)

    def get(self) -> tuple[list[int], list[int], Optional[list[float]]]:
        """(lengths, finish reasons, the look's values or None), once the device has copied them (waits for that
        pass only)."""
        if self.copied is not None:
            self.copied.synchronize()
        (lens, done), look = unpack_read(self.values.tolist(), self.rows, 2)
        return lens, done, look


def pack_read(parts: list[torch.Tensor], extra: Optional[torch.Tensor]) -> torch.Tensor:
    """A pass's host read as one tensor: the per-row values `parts` ([B] each) stacked [P, B], or with `extra` (the
    policy's look, [E] float) one float64 vector [P * B + E], in which lengths and ids are exact."""
    stacked = torch.stack(parts)
    if extra is None:
        return stacked
    return torch.cat([stacked.to(torch.float64).flatten(), extra.to(torch.float64)])


def unpack_read(got: list, b: int, p: int) -> tuple[list[list[int]], Optional[list[float]]]:
    """`pack_read`'s host copy (`.tolist()`) back into its P rows of B ints and the look's values (None: none)."""
    if got and isinstance(got[0], list):  # stacked: no look
        return got, None
    return [[int(x) for x in got[i * b: (i + 1) * b]] for i in range(p)], got[p * b:]


def _floats(bits: list[int]) -> list[float]:
    """float32 values read as their int32 bit patterns (`read_finished` packs them with the integers)."""
    return array.array("f", array.array("i", bits).tobytes()).tolist()


def write_history(hist: torch.Tensor, hist_len: torch.Tensor, committed: torch.Tensor) -> None:
    """committed [B, S] into hist [B, H] at each row's slots hist_len .. hist_len + S - 1, in place (the slots
    past a row's new length are stale anyway: every reader of `hist` stops at hist_len). committed [B, S, K] goes
    into the first K columns of hist [B, H, K' >= K] (the top log-probabilities)."""
    idx = hist_len.unsqueeze(1) + steps(committed.shape[1], committed.device)  # [B, S]
    if committed.ndim == 3:
        hist, idx = hist.narrow(2, 0, committed.shape[2]), idx.unsqueeze(2).expand_as(committed)
    hist.scatter_(1, idx, committed)


def widen_counts(hists: torch.Tensor, width: int) -> torch.Tensor:
    """[B, W * W] pass counts by (n_raw, n_fin) -> [B, width * width], the same counts at the same pairs."""
    b, w = hists.shape[0], math.isqrt(hists.shape[1])
    return torch.nn.functional.pad(hists.view(b, w, w), (0, width - w, 0, width - w)).reshape(b, -1)


def drop_order(n: int, gone: list[int]) -> list[int]:
    """The rows that stay when rows `gone` of 0 .. n-1 leave, ordered so that as few as possible change place:
    each hole below the new size takes one of the last staying rows. Example: n 6, gone [1, 4] -> [0, 5, 2, 3]."""
    out = set(gone)
    stay = [r for r in range(n) if r not in out]
    size = len(stay)
    movers = iter(r for r in stay if r >= size)
    return [r if r not in out else next(movers) for r in range(size)]


def new_counters(b: int, device: torch.device, num_proposers: int = 0) -> dict[str, torch.Tensor]:
    """Statistics counters of b new rows (`RowTensors.drafted`, `hists`, `accepted_by` when P > 0)."""
    z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    return dict(drafted=z(b, 2), hists=z(b, STAT_WIDTH * STAT_WIDTH, dtype=torch.int32),
                accepted_by=z(b, num_proposers) if num_proposers else None)


@dataclass
class Finished:
    """A finishing row's device values on the host (`Rows.read_finished`)."""

    token_ids: list[int]  # the generated tokens
    drafted: list[int]  # [2] draft tokens fed, passes that fed any
    hists: list[int]  # [W * W] passes by tokens committed before and after the stops (`finish_stats`)
    accepted_by: list[int]  # [P] accepted drafts per proposer ([] without proposers)
    logprobs: Optional[list[float]] = None  # the generated tokens' log-probabilities (the row asked for them)
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token, the row's top_logprobs alternatives
    prompt_logprobs: Optional[list[Optional[float]]] = None  # per prompt token (None for the first)


def finish_stats(st: RequestStats, drafted: list[int], hists: list[int], num_generated: int, passes: int,
                 sizes: dict[int, int]) -> None:
    """Fill `st` from one row's counters (host): drafted (draft tokens fed, passes that fed any), and hists [W * W]
    (passes that committed n_raw tokens
    before the stops and n_fin after them, at n_raw * W + n_fin; such a pass kept min(n_raw - 1, n_fin)
    accepted drafts). accepted_per_depth[d] = passes that kept more than d drafts."""
    width = math.isqrt(len(hists))
    acc_hist, committed = [0] * width, [0] * width
    for i, c in enumerate(hists):
        if c:
            n_raw, n_fin = divmod(i, width)
            acc_hist[max(min(n_raw - 1, n_fin), 0)] += c
            committed[n_fin] += c
    st.num_generated_tokens = num_generated
    st.num_decode_passes = passes
    st.num_decode_tokens = max(num_generated - 1, 0)  # the prefill commits the first token
    st.num_drafted_tokens, st.num_drafts = drafted
    st.num_accepted_drafts = sum(j * c for j, c in enumerate(acc_hist))
    st.accepted_per_depth = _trim(list(itertools.accumulate(reversed(acc_hist[1:])))[::-1])
    st.committed_histogram = _trim(committed)
    st.block_size_histogram = sizes


def _trim(xs: list[int]) -> list[int]:
    n = len(xs)
    while n and xs[n - 1] == 0:
        n -= 1
    return xs[:n]
