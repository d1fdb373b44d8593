"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's suffix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..auto.sizer import DraftSizer
from ..consts import constant, ones, steps
from ..passes import Block, PassPlan, PassRecord, RowsView
from ..tree import DraftTree
from .base import FULL, Drafter
from .common import Memo, find_continuation
from .corpus import CorpusNgrams


@dataclass(frozen=True)
class Lookup:
    """Each row's chain at the full depth."""

    chain: torch.Tensor  # [B, depth] tokens following the row's best match
    valid: torch.Tensor  # [B, depth]
    from_corpus: torch.Tensor  # [B] bool: the row's chain is the corpus's continuation


class PromptLookupDrafter(Drafter, DraftSizer):
    """Chain drafter. For n from max_ngram down to min_ngram, find the most recent earlier occurrence of the
    last n tokens (root included) in prompt + output, and propose the (up to) `depth` tokens that followed it.

    Example (n=2, depth=3): history [5 6 7 8 5 6] -> suffix [5 6] matched at 0 -> chain [7 8 5].
    Tie-break: the longest n wins; among matches of one n, the latest start wins.
    """

    name = "pld"
    reads_slot_logits = False

    def __init__(self, max_ngram: int, min_ngram: int, depth: int, corpus: Optional[CorpusNgrams] = None):
        super().__init__()
        self.max_ngram, self.min_ngram, self.depth = max_ngram, min_ngram, depth
        self.max_nodes = depth
        self.corpus = corpus  # hybrid's ngram variant: the job's n-grams where a row's own history has none
        self._parents: dict[tuple, torch.Tensor] = {}
        # per state of the rows (and whether the corpus was consulted): reused within a pass and by the next pass
        # after the policy's look (draft_mass, then propose)
        self._lookups: Memo[Lookup] = Memo()
        # [B] the best match in the rows' own histories per state of the rows: with a corpus, found after the commit
        # (`row_hints`) and reused by the next pass's lookup
        self._own: Memo[torch.Tensor] = Memo()
        self._rates: Memo[torch.Tensor] = Memo()  # [2, depth] cumprod of `rates()` per change of the counters
        self._updates = 0  # changes of the counters so far (in place by observe, or replaced)
        # per source (0: the row's own history, 1: the corpus) and depth d (decayed counts): rows that were
        # offered node d with node d-1 accepted, and those accepting node d (`rates`). The corpus's
        # continuations are accepted less often than a row's own: one shared rate overrated them and
        # underrated the row's own chains.
        self._reached = torch.zeros(2, depth)
        self._accepted = torch.zeros(2, depth)
        self._used: Optional[torch.Tensor] = None  # [B] the last proposed chains' rows that came from the corpus

    @property
    def reached(self) -> torch.Tensor:
        """[2, depth] decayed counts of rows offered node d with node d-1 accepted, per source."""
        return self._reached

    @reached.setter
    def reached(self, value: torch.Tensor) -> None:
        self._reached, self._updates = value, self._updates + 1

    @property
    def accepted(self) -> torch.Tensor:
        """[2, depth] decayed counts of rows that accepted node d, per source."""
        return self._accepted

    @accepted.setter
    def accepted(self, value: torch.Tensor) -> None:
        self._accepted, self._updates = value, self._updates + 1

    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        """The acceptance counters go where the rows live, here at the prefill: inside a pass a copy from host
        memory to a GPU would wait for the stream."""
        dev = view.hist.device
        if self.reached.device != dev:
            self.reached, self.accepted = self.reached.to(dev), self.accepted.to(dev)
        return None

    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        depth = self.depth if plan.num_nodes is None else max(0, min(plan.num_nodes, self.depth))
        if depth == 0:  # a plain pass (block_complexity=auto): no lookup
            return self.blocks.build(DraftTree.root_only(view.root), max_depth=0)
        b = view.hist.shape[0]
        dev = view.hist.device
        look = self._chain(view, depth)
        self._used = look.from_corpus
        tokens = torch.cat([view.root.unsqueeze(1), look.chain], 1)
        valid = torch.cat([ones((b, 1), torch.bool, dev), look.valid], 1)
        key = (b, depth, dev)
        if key not in self._parents:
            self._parents[key] = torch.arange(-1, depth, device=dev).expand(b, -1).contiguous()
        tree = DraftTree(tokens=tokens, parents=self._parents[key], valid=valid, static_key=("chain", depth))
        return self.blocks.build(tree, max_depth=depth)

    def _chain(self, view: RowsView, depth: int) -> Lookup:
        """The chains following the best match, cut to `depth` (looked up once per state of the rows at the full
        depth)."""
        corpus = self.corpus is not None and self.corpus_needed(view)
        m = self._lookups.get((view.version, corpus), lambda: self._lookup(view, corpus))
        if depth < self.depth:
            return Lookup(m.chain.narrow(1, 0, depth), m.valid.narrow(1, 0, depth), m.from_corpus)
        return m

    def _lookup(self, view: RowsView, corpus: bool) -> Lookup:
        hist, length = view.hist, view.hist_len  # [B, C], [B]
        start = self.own_start(view).unsqueeze(1)  # [B, 1], -1 = no match
        idx = start + steps(self.depth, hist.device)  # [B, depth]
        valid = (start >= 0) & (idx < length.unsqueeze(1))
        chain = hist.gather(1, idx.clamp(0, hist.shape[1] - 1))
        if corpus:
            return Lookup(*self.corpus.fill(hist, length, chain, valid))
        used = constant(("no_rows", len(length), hist.device),
                        lambda: torch.zeros(len(length), dtype=torch.bool, device=hist.device))
        return Lookup(chain, valid, used)

    def own_start(self, view: RowsView) -> torch.Tensor:
        """[B] index of the first token after the best match in each row's own history, -1 = none (once per
        history: `row_hints` finds it after a commit, the next pass's lookup reuses it)."""
        return self._own.get(view.version, lambda: self.find_continuation(view.hist, view.hist_len))

    def row_hints(self, view: RowsView) -> Optional[torch.Tensor]:
        """With a corpus: each row's own match (`own_start`), so that the next pass knows on the host whether
        any row needs the corpus (a row with a match of its own never takes the corpus's continuation)."""
        return self.own_start(view) if self.corpus is not None else None

    @staticmethod
    def corpus_needed(view: RowsView) -> bool:
        """Whether some row may take the corpus's continuation: it has no match of its own (as of the last
        host read; unknown = yes)."""
        return view.hints is None or min(view.hints, default=0) < 0

    def from_corpus(self, view: RowsView) -> torch.Tensor:
        """[B] rows whose chain this pass comes from the job's n-grams (the corpus), not their own history."""
        return self._chain(view, self.depth).from_corpus

    def draft_mass(self, view: RowsView, variant: str = "") -> torch.Tensor:
        """Chain node d is accepted with the running rate prod_{i<=d} P(accept i | reached i) of the chain's
        source (the row's own history or the corpus)."""
        look = self._chain(view, self.depth)
        valid, used = look.valid, look.from_corpus
        # the rates change only when the counters do (every change is counted: tensors made under inference mode,
        # as the counters are once moved to a GPU, have no version counter to ask)
        dev = valid.device
        cum = self._rates.get((self._updates, dev), lambda: self.rates().to(dev).cumprod(1))
        return valid.float() * cum.index_select(0, used.long())  # [B, depth]

    def rates(self) -> torch.Tensor:
        """[2, depth] P(node d accepted | node d-1 accepted) per source: decayed counts with a prior of one
        pass whose mean is depth d-1's rate (depth 0: an optimistic 0.8), i.e.
        r[d] = (accepted[d] + r[d-1]) / (reached[d] + 1).

        Why the previous depth: the auto policy only learns about the depths it offers. With a fixed prior
        and only offered depths decaying, two early misses at node 3 (rate 0.8 / 3 = 0.27) made deeper chains
        look worthless, the policy kept to 2-node chains for the rest of the job and never saw node 3 again
        (`pld auto` at 0.88x pld BC 10 in two benchmark runs; 1.04x after this change). A chain that got to depth d - 1 is about as likely to go on
        as it was to get there, and the counts of depths not offered decay (`observe`), so stale misses fade
        and a depth is tried again. Closed form of the recurrence r[d] = a[d] + b[d] r[d-1]
        (a = accepted / (reached + 1), b = 1 / (reached + 1)): r[d] = B[d] (0.8 + sum_{j<=d} a[j] / B[j]),
        B = cumprod(b), in float64 (B >= 101^-depth)."""
        b = 1.0 / (self.reached.double() + 1.0)  # [2, depth]
        big_b = b.cumprod(1)
        return (big_b * (0.8 + (self.accepted.double() * b / big_b).cumsum(1))).float()

    def observe(self, view: RowsView, result: PassRecord) -> None:
        if result.block is None or not self.mass_wanted:  # the rates only feed draft_mass
            return
        valid = result.block.tree.valid[:, 1:].float()  # [B, depth]
        if result.live is not None:  # rows the pass could not commit to (run ahead over rows that had ended)
            valid = valid * result.live[:, None]
        accepted = (result.num_committed - 1).clamp(min=0)  # [B]
        d = valid.shape[1]
        if d == 0:
            return
        steps = torch.arange(d, device=valid.device)[None]
        reached = valid * (steps <= accepted[:, None])  # [B, d] node offered and its parent accepted
        took = valid * (steps < accepted[:, None])  # [B, d] node accepted
        used = self._used if self._used is not None and len(self._used) == len(valid) else torch.zeros_like(accepted)
        src = used.long()  # [B] 0 own history, 1 corpus
        self._reached.mul_(0.99)  # every depth, offered or not: misses at a depth not offered since fade (`rates`)
        self._accepted.mul_(0.99)
        self._reached[:, :d].index_add_(0, src, reached)
        self._accepted[:, :d].index_add_(0, src, took)
        self._updates += 1

    def find_continuation(self, hist: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """[B] index of the first token after the best match, or -1 (see common.find_continuation)."""
        return find_continuation(hist, length, self.max_ngram, self.min_ngram)
