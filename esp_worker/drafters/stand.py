"""STAND (Song et al. 2025, arXiv 2506.04708): n-gram drafting from a store of the model's own past logits.

Logit store: for every history position p the drafter keeps the top-K next-token candidates seen at p
(`store_ids` / `store_lp` [B, C, K], sorted by log-prob). Generated positions get the model's own top-K from
the verification pass that fed them; prompt positions (whose logits the prefill does not return) get the
token that actually followed, with log-prob 0 (a one-hot distribution).

Draft tree (paper Appendix F: depth 10, extra branches by cumulative probability, BC - 1 nodes):
1. Match the context's suffix earlier in the history exactly as `pld` does (longest n first, latest match).
2. The chain: the (up to) `depth` tokens that followed the match. Chain node d is history position
   q_d = start + d - 1 and its log-prob is the store's entry for that token at q_d - 1.
3. Branches: at each depth d, the other stored candidates at q_d - 1 hang under chain node d - 1 (top-1
   expansion: only chain nodes have children).
4. Budget BC - 1 nodes: the chain comes first (depth order), the rest goes to the branches with the highest
   cumulative log-prob along their path. A branch hangs under a chain node, which is kept before it, so the
   kept set is a tree. At BC 10 the budget (9) is spent on the chain alone: STAND is PLD there, as the paper
   says. (Ranking the chain by its stored probability as well loses to PLD under greedy decoding: a top-1
   token of p = 0.4 repeats far more often than 40% of the time in a greedy continuation.)

Simplifications against the paper: the store keeps the latest occurrence per position (no aggregation over
repeated n-grams) and drafting is deterministic top-K (no Gumbel-top-K sampling; verification keeps the
output distribution exact either way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import EngineConfig
from ..consts import constant
from ..model.runner import ModelRunner
from ..tree import best_nodes
from ..auto.sizer import DraftSizer
from ..passes import Block, PassPlan, PassRecord, RowsView
from .base import FULL, Drafter
from .common import NEG, find_continuation, topk_excluding
from ..row_state import RowState, row_field


@dataclass
class StandState(RowState):
    store_ids: Optional[torch.Tensor] = row_field()  # [B, C, K] top-K next-token candidates per history position
    store_lp: Optional[torch.Tensor] = row_field(NEG)  # [B, C, K] their log-probs (NEG = none)


@dataclass(frozen=True)
class StoreCandidates:
    """The n-gram continuation of each row and the logit store's alternatives at each of its depths (`candidates`)."""

    chain: torch.Tensor  # [B, D] tokens following the best suffix match
    ok: torch.Tensor  # [B, D] bool, prefix-closed: False past the history or without a match
    chain_lp: torch.Tensor  # [B, D] the chain token's stored log-prob (-1e4 missing from the store, NEG where not ok)
    alt_ids: torch.Tensor  # [B, D, K-1] the other stored candidates at each depth (under chain node d - 1), best first
    alt_lp: torch.Tensor  # [B, D, K-1] their log-probs, NEG where absent


