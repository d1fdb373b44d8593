"""ESP: mask-token probing (Goel et al., arXiv 2603.17942). No draft model, no training.

The rows' probe (`MaskProbe`: the mask vector m and the candidates its masks predicted) gives, per depth 1..k,
candidates for the next tree; ESP builds that tree from them, static (fixed branches per depth) or dynamic
(Algorithm 1: the best nodes of a candidate pool by cumulative probability), and feeds k masks per tree slot.

A replayed pass (engine.cuda_graphs) may end with the probe itself (`ProbeStage`, made of the eager functions
`probe_candidates` and `static_tree_tokens`): the candidates and the next pass's static tree, which `propose`
takes as they are while the rows are as they were (`RowsView.version`) and m owes nothing. Integers and copies
only past the normaliser, so the drafts are the eager ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..auto.sizer import DraftSizer
from ..consts import ones
from ..graphs.hooks import StepHooks, StepProbe
from ..passes import Block, PassPlan, PassRecord, ProbeOut, RowsView
from ..sampling import upload
from ..tree import DraftTree, gather_slots, mask_indices, static_branches, static_parents
from .base import FULL, Drafter
from .common import NEG, CandidatePool, Memo, ema_apply, topk_excluding
from .mask_probe import ESPState, MaskModel, MaskProbe, MaskSettings, ema_table, probe_candidates
from .stand import path_topk

__all__ = ["ESPDrafter", "ESPState", "MaskModel", "MaskSettings", "candidate_pool", "ProbeSpec", "ProbeStage",
           "static_tree_tokens"]


class ESPDrafter(Drafter, DraftSizer, StepHooks):
    state_type = ESPState
    name = "esp"
    reads_slot_logits = False
    needs_probe_to_draft = True  # ESP drafts from its last probe only

    def __init__(self, model: MaskModel, mask: MaskSettings, block_complexity: int, tree: str = "dynamic",
                 branches: Optional[list[int]] = None, expansion: str = "top1"):
        super().__init__()
        self.num_masks = k = mask.num_masks
        self.tree_mode, self.expansion, self.prune = tree, expansion, mask.prune
        if tree == "static":
            self.branches = list(branches) if branches else static_branches(block_complexity, k)
            if len(self.branches) > k:
                raise ValueError(f"engine.branches={self.branches} is deeper than num_masks={k}")
            self.num_nodes = sum(self.branches)
            self.budget = self.num_nodes + 1
        else:
            self.budget = block_complexity // (k + 1)  # tree slots, root included
            self.num_nodes = self.budget - 1
            if self.num_nodes < 1:
                raise ValueError(f"block_complexity={block_complexity} leaves no draft node with num_masks={k}")
        # top candidates kept per mask: enough for any tree of the budget (the root's own token is excluded before
        # the probe's top-k, so depth 1 needs budget - 1; a deeper level skips one parent token of budget - 1)
        self.probe = MaskProbe(model, mask, num_cand=max(1, self.budget - 1))
        self._parents: dict[tuple, torch.Tensor] = {}
        self._pools: Memo[CandidatePool] = Memo()  # candidate_pool per state of the rows

    def start_job(self) -> None:
        self._ready = None
        self._pools.clear()

    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        return self.probe.start_rows(view)

    def observe(self, view: RowsView, record: PassRecord) -> None:
        self._pools.clear()  # the probe changes the candidates
        logits = self.probe.observe(view, record)
        if record.staged_probe is not None:  # the replayed pass ran the probe (`step_probe`)
            self._take_probe(view, record.staged_probe)
        elif logits is not None:
            self._ready = None
            self.probe.candidates(view, logits)

    def step_probe(self, view: RowsView, block: Block) -> Optional[StepProbe]:
        """A replayed pass that feeds every tree slot its masks ends with the probe (`ProbeStage`): the EMA over its
        kept tokens, the candidates and, for the configured static tree, the next pass's tree."""
        if block.aux_embeds is None or block.mask_owner is not None or self.probe.owes:
            return None
        branches = self._branches_for(self.num_nodes) or []
        spec = ProbeSpec(self.probe.num_cand, self.prune, tuple(branches), self.num_masks)
        return StepProbe(ProbeStage(spec, False, max(self.probe.ema_lambda, 0.0)), view.state.m)

    def _take_probe(self, view: RowsView, probe: ProbeOut) -> None:
        """The candidates a replayed pass's probe stage computed, and its next tree as a block prepared for these
        rows (`propose` takes it while they are unchanged)."""
        st = view.state
        st.cand_lp, st.cand_ids = probe.cand_lp, probe.cand_ids
        self._ready = None
        if probe.tokens is not None:
            self._ready = _Prepared(view.version, self._branches_for(self.num_nodes), probe.tokens, probe.valid)

    # the block prepared with the last replayed pass's probe stage; prepared blocks proposed
    _ready: Optional["_Prepared"] = None
    prepared_blocks = 0

    # ---- sizes (block_complexity=auto) -------------------------------------------------------------
    @property
    def depth_limit(self) -> Optional[int]:
        # a mask predicts one position further, so an ESP tree is at most k deep (static trees: one level per mask)
        return self.num_masks

    def needs_probe(self, view: RowsView) -> bool:
        return self.probe.needs_probe(view)

    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    def block_tokens(self, num_nodes: int) -> int:
        return 1 if num_nodes < 0 else (self.num_masks + 1) * (1 + num_nodes)

    # ---- trees -------------------------------------------------------------------------------------
    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """num_nodes None = the configured size; -1 = plain pass (no masks); 0 = root + masks (re-probe)."""
        st = view.state
        n = self.num_nodes if plan.num_nodes is None else plan.num_nodes
        if n < 0:
            return self.blocks.build(DraftTree.root_only(view.root), None, self.num_masks, max_depth=0)
        branches = self._branches_for(n)
        ready = self._ready
        if (ready is not None and ready.version == view.version and self.probe.all_probed and not self.probe.owes
                and ready.branches == branches):
            # the tree a replayed pass's probe stage prepared
            tokens, valid = ready.tokens, ready.valid
            b, t = tokens.shape
            tree = DraftTree(tokens, self._parents_for(b, tokens.device, branches), valid, static_key=("esp", tuple(branches)))
            aux = self.probe.mask_inputs(view, t * self.num_masks)
            block = self.blocks.build(tree, aux, self.num_masks, max_depth=len(branches))
            self.prepared_blocks += 1
            return block
        # depth: the tree's depth (static shapes) or a bound on it (a dynamic tree is never deeper than k),
        # known on the host so that no pass reads it from the device
        if n == 0:
            tree, depth = DraftTree.root_only(view.root), 0
        elif branches is not None:
            tree, depth = self._static_tree(view.root, st.cand_lp, st.cand_ids, branches), len(branches)
        else:
            tree, depth = self._dynamic_tree(view, n), min(self.num_masks, n)
        if not self.probe.all_probed:  # rows without a probe keep the root only
            tree.valid = tree.valid & (st.has_probe[:, None] | (torch.arange(tree.num_slots, device=tree.valid.device) == 0))
        aux = self.probe.mask_inputs(view, tree.num_slots * self.num_masks)
        return self.blocks.build(tree, aux, self.num_masks, max_depth=depth)

    def _branches_for(self, n: int) -> Optional[list[int]]:
        """The static tree of n >= 1 draft nodes ([K_1 .. K_d] nodes per depth), or None for a dynamic tree. One
        mask: Algorithm 1 keeps the n most probable depth-1 candidates, which is the static tree [n]."""
        if n < 1:
            return None
        if self.num_masks == 1:
            return [n]
        if self.tree_mode == "static":
            return self.branches if n == self.num_nodes else static_branches((self.num_masks + 1) * (n + 1), self.num_masks)
        return None

    def draft_mass(self, view: RowsView, variant: str = "") -> torch.Tensor:
        """[B, max_nodes] probe probability of each node of the largest tree, best first (0 without a probe).

        Their prefix sums estimate the drafts a tree of n nodes gets accepted (before calibration).
        """
        return self.pool(view).top_mass(self.num_nodes, view.state.has_probe)

    def _parents_for(self, b: int, dev, branches: list[int]) -> torch.Tensor:
        key = (b, dev, tuple(branches))
        if key not in self._parents:
            self._parents[key] = upload(torch.tensor(static_parents(branches)), dev).expand(b, -1).contiguous()
        return self._parents[key]

    def _static_tree(self, root, cand_lp, cand_ids, branches: list[int]) -> DraftTree:
        tokens, valid = static_tree_tokens(root, cand_lp, cand_ids, branches, self.prune)
        return DraftTree(tokens, self._parents_for(root.shape[0], root.device, branches), valid,
                         static_key=("esp", tuple(branches)))

    def pool(self, view: RowsView) -> CandidatePool:
        """Algorithm 1's candidate pool of the rows' probe for the full budget (`candidate_pool`); built once per
        state of the rows (draft_mass, then propose, in one pass: `RowsView.version`, and observe clears it)."""
        st = view.state
        return self._pools.get(view.version, lambda: candidate_pool(view.root, st.cand_lp, st.cand_ids, self.budget,
                                                                    self.expansion, self.prune))

    def _dynamic_tree(self, view: RowsView, num_nodes: int) -> DraftTree:
        """Algorithm 1 under a budget of num_nodes + 1 slots: the best num_nodes pool candidates by cumulative
        probability. A stable sort keeps a parent ahead of an equal-scoring child, so the kept set is a tree.
        (The pool is built for the full budget; for a smaller budget Algorithm 1's pool is a subset of it
        and holds the same best candidates under top-1 expansion.)"""
        tree = self.pool(view).best_tree(view.root, num_nodes)
        # with one mask every node hangs under the root: the shape is fixed and its layout can be cached
        if self.num_masks == 1:
            tree.static_key = ("esp-k1", num_nodes)
        return tree


