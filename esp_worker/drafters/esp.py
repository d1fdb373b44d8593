"""ESP: mask-token probing (Goel et al., arXiv 2603.17942). No draft model, no training.

Each tree slot owns k mask inputs whose embedding is the per-sequence vector m. The hidden states of the
masks owned by the last accepted slot give, through the LM head, candidates for depths 1..k of the next tree
(mask j stood at pos(last) + j, which is depth j under the new root). m starts from the prompt's embeddings
and moves by EMA toward each committed token's embedding.

State per row: `m` [B, 1, D]; `cand_lp` [B, k, C] sorted log-probs and `cand_ids` [B, k, C] of each mask's top-C
tokens; `has_probe` [B] bool (False until a probe exists, e.g. when prefill probing is off).

Under engine.compile_host (CPU) the work after the probe's LM head, when every row was probed and the tree is
static, is one AOTInductor kernel (`probe_block`, made of the eager functions `probe_candidates` and
`static_tree_tokens`): the candidates, the next pass's tree and all of its input embeddings, which `propose`
takes as they are while the roots, candidates and m are the ones they were built from. Integers and copies
only past the normaliser, so the drafts are the eager ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ..auto.sizer import DraftSizer
from ..kernels.aot import AotKernels
from ..kernels.hooks import KernelHooks
from ..passes import Block, PassPlan, PassRecord, RowsView
from ..consts import ones
from ..sampling import upload
from ..tree import DraftTree, best_nodes, static_branches, static_parents
from .base import FULL, Drafter
from .common import NEG, ema_apply, topk_excluding  # noqa: F401  (topk_excluding re-exported for callers of esp)
from ..row_state import RowState, row_field


EMA_TABLE_MAX = 1024  # widest EMA replay in one step (its weight table is [N + 1, N]); wider gaps go in chunks


def ema_window(lam: float) -> int:
    """Tokens whose EMA weights sum to all but < 2^-40 of m: (1 - lam)^W < 2^-40 (lam 0.1: 264; lam 1: 1)."""
    if lam >= 1.0:
        return 1
    return max(1, math.ceil(40 * math.log(2) / -math.log1p(-lam)))


@dataclass
class ESPState(RowState):
    m: Optional[torch.Tensor] = row_field()  # [B, 1, D] running mask embedding (EMA of the history's embeddings)
    m_len: Optional[torch.Tensor] = row_field()  # [B] history length m has seen (the EMA is applied lazily)
    cand_lp: Optional[torch.Tensor] = row_field(NEG)  # [B, k, C] the probe's candidates per mask, log-probs
    cand_ids: Optional[torch.Tensor] = row_field()  # [B, k, C] their token ids
    has_probe: Optional[torch.Tensor] = row_field()  # [B] bool: the candidates come from the last pass

class ESPDrafter(Drafter, DraftSizer, KernelHooks):
    state_type = ESPState
    name = "esp"
    needs_probe_to_draft = True  # ESP drafts from its last probe only
    # host flag: some row may hold a fresh probe (False after a plain pass fed no masks); lets the policy skip a
    # device read on the plain path
    probe_maybe = True

    def __init__(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor],
        embedding_table: torch.Tensor,  # [V, D]
        num_masks: int,
        block_complexity: int,
        tree: str = "dynamic",
        branches: Optional[list[int]] = None,
        expansion: str = "top1",
        prune: bool = True,
        mask_init: str = "mean",
        mask_init_last_k: int = 1,
        mask_init_offset: float = 5.0,
        ema_lambda: float = 0.1,
        probe_prefill: bool = True,
    ):
        super().__init__()
        self._ema_cols: dict[int, torch.Tensor] = {}
        self.embed, self.logits = embed, logits
        self.num_masks = k = num_masks
        self.tree_mode, self.expansion, self.prune = tree, expansion, prune
        self.mask_init, self.last_k, self.offset = mask_init, mask_init_last_k, mask_init_offset
        self.ema_lambda, self.probe_prefill = ema_lambda, probe_prefill
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
        self.num_cand = max(1, self.budget - 1)
        table = embedding_table.float()
        self.table_mu = table.mean(0)  # [D]
        self.table_sigma = table.std(0)  # [D]
        self._parents: dict[tuple, torch.Tensor] = {}

    # ---- mask vector -------------------------------------------------------------------------------
    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        hist, plen = view.hist, view.prompt_len  # prompt only: hist_len == prompt_len
        b, c = hist.shape
        dev = hist.device
        pos = torch.arange(c, device=dev)[None]
        if self.mask_init in ("mean", "last_k"):
            lo = (plen - self.last_k).clamp(min=0)[:, None] if self.mask_init == "last_k" else 0
            w = ((pos < plen[:, None]) & (pos >= lo)).float()  # [B, C]
            emb = self.embed(hist).float()  # [B, C, D]
            m = (w[..., None] * emb).sum(1) / w.sum(1, keepdim=True)
        elif self.mask_init == "sample":
            z = torch.stack([torch.randn(self.table_mu.shape, generator=_gen(s)) for s in view.seeds]).to(dev)
            m = self.table_mu.to(dev) + self.table_sigma.to(dev) * z
        else:  # offset
            m = (self.table_mu + self.offset * self.table_sigma).to(dev).expand(b, -1).clone()
        k, cn = self.num_masks, self.num_cand
        view.state.m = m = m.unsqueeze(1)  # [B, 1, D]: one input of the block, per row
        view.state.m_len = plen.clone()  # history length m has seen (EMA applied lazily, see _catch_up)
        view.state.cand_lp = torch.full((b, k, cn), NEG, device=dev)
        view.state.cand_ids = torch.zeros((b, k, cn), dtype=torch.long, device=dev)
        view.state.has_probe = torch.zeros(b, dtype=torch.bool, device=dev)
        if not self.probe_prefill:
            return None
        return self._mask_embeds(m, 1)

    def _mask_embeds(self, m: torch.Tensor, num_slots: int) -> torch.Tensor:
        # m: [B, 1, D] -> [B, num_slots * k, D] in the model dtype
        return mask_inputs(m, num_slots * self.num_masks, self._mask_dtype)

    @property
    def _mask_dtype(self) -> torch.dtype:
        return self.table_mu.dtype if self._model_dtype is None else self._model_dtype

    _model_dtype: Optional[torch.dtype] = None

    def set_model_dtype(self, dtype: torch.dtype) -> None:
        self._model_dtype = dtype

    def observe(self, view: RowsView, result: PassRecord) -> None:
        st = view.state
        committed = result.committed.shape[1]  # host bound on the tokens this pass committed per row
        if result.mask_hidden is not None:
            if result.mask_ok is not None:
                st.has_probe = result.mask_ok.clone()
            elif not (self._all_probed and not result.prefill):  # else every row holds a probe already
                st.has_probe = torch.ones_like(st.has_probe)
            self.probe_maybe = True
            self._probe_partial = result.mask_ok is not None  # only then may rows be left without a probe
            if not result.prefill:  # a prefill probes only the rows that join
                self._all_probed = result.mask_ok is None
            # the EMA first: a block prepared with the probe carries the new m in its masks
            if result.prefill:
                self._catch_up(view, committed)
            elif self._lag:
                self._catch_up(view, self._lag + committed)
                self._lag = 0
            else:  # m was up to date before this pass: it owes exactly the tokens just committed
                self._catch_up(view, committed, fresh=(result.committed, result.num_committed, result.ema_m))
            # the next pass can use a block prepared now when every row is probed and m owes nothing
            self._probe(view, self.logits(result.mask_hidden), prepare=self._all_probed and not result.prefill)
        elif not result.prefill:
            # a plain pass (block_complexity=auto) fed no masks: the probe is stale, and the EMA can wait
            # until masks are fed again (_catch_up replays the committed tokens from the history). After a plain
            # pass has_probe is already all False (rows that joined since came with a probe: probe_maybe True)
            if self.probe_maybe:
                st.has_probe = torch.zeros_like(st.has_probe)
                self.probe_maybe = False
            self._all_probed = False
            self._lag += committed
        else:  # a prefill without masks: the rows that join have no probe
            self._all_probed = False
            self._catch_up(view, committed)

    def _probe(self, view: RowsView, logits: torch.Tensor, prepare: bool) -> None:
        """The candidates of the probe's logits [B, k, V] (`probe_candidates`). Under engine.compile_host, when
        `prepare` and the configured tree is static, one kernel (`probe_block`) also builds the next pass's tree
        and input embeddings, which `propose` takes as they are while the roots, candidates and m are unchanged."""
        st = view.state
        branches = self._branches_for(self.num_nodes) if prepare and self._kernels is not None else None
        if branches is not None:
            args = [logits, view.root, st.m, self._embed_weight]
            dtype = self._mask_dtype
            kernel = self._kernels.get(
                (tuple(logits.shape[1:]), logits.dtype, tuple(st.m.shape[1:]), st.m.dtype, dtype, tuple(branches)),
                lambda: _ProbeBlock(self.num_cand, self.prune, branches, self.num_masks, dtype), args,
                [{0: "batch"}, {0: "batch"}, {0: "batch"}, {}]) if all(a.is_contiguous() for a in args) else None
            if kernel is not None:
                st.cand_lp, st.cand_ids, tokens, valid, embeds = kernel.boxed_run(args)  # takes the list
                self._ready = _Prepared(view.root, st.cand_lp, st.m, branches, tokens, valid, embeds)
                self.kernel_probes += 1
                return
        st.cand_lp, st.cand_ids = probe_candidates(logits, view.root, self.num_cand, self.prune)

    # engine.compile_host (`use_compiled`): the kernels and the embedding weight; the block prepared with the last
    # probe; probes run by the kernel and prepared blocks proposed
    _kernels: Optional[AotKernels] = None
    _embed_weight: Optional[torch.Tensor] = None
    _ready: Optional["_Prepared"] = None
    kernel_probes = 0
    prepared_blocks = 0

    def use_compiled(self, kernels: AotKernels, embed_weight: torch.Tensor) -> None:
        self._kernels, self._embed_weight = kernels, embed_weight

    _lag = 0  # host bound on max(hist_len - m_len) over the batch rows: tokens the EMA still owes
    # host flag: every row of the batch holds a fresh probe (its last pass fed it masks); then `propose` need not
    # mask the tree with has_probe. Conservative: False until a decode pass probed every row
    _all_probed = False

    def _catch_up(self, view: RowsView, bound: int, fresh: Optional[tuple] = None) -> None:
        """Apply the EMA for every token committed since m was last updated, in order:
        m_n = (1-lam)^n m + sum_i lam (1-lam)^(n-1-i) E[e_i] over the n tokens e_i = hist[m_len:hist_len].
        `bound` >= every row's n is known on the host, so the width of the gather needs no device read.
        `fresh` = (committed [B, S], n [B], m after them or None): this pass's tokens, when they are exactly what
        every row owes (m was up to date before the pass); they are used as they are, with no gather from the
        history, and a new m the compiled settle computed (`settle_ema`) is taken as it is.

        The host bound only grows between mask passes and outlives the rows it was counted for (a batch-1 job
        drafting from n-grams for many requests owed ~2,500 tokens, and a weight table of that size squared
        cost ~0.5 s), so its work is bounded two ways: tokens more than `ema_window` back (and the old m) weigh
        less than 2^-40 of m, below float32's resolution, so a longer gap starts m over from the window's first
        token; and a window wider than EMA_TABLE_MAX is replayed in chunks of that size, in order."""
        st = view.state
        if self.ema_lambda <= 0 or bound <= 0:
            st.m_len = view.hist_len
            return
        if fresh is not None:
            committed, n, done = fresh
            st.m, st.m_len = (done if done is not None else self._ema_step(st.m, committed, n)), view.hist_len
            return
        bound = min(bound, view.hist.shape[1])  # no row owes more than its history
        window = ema_window(self.ema_lambda)
        if bound > window:  # rows owing more than the window: m restarts from the window's first token
            start = torch.maximum(st.m_len, view.hist_len - window)
            st.m = torch.where((start > st.m_len)[:, None, None], 0.0, st.m)
            st.m_len, bound = start, window
        last = view.hist.shape[1] - 1
        while bound > 0:
            g = min(bound, EMA_TABLE_MAX)
            gap = view.hist_len - st.m_len  # [B] tokens to apply per row (<= g, or clamped to g: more chunks follow)
            if g < bound:
                gap = gap.clamp(max=g)
            idx = (st.m_len[:, None] + self._ema_table(g, st.m.device)[1][:g]).clamp(max=last)
            st.m = self._ema_step(st.m, view.hist.gather(1, idx), gap)  # tokens [B, G]
            bound -= g
            if bound > 0:
                st.m_len = st.m_len + gap
        st.m_len = view.hist_len

    def _ema_step(self, m: torch.Tensor, tokens: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
        """m [B, 1, D] after the first gap[b] <= G of tokens [B, G] (the rest ignored): one batched product of the
        weights [decay, w_0 .. w_{G-1}] with [m, E[t_0] .. E[t_{G-1}]]."""
        return ema_apply(m, self.embed(tokens), self._ema_columns(tokens.shape[1], m.device), gap)

    def settle_ema(self, view: RowsView, block: Block) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(m [B, 1, D], weight columns [N+1, 1, 1+S]) when this pass's `observe` will apply the EMA to exactly the
        tokens the pass commits (its masks were fed and m owed nothing before it), so that engine.compile_host's
        kernel can compute the new m with the pass (`ema_apply`); None otherwise."""
        if self.ema_lambda <= 0 or self._lag or block.aux_embeds is None or not self.num_masks:
            return None
        m = view.state.m
        return m, self._ema_columns(block.max_depth + 1, m.device)

    def _ema_columns(self, g: int, dev: torch.device) -> torch.Tensor:
        """The table's first 1 + g columns as [N+1, 1, 1+g] (cached per g until the table is rebuilt)."""
        table = self._ema_table(g, dev)[0]
        cols = self._ema_cols.get(g)
        if cols is None:
            cols = self._ema_cols[g] = table[:, None, : g + 1].contiguous()  # dense: compile_host's kernel reads it
        return cols

    _ema = None

    def _ema_table(self, g: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [N+1, 1+N], steps [N]) for gaps up to N >= g, N a power of two: table[n, 0] = (1-lam)^n (the
        old m's weight) and table[n, 1+i] = lam (1-lam)^(n-1-i) for i < n, else 0; steps = 0 .. N-1. Built on
        the device (no host data), once per size."""
        if self._ema is None or self._ema[1].shape[0] < g or self._ema[1].device != dev:
            lam, size = self.ema_lambda, max(8, 1 << (g - 1).bit_length())
            n = torch.arange(size + 1, device=dev, dtype=torch.float64)
            i = torch.arange(size, device=dev, dtype=torch.float64)
            weights = torch.where(i[None] < n[:, None], lam * (1 - lam) ** (n[:, None] - 1 - i[None]).clamp(min=0), 0.0)
            table = torch.cat([((1 - lam) ** n)[:, None], weights], 1).float()
            self._ema, self._ema_cols = (table, torch.arange(size, device=dev)), {}
        return self._ema

    @property
    def depth_limit(self) -> Optional[int]:
        # a mask predicts one position further, so an ESP tree is at most k deep (static trees: one level per mask)
        return self.num_masks

    def needs_probe(self, view: RowsView) -> bool:
        if not self.needs_probe_to_draft:
            return False
        if not self.probe_maybe:
            return True
        # after a pass that fed every row masks, every row has a probe (rows that joined since came with one):
        # known on the host; only masks on some rows (mask_ok) leave it to the device
        return self._probe_partial and not bool(view.state.has_probe.any())

    _probe_partial = False

    # ---- trees -------------------------------------------------------------------------------------
    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    def block_tokens(self, num_nodes: int) -> int:
        return 1 if num_nodes < 0 else (self.num_masks + 1) * (1 + num_nodes)

    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """num_nodes None = the configured size; -1 = plain pass (no masks); 0 = root + masks (re-probe)."""
        st = view.state
        n = self.num_nodes if plan.num_nodes is None else plan.num_nodes
        if n < 0:
            return self.blocks.build(DraftTree.root_only(view.root), None, self.num_masks, max_depth=0)
        branches = self._branches_for(n)
        ready = self._ready
        if (ready is not None and self._all_probed and not self._lag and ready.root is view.root
                and ready.cand_lp is st.cand_lp and ready.m is st.m and ready.branches == branches):
            # the block the last probe's kernel prepared (`_probe`): its tree and every input embedding
            tokens, valid, embeds = ready.tokens, ready.valid, ready.embeds
            b, t = tokens.shape
            tree = DraftTree(tokens, self._parents_for(b, tokens.device, branches), valid, static_key=("esp", tuple(branches)))
            block = self.blocks.build(tree, embeds.narrow(1, t, t * self.num_masks), self.num_masks, max_depth=len(branches))
            block.embeds = embeds
            self.prepared_blocks += 1
            return block
        # depth: the tree's depth (static shapes) or a bound on it (a dynamic tree is never deeper than k),
        # known on the host so that no pass reads it from the device
        if n == 0:
            tree, depth = DraftTree.root_only(view.root), 0
        elif branches is not None:
            tree, depth = self._static_tree(view.root, st.cand_lp, st.cand_ids, branches), len(branches)
        else:
            tree, depth = self._dynamic_tree(view.root, st.cand_lp, st.cand_ids, n), min(self.num_masks, n)
        if not self._all_probed:  # rows without a probe keep the root only
            tree.valid = tree.valid & (st.has_probe[:, None] | (torch.arange(tree.num_slots, device=tree.valid.device) == 0))
        if self._lag:
            self._catch_up(view, self._lag)  # after plain passes m still owes their tokens
            self._lag = 0
        aux = self._mask_embeds(st.m, tree.num_slots)
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
        st = view.state
        score = self._pool(view.root, st.cand_lp, st.cand_ids)[0]
        n = min(self.num_nodes, score.shape[1])
        top = score.topk(n, dim=1).values.exp()
        top = top * st.has_probe[:, None]
        return torch.nn.functional.pad(top, (0, self.num_nodes - n))

    def _parents_for(self, b: int, dev, branches: list[int]) -> torch.Tensor:
        key = (b, dev, tuple(branches))
        if key not in self._parents:
            self._parents[key] = upload(torch.tensor(static_parents(branches)), dev).expand(b, -1).contiguous()
        return self._parents[key]

    def _static_tree(self, root, cand_lp, cand_ids, branches: list[int]) -> DraftTree:
        tokens, valid = static_tree_tokens(root, cand_lp, cand_ids, branches, self.prune)
        return DraftTree(tokens, self._parents_for(root.shape[0], root.device, branches), valid,
                         static_key=("esp", tuple(branches)))

    def _pool(self, root, cand_lp, cand_ids):
        """Algorithm 1's candidate pool for the full budget: (score [B, P] cumulative log-prob, token [B, P],
        parent pool index [B, P], -1 = root). Pool entries are appended depth by depth (topological order).
        Reused when called twice on the same probe (draft_mass, then propose, in one pass)."""
        if self._pool_cache is not None and self._pool_cache[0] is cand_lp and self._pool_cache[1] is root:
            return self._pool_cache[2]
        out = self._build_pool(root, cand_lp, cand_ids)
        self._pool_cache = (cand_lp, root, out)
        return out

    _pool_cache = None

    def _build_pool(self, root, cand_lp, cand_ids):
        b, k, _ = cand_lp.shape
        dev = root.device
        bud = self.budget
        # depth 1: the probe's candidates never hold the root (observe excluded it when pruning)
        lp1, ids1 = topk_excluding(cand_lp[:, 0], cand_ids[:, 0], None, bud - 1)  # [B, B-1]
        pool_score, pool_tok = [lp1], [ids1]
        pool_par = [torch.full_like(ids1, -1)]  # parent pool index, -1 = root
        level_score, level_tok, level_off = lp1, ids1, 0
        for i in range(2, k + 1):
            width = bud - i
            if width < 1:
                break
            nf = 1 if self.expansion == "top1" else width
            order = level_score.sort(dim=1, descending=True, stable=True).indices  # ties: earlier candidate first
            f_idx = order[:, :nf].sort(dim=1).values  # frontier [B, F], in pool order
            f_score = level_score.gather(1, f_idx)
            f_tok = level_tok.gather(1, f_idx)
            f = f_score.shape[1]
            lp_i, ids_i = cand_lp[:, i - 1], cand_ids[:, i - 1]  # [B, C]
            if self.prune:
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
        return torch.cat(pool_score, 1), torch.cat(pool_tok, 1), torch.cat(pool_par, 1)

    def _dynamic_tree(self, root, cand_lp, cand_ids, num_nodes: int) -> DraftTree:
        """Algorithm 1 under a budget of num_nodes + 1 slots: the best num_nodes pool candidates by cumulative
        probability. A stable sort keeps a parent ahead of an equal-scoring child, so the kept set is a tree.
        (The pool is built for the full budget; for a smaller budget Algorithm 1's pool is a subset of it
        and holds the same best candidates under top-1 expansion.)"""
        score, tok, par = self._pool(root, cand_lp, cand_ids)
        tree, _ = best_nodes(root, score, score > NEG, tok, par, num_nodes)
        # with one mask every node hangs under the root: the shape is fixed and its layout can be cached
        if self.num_masks == 1:
            tree.static_key = ("esp-k1", num_nodes)
        return tree


def probe_candidates(logits: torch.Tensor, root: torch.Tensor, num_cand: int, prune: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe's candidates: (log-probs [B, k, C], token ids [B, k, C]) of each mask's top C tokens, best first,
    from its logits [B, k, V] (float32; mask 1's entry of the root token [B] is overwritten when pruning: mask
    1's candidates hang under the next root, never the root's own token). Ranked by the logits themselves, so
    the order does not depend on the normaliser's rounding; a vocabulary smaller than C pads with NEG."""
    lse = torch.logsumexp(logits, -1, keepdim=True)  # [B, k, 1]
    if prune:
        logits.select(1, 0).scatter_(1, root.unsqueeze(1), NEG)
    top = logits.topk(min(num_cand, logits.shape[-1]), dim=-1)
    lp, ids = top.values - lse, top.indices
    if lp.shape[-1] < num_cand:
        lp = torch.nn.functional.pad(lp, (0, num_cand - lp.shape[-1]), value=NEG)
        ids = torch.nn.functional.pad(ids, (0, num_cand - ids.shape[-1]))
    return lp, ids


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