class StandDrafter(Drafter, DraftSizer):
    name = "stand"
    state_type = StandState

    def __init__(self, num_nodes: int, depth: int, topk: int, max_ngram: int, min_ngram: int):
        super().__init__()
        if num_nodes < 1:
            raise ValueError("stand needs engine.block_complexity >= 2")
        if topk < 1 or depth < 1:
            raise ValueError("engine.stand_topk and engine.stand_depth must be >= 1")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("engine.stand_min_ngram must be >= 1 and <= engine.stand_max_ngram")
        self.num_nodes = num_nodes
        self.depth = min(depth, num_nodes)
        self.topk = topk
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @classmethod
    def from_config(cls, cfg: EngineConfig, runner: ModelRunner) -> "StandDrafter":
        return cls(
            num_nodes=cfg.block_complexity - 1,
            depth=cfg.stand_depth,
            topk=cfg.stand_topk,
            max_ngram=cfg.stand_max_ngram,
            min_ngram=cfg.stand_min_ngram,
        )

    # ---- logit store -------------------------------------------------------------------------------
    def start_rows(self, view: RowsView) -> None:
        hist, plen = view.hist, view.prompt_len  # [B, C], [B]
        b, c = hist.shape
        dev = hist.device
        ids = torch.zeros((b, c, self.topk), dtype=torch.long, device=dev)
        lp = torch.full((b, c, self.topk), NEG, device=dev)
        # position p stores the prompt token at p + 1 with log-prob 0
        nxt = torch.cat([hist[:, 1:], hist[:, :1]], 1)  # [B, C]
        has_next = torch.arange(c, device=dev)[None] < (plen - 1)[:, None]
        ids[..., 0] = nxt
        lp[..., 0] = torch.where(has_next, 0.0, NEG)
        view.state.store_ids, view.state.store_lp = ids, lp
        return None

    def _fit_store(self, view: RowsView) -> None:
        """Grow the store with the history capacity (the engine pads `hist` as rows get longer)."""
        st = view.state
        extra = view.hist.shape[1] - st.store_ids.shape[1]
        if extra > 0:
            st.store_ids = torch.nn.functional.pad(st.store_ids, (0, 0, 0, extra))
            st.store_lp = torch.nn.functional.pad(st.store_lp, (0, 0, 0, extra), value=NEG)

    def observe(self, view: RowsView, result: PassRecord) -> None:
        """Store the model's top-K at the root and every accepted node: n positions ending at hist_len - 2.

        Example: root at position 10, two drafts accepted + the bonus (n = 3): hist_len went from 11 to 14 and
        positions 10, 11, 12 get the top-K of the logits at the root and at the two accepted slots.
        """
        self._fit_store(view)
        st = view.state
        n = result.num_committed  # [B]
        if result.prefill:
            # the prefill gives no logits: one-hot of the first generated token at the last prompt position
            ids = result.committed[:, :1, None].expand(-1, -1, self.topk)  # [B, 1, K]
            lp = torch.full(ids.shape, NEG, device=ids.device)
            lp[..., 0] = 0.0
        elif result.probe is not None and result.probe.path_lp is not None:  # the replayed pass's stage took them
            lp, ids = result.probe.path_lp, result.probe.path_ids
        else:
            lp, ids = path_topk(result.slot_logits, result.path_slots, self.topk)
        pos = view.hist_len[:, None] - n[:, None] - 1 + torch.arange(ids.shape[1], device=n.device)[None]  # [B, S]
        keep = torch.arange(pos.shape[1], device=pos.device)[None] < n[:, None]  # [B, S]
        c = st.store_ids.shape[1]
        pos = pos.clamp(0, c - 1)
        idx = pos[..., None].expand(-1, -1, self.topk)
        for key, new in (("store_ids", ids), ("store_lp", lp)):
            cur = getattr(st, key).gather(1, idx)
            getattr(st, key).scatter_(1, idx, torch.where(keep[..., None], new, cur))

    # ---- draft tree --------------------------------------------------------------------------------
    def candidates(self, view: RowsView, start: Optional[torch.Tensor] = None) -> StoreCandidates:
        """The n-gram continuation and the stored alternatives at each of its depths (also used by hybrid). A chain
        token missing from the store stays draftable at a low score, so the tree degrades to PLD, never below it.
        start: [B] the match already found with this drafter's n-gram lengths (hybrid's chain), or None to find it
        here."""
        self._fit_store(view)
        st = view.state
        hist, length = view.hist, view.hist_len  # [B, C], [B]
        b, c = hist.shape
        dev = hist.device
        dep, k = self.depth, self.topk
        if start is None:
            start = find_continuation(hist, length, self.max_ngram, self.min_ngram)  # [B], -1 = no match
        q = start[:, None] + torch.arange(dep, device=dev)[None]  # [B, D] history positions of chain nodes
        ok = (start[:, None] >= 0) & (q < length[:, None])
        chain = hist.gather(1, q.clamp(0, c - 1))  # [B, D]
        src = (q - 1).clamp(0, c - 1)[..., None].expand(-1, -1, k)  # stored candidates for each depth
        cand_ids = st.store_ids.gather(1, src)  # [B, D, K]
        cand_lp = st.store_lp.gather(1, src)
        # the chain token's log-prob (NEG if it is not among the stored candidates)
        hit = cand_ids == chain[..., None]
        chain_lp = torch.where(hit, cand_lp, NEG).max(-1).values  # [B, D]
        chain_lp = torch.where(ok, chain_lp.clamp(min=-1e4), NEG)  # missing from the store: -1e4
        alt_lp, alt_ids = topk_excluding(cand_lp.reshape(b * dep, k), cand_ids.reshape(b * dep, k), chain.reshape(-1), k - 1)
        alt_lp = torch.where(ok[..., None], alt_lp.reshape(b, dep, k - 1), NEG)  # [B, D, K-1]
        alt_ids = alt_ids.reshape(b, dep, k - 1)
        return StoreCandidates(chain, ok, chain_lp, alt_ids, alt_lp)

    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        c = self.candidates(view)
        b, dep = c.chain.shape
        k, dev = self.topk, c.chain.device
        cum = c.chain_lp.cumsum(1)  # [B, D] cumulative log-prob of chain node d
        above = torch.cat([torch.zeros((b, 1), device=dev), cum[:, :-1]], 1)  # of its parent
        # pool in depth-major order: [chain_1, alt_1.., chain_2, alt_2.., ...]; parent pool index per entry
        score = torch.cat([cum[..., None], above[..., None] + c.alt_lp], 2).reshape(b, dep * k)
        tok = torch.cat([c.chain[..., None], c.alt_ids], 2).reshape(b, dep * k)
        par = pool_parents(dep, k, dev)
        is_chain = (torch.arange(dep * k, device=dev) % k == 0)[None]  # [1, D*K]
        rank = torch.where(is_chain & (score > NEG), 1.0, score)  # chain first, then branches by score
        tree, _ = best_nodes(view.root, rank, score > NEG, tok, par.expand(b, -1), self.num_nodes)
        return self.blocks.build(tree, max_depth=dep)


def pool_parents(depth: int, k: int, device: torch.device) -> torch.Tensor:
    """[D*K] parent pool index of each entry of the depth-major pool [chain_1, alt_1.., chain_2, ...] of `depth`
    depths and k entries each: every entry at depth d hangs under chain node d - 1 (built once per shape).
    Example: depth 2, k 2 -> [-1, -1, 0, 0]."""

    def make() -> torch.Tensor:
        d = torch.arange(depth, device=device)
        return torch.where(d == 0, -1, (d - 1) * k)[:, None].expand(depth, k).reshape(-1)

    return constant(("pool_parents", depth, k, device), make)


def path_topk(slot_logits: torch.Tensor, path_slots: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top K at each slot of the accepted path: (log-probs, ids) [B, S, K] from the tree slots' logits
    [B, T, V] and the path [B, S] (a vocabulary smaller than K pads with NEG). What the logit store keeps; the same
    function in a replayed pass's stage (`drafters.esp.ProbeStage`)."""
    logits = slot_logits.gather(1, path_slots[..., None].expand(-1, -1, slot_logits.shape[-1]))  # [B, S, V]
    k = min(topk, logits.shape[-1])
    top = torch.log_softmax(logits, -1).topk(k, dim=-1)
    lp = torch.nn.functional.pad(top.values, (0, topk - k), value=NEG)
    ids = torch.nn.functional.pad(top.indices, (0, topk - k))
    return lp, ids