def candidate_pool(root: torch.Tensor, cand_lp: torch.Tensor, cand_ids: torch.Tensor, budget: int, expansion: str,
                   prune: bool) -> CandidatePool:
    """Algorithm 1's candidate pool for a budget of `budget` slots (scores: cumulative log-probs), from the probe's
    candidates [B, k, C] under the roots [B]. Entries are appended depth by depth (topological order); "top1"
    expands the best node of each depth, "all" every one."""
    b, k, _ = cand_lp.shape
    dev = root.device
    bud = budget
    # depth 1: the probe's candidates never hold the root (observe excluded it when pruning)
    lp1, ids1 = topk_excluding(cand_lp[:, 0], cand_ids[:, 0], None, bud - 1)  # [B, B-1]
    pool_score, pool_tok = [lp1], [ids1]
    pool_par = [torch.full_like(ids1, -1)]  # parent pool index, -1 = root
    level_score, level_tok, level_off = lp1, ids1, 0
    for i in range(2, k + 1):
        width = bud - i
        if width < 1:
            break
        nf = 1 if expansion == "top1" else width
        order = level_score.sort(dim=1, descending=True, stable=True).indices  # ties: earlier candidate first
        f_idx = order[:, :nf].sort(dim=1).values  # frontier [B, F], in pool order
        f_score = level_score.gather(1, f_idx)
        f_tok = level_tok.gather(1, f_idx)
        f = f_score.shape[1]
        lp_i, ids_i = cand_lp[:, i - 1], cand_ids[:, i - 1]  # [B, C]
        if prune:
            c = lp_i.shape[1]
            key = torch.arange(c, device=dev)[None, None] + c * (ids_i[:, None, :] == f_tok[..., None])
            order = key.argsort(dim=2)[..., :width]  # [B, F, W]
            ch_lp = lp_i[:, None].expand(-1, f, -1).gather(2, order)
            ch_ids = ids_i[:, None].expand(-1, f, -1).gather(2, order)
        else:
            ch_lp = lp_i[:, None, :width].expand(-1, f, -1)
            ch_ids = ids_i[:, None, :width].expand(-1, f, -1)
        score = (f_score[..., None] + ch_lp).reshape(b, -1)  # [B, F*W]
        tok = ch_ids.reshape(b, -1)
        par = (f_idx + level_off)[..., None].expand(-1, -1, ch_lp.shape[2]).reshape(b, -1)
        level_off += level_score.shape[1]
        pool_score.append(score), pool_tok.append(tok), pool_par.append(par)
        level_score, level_tok = score, tok
    return CandidatePool(torch.cat(pool_score, 1), torch.cat(pool_tok, 1), torch.cat(pool_par, 1))


