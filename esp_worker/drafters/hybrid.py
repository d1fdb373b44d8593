"""Hybrid drafting: one draft tree per row per pass, merged from n-gram continuations and ESP's mask probe.

Proposers (`proposers`, the index is Block.source):
    0 "ngram": the tokens that followed the latest, longest earlier match of the context's suffix (as pld);
    1 "store": STAND's stored alternatives (the model's own past top-k) at each depth of that continuation;
    2 "esp":   the candidates of the mask probe (ESP's Algorithm 1 pool, top-1 expansion);
    3 "corpus": where a row's own history has no match, the continuation of the latest, longest match in the
               requests the job has already finished (`corpus.CorpusNgrams`; engine.hybrid_corpus_tokens).
    next "heads": with engine.heads_path, the best joint continuations of trained CP multi-token heads
               (`cp_heads.CPHeadsDrafter`'s candidate pool, its `num_nodes` wide) from the last accepted
               slot's hidden state; index 4 with the corpus, 3 without.

Merge (per row, tensor ops only):
1. Every candidate gets a *conditional* acceptance estimate c = P(accepted | parent accepted): ngram and
   corpus nodes c = r[p, d] (a running acceptance rate per proposer and depth); store and esp nodes
   c = min(1, a[p, d] * q) where q is the proposer's own probability (stored log-prob / probe probability)
   and a[p, d] a running ratio of accepted to predicted, per proposer and depth (decayed counts with a
   prior). These are the calibration.
2. An esp or heads candidate equal to an earlier candidate (n-gram, then esp) under the same parent is
   merged into it (one node, its estimate the larger of the two; its children move under it).
3. A node's score is the product of c along its path (never above its parent's), and the best `n` nodes
   by score form the tree (`tree.best_nodes`, shared with ESP and STAND). A proposer with nothing to offer
   (no match, no probe) has only invalid entries and the others get the whole budget.
4. ESP's masks ride on the root and, in trees of at least `mask_min_nodes` nodes, on the `n // mask_every`
   nodes most likely to end the accepted path (P(reach u) - sum of P(reach child)); the next pass's probe
   comes from the last accepted slot's masks (none when that slot owned no masks: the row then drafts from
   the n-gram proposers and the root's masks give it a probe again).

Variants (block_complexity=auto picks one per look by measured throughput, `policy.BlockPolicy`):
"merged" is the above; "ngram" is the n-gram continuation alone (a prompt-lookup chain: no masks, no store
lookups, no merge, the accepted path already in place; the corpus fills in where the row's own history
has no match), for text where copying carries the acceptance and the merge's own work would cost more
than the extra drafts it finds. The store and the probe are not
updated on ngram passes (the EMA of the mask vector is replayed when masks are fed again).

Block tokens: (1 + n) tree slots + k * owners masks (owners = 1, or 1 + n // mask_every from mask_min_nodes
nodes on). A fixed block complexity BC gets the largest n that fits; block_complexity=auto asks `draft_mass`
(the calibrated scores, best first) and the policy picks n, plain decoding included.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch

from ..consts import constant
from ..tree import DraftTree, best_nodes, block_layout
from ..passes import Block, PassPlan, PassRecord, RowsView
from .base import FULL
from .calibration import AcceptanceCalibration
from .common import NEG, CandidatePool, Memo, pool_depth
from .corpus import CorpusNgrams
from ..auto.sizer import DraftSizer
from ..graphs.hooks import StepHooks, StepProbe
from .base import Drafter
from .cp_heads import CPHeadsDrafter, CPHeadsState
from .esp import ProbeSpec, ProbeStage, candidate_pool
from .mask_probe import ESPState, MaskModel, MaskProbe, MaskSettings
from .pld import PromptLookupDrafter
from .stand import StandDrafter, StandState, pool_parents

NGRAM, STORE, ESP, CORPUS = 0, 1, 2, 3


def mask_owners(num_nodes: int, mask_every: int, mask_min_nodes: int) -> int:
    """Slots that own masks in a tree of n draft nodes: the root, plus n // mask_every nodes once n reaches
    mask_min_nodes (below it a draft node is worth more than a probe on an unlikely path end)."""
    return 1 + (num_nodes // mask_every if num_nodes >= mask_min_nodes else 0)


def hybrid_tokens(num_nodes: int, num_masks: int, mask_every: int, mask_min_nodes: int = 0) -> int:
    """Tokens fed per row for n draft nodes (-1 = plain pass, 0 = root + its masks)."""
    if num_nodes < 0:
        return 1
    return 1 + num_nodes + num_masks * mask_owners(num_nodes, mask_every, mask_min_nodes)


def path_products(cond: torch.Tensor, valid: torch.Tensor, par: torch.Tensor, max_depth: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cum, ok) [B, P]: each node's product of `cond` along its path from the root, and whether every node on
    that path is `valid`. par [B, P]: parent pool index, -1 under the root; no path deeper than max_depth.

    By pointer doubling: each round multiplies a node's product with its current ancestor's and jumps that
    ancestor twice as far, so ceil(log2(max_depth)) rounds of five operations cover every path (a loop over depths
    takes max_depth - 1 rounds). The root's place is a sentinel column past the pool (product 1, valid, its own
    parent), so a round needs no masking.
    Example: cond [0.5, 0.4, 0.9], par [-1, 0, 1] -> cum [0.5, 0.2, 0.18]."""
    b, p = cond.shape
    cum = torch.nn.functional.pad(cond, (0, 1), value=1.0)  # [B, P + 1]
    ok = torch.nn.functional.pad(valid, (0, 1), value=True)
    up = torch.where(par < 0, p, par)
    up = torch.nn.functional.pad(up, (0, 1), value=p)
    rounds = max(max_depth - 1, 0).bit_length()  # after r rounds a node's product covers 2^r nodes of its path
    for r in range(rounds):
        cum = cum * cum.gather(1, up)
        ok = ok & ok.gather(1, up)
        if r + 1 < rounds:  # (the last round's jumps are never used)
            up = up.gather(1, up)
    return cum[:, :p], ok[:, :p]


