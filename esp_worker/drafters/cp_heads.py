"""`cp_heads`: draft trees from trained rank-r CP multi-token heads (esp_worker/cp_heads.py).

The heads read e_p, the hidden state of the last accepted slot of the previous pass (position p). Its next
token x_{p+1} is already known: it is the bonus token, i.e. the root of the next tree. So the mixture is first
conditioned on the root (the paper's sequential scheme, equations 11-13):

    log pi_a = log w_a(e_p) + log P_a^(1)(root)                         (expert posterior given the root)
    depth d node y under path x_1..x_{d-1}:
    log q(x_1..x_{d-1}, y) = logsumexp_a(log pi_a + sum_{i<d} log P_a^(i+1)(x_i) + log P_a^(d+1)(y)) - logZ

Heads predicting n tokens give trees of depth n - 1. The tree holds the `num_nodes` most probable joint
continuations (depth 1: the best N tokens; depth d + 1: the best children of the best depth-d nodes); a child
never scores above its parent, so the kept set is a tree. Verification is the engine's, so the output is
exactly plain decoding's whatever the heads say.

The prefill returns no hidden state of the prompt's last token, so the first decode pass of a request has no
draft (root only); every later pass drafts.

State per row: `cp_h` [B, E] the last accepted slot's hidden state; `cp_ok` [B] bool (False until a pass gave one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..auto.sizer import DraftSizer
from ..grad import inference
from ..model.heads import CPHeads
from ..passes import Block, PassPlan, PassRecord, RowsView
from ..row_state import RowState, row_field
from ..tree import DraftTree
from .base import FULL, Drafter
from .common import CandidatePool, Memo


@dataclass
class CPHeadsState(RowState):
    cp_h: Optional[torch.Tensor] = row_field()  # [B, E] hidden state of the last accepted slot
    cp_ok: Optional[torch.Tensor] = row_field()  # [B] bool: False until a decode pass gave one


class CPHeadsDrafter(Drafter, DraftSizer):
    name = "cp_heads"
    reads_slot_logits = False
    state_type = CPHeadsState

    def __init__(self, heads: CPHeads, unembed, num_nodes: int):
        super().__init__()
        if num_nodes < 1:
            raise ValueError("cp_heads needs engine.block_complexity >= 2")
        if heads.cfg.num_positions < 2:
            raise ValueError("cp_heads needs heads with num_positions >= 2 (position 1 is the root)")
        self.heads, self.unembed = heads, unembed
        self.num_nodes = num_nodes
        self.depth = heads.cfg.num_positions - 1
        self._pools: Memo[CandidatePool] = Memo()  # the pool per state of the rows: draft_mass, then propose

    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    def start_rows(self, view: RowsView) -> None:
        b = view.hist.shape[0]
        dev = view.hist.device
        view.state.cp_h = torch.zeros((b, self.heads.cfg.hidden_size), device=dev)
        view.state.cp_ok = torch.zeros(b, dtype=torch.bool, device=dev)
        return None

    def start_job(self) -> None:
        self._pools.clear()

    def observe(self, view: RowsView, result: PassRecord) -> None:
        self._pools.clear()  # a new hidden state
        st = view.state
        if result.prefill or result.hidden is None or result.last_slot is None:
            st.cp_ok = torch.zeros_like(st.cp_ok)
            return
        h = result.hidden
        st.cp_h = h.gather(1, result.last_slot[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0].float()
        st.cp_ok = torch.ones_like(st.cp_ok)

    # ---- the mixture and its candidate pool ---------------------------------------------------------
    def pool(self, view: RowsView) -> CandidatePool:
        """`_build_pool`, once per state of the rows."""
        return self._pools.get(view.version, lambda: self._build_pool(view))

    @inference
    def _build_pool(self, view: RowsView) -> CandidatePool:
        """The joint continuations under the roots, depth by depth (scores: joint log-probs; depths known).

        Example (N = 3, depth 2): depth 1 keeps the best 3 tokens; each of the best 2 depth-1 nodes gets its
        best 2 children (a tree of 3 nodes holds at most 2 nodes below depth 1); P = 3 + 2 * 2.
        """
        st = view.state
        h, root = st.cp_h, view.root  # [B, E], [B]
        b, dev, n = h.shape[0], h.device, self.num_nodes
        log_w, log_p = self.heads(h, self.unembed)  # [B, r], [B, r, n, V]
        r, v = log_p.shape[1], log_p.shape[-1]
        lw = log_w + log_p[..., 0, :].gather(-1, root[:, None, None].expand(-1, r, 1))[..., 0]  # [B, r]
        lw = lw - torch.logsumexp(lw, -1, keepdim=True)  # expert posterior given the root
        # depth 1: [B, 1 node (root), r] expert log-weights along each node's path
        node_lw = lw[:, None, :]
        node_idx = torch.full((b, 1), -1, dtype=torch.long, device=dev)  # pool index of each frontier node
        scores, toks, pars, deps, offset = [], [], [], [], 0
        for d in range(1, self.depth + 1):
            width = min(n - d + 1, v)  # children per frontier node that a tree of n nodes can use
            if width < 1:
                break
            lp = log_p[:, :, d, :]  # [B, r, V] factor of depth d (position d + 1)
            joint = torch.logsumexp(node_lw[..., None] + lp[:, None], dim=2)  # [B, F, V]
            top = joint.topk(width, dim=-1)  # [B, F, W]
            f = node_lw.shape[1]
            scores.append(top.values.reshape(b, -1))
            toks.append(top.indices.reshape(b, -1))
            pars.append(node_idx[..., None].expand(-1, -1, width).reshape(b, -1))
            deps.append(torch.full_like(toks[-1], d))
            child_lw = node_lw[:, :, None, :] + lp[:, None].expand(-1, f, -1, -1).gather(
                3, top.indices[:, :, None, :].expand(-1, -1, r, -1)
            ).transpose(2, 3)  # [B, F, W, r]
            level = top.values.reshape(b, -1)
            level_idx = offset + torch.arange(level.shape[1], device=dev)[None].expand(b, -1)
            offset += level.shape[1]
            # frontier for the next depth: the best (n - d) nodes of this depth
            nf = min(n - d, level.shape[1])
            if nf < 1 or d == self.depth:
                break
            best = level.topk(nf, dim=-1).indices.sort(-1).values  # [B, nf] in pool order
            node_lw = child_lw.reshape(b, -1, r).gather(1, best[..., None].expand(-1, -1, r))
            node_idx = level_idx.gather(1, best)
        return CandidatePool(torch.cat(scores, 1), torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(deps, 1))

    def draft_mass(self, view: RowsView, variant: str = "") -> torch.Tensor:
        """[B, max_nodes] joint probability of each node of the largest tree, best first (0 without a state)."""
        return self.pool(view).top_mass(self.num_nodes, view.state.cp_ok)

    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """num_nodes None = the configured size; <= 0 = a plain pass (root only)."""
        n = self.num_nodes if plan.num_nodes is None else min(plan.num_nodes, self.num_nodes)
        if n <= 0:
            return self.blocks.build(DraftTree.root_only(view.root), max_depth=0)
        tree = self.pool(view).best_tree(view.root, n)  # the shared tree selection
        tree.valid[:, 1:] &= view.state.cp_ok[:, None]
        return self.blocks.build(tree, max_depth=self.depth)
