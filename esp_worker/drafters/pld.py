"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's suffix."""
from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import Block, Drafter, RowsView


class PromptLookupDrafter(Drafter):
    """Chain drafter. For n from max_ngram down to min_ngram, find the most recent earlier occurrence of the
    last n tokens (root included) in prompt + output, and propose the (up to) `depth` tokens that followed it.

    Example (n=2, depth=3): history [5 6 7 8 5 6] -> suffix [5 6] matched at 0 -> chain [7 8 5].
    Tie-break: the longest n wins; among matches of one n, the latest start wins.
    """

    name = "pld"

    def __init__(self, max_ngram: int, min_ngram: int, depth: int):
        super().__init__()
        self.max_ngram, self.min_ngram, self.depth = max_ngram, min_ngram, depth
        self._parents: dict[tuple, torch.Tensor] = {}

    def propose(self, view: RowsView) -> Block:
        hist, length = view.hist, view.hist_len  # [B, C], [B]
        b, c = hist.shape
        dev = hist.device
        start = self.find_continuation(hist, length)  # [B], -1 = no match
        steps = torch.arange(self.depth, device=dev)
        idx = start[:, None] + steps  # [B, depth]
        valid = (start[:, None] >= 0) & (idx < length[:, None])
        chain = hist.gather(1, idx.clamp(0, c - 1))
        tokens = torch.cat([view.root[:, None], chain], 1)
        valid = torch.cat([torch.ones((b, 1), dtype=torch.bool, device=dev), valid], 1)
        key = (b, self.depth, dev)
        if key not in self._parents:
            self._parents[key] = torch.arange(-1, self.depth, device=dev).expand(b, -1).contiguous()
        tree = DraftTree(tokens=tokens, parents=self._parents[key], valid=valid, static_key=("chain", self.depth))
        return self.block(tree, max_depth=self.depth)

    def find_continuation(self, hist: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """[B] index of the first token after the best match, or -1."""
        b, c = hist.shape
        dev = hist.device
        best = torch.full((b,), -1, dtype=torch.long, device=dev)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if c < n + 1:
                continue
            suffix_idx = (length[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
            suffix = hist.gather(1, suffix_idx)  # [B, n]
            windows = hist.unfold(1, n, 1)  # [B, C-n+1, n]
            match = (windows == suffix[:, None, :]).all(-1)  # [B, W]
            starts = torch.arange(windows.shape[1], device=dev)
            match &= (starts[None] + n < length[:, None]) & (length[:, None] >= n + 1)
            latest = torch.where(match, starts[None], -1).max(-1).values  # [B]
            take = (best < 0) & (latest >= 0)
            best = torch.where(take, latest + n, best)
        return best