def hybrid_nodes(block_complexity: int, num_masks: int, mask_every: int, mask_min_nodes: int = 0) -> int:
    """The most draft nodes a block of `block_complexity` tokens holds (tokens grow with n).
    k=1, every 4: BC 10/30/60 -> 7/23/47 nodes; with mask_min_nodes 32 -> 8/28/47."""
    n = 0
    while hybrid_tokens(n + 1, num_masks, mask_every, mask_min_nodes) <= block_complexity:
        n += 1
    return n


def _root_owner(b: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(owners [B, 1] = the root, mask_owner [B, T] = [0, -1, ..]): a tree whose masks the root alone owns."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        mask_owner = torch.full((b, t), -1, dtype=torch.long, device=device)
        mask_owner[:, 0] = 0
        return torch.zeros((b, 1), dtype=torch.long, device=device), mask_owner

    return constant(("hybrid_root_owner", b, t, device), make)


@dataclass(frozen=True)
class MergedPool:
    """Every proposer's candidates in one pool of P nodes, topological (a parent before its children)."""

    rank: torch.Tensor  # [B, P] calibrated probability the node is accepted (its path's product), -1 where not valid
    valid: torch.Tensor  # [B, P] bool: a live candidate (merged duplicates and orphans are not)
    tokens: torch.Tensor  # [B, P]
    parents: torch.Tensor  # [B, P] pool index of the parent, -1 under the root
    source: torch.Tensor  # [B, P] proposer (NGRAM, STORE, ESP, CORPUS or the heads')
    cell: torch.Tensor  # [B, P] the calibration's (proposer, depth) index
    q: torch.Tensor  # [B, P] the proposer's own P(accepted | parent accepted)


@dataclass(frozen=True)
class _NgramLayout:
    """What the depth-major n-gram pool [chain_1, alt_1.., chain_2, ...] of D depths and K entries each keeps fixed."""

    parents: torch.Tensor  # [1, D*K] pool index of the parent, -1 under the root
    depth: torch.Tensor  # [1, D*K] depth - 1
    chain: torch.Tensor  # [1, D*K] bool: a chain entry (the n-gram's own token)
    kind: torch.Tensor  # [1, D*K] NGRAM for chain entries, STORE for the stored alternatives
    cell: torch.Tensor  # [1, D*K] the calibration's (proposer, depth) index


def _ngram_layout(depth: int, k: int, depth_bound: int, device: torch.device) -> _NgramLayout:
    """Built once per shape: a pass reads it (ten operations fewer per merged pool)."""

    def make() -> _NgramLayout:
        d = torch.arange(depth, device=device)[:, None].expand(depth, k).reshape(1, -1)
        chain = (torch.arange(depth * k, device=device) % k == 0)[None]
        kind = torch.where(chain, NGRAM, STORE)
        return _NgramLayout(pool_parents(depth, k, device)[None], d, chain, kind, kind * depth_bound + d)

    return constant(("hybrid_ngram_layout", depth, k, depth_bound, device), make)


@dataclass(frozen=True)
class _Candidates:
    """One proposer's (or several's) candidates before the merge, parents already in the merged pool's numbering."""

    tokens: torch.Tensor  # [B, P]
    parents: torch.Tensor  # [B, P] merged pool index of the parent, -1 under the root
    valid: torch.Tensor  # [B, P] bool
    q: torch.Tensor  # [B, P] the proposer's own P(accepted | parent accepted)
    cell: torch.Tensor  # [B, P] the calibration's (proposer, depth) index
    source: torch.Tensor  # [B, P] proposer

    @staticmethod
    def cat(parts: list[_Candidates]) -> _Candidates:
        return _Candidates(*(torch.cat([getattr(p, f.name) for p in parts], 1) for f in fields(_Candidates)))


@dataclass(frozen=True)
class Proposed:
    """What calibration learns from about the tree a pass fed, per tree slot."""

    cell: torch.Tensor  # [B, T] the calibration's (proposer, depth) index of each slot
    q: torch.Tensor  # [B, T] its proposer's own P(accepted | parent accepted)


@dataclass
class HybridState(ESPState, StandState, CPHeadsState):
    """ESP's probe and mask vector, STAND's logit store and (with heads) the heads' hidden state."""


@dataclass(frozen=True)
class HybridSettings:
    block_complexity: int  # tokens fed per row of the largest tree, masks included
    mask_every: int = 4  # in trees of mask_min_nodes nodes or more, one mask owner per this many nodes
    mask_min_nodes: int = 0
    prior: tuple[float, ...] = (0.8, 0.5, 1.0, 0.6)  # calibration priors of ngram, store, esp, corpus
    decay: float = 0.99  # of the calibration's running counts
    heads_prior: float = 1.0
    expansion: str = "top1"  # the ESP pool's expansion (Algorithm 1)


class HybridDrafter(Drafter, DraftSizer, StepHooks):
    name = "hybrid"
    state_type = HybridState
    proposers = ("ngram", "store", "esp")
    needs_probe_to_draft = False  # the n-gram proposers draft without a probe
    variants = ("merged", "ngram")

    def __init__(self, store: StandDrafter, chain: PromptLookupDrafter, model: MaskModel, mask: MaskSettings,
                 settings: HybridSettings, corpus: Optional[CorpusNgrams] = None,
                 heads: Optional[CPHeadsDrafter] = None):
        super().__init__()
        num_masks, block_complexity = mask.num_masks, settings.block_complexity
        mask_every, mask_min_nodes, prior = settings.mask_every, settings.mask_min_nodes, settings.prior
        n = hybrid_nodes(block_complexity, num_masks, mask_every, mask_min_nodes)
        if (store.max_ngram, store.min_ngram) != (chain.max_ngram, chain.min_ngram):
            raise ValueError("hybrid's store and chain must match n-grams of the same lengths (they share one lookup)")
        if n < 1:
            raise ValueError(f"block_complexity={block_complexity} leaves no draft node for hybrid with num_masks={num_masks}")
        self.num_masks = num_masks
        # ESP's probe with a dynamic pool sized for the whole node budget (n + 1 slots)
        self.probe = MaskProbe(model, mask, num_cand=max(1, n))
        self.expansion, self.prune = settings.expansion, mask.prune
        self.num_nodes = n
        self.store = store
        self.chain = chain  # the "ngram" variant
        self.corpus = corpus  # the job's n-grams (shared with `chain`), or None
        self.heads = heads  # trained multi-token heads, or None
        self.proposers = HybridDrafter.proposers + (("corpus",) if corpus is not None else ()) + \
            (("heads",) if heads is not None else ())
        self.heads_source = self.proposers.index("heads") if heads is not None else -1
        self.variant = "merged"
        self._chain_pass = False  # the last propose was an ngram-variant pass
        self.mask_every = mask_every
        self.mask_min_nodes = mask_min_nodes
        self.depth_bound = max(store.depth, num_masks, heads.depth if heads is not None else 0)
        d = self.depth_bound
        # calibration per (proposer, depth), flattened [proposers * D] (cell = proposer * D + depth - 1)
        priors = dict(zip(("ngram", "store", "esp", "corpus"), prior))
        priors["heads"] = settings.heads_prior
        self.calibration = AcceptanceCalibration(torch.tensor([priors[p] for p in self.proposers]).repeat_interleave(d),
                                                 settings.decay)
        # per state of the rows and whether the corpus was consulted (the policy's look may have built it with the
        # previous read's hints): the look and the pass's propose read one pool
        self._pools: Memo[MergedPool] = Memo()
        self._last: Optional[Proposed] = None  # the tree last proposed, until its pass is observed

    @property
    def reads_slot_logits(self) -> bool:  # a pass of the n-gram set consults no logit store (`observe`)
        return self.variant != "ngram"

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    @property
    def depth_limit(self) -> Optional[int]:
        return None  # n-gram chains go as deep as their nodes

    def block_tokens(self, num_nodes: int) -> int:
        return hybrid_tokens(num_nodes, self.num_masks, self.mask_every, self.mask_min_nodes)

    def sizes(self, variant: str) -> tuple[Callable[[int], int], int]:
        if variant == "ngram":
            return self.chain.block_tokens, self.chain.max_nodes
        return self.block_tokens, self.num_nodes

    def alpha(self, dev: Optional[torch.device] = None) -> torch.Tensor:
        """[proposers * D] calibration factors (ngram and corpus: the acceptance rate per depth)."""
        return self.calibration.factors(dev or self.calibration.pred.device)

    # ---- state -------------------------------------------------------------------------------------
    def start_job(self) -> None:
        self._pools.clear()
        if self.corpus is not None:
            self.corpus.reset()

    def finish_request(self, token_ids: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(token_ids)

    def row_hints(self, view: RowsView) -> Optional[torch.Tensor]:
        return self.chain.row_hints(view)  # with a corpus: whether any row needs it next pass

    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        self.calibration.to(view.hist.device)  # here, not inside a pass (a host-to-GPU copy synchronises)
        if self.chain is not None:
            self.chain.start_rows(view)
        self.store.start_rows(view)
        if self.heads is not None:
            self.heads.start_rows(view)
        return self.probe.start_rows(view)

    def observe(self, view: RowsView, result: PassRecord) -> None:
        self._pools.clear()  # the probe, the store and the calibration change
        if self.heads is not None:  # every pass: the last accepted slot's hidden state (a gather)
            self.heads.observe(view, result)
        if self.variant == "ngram" and not result.prefill:  # no masks fed, store not consulted
            self.probe.observe(view, result)  # the probe goes stale; the EMA waits for the next masks
            if self._chain_pass:
                self.chain.observe(view, result)
            self._chain_pass, self._last = False, None
            return
        self._probe(view, result)  # the probe and the mask EMA
        self.store.observe(view, result)  # the logit store
        if result.block is not None and result.block.source is not None and self._last is not None:
            self._calibrate(result)
        self._last = None

    def _probe(self, view: RowsView, result: PassRecord) -> None:
        logits = self.probe.observe(view, result)
        staged = result.staged_probe
        if staged is not None:  # the replayed pass ran the probe (`step_probe`)
            view.state.cand_lp, view.state.cand_ids = staged.cand_lp, staged.cand_ids
        elif logits is not None:
            self.probe.candidates(view, logits)

    def step_probe(self, view: RowsView, block: Block) -> Optional[StepProbe]:
        """A replayed pass of the merged set ends with what `observe` reads of it: the model's top K along the
        accepted path (the logit store), and after a pass that fed masks the probe (the EMA, the candidates of the
        masks the last accepted slot's owner holds). The n-gram set's passes read neither."""
        if self.variant == "ngram" or (block.aux_embeds is not None and self.probe.owes):
            return None
        probe = None
        if block.aux_embeds is not None:
            probe = ProbeSpec(self.probe.num_cand, self.prune, (), self.num_masks)
        owners = probe is not None and block.mask_owner is not None
        stage = ProbeStage(probe, owners, max(self.probe.ema_lambda, 0.0), self.store.topk)
        return StepProbe(stage, view.state.m if probe is not None else None, block.mask_owner if owners else None)

    def _calibrate(self, result: PassRecord) -> None:
        self.calibration.update(result.block.tree, result.path_slots, result.num_committed, self._last.cell,
                                self._last.q, result.live)

    # ---- candidates --------------------------------------------------------------------------------
    def _merged_pool(self, view: RowsView) -> MergedPool:
        """The merged pool of this state of the rows (until the probe, the store or the calibration change)."""
        corpus = self.corpus is not None and self.chain.corpus_needed(view)
        return self._pools.get((view.version, corpus), lambda: self._build_pool(view, corpus))

    def _build_pool(self, view: RowsView, corpus: bool) -> MergedPool:
        """The n-gram proposers' candidates, then the model's (ESP's probe, the heads), merged (module docstring)."""
        ngram = self._ngram_candidates(view, corpus)
        offset = ngram.tokens.shape[1]
        st = view.state
        esp = candidate_pool(view.root, st.cand_lp, st.cand_ids, self.num_nodes + 1, self.expansion, self.prune)
        esp = replace(esp, depth=pool_depth(esp.parents, self.num_masks))
        model = self._from_pool(esp, st.has_probe, ESP, offset)
        if self.heads is not None:  # the heads' pool behind esp's
            heads = self._from_pool(self.heads.pool(view), st.cp_ok, self.heads_source, offset + esp.tokens.shape[1])
            model = _Candidates.cat([model, heads])
        return self._merge(ngram, model)

    def _ngram_candidates(self, view: RowsView, corpus: bool) -> _Candidates:
        """The chain of each row's match with the store's alternatives at each depth, depth-major [chain_1, alt_1..,
        chain_2, ...] (STAND's layout); with `corpus`, the job's n-grams for rows with no match of their own."""
        b, dev = view.root.shape[0], view.root.device
        c = self.store.candidates(view, self.chain.own_start(view))  # the chain's match (same n-gram lengths)
        chain, ok = c.chain, c.ok
        if corpus:  # rows with no match of their own: the job's n-grams (no stored branches)
            chain, ok, from_corpus = self.corpus.fill(view.hist, view.hist_len, chain, ok)
        dep, kk = chain.shape[1], self.store.topk
        p = dep * kk
        tokens = torch.cat([chain[..., None], c.alt_ids], 2).reshape(b, p)
        q = torch.cat([ok.float()[..., None], c.alt_lp.exp()], 2).reshape(b, p)
        valid = torch.cat([ok[..., None], c.alt_lp > NEG], 2).reshape(b, p)
        layout = _ngram_layout(dep, kk, self.depth_bound, dev)
        kind, cell = layout.kind.expand(b, -1), layout.cell.expand(b, -1)
        if corpus:  # the chain's entries of rows that took the corpus's
            kind = torch.where(from_corpus[:, None] & layout.chain, CORPUS, kind)
            cell = kind * self.depth_bound + layout.depth
        return _Candidates(tokens, layout.parents.expand(b, -1), valid, q, cell, kind)

    def _from_pool(self, pool: CandidatePool, usable: torch.Tensor, source: int, offset: int) -> _Candidates:
        """A model proposer's pool (joint log-probs) as candidates: each node's conditional probability given its
        parent, its parents `offset` places on (behind the pools before it); rows not `usable` [B] offer nothing."""
        score, par = pool.score, pool.parents
        valid = pool.valid & usable[:, None]
        parent_score = torch.where(par < 0, 0.0, score.gather(1, par.clamp(min=0)))
        q = torch.where(valid, (score - parent_score).exp(), 0.0)
        return _Candidates(pool.tokens, torch.where(par < 0, -1, par + offset), valid, q,
                           source * self.depth_bound + pool.depth - 1, torch.full_like(pool.tokens, source))

    def _merge(self, ngram: _Candidates, model: _Candidates) -> MergedPool:
        """One pool: a model candidate equal to an earlier live one (n-gram, then the model's) under the same parent
        merges into it, keeping the larger estimate; then calibrated estimates multiplied along each path."""
        b, dev = ngram.tokens.shape[0], ngram.tokens.device
        p1, p2 = ngram.tokens.shape[1], model.tokens.shape[1]
        heads = self.heads is not None
        e_tok, e_par, e_valid = model.tokens, model.parents, model.valid
        tok = torch.cat([ngram.tokens, e_tok], 1)
        valid = torch.cat([ngram.valid, e_valid], 1)
        # (esp's own candidates never repeat one another: without heads the n-gram pool is the only target)
        tgt = p1 + p2 if heads else p1
        pos = torch.arange(p1 + p2, device=dev)
        earlier = pos[None, :] < pos[p1:, None] if heads else None  # [P2, P] target below candidate
        alias = pos.expand(b, -1).clone()
        dup = torch.zeros((b, p2), dtype=torch.bool, device=dev)
        root, up = e_par < 0, e_par.clamp(min=0)
        eff = e_par  # [B, P2] effective parents: a merged candidate's children hang under what it merged into
        for r in range(max(self.num_masks, self.heads.depth if heads else 0)):  # the deepest merging pool
            if r:  # (nothing has merged before the first round)
                eff = torch.where(root, -1, alias.gather(1, up))
            if heads:  # live targets (not merged away themselves) below the candidate
                t_par, live = torch.cat([ngram.parents, eff], 1), (valid & (alias == pos))[:, None, :] & earlier
            else:
                t_par, live = ngram.parents, ngram.valid[:, None, :]
            same = (eff[:, :, None] == t_par[:, None, :]) & (e_tok[:, :, None] == tok[:, None, :tgt])
            same &= live & e_valid[:, :, None]
            dup = same.any(-1)
            alias[:, p1:] = torch.where(dup, same.long().argmax(-1), pos[p1:])
        e_par = torch.where(root, -1, alias.gather(1, up))
        par = torch.cat([ngram.parents, e_par], 1)
        q = torch.cat([ngram.q, model.q], 1)
        cell = torch.cat([ngram.cell, model.cell], 1)
        valid = torch.cat([ngram.valid, e_valid & ~dup], 1)
        src = torch.cat([ngram.source, model.source], 1)
        cond = (self.alpha(dev)[cell] * q).clamp(max=1.0)  # calibrated P(accepted | parent accepted)
        merged = torch.where(dup, cond[:, p1:], 0.0)  # a merged node keeps the larger estimate
        into = torch.zeros_like(cond).scatter_reduce(1, alias[:, p1:], merged, reduce="amax", include_self=False)
        cond = torch.maximum(cond, into)
        cum, valid = path_products(cond, valid, par, self.depth_bound)
        return MergedPool(torch.where(valid, cum, -1.0), valid, tok, par, src, cell, q)

    @staticmethod
    def _mask_owners(pool: MergedPool, tree: DraftTree, keep: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(owners [B, m] slots in order, mask_owner [B, T] each slot's owner index or -1): the root and the m - 1
        nodes most likely to end the accepted path, P(reach u) - sum of P(reach child)."""
        b, t = tree.tokens.shape
        reach = torch.nn.functional.pad(pool.rank.gather(1, keep).clamp(min=0.0), (1, t - 1 - keep.shape[1]), value=1.0)
        reach = reach * tree.valid
        below = torch.zeros_like(reach).scatter_add_(1, tree.parents[:, 1:].clamp(min=0), reach[:, 1:])
        end = torch.where(tree.valid, reach - below, -1.0)
        extra = end[:, 1:].topk(m - 1, dim=1).indices + 1
        owners = torch.nn.functional.pad(extra.sort(dim=1).values, (1, 0))  # [B, M] the root first
        mask_owner = torch.full((b, t), -1, dtype=torch.long, device=tree.tokens.device)
        mask_owner.scatter_(1, owners, torch.arange(m, device=owners.device).expand(b, -1))
        return owners, mask_owner

    def draft_mass(self, view: RowsView, variant: str = "") -> torch.Tensor:
        """[B, max_nodes] calibrated acceptance estimate of each node of the largest tree, best first."""
        if (variant or self.variant) == "ngram":
            return self.chain.draft_mass(view)
        rank = self._merged_pool(view).rank
        n = min(self.num_nodes, rank.shape[1])
        top = rank.topk(n, dim=1).values.clamp(min=0.0)
        return torch.nn.functional.pad(top, (0, self.num_nodes - n))

    # ---- the tree ----------------------------------------------------------------------------------
    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """num_nodes None = the configured size; -1 = plain pass (no masks); 0 = root + masks (re-probe)."""
        n = self.num_nodes if plan.num_nodes is None else min(plan.num_nodes, self.num_nodes)
        if plan.variant:
            self.variant = plan.variant  # the proposer set of this pass (observe learns by it)
        self._last = None
        if n < 0:
            return self.blocks.build(DraftTree.root_only(view.root), None, self.num_masks, max_depth=0)
        if self.variant == "ngram" and n > 0:
            block = self.chain.propose(view, PassPlan(n))
            block.source = torch.where(self.chain.from_corpus(view), CORPUS, NGRAM)[:, None]  # [B, 1]: the whole chain
            self._chain_pass = True
            return block
        if n == 0:
            return self.blocks.build(DraftTree.root_only(view.root), self.probe.mask_inputs(view, self.num_masks),
                                     self.num_masks, max_depth=0)
        pool = self._merged_pool(view)
        tree, keep = best_nodes(view.root, pool.rank, pool.valid, pool.tokens, pool.parents, n)
        b, t, dev = tree.tokens.shape[0], tree.num_slots, tree.tokens.device
        n_kept = keep.shape[1]
        pad = lambda x, fill: torch.nn.functional.pad(x, (1, t - 1 - n_kept), value=fill)  # noqa: E731 root + padding
        source = pad(pool.source.gather(1, keep), -1)
        self._last = Proposed(pad(pool.cell.gather(1, keep), 0), pad(pool.q.gather(1, keep), 0.0))
        m = mask_owners(n, self.mask_every, self.mask_min_nodes)
        owners, mask_owner = self._mask_owners(pool, tree, keep, m) if m > 1 else _root_owner(b, t, dev)
        depth = min(n, self.depth_bound)
        layout = block_layout(tree.parents, self.num_masks, owners, depth)
        aux = self.probe.mask_inputs(view, m * self.num_masks)
        return Block(tree=tree, layout=layout, aux_embeds=aux, max_depth=depth,
                     mask_owner=mask_owner, source=source)