def static_tree_tokens(root: torch.Tensor, cand_lp: torch.Tensor, cand_ids: torch.Tensor, branches: list[int],
                       prune: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 expansion with fixed branches [K_1..K_d]: depth j+1 hangs under the first depth-j node. (tokens,
    valid) [B, T] of the tree whose slot 0 is the root [B] (parents: `tree.static_parents(branches)`)."""
    b = root.shape[0]
    parent_tok = root
    toks, oks = [], []
    for j, kj in enumerate(branches):
        # depth 1 never holds the root (the probe excluded it); deeper, the parent's token is skipped here
        excl = parent_tok if prune and j else None
        lp, ids = topk_excluding(cand_lp.select(1, j), cand_ids.select(1, j), excl, kj)
        toks.append(ids)
        ok = lp > NEG
        if oks:
            ok = ok & oks[-1][:, :1]  # children of an invalid parent are invalid
        oks.append(ok)
        if j + 1 < len(branches):
            parent_tok = ids[:, 0]
    tokens = torch.cat([root.unsqueeze(1)] + toks, 1)
    valid = torch.cat([ones((b, 1), torch.bool, root.device)] + oks, 1)
    return tokens, valid


@dataclass(frozen=True)
class ProbeSpec:
    """What a probe stage knows on the host: its shape and pruning (`probe_tree`)."""

    num_cand: int  # candidates kept per mask
    prune: bool
    branches: tuple[int, ...]  # the static tree's nodes per depth
    num_masks: int


def probe_tree(logits: torch.Tensor, root: torch.Tensor, spec: ProbeSpec
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A probe's candidates (`probe_candidates`, [B, k, C] each) from its logits [B, k, V] under the roots [B], and
    with `spec.branches` the next pass's static tree (`static_tree_tokens`: tokens, valid [B, T]; else None, None).
    A replayed pass's stage (`ProbeStage`) runs it."""
    cand_lp, cand_ids = probe_candidates(logits, root, spec.num_cand, spec.prune)
    if not spec.branches:
        return cand_lp, cand_ids, None, None
    tokens, valid = static_tree_tokens(root, cand_lp, cand_ids, list(spec.branches), spec.prune)
    return cand_lp, cand_ids, tokens, valid


@dataclass(frozen=True)
class ProbeStage:
    """A drafter's work after a pass as the last stage of the replayed pass (engine.cuda_graphs,
    `graphs.hooks.StepHooks`): what `observe` and the next `propose` compute eagerly, from the same functions, so
    the drafts are the eager ones. After a pass that fed masks, the probe: m moved by the EMA over the kept tokens
    (`ema_apply`), the LM head at the masks of the last accepted slot (or of its mask owner: the hybrid), their
    candidates (`probe_candidates`) and, with the probe's branches, ESP's next static tree (`static_tree_tokens`).
    With `store_topk`, the model's top K along the accepted path (`stand.path_topk`: the hybrid's logit store), so
    the engine need not run the LM head again at the tree slots. The next pass's masks are m, which the host expands
    as after an eager probe; no input embedding is made here."""

    probe: Optional[ProbeSpec]  # the probe (the pass fed masks; branches () = candidates only), or None
    owners: bool  # masks hang on some tree slots only (`StepInputs.mask_owner`), else every slot owns k, in order
    ema_lambda: float  # the EMA's weight of a new token (0 = m stays)
    store_topk: int = 0  # K > 0: the top K along the accepted path

    @property
    def ema(self) -> bool:
        return self.probe is not None and self.ema_lambda > 0

    def ema_columns(self, width: int, device: torch.device) -> torch.Tensor:
        """[width + 1, 1, 1 + width] the EMA's weights by tokens kept, up to `width` (`StepInputs.ema_cols`)."""
        return ema_table(self.ema_lambda, width, device).unsqueeze(1)

    def run(self, model, inp, hidden: torch.Tensor, logits: torch.Tensor, verified, last_token: torch.Tensor,
            n_fin: torch.Tensor) -> ProbeOut:
        """From the step's model (`embed`, `head`), inputs (`tokens`, `m`, `ema_cols`, `mask_owner`), hidden states
        [B, Q, D], the tree slots' logits [B, T, V], verification (`committed`, `last_slot`, `path_slots`), last
        committed tokens [B] and tokens kept [B]."""
        path_lp = path_ids = None
        if self.store_topk:
            path_lp, path_ids = path_topk(logits, verified.path_slots, self.store_topk)
        spec = self.probe
        if spec is None:
            return ProbeOut(path_lp=path_lp, path_ids=path_ids)
        m = inp.m
        if self.ema:  # (the clamp: a padding row's inputs never index out of the weights, a device-side fault)
            kept = n_fin.clamp(0, inp.ema_cols.shape[0] - 1)
            m = ema_apply(m, model.embed(verified.committed), inp.ema_cols, kept)
        owner, mask_ok = verified.last_slot, None
        if self.owners:  # the masks of the last accepted slot's owner index (none: -1)
            owner = inp.mask_owner.gather(1, owner.unsqueeze(1)).squeeze(1)
            mask_ok = owner >= 0
            owner = owner.clamp(min=0)
        mask_hidden = gather_slots(hidden, mask_indices(owner, inp.tokens.shape[1], spec.num_masks))
        cand_lp, cand_ids, tokens, valid = probe_tree(model.head(mask_hidden), last_token, spec)
        return ProbeOut(m, cand_lp, cand_ids, mask_ok, tokens, valid, path_lp, path_ids)


class _Prepared(NamedTuple):
    """A block prepared with a replayed pass's probe stage (`ProbeStage`), valid for the rows it was built for
    (`RowsView.version`)."""

    version: int
    branches: list[int]
    tokens: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
