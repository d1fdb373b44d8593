"""ESP's mask probe: the per-row mask vector m and the candidates its masks predict (Goel et al., arXiv 2603.17942).

Each tree slot may own k mask inputs whose embedding is the per-row vector m. The hidden states of the masks owned
by the last accepted slot give, through the LM head, candidates for depths 1..k of the next tree (mask j stood at
pos(last) + j, which is depth j under the new root). m starts from the prompt's embeddings and moves by EMA toward
each committed token's embedding. ESP drafts its trees from these candidates; the hybrid merges them with its
n-gram proposers: both own a `MaskProbe`.

State per row (`ESPState`): `m` [B, 1, D]; `cand_lp` [B, k, C] sorted log-probs and `cand_ids` [B, k, C] of each
mask's top-C tokens; `has_probe` [B] bool (False until a probe exists, e.g. when prefill probing is off).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..passes import PassRecord, RowsView
from ..row_state import RowState, row_field
from .common import NEG, ema_apply

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


@dataclass(frozen=True)
class MaskSettings:
    """How the masks are fed and m is kept (engine.num_masks, mask_init*, ema_lambda, probe_prefill, prune)."""

    num_masks: int
    mask_init: str = "mean"  # mean | last_k | sample | offset
    mask_init_last_k: int = 1
    mask_init_offset: float = 5.0
    ema_lambda: float = 0.1
    probe_prefill: bool = True  # the prefill feeds masks too (the first pass can draft)
    prune: bool = True  # mask 1's candidates never repeat the root's own token


@dataclass
class MaskModel:
    """What the probe needs of the model."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids [..] -> input embeddings [.., D]
    logits: Callable[[torch.Tensor], torch.Tensor]  # hidden states [.., D] -> logits [.., V]
    embedding_table: torch.Tensor  # [V, D] the input embedding's weight (mask_init sample | offset)
    dtype: Optional[torch.dtype] = None  # the model's dtype (the mask inputs'); None = the table's


