"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057): Jacobi lookahead window + n-gram pool, one pass.

Each pass feeds, per row, Q = (N - 1)(W + G) tokens (the paper's block complexity):
- the verification branch: the root and up to G (N-1)-token n-grams from the pool that start with the
  root token, merged into a trie (the draft tree, slots [0, T), T = 1 + G (N - 1) with invalid padding
  where n-grams share prefixes or the pool has fewer than G);
- the lookahead branch: a window of N - 1 levels x W columns, level 0 column 0 being the root itself, so
  A = (N - 1) W - 1 aux inputs after the tree. Window token (l, i) sits at position root + l + i and sees
  the root, level-0 tokens (0, 0..i) and its own column below it, (1..l, i) (the lmsys blog's mask).

After the pass the model's argmax at each last-level token (N - 2, i) is a new guess; the window shifts
one level down (level 0 dropped) and the guesses become the new last level. Column i then holds a chain
in which each token was predicted from the one below it, so [level 0 .. level N-2, guess] is an n-gram
for the pool (kept only once the window holds no initial tokens above level 0).

Example (N=3, W=2): window [[r, a], [b, c]] (r = root); guesses g0 at (1, 0), g1 at (1, 1);
n-grams [r, b, g0], [a, c, g1]; next window [[b, c], [g0, g1]] (its (0, 0) is replaced by the next root).

State per row: `window` [B, N-1, W] tokens, `passes` [B], the pool `pool` [B, P, N] (key token first) and
`seen` [B, P] (pass * W + column of the latest sighting, -1 = empty). Lookup takes the G most recently seen
n-grams with the root as key, as LADE's per-key LRU of size G does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import EngineConfig
from ..model.runner import ModelRunner
from ..tree import BlockLayout, DraftTree, ancestor_matrix
from ..auto.sizer import DraftSizer
from ..passes import Block, PassPlan, PassRecord, RowsView
from .base import FULL, Drafter
from ..row_state import RowState, row_field


@dataclass
class LadeState(RowState):
    window: Optional[torch.Tensor] = row_field()  # [B, N-1, W] the lookahead window
    passes: Optional[torch.Tensor] = row_field()  # [B] passes seen (n-gram recency clock)
    pool: Optional[torch.Tensor] = row_field()  # [B, P, N] remembered n-grams
    seen: Optional[torch.Tensor] = row_field(-1)  # [B, P] when each was last seen (-1 = empty slot)


def window_layout(levels: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In-window visibility [K, K] and relative positions [K] for K = levels * width tokens, k = l * W + i.

    (l, i) sees (0, j) for j <= i and (m, i) for 1 <= m <= l; it sits at l + i. Example (levels 2, width 2):
    order [(0,0), (0,1), (1,0), (1,1)], rel_pos [0, 1, 1, 2]; (1, 1) sees (0,0), (0,1), (1,1).
    """
    k = torch.arange(levels * width)
    lv, col = k // width, k % width
    base = (lv[None] == 0) & (col[None] <= col[:, None])
    column = (lv[None] >= 1) & (lv[None] <= lv[:, None]) & (col[None] == col[:, None])
    return base | column, lv + col


def ngram_trie(root: torch.Tensor, cands: torch.Tensor, ok: torch.Tensor) -> DraftTree:
    """Merge G candidate continuations of the root into a trie with distinct siblings.

    root [B]; cands [B, G, L] tokens; ok [B, G]. Nodes are prefixes cands[g, :d+1]; the first g carrying a
    prefix owns it. Slots are numbered depth by depth (so parents come first), then packed to the front.
    T = 1 + G * L whatever merged (the paper's block complexity counts every n-gram's tokens): a shape known
    on the host, so the pass reads nothing from the device; the slots a row does not use are invalid
    padding (token 0 under the root, never accepted).
    Example: cands [[7, 8], [7, 9], [5, 6]] -> tokens [r, 7, 5, 8, 9, 6, 0], parents [-1, 0, 0, 1, 1, 2, 0],
    the last slot invalid.
    """
    b, g, length = cands.shape
    dev = cands.device
    same = (cands[:, :, None, :] == cands[:, None, :, :]).long().cumprod(-1).bool()  # [B, G, G, L]
    same &= ok[:, :, None, None] & ok[:, None, :, None]
    owner = same.long().argmax(2)  # [B, G, L] first g' sharing prefix (g, :d+1)
    own = ok[..., None] & (owner == torch.arange(g, device=dev)[None, :, None])  # [B, G, L]
    # depth-major flat order f = d * G + g
    own_f = own.transpose(1, 2).reshape(b, length * g)
    slot_f = own_f.long().cumsum(1)  # slot of each owned node (1-based)
    owner_f = (owner.transpose(1, 2) + g * torch.arange(length, device=dev)[None, :, None]).reshape(b, -1)
    rep_slot = slot_f.gather(1, owner_f)  # [B, L*G] slot of the node carrying this prefix
    parent_f = torch.cat([torch.zeros((b, g), dtype=torch.long, device=dev), rep_slot[:, : (length - 1) * g]], 1)
    m = length * g  # the most nodes a row can own (host-known: no device read)
    tgt = torch.where(own_f, slot_f, m + 1)  # non-owned entries go to a dropped column
    tokens = torch.zeros((b, m + 2), dtype=torch.long, device=dev)
    parents = torch.zeros((b, m + 2), dtype=torch.long, device=dev)
    valid = torch.zeros((b, m + 2), dtype=torch.bool, device=dev)
    tokens.scatter_(1, tgt, cands.transpose(1, 2).reshape(b, -1))
    parents.scatter_(1, tgt, parent_f)
    valid.scatter_(1, tgt, own_f)
    tokens[:, 0], parents[:, 0], valid[:, 0] = root, -1, True
    return DraftTree(tokens[:, : m + 1], parents[:, : m + 1], valid[:, : m + 1], static_key=None)


class LookaheadDrafter(Drafter, DraftSizer):
    state_type = LadeState
    name = "lade"
    reads_slot_logits = False

    def __init__(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],  # ids [...] -> embeddings [..., D]
        logits: Callable[[torch.Tensor], torch.Tensor],  # hidden [..., D] -> logits [..., V]
        ngram: int,
        window: int,
        guess: int,
        pool_size: int,
    ):
        super().__init__()
        if ngram < 3 or window < 1 or guess < 1:
            raise ValueError(f"lade needs n-gram size >= 3, window >= 1, guess >= 1; got N={ngram} W={window} G={guess}")
        if pool_size < max(window, guess):  # a pass takes the G latest n-grams of the pool
            raise ValueError(f"engine.lade_pool_size={pool_size} must be >= the window ({window}) and guess ({guess})")
        self.embed, self.logits = embed, logits
        self.n, self.w, self.g, self.pool_size = ngram, window, guess, pool_size
        self.levels = ngram - 1
        vis, pos = window_layout(self.levels, window)
        # [K, K], [K] (K = levels * W, index 0 = root); moved to the rows' device at the prefill (`start_rows`)
        self._win_vis, self._win_pos = vis, pos

    @classmethod
    def from_config(cls, cfg: EngineConfig, runner: ModelRunner) -> "LookaheadDrafter":
        n, w, g = cfg.lade_shape()
        return cls(runner.embed_ids, runner.logits, ngram=n, window=w, guess=g, pool_size=cfg.lade_pool_size)

    # ---- state -------------------------------------------------------------------------------------
    def start_rows(self, view: RowsView) -> None:
        """Window filled with prompt tokens drawn with each row's seed; empty pool."""
        hist, plen = view.hist, view.prompt_len  # [B, C], [B]
        b = hist.shape[0]
        dev = hist.device
        k = self.levels * self.w
        # here, not inside a pass: a host-to-GPU copy synchronises
        self._win_vis, self._win_pos = self._win_vis.to(dev), self._win_pos.to(dev)
        draws = torch.stack([torch.randint(1 << 30, (k,), generator=_gen(s)) for s in view.seeds]).to(dev)
        window = hist.gather(1, draws % plen[:, None]).reshape(b, self.levels, self.w)
        st = view.state
        st.window = window
        st.passes = torch.zeros(b, dtype=torch.long, device=dev)
        st.pool = torch.zeros((b, self.pool_size, self.n), dtype=torch.long, device=dev)
        st.seen = torch.full((b, self.pool_size), -1, dtype=torch.long, device=dev)
        return None

    # ---- one pass ----------------------------------------------------------------------------------
    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        st = view.state
        root = view.root  # [B]
        b = root.shape[0]
        dev = root.device
        hit = (st.pool[..., 0] == root[:, None]) & (st.seen >= 0)  # [B, P]
        recency, idx = torch.where(hit, st.seen, -1).topk(self.g, dim=1)  # [B, G]
        cands = st.pool.gather(1, idx[..., None].expand(-1, -1, self.n))[..., 1:]  # [B, G, N-1]
        tree = ngram_trie(root, cands, recency >= 0)
        t = tree.num_slots
        aux_ids = st.window.reshape(b, -1)[:, 1:]  # [B, A] (window (0, 0) is the root)
        a = aux_ids.shape[1]
        q = t + a
        anc = ancestor_matrix(tree.parents)  # [B, T, T]
        visible = torch.zeros((b, q, q), dtype=torch.bool, device=dev)
        visible[:, :t, :t] = anc
        visible[:, t:, t:] = self._win_vis[1:, 1:]
        visible[:, t:, 0] = True  # every window token sees the root
        depth = anc.sum(-1) - 1  # [B, T]
        rel_pos = torch.cat([depth, self._win_pos[1:].expand(b, -1)], 1)
        lay = BlockLayout(visible=visible, rel_pos=rel_pos, depth=depth, num_slots=t, num_masks=0)
        # the trie is at most N - 1 deep: a host bound for verification (the deepest slot would be a device read)
        return Block(tree=tree, layout=lay, aux_embeds=self.embed(aux_ids), max_depth=self.levels)

    def observe(self, view: RowsView, result: PassRecord) -> None:
        if result.prefill:
            return
        st = view.state
        t = result.block.tree.num_slots
        last = t - 1 + (self.levels - 1) * self.w  # block index of window token (N-2, 0)
        guesses = self.logits(result.hidden[:, last : last + self.w]).argmax(-1)  # [B, W]
        fed = st.window.clone()
        fed[:, 0, 0] = result.block.tree.tokens[:, 0]  # the root stood at (0, 0)
        ngrams = torch.cat([fed, guesses[:, None]], 1).transpose(1, 2)  # [B, W, N]
        ready = st.passes >= self.n - 2  # levels 1..N-2 all hold guesses, so every column is a chain
        self.insert(st, ngrams, ready[:, None].expand(-1, self.w))
        st.window = torch.cat([st.window[:, 1:], guesses[:, None]], 1)
        st.passes = st.passes + 1

    @staticmethod
    def insert(st: "LadeState", ngrams: torch.Tensor, ok: torch.Tensor) -> None:
        """Add n-grams [B, W, N] where ok [B, W] to the pool: a known n-gram is marked as seen now, a new
        one replaces the least recently seen entry (empty entries first). Duplicates within `ngrams` count
        once (the first column). Sightings are stamped passes * W + column, so later columns are newer.
        """
        pool, seen = st.pool, st.seen  # [B, P, N], [B, P]
        b, w, _ = ngrams.shape
        p = pool.shape[1]
        dev = ngrams.device
        now = st.passes[:, None] * w + torch.arange(w, device=dev)[None]  # [B, W]
        twin = (ngrams[:, :, None] == ngrams[:, None]).all(-1)  # [B, W, W]
        earlier = torch.tril(torch.ones((w, w), dtype=torch.bool, device=dev), -1)
        ok = ok & ~(twin & earlier & ok[:, None, :]).any(-1)
        known = (ngrams[:, :, None] == pool[:, None]).all(-1) & (seen >= 0)[:, None] & ok[..., None]  # [B, W, P]
        seen = torch.maximum(seen, torch.where(known, now[..., None], -1).max(1).values)
        fresh = ok & ~known.any(-1)  # [B, W]
        oldest = seen.argsort(dim=1)[:, :w]  # [B, W] slots to overwrite, least recently seen first
        rank = (fresh.long().cumsum(1) - 1).clamp(min=0)
        slot = torch.where(fresh, oldest.gather(1, rank), p)  # p = a dropped column
        pool = torch.cat([pool, pool.new_zeros((b, 1, pool.shape[2]))], 1)
        seen = torch.cat([seen, seen.new_zeros((b, 1))], 1)
        pool.scatter_(1, slot[..., None].expand_as(ngrams), ngrams)
        seen.scatter_(1, slot, now)
        st.pool, st.seen = pool[:, :p], seen[:, :p]


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    return g
