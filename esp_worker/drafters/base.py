"""The drafter interface: propose a draft tree (+ auxiliary inputs such as ESP's mask tokens), observe.

A drafter keeps its per-row state in `view.state`, a `RowState` dataclass of [B, ...] tensors it declares
(`state_type`); the engine selects and appends its rows together with its own row tensors without reading
it, so drafters never see batch bookkeeping.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..tree import BlockLayout, DraftTree, block_layout
from .state import RowState

if TYPE_CHECKING:
    from ..kernels.aot import AotKernels


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
    # [B, Q, D] every input's embedding (the tree tokens', then aux_embeds) when the drafter computed them with
    # its last probe (engine.compile_host); None = the engine embeds the tree tokens
    embeds: Optional[torch.Tensor] = None


@dataclass
class PassResult:
    """What a drafter may learn from after a forward pass (decode pass or prefill)."""

    # [B, S] tokens committed this pass (accepted drafts then the bonus), valid up to num_committed
    committed: torch.Tensor
    # [B]
    num_committed: torch.Tensor
    # [B, Q, D] hidden states of the block (prefill: only the aux inputs after the prompt, [B, A, D])
    hidden: Optional[torch.Tensor]
    # [B, k, D] hidden states of the masks owned by the last accepted slot (None when num_masks == 0 or
    # when the prefill carried no masks)
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
    # [B, 1, D] ESP's mask EMA after this pass's committed tokens, when engine.compile_host's kernel computed it
    # (`ESPDrafter.settle_ema`); None = the drafter computes it
    ema_m: Optional[torch.Tensor] = None


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

    @functools.cached_property
    def root(self) -> torch.Tensor:
        # [B] last committed token (computed once per view)
        if self.known_root is not None:
            return self.known_root
        return self.hist.gather(1, (self.hist_len - 1).unsqueeze(1)).squeeze(1)


class Drafter(ABC):
    """Base class. Subclasses implement `propose`; ESP-like drafters also use masks (`num_masks` > 0)."""

    name: str = "base"
    state_type: type[RowState] = RowState  # the per-row tensors the drafter keeps
    num_masks: int = 0  # auxiliary mask inputs owned by each tree slot (their hidden states come back)
    # names of the proposers a Block.source indexes (hybrid); () = one proposer, the drafter itself
    proposers: tuple[str, ...] = ()
    # with masks (num_masks > 0): whether the drafter may still propose when no row has a fresh probe
    # (block_complexity=auto asks; ESP cannot, hybrid can from its n-gram proposers)
    drafts_without_probe: bool = False
    # host flag: some row may hold a fresh probe (False after a plain pass fed no masks); lets the policy
    # skip a device read on the plain path
    probe_maybe: bool = True
    # a bound on the depth of every tree the drafter proposes (None = the node count): nodes at one depth are
    # alternatives, so a pass accepts at most this many drafts per row whatever the tree's size
    depth_limit: Optional[int] = None

    def __init__(self) -> None:
        self._layouts: dict[tuple, BlockLayout] = {}

    def new_state(self) -> RowState:
        """An empty per-row state for a new batch (start_rows fills it for the rows it is given)."""
        return self.state_type()

    def start_job(self) -> None:
        """A new `generate_iter` call begins: forget what belonged to the previous job. Default: nothing."""

    def finish_request(self, token_ids: list[int]) -> None:
        """A request finished with these tokens (prompt + output), known on the host. Default: nothing."""

    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        """Initialise state for new rows (prompt only in view.hist). Return prefill aux embeds [R, A, D] or None."""
        return None

    @abstractmethod
    def propose(self, view: RowsView, num_nodes: Optional[int] = None) -> Block:
        """The next block. num_nodes: None = the configured size; otherwise at most that many draft nodes
        (-1 = a plain pass with no auxiliary inputs). Only drafters with `draft_mass` get a num_nodes."""

    max_nodes: int = 0  # draft nodes of the configured (largest) tree

    def block_tokens(self, num_nodes: int) -> int:
        """Tokens fed per sequence for a tree of num_nodes draft nodes (-1 = plain pass)."""
        return 1 + max(num_nodes, 0)

    # whether anything will ask `draft_mass` (the engine clears it when the block size is fixed): a drafter may
    # then skip the statistics that only feed it
    mass_wanted: bool = True

    def draft_mass(self, view: RowsView) -> Optional[torch.Tensor]:
        """[B, max_nodes] the drafter's own probability that each node of its largest tree is accepted, best
        first; None when the drafter cannot tell (block_complexity=auto needs it)."""
        return None

    @property
    def needs_probe_to_draft(self) -> bool:
        """A drafter that can only draft from a fresh probe (its look at a pass costs a probe pass)."""
        return bool(self.num_masks) and not self.drafts_without_probe

    # named proposer sets block_complexity=auto may choose between per pass (hybrid: "merged" | "ngram");
    # ("",) = one set, the drafter itself
    variants: tuple[str, ...] = ("",)

    def use_variant(self, variant: str) -> tuple[Callable[[int], int], int]:
        """Draft from proposer set `variant` from the next draft_mass/propose on; returns that set's
        (block_tokens, max_nodes)."""
        return self.block_tokens, self.max_nodes

    def needs_probe(self, view: RowsView) -> bool:
        """True when the drafter cannot draft this pass until a probe pass (root + masks) refreshes it: a mask
        drafter after plain passes. Reads the device only while some row may hold a probe."""
        return False

    def observe(self, view: RowsView, result: PassResult) -> None:
        """Learn from a pass (or the prefill); view.hist already holds the committed tokens. Default: nothing."""

    def settle_ema(self, view: RowsView, block: Block) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(state [B, 1, D], weight columns) of an EMA over this pass's committed tokens that engine.compile_host's
        kernel may compute with the pass (`common.ema_apply`, handed back as PassResult.ema_m). Default: none."""
        return None

    def use_compiled(self, kernels: "AotKernels", embed_weight: torch.Tensor) -> None:
        """engine.compile_host: the drafter may run its per-pass work as kernels of `kernels` (aot.py), with the
        plain input embedding's weight [V, D] (`ModelRunner.embed_weight`). Default: it runs eagerly."""

    def row_hints(self, view: RowsView) -> Optional[torch.Tensor]:
        """[B] long: what the drafter wants to know on the host at the next propose (view.hints), computed
        after the commit and read with the pass's one host read (no read of its own). Lets a drafter skip
        work the host would otherwise have to launch for every row. Default: None (nothing)."""
        return None

    def layout_for(self, tree: DraftTree, num_masks: int) -> BlockLayout:
        """Block layout; computed once per static shape and reused (the paper's "efficient" path)."""
        if tree.static_key is None:
            return block_layout(tree.parents, num_masks)
        key = (tree.static_key, num_masks, tree.tokens.device)
        lay = self._layouts.get(key)
        if lay is None:
            lay = block_layout(tree.parents[:1], num_masks)
            self._layouts[key] = lay
        return lay

    def block(self, tree: DraftTree, aux_embeds: Optional[torch.Tensor] = None, max_depth: Optional[int] = None) -> Block:
        """A block of `tree` followed by this drafter's masks (when aux_embeds holds them, T * k inputs)."""
        lay = self.layout_for(tree, self.num_masks if aux_embeds is not None else 0)
        if max_depth is None and lay.max_depth is None:
            max_depth = int(lay.depth.max())  # a device read; cached for static shapes (once per shape)
            if tree.static_key is not None:
                lay.max_depth = max_depth
        depth = lay.max_depth if max_depth is None else max_depth
        return Block(tree=tree, layout=lay, aux_embeds=aux_embeds, max_depth=depth)


class PlainDrafter(Drafter):
    """`ar`: no draft; the same loop as every other method with a one-slot tree (plain decoding)."""

    name = "ar"

    def propose(self, view: RowsView, num_nodes: Optional[int] = None) -> Block:
        return self.block(DraftTree.root_only(view.root), max_depth=0)
