"""Helpers shared by the drafters (one place, so that no drafter imports another's internals).

- `NEG`: log-prob of "no candidate".
- `topk_excluding`: the best k of sorted candidates, skipping one token (ESP's pruning, STAND's branches).
- `find_continuation`: the longest, latest n-gram match of the context's suffix (PLD, STAND, hybrid).
- `pool_depth`: depth of each entry of a candidate pool from its parent indices.
- `ema_apply`: ESP's mask-embedding EMA over a row's next tokens (eager, and in the compiled settle).
- `Memo`: a value computed once per state of the rows (`RowsView.version`), e.g. a pool the policy's look and
  the pass's propose both read.
- `CandidatePool`: scored candidates a tree is chosen from (ESP's Algorithm 1, the CP heads), with the two
  reads every such drafter makes of it: the best tree and the mass of its nodes.
The tree-selection helper (`best_nodes`) lives in esp_worker.tree next to the tree types.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Optional, TypeVar

import torch

from ..tree import DraftTree, best_nodes

NEG = float("-inf")
T = TypeVar("T")


class Memo(Generic[T]):
    """The value last computed and the key it was computed for (a state of the rows, `RowsView.version`, with
    whatever else it depends on): the same key gives the same value, another key computes it anew. One value at a
    time; `clear` when what it was computed from changes under the same key (a drafter's observe)."""

    def __init__(self) -> None:
        self._key: Optional[Hashable] = None
        self._value: Optional[T] = None

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        if self._key is None or self._key != key:
            self._value, self._key = make(), key
        return self._value

    def clear(self) -> None:
        self._key, self._value = None, None


@dataclass
class CandidatePool:
    """Candidates scored by joint log-probability, in topological order (a parent before its children, and no
    child above its parent): the tree of the n best is `best_tree(root, n)`."""

    score: torch.Tensor  # [B, P] joint log-prob of the path root -> entry (NEG = no candidate)
    tokens: torch.Tensor  # [B, P]
    parents: torch.Tensor  # [B, P] parent pool index, -1 = the root
    depth: Optional[torch.Tensor] = None  # [B, P] 1 = a child of the root (when the builder knows it)

    @property
    def valid(self) -> torch.Tensor:  # [B, P]
        return self.score > NEG

    def best_tree(self, root: torch.Tensor, num_nodes: int) -> DraftTree:
        """The `num_nodes` most probable entries under the roots [B] as a tree (`tree.best_nodes`)."""
        return best_nodes(root, self.score, self.valid, self.tokens, self.parents, num_nodes)[0]

    def top_mass(self, num_nodes: int, usable: torch.Tensor) -> torch.Tensor:
        """[B, num_nodes] probability of each node of the best tree of num_nodes, best first, 0 for rows not
        usable [B] and past the pool's end: its prefix sums estimate the drafts such a tree gets accepted."""
        n = min(num_nodes, self.score.shape[1])
        top = self.score.topk(n, dim=1).values.exp() * usable[:, None]
        return torch.nn.functional.pad(top, (0, num_nodes - n))


def ema_apply(m: torch.Tensor, emb: torch.Tensor, cols: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    """m [B, 1, D] after the first gap[b] <= G of the embeddings emb [B, G, D] (the rest ignored): one batched
    product of each row's weights cols[gap] = [decay, w_0 .. w_{G-1}] ([N+1, 1, 1+G] table) with [m, emb]."""
    if emb.dtype != m.dtype:
        emb = emb.to(m.dtype)
    return torch.bmm(cols.index_select(0, gap), torch.cat([m, emb], 1))  # [B, 1, D]


def topk_excluding(lp: torch.Tensor, ids: torch.Tensor, exclude: Optional[torch.Tensor], k: int):
    """From sorted candidates lp/ids [B, C] take the best k, skipping token `exclude` [B] (or None).

    Example: ids [7, 3, 9], exclude 7, k 2 -> [3, 9] (the next best replaces the excluded token).
    """
    if exclude is not None:
        c = lp.shape[1]
        key = torch.arange(c, device=lp.device)[None] + c * (ids == exclude[:, None])
        order = key.argsort(dim=1)[:, :k]
        return lp.gather(1, order), ids.gather(1, order)
    if k >= lp.shape[1]:
        return lp, ids
    return lp.narrow(1, 0, k), ids.narrow(1, 0, k)


def find_continuation(hist: torch.Tensor, length: torch.Tensor, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """[B] index of the first token after the best earlier match of the context's suffix, or -1.

    For n from max_ngram down to min_ngram the last n tokens (root included) are matched against every
    earlier window of prompt + output; the longest n wins, and among matches of one n the latest start.
    Example (n=2): history [5 6 7 8 5 6] -> suffix [5 6] matched at 0 -> 2 (the continuation starts with 7).

    One comparison for every length: window e holds the m = max_ngram tokens ending at position e, compared
    with the suffix's last m; the run of equal tokens from the end of the window (m minus the place of its
    last difference) is the longest n that matches ending at e, and the best window maximises (run, e) among
    those with run >= min_ngram and a continuation before the suffix (the history is left-padded with m - 1
    tokens that match nothing). ~22 tensor ops whatever the lengths.
    """
    b, c = hist.shape
    m = max_ngram
    back, place, ends = _match_ranges(m, c, hist.device)
    lengths = length[:, None]  # [B, 1]
    suffix = hist.gather(1, (lengths + back).clamp(min=0))  # [B, m] oldest first
    windows = torch.nn.functional.pad(hist, (m - 1, 0), value=-1).unfold(1, m, 1)  # [B, C, m] ending at e
    run = m - ((windows != suffix[:, None, :]) * place).amax(-1)  # [B, C] equal tokens back from e
    ok = (run >= min_ngram) & (ends < lengths)  # a match whose continuation e + 1 comes before the suffix
    best = torch.where(ok, run * (c + 1) + ends, 0).amax(1)  # [B] longest run, then latest e (0: none)
    return torch.where(best > 0, best % (c + 1), -1)


@functools.lru_cache(maxsize=64)
def _match_ranges(m: int, c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(back [m] = -m .. -1: a suffix's positions from its end; place [m] = 1 .. m: a window position's rank;
    ends [C] = 1 .. C: the continuation index after each window), built once per history width."""
    return (torch.arange(-m, 0, device=device), torch.arange(1, m + 1, device=device),
            torch.arange(1, c + 1, device=device))


def pool_depth(par: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, P] parent pool indices (-1 = root, topological order) -> [B, P] depth (1 = child of the root).

    Example: par [-1, -1, 0, 2] -> [1, 1, 2, 3].
    """
    depth = torch.ones_like(par)
    for _ in range(max(max_depth - 1, 0)):
        depth = torch.where(par < 0, 1, depth.gather(1, par.clamp(min=0)) + 1)
    return depth