def mask_inputs(m: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask inputs of a block: m [B, 1, D] in `dtype` (the model's) as [B, count, D] (a view)."""
    if m.dtype != dtype:
        m = m.to(dtype)
    return m.expand(-1, count, -1)


def probe_block(logits: torch.Tensor, root: torch.Tensor, m: torch.Tensor, embed_weight: torch.Tensor, *,
                num_cand: int, prune: bool, branches: list[int], num_masks: int, mask_dtype: torch.dtype
                ) -> tuple[torch.Tensor, ...]:
    """engine.compile_host's kernel after a probe: the candidates (`probe_candidates`), the next pass's static tree
    (`static_tree_tokens`) and its input embeddings [B, T * (1 + k), D]: the tree tokens' rows of embed_weight
    [V, D], then the T * k mask inputs (`mask_inputs`), as the engine joins them (`Engine._forward`)."""
    cand_lp, cand_ids = probe_candidates(logits, root, num_cand, prune)
    tokens, valid = static_tree_tokens(root, cand_lp, cand_ids, branches, prune)
    masks = mask_inputs(m, tokens.shape[1] * num_masks, mask_dtype).to(embed_weight.dtype)
    embeds = torch.cat([torch.nn.functional.embedding(tokens, embed_weight), masks], 1)
    return cand_lp, cand_ids, tokens, valid, embeds


class _Prepared(NamedTuple):
    """A block `probe_block` prepared, and what it was built from (valid while the rows still hold these)."""

    root: torch.Tensor  # [B] the roots
    cand_lp: torch.Tensor  # [B, k, C] the probe's candidates (the state's tensor)
    m: torch.Tensor  # [B, 1, D] the mask vector
    branches: list[int]
    tokens: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
    embeds: torch.Tensor  # [B, T * (1 + k), D]


class _ProbeBlock(torch.nn.Module):
    """probe_block with its host-known arguments fixed: what torch.export traces."""

    def __init__(self, num_cand: int, prune: bool, branches: list[int], num_masks: int, mask_dtype: torch.dtype):
        super().__init__()
        self.kw = dict(num_cand=num_cand, prune=prune, branches=list(branches), num_masks=num_masks,
                       mask_dtype=mask_dtype)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:  # logits, root, m, embed_weight
        return probe_block(*args, **self.kw)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    return g