class MaskProbe:
    """The mask vector and the probe's candidates of a drafter's rows (in `view.state`, an `ESPState`)."""

    def __init__(self, model: MaskModel, settings: MaskSettings, num_cand: int):
        self.embed, self.logits = model.embed, model.logits
        self.num_masks = settings.num_masks
        self.num_cand = num_cand  # top candidates kept per mask
        self.prune = settings.prune
        self.mask_init, self.last_k, self.offset = settings.mask_init, settings.mask_init_last_k, settings.mask_init_offset
        self.ema_lambda, self.probe_prefill = settings.ema_lambda, settings.probe_prefill
        table = model.embedding_table.float()
        self.table_mu = table.mean(0)  # [D]
        self.table_sigma = table.std(0)  # [D]
        self.dtype = model.dtype or self.table_mu.dtype
        self._ema_cols: dict[int, torch.Tensor] = {}
        self._ema: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        # host flag: some row may hold a fresh probe (False after a plain pass fed no masks); lets the policy skip
        # a device read on the plain path
        self.probe_maybe = True
        self._probe_partial = False  # the last probe fed masks on some rows only (mask_ok): has_probe says which
        self._lag = 0  # host bound on max(hist_len - m_len) over the batch rows: tokens the EMA still owes
        # host flag: every row of the batch holds a fresh probe (its last pass fed it masks); then a tree need not be
        # masked with has_probe. Conservative: False until a decode pass probed every row
        self._all_probed = False

    @property
    def all_probed(self) -> bool:
        return self._all_probed

    @property
    def ema_table_size(self) -> int:
        """Gaps the EMA's weight table covers now (it grows with the widest replay, up to EMA_TABLE_MAX)."""
        return 0 if self._ema is None else self._ema[1].shape[0]

    @property
    def owes(self) -> bool:
        """m still owes tokens committed by passes that fed no masks."""
        return self._lag > 0

    def mask_inputs(self, view: RowsView, count: int) -> torch.Tensor:
        """[B, count, D] mask inputs of the next block, m brought up to date first."""
        if self._lag:
            self.catch_up(view, self._lag)  # after plain passes m still owes their tokens
            self._lag = 0
        return mask_inputs(view.state.m, count, self.dtype)

    def candidates(self, view: RowsView, logits: torch.Tensor) -> None:
        """The candidates of the probe's logits [B, k, V] into the rows' state (`probe_candidates`)."""
        view.state.cand_lp, view.state.cand_ids = probe_candidates(logits, view.root, self.num_cand, self.prune)

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
        view.state.m_len = plen.clone()  # history length m has seen (EMA applied lazily, see catch_up)
        view.state.cand_lp = torch.full((b, k, cn), NEG, device=dev)
        view.state.cand_ids = torch.zeros((b, k, cn), dtype=torch.long, device=dev)
        view.state.has_probe = torch.zeros(b, dtype=torch.bool, device=dev)
        if not self.probe_prefill:
            return None
        return mask_inputs(m, self.num_masks, self.dtype)

    def observe(self, view: RowsView, result: PassRecord) -> Optional[torch.Tensor]:
        """The probe's flags and the EMA after a pass; returns the probe's logits [B, k, V] when masks were fed
        (the drafter turns them into candidates: `candidates`, or its kernel), else None. When the replayed pass
        ran the probe (`result.probe`) the EMA is its m and there are no logits: the candidates came with it."""
        st = view.state
        committed = result.committed.shape[1]  # host bound on the tokens this pass committed per row
        staged = result.staged_probe is not None
        if result.mask_hidden is not None or staged:
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
                self.catch_up(view, committed)
            elif self._lag:
                self.catch_up(view, self._lag + committed)
                self._lag = 0
            else:  # m was up to date before this pass: it owes exactly the tokens just committed
                done = result.probe.m if staged else None
                self.catch_up(view, committed, fresh=(result.committed, result.num_committed, done))
            return None if staged else self.logits(result.mask_hidden)
        if not result.prefill:
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
            self.catch_up(view, committed)
        return None

    def needs_probe(self, view: RowsView) -> bool:
        if not self.probe_maybe:
            return True
        # after a pass that fed every row masks, every row has a probe (rows that joined since came with one):
        # known on the host; only masks on some rows (mask_ok) leave it to the device
        return self._probe_partial and not bool(view.state.has_probe.any())

    def catch_up(self, view: RowsView, bound: int, fresh: Optional[tuple] = None) -> None:
        """Apply the EMA for every token committed since m was last updated, in order:
        m_n = (1-lam)^n m + sum_i lam (1-lam)^(n-1-i) E[e_i] over the n tokens e_i = hist[m_len:hist_len].
        `bound` >= every row's n is known on the host, so the width of the gather needs no device read.
        `fresh` = (committed [B, S], n [B], m after them or None): this pass's tokens, when they are exactly what
        every row owes (m was up to date before the pass); they are used as they are, with no gather from the
        history, and a new m the replayed pass's probe stage computed is taken as it is.

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

    def _ema_columns(self, g: int, dev: torch.device) -> torch.Tensor:
        """The table's first 1 + g columns as [N+1, 1, 1+g] (cached per g until the table is rebuilt)."""
        table = self._ema_table(g, dev)[0]
        cols = self._ema_cols.get(g)
        if cols is None:
            cols = self._ema_cols[g] = table[:, None, : g + 1].contiguous()
        return cols

    def _ema_table(self, g: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [N+1, 1+N], steps [N]) for gaps up to N >= g, N a power of two: table[n, 0] = (1-lam)^n (the
        old m's weight) and table[n, 1+i] = lam (1-lam)^(n-1-i) for i < n, else 0; steps = 0 .. N-1. Built on
        the device (no host data), once per size."""
        if self._ema is None or self._ema[1].shape[0] < g or self._ema[1].device != dev:
            size = max(8, 1 << (g - 1).bit_length())
            self._ema, self._ema_cols = (ema_table(self.ema_lambda, size, dev), torch.arange(size, device=dev)), {}
        return self._ema


def ema_table(lam: float, size: int, dev: torch.device) -> torch.Tensor:
    """[size + 1, 1 + size] float32 EMA weights for gaps up to `size`: row n is [(1-lam)^n, w_0 .. w_{size-1}] with
    w_i = lam (1-lam)^(n-1-i) for i < n, else 0 (`ema_apply`'s table). Each entry depends on (n, i) alone, so a
    table of any size holds the same values where they overlap."""
    n = torch.arange(size + 1, device=dev, dtype=torch.float64)
    i = torch.arange(size, device=dev, dtype=torch.float64)
    weights = torch.where(i[None] < n[:, None], lam * (1 - lam) ** (n[:, None] - 1 - i[None]).clamp(min=0), 0.0)
    return torch.cat([((1 - lam) ** n)[:, None], weights], 1).float()


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


def mask_inputs(m: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask inputs of a block: m [B, 1, D] in `dtype` (the model's) as [B, count, D] (a view)."""
    if m.dtype != dtype:
        m = m.to(dtype)
    return m.expand(-1, count, -1)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    return g
