"""The drafter interface: propose a draft tree (+ auxiliary inputs such as ESP's mask tokens), observe.

A drafter keeps its per-row state in `view.state`, a `RowState` dataclass of [B, ...] tensors it declares
(`state_type`); the engine selects and appends its rows together with its own row tensors without reading
it, so drafters never see batch bookkeeping. What block_complexity=auto needs of a drafter is a separate
protocol (`auto.sizer.DraftSizer`), as is what a replayed pass's probe stage needs (`graphs.hooks.StepHooks`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from ..passes import Block, PassPlan, PassRecord, RowsView
from ..row_state import RowState
from ..tree import BlockLayout, DraftTree, block_layout

# a plan that drafts the configured tree (a fixed block size)
FULL = PassPlan()


class Drafter(ABC):
    """Base class. Subclasses implement `propose`; ESP-like drafters also feed masks (`num_masks` > 0)."""

    name: str = "base"
    state_type: type[RowState] = RowState  # the per-row tensors the drafter keeps
    num_masks: int = 0  # auxiliary mask inputs owned by each tree slot (their hidden states come back)
    # names of the proposers a Block.source indexes (hybrid); () = one proposer, the drafter itself
    proposers: tuple[str, ...] = ()
    # whether `observe` reads PassRecord.slot_logits (asked after `propose`, of the pass it proposed): a pass replayed
    # from a CUDA graph keeps no logits (their [B, T, V] per shape class would hold gigabytes), so the engine computes
    # them for such a drafter afterwards, unless the pass's stage took what it reads (`PassRecord.probe`)
    reads_slot_logits: bool = True

    def __init__(self) -> None:
        self.blocks = BlockBuilder()

    def start_job(self) -> None:
        """A new `generate_iter` call begins: forget what belonged to the previous job. Default: nothing."""

    def start_rows(self, view: RowsView) -> Optional[torch.Tensor]:
        """Initialise state for new rows (prompt only in view.hist). Return prefill aux embeds [R, A, D] or None."""
        return None

    @abstractmethod
    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """The next block, as large as `plan` allows."""

    def observe(self, view: RowsView, record: PassRecord) -> None:
        """Learn from a pass (or the prefill); view.hist already holds the committed tokens. Default: nothing."""

    def row_hints(self, view: RowsView) -> Optional[torch.Tensor]:
        """[B] long: what the drafter wants to know on the host at the next propose (view.hints), computed
        after the commit and read with the pass's one host read (no read of its own). Default: None."""
        return None

    def finish_request(self, token_ids: list[int]) -> None:
        """A request finished with these tokens (prompt + output), known on the host. Default: nothing."""


class BlockBuilder:
    """Blocks of one drafter's trees; the layout of each static tree shape is built once and reused."""

    def __init__(self) -> None:
        self._layouts: dict[tuple, BlockLayout] = {}

    def layout(self, tree: DraftTree, num_masks: int) -> BlockLayout:
        if tree.static_key is None:
            return block_layout(tree.parents, num_masks)
        key = (tree.static_key, num_masks, tree.tokens.device)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = block_layout(tree.parents[:1], num_masks)
        return lay

    def build(self, tree: DraftTree, aux_embeds: Optional[torch.Tensor] = None, num_masks: int = 0,
              max_depth: Optional[int] = None) -> Block:
        """A block of `tree` followed by `aux_embeds` (T * num_masks mask inputs, or None)."""
        lay = self.layout(tree, num_masks if aux_embeds is not None else 0)
        if max_depth is None and lay.max_depth is None:
            max_depth = int(lay.depth.max())  # a device read; cached for static shapes (once per shape)
            if tree.static_key is not None:
                lay.max_depth = max_depth
        depth = lay.max_depth if max_depth is None else max_depth
        return Block(tree=tree, layout=lay, aux_embeds=aux_embeds, max_depth=depth)


class PlainDrafter(Drafter):
    """`ar`: no draft; the same loop as every other method with a one-slot tree (plain decoding)."""

    name = "ar"
    reads_slot_logits = False

    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        return self.blocks.build(DraftTree.root_only(view.root), max_depth=0)
