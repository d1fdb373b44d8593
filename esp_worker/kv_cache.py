"""The only code that touches the KV cache: a preallocated slab that presents itself as a transformers Cache.

Layout: every layer holds key and value buffers [R, H, C, D] (R rows of capacity, C slots of capacity). They
are views of one slab [L, 2, R, H, C, D] shared by all layers of the first layer's shape (every layer, for the
supported architectures), so that bookkeeping after a pass (`keep`, `select_rows`, growth) is one tensor
operation for the whole model, not two per layer; a layer of another shape gets buffers of its own.
Rows 0 .. num_rows-1 are the batch in flight. Row b's valid slots are 0 .. cache_len[b]-1, packed to the
front in position order (slot s holds position s); later slots are stale and masked out by the caller.

A forward pass is planned first (`plan`): which rows it covers, where each row writes its Q new keys and
how many slots the model sees. Each layer's `update` then writes the block in place (no concatenation, no
copy of the cached prefix) and hands the model a view [B, H, S, D] of the buffers. A decode pass writes
row b's block at slots cache_len[b] .. cache_len[b]+Q-1, so the root lands where it belongs and plain
decoding never moves a slot; `keep` packs the accepted nodes of a tree behind the root.

Capacity grows in buckets (about 1/8 of the length, so at most ~12% above what is needed) and shrinks
when the live rows need much less; rows that leave are compacted in place (`select_rows`). The owner may
set `before_growth`, which hears the capacity a growth is about to allocate and may refuse it by raising
(the engine compares it with the device's free memory: esp_worker/memory.py).

A pinned slab (`pin`: CUDA graphs read it at fixed addresses) holds a fixed number of rows, so it grows for all of
them at once. Where that growth is refused (MemoryShortError) but buffers for the live rows alone fit, the rows
spill into buffers of their own (`spilled`) and the pinned slab is kept; they move back into it at the first
`reserve` they fit, e.g. once a long row has finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .consts import steps
from .grad import inference
from .memory import MemoryShortError


def move_slots(t: torch.Tensor, rd: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    """`KVCache.keep` in one cache tensor t (rows at dim rd, slots at rd + 2): row b < B's slots src[b] go to
    slots dst[b] (both [B, P]), in place, every source read before any write (the right side is read whole
    first); rows from B on are untouched. One index and one index_put (also inside a replayed pass,
    `graphs/step.py`, where the index_put writes the slab in place)."""
    rows = steps(src.shape[0], src.device).unsqueeze(1)  # [B, 1]
    lead = (slice(None),) * rd
    t[lead + (rows, slice(None), dst)] = t[lead + (rows, slice(None), src)]


def bucket(n: int, minimum: int = 16) -> int:
    """n rounded up to a multiple of max(minimum, 2^(floor(log2 n) - 3)): 100 -> 112, 1000 -> 1024, 1100 -> 1152."""
    step = max(minimum, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


@dataclass
class _Plan:
    """What the next forward writes and reads (set by KVCache.plan, read by every layer's update)."""

    row0: int = 0
    num_rows: int = 0
    view_len: int = 0  # slots the model sees: S_old + Q
    # int: every row writes its block at slots [write_at, write_at + Q); tensor [B]: row b at write_at[b]
    write_at: Union[int, torch.Tensor] = 0
    index: Optional[torch.Tensor] = None  # [B, H, Q, D] scatter index for a per-row write, built once per pass
    # [R] the rows this forward covers when they are not one range (DMTD's thinking layers run for the rows at a
    # cycle start only): they write through an index and the model sees a gathered copy of their slots
    rows: Optional[torch.Tensor] = None


class _SlabLayer(CacheLayerMixin):
    """One layer: `keys` / `values` are the whole buffers [R, H, C, D] (views of the shared slab, or its own
    buffers when its shape differs); `update` writes per the shared plan."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "KVCache", index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.in_slab = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.attach(self, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, Q, D] -> keys [B, H, S, D] (views of the buffers)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.owner.plan_
        if p.rows is not None:
            return self._update_rows(p, key_states, value_states)
        rows = slice(p.row0, p.row0 + p.num_rows)
        k, v = self.keys[rows], self.values[rows]
        q = key_states.shape[2]
        if isinstance(p.write_at, int):
            k[:, :, p.write_at: p.write_at + q] = key_states
            v[:, :, p.write_at: p.write_at + q] = value_states
        else:
            if p.index is None or p.index.shape != key_states.shape:
                slots = p.write_at[:, None] + torch.arange(q, device=key_states.device)  # [B, Q]
                p.index = slots[:, None, :, None].expand(key_states.shape)
            k.scatter_(2, p.index, key_states)
            v.scatter_(2, p.index, value_states)
        return k[:, :, : p.view_len], v[:, :, : p.view_len]

    def _update_rows(self, p: _Plan, key_states: torch.Tensor, value_states: torch.Tensor):
        """The write and view of a plan over rows `p.rows` [R]: row r's Q keys at slots write_at[r] .. (an index
        put), and a copy [R, H, S, D] of their first view_len slots."""
        q = key_states.shape[2]
        start = p.write_at if isinstance(p.write_at, int) else p.write_at[:, None]
        slots = start + steps(q, key_states.device)[None]  # [R|1, Q]
        rows = p.rows[:, None]  # [R, 1]
        self.keys[rows, :, slots] = key_states.transpose(1, 2)  # [R, Q, H, D] at (row, slot) pairs
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        return self.keys[p.rows, :, : p.view_len], self.values[p.rows, :, : p.view_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.plan_.view_len, 0

    def get_seq_length(self) -> int:
        return self.owner.plan_.view_len

    def get_max_length(self) -> int:
        return self.owner.capacity[1]


class KVCache(Cache):
    """Preallocated per-layer key/value buffers for the rows in flight (see the module docstring)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[_SlabLayer(self, i) for i in range(num_layers)])
        self.num_rows = 0  # rows of the batch in flight (0 .. num_rows-1)
        self.capacity = (0, 0)  # (rows R, slots C) of every buffer
        self.plan_ = _Plan()
        self.slab: Optional[torch.Tensor] = None  # [L, 2, R, H, C, D] keys and values of every slab layer
        self._listed: Optional[list] = None  # `_tensors()`, until a buffer is made or replaced
        # (rows, slots) the buffers never shrink below (`pin`: captured passes read the slab at fixed addresses)
        self.pinned: Optional[tuple[int, int]] = None
        # the pinned slab while the rows live in buffers of their own (`reserve`: its growth was refused)
        self.home: Optional[torch.Tensor] = None
        # hears (rows, slots) before buffers of that capacity are allocated; raises to refuse them
        self.before_growth: Optional[Callable[[int, int], None]] = None

    # ---- buffers -----------------------------------------------------------------------------------
    def attach(self, layer: _SlabLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Give `layer` its buffers at its first update: views of the slab (made at the first layer's) when
        its keys and values have the slab's shape and dtype, buffers of its own otherwise."""
        r, c = self.capacity
        _, h, _, d = key_states.shape
        uniform = value_states.shape[-1] == d and value_states.dtype == key_states.dtype
        if self.slab is None and uniform:
            self.slab = key_states.new_zeros((len(self.layers), 2, r, h, c, d))
        s = self.slab
        if uniform and s is not None and (s.shape[3], s.shape[5], s.dtype, s.device) == (h, d, key_states.dtype, key_states.device):
            layer.in_slab = True
            layer.keys, layer.values = s[layer.index, 0], s[layer.index, 1]
        else:
            layer.keys = key_states.new_zeros((r, h, c, d))
            layer.values = value_states.new_zeros((r, h, c, value_states.shape[-1]))
        self._listed = None

    @inference
    def pin(self, rows: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the slab now at (rows, slots) for every layer (keys and values of `heads` x `head_dim`) and keep
        it: `reserve` grows it only past that capacity and never shrinks it, so CUDA graphs captured over it stay
        valid (engine.cuda_graphs; a growth makes a new slab, which the graphs' owner notices, and a growth that
        does not fit spills the rows, see the module docstring)."""
        self.pinned = (rows, slots)
        self.capacity = (rows, slots)
        self._new_slab(heads, head_dim, dtype, device)

    def _new_slab(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The slab at the cache's capacity, zeroed, every layer's buffers views of it."""
        rows, slots = self.capacity
        self.slab = torch.zeros((len(self.layers), 2, rows, heads, slots, head_dim), dtype=dtype, device=device)
        for layer in self.layers:
            layer.in_slab, layer.is_initialized = True, True
            layer.keys, layer.values = self.slab[layer.index, 0], self.slab[layer.index, 1]
        self._listed = None

    def _tensors(self) -> list[tuple[torch.Tensor, int, Optional[_SlabLayer], str]]:
        """(tensor, its row dim, owning layer or None for the slab, attribute): the slab, then own buffers
        (listed once per set of buffers: the compiled settle and the peak-memory count ask every pass)."""
        if self._listed is None:
            out = [(self.slab, 2, None, "")] if self.slab is not None else []
            for layer in self.layers:
                if layer.is_initialized and not layer.in_slab:
                    out += [(layer.keys, 0, layer, "keys"), (layer.values, 0, layer, "values")]
            self._listed = out
        return self._listed

    def _set(self, layer: Optional[_SlabLayer], name: str, t: torch.Tensor) -> None:
        self._listed = None
        if layer is not None:
            setattr(layer, name, t)
            return
        self.slab = t
        for l in self.layers:
            if l.in_slab:
                l.keys, l.values = t[l.index, 0], t[l.index, 1]

    @property
    def spilled(self) -> bool:
        """Whether the rows live outside the pinned slab (graphs over it cannot serve their passes)."""
        return self.home is not None

    @property
    def pinned_slab(self) -> Optional[torch.Tensor]:
        """The slab captured passes read (None: not pinned), where the rows are or not."""
        if self.pinned is None:
            return None
        return self.home if self.home is not None else self.slab

    @inference
    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for `num_rows` rows of `length` slots; keeps rows 0 .. self.num_rows-1 and their slots."""
        home = self.home
        if home is not None and num_rows <= home.shape[2] and length <= home.shape[4]:
            self._return_home()
            return
        r, c = self.capacity
        need_c = bucket(length)
        grow = num_rows > r or length > c
        pinned = self.pinned is not None and home is None  # the buffers are the pinned slab
        # shrink when the live rows use less than ~2/3 of the buffers (hysteresis: no churn at steady state)
        shrink = r * c > 1.5 * num_rows * need_c and not pinned
        if not (grow or shrink):
            return
        new_r, new_c = num_rows, max(need_c, length)
        if pinned:  # a pinned slab only grows, and then for all its rows and at least to the pinned size
            whole = max(new_r, r, self.pinned[0]), max(new_c, c, self.pinned[1])
            try:
                self._may_grow(*whole)
                new_r, new_c = whole
            except MemoryShortError:  # the live rows alone, in buffers of their own, if they fit (else it raises)
                self._may_grow(new_r, new_c)
                self.home = self.slab
        elif grow:
            self._may_grow(new_r, new_c)
        keep_r, keep_c = min(self.num_rows, new_r), min(c, new_c)
        made = []
        for old, rd, layer, name in self._tensors():  # rows at dim rd, slots at rd + 2
            size = list(old.shape)
            size[rd], size[rd + 2] = new_r, new_c
            new = old.new_empty(size)
            new.narrow(rd, 0, keep_r).narrow(rd + 2, 0, keep_c).copy_(old.narrow(rd, 0, keep_r).narrow(rd + 2, 0, keep_c))
            # stale slots are masked, not skipped (0 * NaN is NaN): zero what was not copied, once
            new.narrow(rd, 0, keep_r).narrow(rd + 2, keep_c, new_c - keep_c).zero_()
            new.narrow(rd, keep_r, new_r - keep_r).zero_()
            made.append((layer, name, new))
        # the capacity and the buffers change together, once every buffer is made: an allocation that fails leaves
        # the cache as it was (a pinned one outlives the batch it failed in)
        self.capacity = (new_r, new_c)
        for layer, name, new in made:
            self._set(layer, name, new)

    def _may_grow(self, rows: int, slots: int) -> None:
        if self.before_growth is not None:
            self.before_growth(rows, slots)

    def _return_home(self) -> None:
        """The spilled rows back into the pinned slab (they fit it again), their own buffers dropped. The slab's
        slots past what is copied hold what earlier rows left there: finite values, masked as any stale slot."""
        home, cur, n = self.home, self.slab, self.num_rows
        keep_c = min(cur.shape[4], home.shape[4])
        home.narrow(2, 0, n).narrow(4, 0, keep_c).copy_(cur.narrow(2, 0, n).narrow(4, 0, keep_c))
        self.home = None
        self.capacity = (home.shape[2], home.shape[4])
        self._set(None, "", home)

    def nbytes(self) -> int:
        """Bytes the cache holds: its buffers, and the pinned slab while the rows are spilled."""
        held = [t for t, *_ in self._tensors()] + ([self.home] if self.home is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    # ---- prompt prefixes (prefix_cache.py) ----------------------------------------------------------
    def read_prefix(self, row: int, length: int) -> Optional[torch.Tensor]:
        """A copy of row `row`'s slots 0 .. length-1 of the slab, [L, 2, 1, H, P, D]; None when some layer lives
        outside the slab (no prefix is kept for such a model)."""
        if self.move_target() is None:
            return None
        return self.slab.narrow(2, row, 1).narrow(4, 0, length).clone()

    @inference
    def write_prefix(self, rows: Sequence[int], kv: torch.Tensor) -> None:
        """Slots 0 .. P-1 of rows `rows` (ascending) set to `kv` (`read_prefix`'s, of P slots); a run of consecutive
        rows is one copy. Before the cache's first forward the slab is made here, of the prefix's layout."""
        if self.slab is None:
            self._new_slab(kv.shape[3], kv.shape[5], kv.dtype, kv.device)
        runs: list[list[int]] = []
        for row in rows:
            if runs and row == runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([row, row + 1])
        for a, b in runs:
            self.slab.narrow(2, a, b - a).narrow(4, 0, kv.shape[4]).copy_(kv)  # broadcast over the run's rows

    # ---- one forward -------------------------------------------------------------------------------
    def plan(self, row0: int, num_rows: int, view_len: int, write_at: Union[int, torch.Tensor],
             rows: Optional[torch.Tensor] = None) -> None:
        """The next forward covers rows row0 .. row0+num_rows-1 (or the rows `rows` [R] in that order), writes
        each row's Q new slots at `write_at` (an int for all rows, or [B] per row) and shows the model slots
        0 .. view_len-1."""
        assert row0 + num_rows <= self.capacity[0] and view_len <= self.capacity[1], "reserve() first"
        self.plan_ = _Plan(row0, num_rows, view_len, write_at, rows=rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan_.view_len

    # ---- bookkeeping after a pass ------------------------------------------------------------------
    @inference
    def keep(self, dst: Union[int, torch.Tensor], src: torch.Tensor) -> None:
        """Copy slots `src` to slots `dst` in every row of the batch (src: [B, P] slot indices; dst: [B, P], or an
        int d for slots d .. d+P-1 of every row).

        Only the P moved slots per row are touched (P = accepted path + 1), so the cost of a pass does not
        grow with the cache. Example: cache_len [3, 5], a pass of Q=4 wrote row 0 at slots 3..6 and row 1 at
        5..8. Row 0 keeps the root and the node at block index 2: dst [3, 4], src [3, 5]. Row 1 keeps the
        root only: dst [5, 6], src [5, 6] (slot 6 is beyond its new length, whatever lands there is stale).
        Every source is read before any slot is written.
        """
        b, p = src.shape
        for t, rd, _, _ in self._tensors():
            if b > 1 and not isinstance(dst, int):
                move_slots(t, rd, dst, src)
                continue
            if t.shape[rd] != b:
                t = t.narrow(rd, 0, b)  # slab [L, 2, B, H, C, D] / own buffer [B, H, C, D]
            shape = (1,) * rd + (b, 1, p, 1)  # the indices broadcast over layers, heads and head dims
            size = list(t.shape)
            size[rd + 2] = p
            if b == 1:  # one row: its slots as one index
                moved = t.index_select(rd + 2, src.view(p))
            else:
                moved = torch.gather(t, rd + 2, src.view(shape).expand(size))
            if isinstance(dst, int):
                t.narrow(rd + 2, dst, p).copy_(moved)
            else:
                t.scatter_(rd + 2, dst.view(shape).expand(size), moved)

    def move_target(self) -> Optional[torch.Tensor]:
        """The one tensor a `keep` touches, the slab [L, 2, R, H, C, D], when every layer lives in it (prompt
        prefixes are read from it); None otherwise."""
        return self.slab if self.slab is not None and len(self._tensors()) == 1 else None

    @inference
    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only batch rows `keep` (host list), in that order: row keep[i] becomes row i.

        Only rows whose index changes are copied, so a batch that fills the holes of leaving rows with its last
        rows (`batch.drop_order`) moves one row per leaving row, not the whole cache. Example: keep [0, 3, 2]
        copies row 3 to row 1; rows 0 and 2 stay where they are."""
        moved = [(i, r) for i, r in enumerate(keep) if i != r]
        if moved:
            dev = self.slab.device if self.slab is not None else None
            dst = torch.tensor([i for i, _ in moved], dtype=torch.long, device=dev)
            src = torch.tensor([r for _, r in moved], dtype=torch.long, device=dev)
            for t, rd, _, _ in self._tensors():
                t.index_copy_(rd, dst.to(t.device), t.index_select(rd, src.to(t.device)))  # sources read first
        self.num_rows = len(keep)

    def add_rows(self, n: int) -> None:
        """Rows num_rows .. num_rows+n-1 (already written by a prefill plan) join the batch."""
        self.num_rows += n


def new_cache(num_layers: int) -> KVCache:
    return KVCache(num_layers)
