"""The typed values one decode pass hands from verb to verb.

    plan    = planner.plan(view)                      PassPlan: how many draft nodes, from which proposer set
    block   = drafter.propose(view, plan)             Block: the tree, its layout and the auxiliary inputs
    out     = engine.forward(rows, block)             ForwardOut: hidden states and the tree slots' logits
    settled = engine.settle(rows, block, out)         Settled: verification, stops, KV keep, commit, counters
    record  = PassRecord.of(block, out, settled)      what the drafter learns from (`drafter.observe`)

Shapes: B rows, T tree slots, A auxiliary inputs (ESP's masks), Q = T + A tokens fed per row, S tokens a row
may commit (max depth + 1), D hidden size, V vocabulary, k masks per owning slot.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .row_state import RowState
from .tree import BlockLayout, DraftTree
from .verify import VerifyResult


_VERSIONS = itertools.count(1)


def new_version() -> int:
    """A number no state of any rows had before (`RowsView.version`)."""
    return next(_VERSIONS)


@dataclass(frozen=True)
class PassPlan:
    """What the next pass drafts. A fixed block size plans `PassPlan()` every pass."""

    # None = the drafter's configured (largest) tree; -1 = a plain pass (root only, no auxiliary inputs);
    # 0 = the root and its masks (a probe); n > 0 = at most n draft nodes
    num_nodes: Optional[int] = None
    # the proposer set to draft from (hybrid: "merged" | "ngram"); "" = the drafter's own choice
    variant: str = ""


@dataclass
class Block:
    """What one decode pass feeds per row: tree slots then `aux` inputs, Q = T + A tokens."""

    tree: DraftTree
    layout: BlockLayout  # visible [B|1, Q, Q], rel_pos [B|1, Q]
    # [B, A, D] input embeddings placed after the tree slots (ESP: T * k mask tokens); None when A = 0
    aux_embeds: Optional[torch.Tensor]
    max_depth: int  # deepest node in any row's tree, or an upper bound on it (host int: no device read)
    # [B, T] for each tree slot, the index of its masks among the mask owners (its masks are aux inputs
    # owner*k .. owner*k + k-1), -1 = no masks; None = every slot owns k masks in slot order (ESP)
    mask_owner: Optional[torch.Tensor] = None
    # [B, T] index into the drafter's `proposers` of the proposer that supplied each slot (-1 = root), or
    # [B, 1]: one proposer per row supplied every draft (a chain); None = one proposer (accepted drafts are
    # not split by proposer)
    source: Optional[torch.Tensor] = None

    @property
    def num_inputs(self) -> int:
        """Q: tokens fed per row."""
        return self.tree.num_slots + (0 if self.aux_embeds is None else self.aux_embeds.shape[1])


@dataclass
class Placement:
    """Where a block goes in the rows' caches (the plan itself is set on the cache)."""

    pos: torch.Tensor  # [B, Q] positions of the inputs
    bias: Optional[torch.Tensor]  # [B|1, 1, Q, view_len] additive attention bias (None: every slot visible)
    view_len: int  # cache slots the block attends over, its own included


@dataclass
class ForwardOut:
    """The model's output over a block."""

    hidden: torch.Tensor  # [B, Q, D] hidden states of every input
    # [B, T, V] logits at the tree slots (None from a replayed pass until the engine computes them for a drafter
    # that reads them: `Drafter.reads_slot_logits`)
    slot_logits: Optional[torch.Tensor]


@dataclass
class ProbeOut:
    """A drafter's work after the pass, computed inside a replayed decode pass (engine.cuda_graphs:
    `drafters.esp.ProbeStage`): what its `observe` computes eagerly from the pass, and ESP's next static tree.
    A field is None where the stage did not compute it."""

    # after a pass that fed masks (the probe): the mask vector after the pass's kept tokens (the EMA, when on),
    # each mask's top C candidates (log-probs, best first) and their ids, and where masks hang on some slots only,
    # whether the last accepted slot owned masks
    m: Optional[torch.Tensor] = None  # [B, 1, D]
    cand_lp: Optional[torch.Tensor] = None  # [B, k, C]
    cand_ids: Optional[torch.Tensor] = None  # [B, k, C]
    mask_ok: Optional[torch.Tensor] = None  # [B] bool
    # the next pass's static tree (ESP; None: the drafter builds its tree)
    tokens: Optional[torch.Tensor] = None  # [B, T]
    valid: Optional[torch.Tensor] = None  # [B, T] bool
    # the model's top K at each slot of the accepted path, log-probs and ids (STAND's logit store, the hybrid's)
    path_lp: Optional[torch.Tensor] = None  # [B, S, K]
    path_ids: Optional[torch.Tensor] = None  # [B, S, K]

    @property
    def probed(self) -> bool:
        """The stage ran the probe (the pass fed masks)."""
        return self.cand_lp is not None

    def tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        """The fields in order (not `dataclasses.astuple`, which copies tensors)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def map(self, fn) -> "ProbeOut":
        """The same fields through `fn` (a view of some rows, a copy)."""
        return ProbeOut(*(None if t is None else fn(t) for t in self.tensors()))


@dataclass
class Settled:
    """A settled pass, eager or replayed alike: what verification accepted and what the stops kept."""

    verified: VerifyResult
    num_kept: torch.Tensor  # [B] tokens committed after the stops (<= verified.num_committed)
    reason: torch.Tensor  # [B] finish reason code (0 = running)
    # the drafter's probe, when the replayed pass computed it (`graphs.hooks.StepHooks.step_probe`)
    probe: Optional[ProbeOut] = None


@dataclass
class PassRecord:
    """What a drafter may learn from after a forward pass (decode pass or prefill)."""

    # [B, S] tokens committed this pass (accepted drafts then the bonus), valid up to num_committed
    committed: torch.Tensor
    # [B] tokens committed after the stops
    num_committed: torch.Tensor
    # [B, Q, D] hidden states of the block (prefill: only the aux inputs after the prompt, [B, A, D])
    hidden: Optional[torch.Tensor]
    # [B, k, D] hidden states of the masks owned by the last accepted slot (None when no masks were fed)
    mask_hidden: Optional[torch.Tensor]
    # [B, T, V] logits at the tree slots; None after prefill
    slot_logits: Optional[torch.Tensor] = None
    # [B, S] tree slots on the accepted path (slot 0 first); None after prefill
    path_slots: Optional[torch.Tensor] = None
    # [B] deepest accepted slot; None after prefill
    last_slot: Optional[torch.Tensor] = None
    # the block that was fed; None after prefill
    block: Optional[Block] = None
    prefill: bool = False
    # [B] False where the last accepted slot owned no masks (mask_hidden is then meaningless); None = all True
    mask_ok: Optional[torch.Tensor] = None
    # the probe's candidates (and the next static tree), when the replayed pass computed them; mask_hidden is then
    # None (`graphs.hooks.StepHooks.step_probe`)
    probe: Optional[ProbeOut] = None
    # [B, Q, D] the hidden states entering the model's layer `runner.tap_layer` at every input of the forward, when
    # a drafter set one (dmtd_verified: the trunk's output under its drafting layers); None otherwise
    trunk: Optional[torch.Tensor] = None
    # [B] bool: the rows the pass committed to and counted for; None = all. A pass run ahead of the last one's read
    # (engine.cuda_graphs_run_ahead) also runs over the rows that pass ended: learning across rows skips them
    live: Optional[torch.Tensor] = None

    @property
    def staged_probe(self) -> Optional[ProbeOut]:
        """The probe's results when the replayed pass ran it (the pass fed masks), else None."""
        return self.probe if self.probe is not None and self.probe.probed else None


@dataclass
class RowsView:
    """Read access to the batch rows a drafter works on, plus its own mutable state."""

    # [B, C] prompt + committed tokens (root included), valid up to hist_len
    hist: torch.Tensor
    # [B]
    hist_len: torch.Tensor
    # [B]
    prompt_len: torch.Tensor
    # per-row seeds (for drafters that draw random numbers)
    seeds: list[int]
    # drafter-owned per-row tensors, [B, ...] each (the drafter's state_type)
    state: RowState = field(default_factory=RowState)
    # host copy of the drafter's `row_hints` as of the last host read (after the last commit), or None
    hints: Optional[list[int]] = None
    # [B] the last committed token where the engine knows it already (from verification), else None
    known_root: Optional[torch.Tensor] = None
    # host copy of hist_len as of the last host read: exact at `propose` and `start_rows`; in `observe` the lengths
    # before the pass's commit
    lens: Optional[list[int]] = None
    # the rows' state (which rows, their lengths): a drafter may reuse what it computed for a view of one version
    # until its next observe (e.g. a look's candidate pool, then the propose of the same pass); unique per state
    version: int = field(default_factory=lambda: new_version())
    # [B] the rows' finish reasons on the device (0 = going on), or None (all go on). Rows that ended may stay in
    # the batch while passes run ahead of their reads (engine.cuda_graphs_run_ahead); what learns across rows
    # (block_complexity=auto's look) leaves them out
    reason: Optional[torch.Tensor] = None

    @functools.cached_property
    def going(self) -> Optional[torch.Tensor]:
        # [B] bool: rows whose requests go on (None: all)
        return None if self.reason is None else self.reason.eq(0)

    @functools.cached_property
    def root(self) -> torch.Tensor:
        # [B] last committed token (computed once per view)
        if self.known_root is not None:
            return self.known_root
        return self.hist.gather(1, (self.hist_len - 1).unsqueeze(1)).squeeze(1)
