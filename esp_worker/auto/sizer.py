"""What block_complexity=auto needs of a drafter, apart from the drafting itself.

A drafter that can be sized inherits `DraftSizer` and overrides what applies to it; the policy
(`auto.policy.BlockPolicy`) reads nothing else of the drafter. Sizes are draft nodes: -1 = a plain pass,
0 = the root and its masks (a probe), n > 0 = a tree of at most n nodes.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class DraftSizer:
    """Defaults: one proposer set, no masks, no estimate of what a tree would get accepted."""

    max_nodes: int = 0  # draft nodes of the configured (largest) tree
    # a bound on the depth of every tree proposed (None = the node count): nodes at one depth are alternatives,
    # so a pass accepts at most this many drafts per row whatever the tree's size
    depth_limit: Optional[int] = None
    # named proposer sets the policy may choose between per pass (hybrid: "merged" | "ngram"); ("",) = one set
    variants: tuple[str, ...] = ("",)
    # whether anything will ask `draft_mass` (False when the block size is fixed): a drafter may then skip the
    # statistics that only feed it
    mass_wanted: bool = True
    # a drafter that can only draft from a fresh probe (a look then costs it a probe pass first)
    needs_probe_to_draft: bool = False

    def block_tokens(self, num_nodes: int) -> int:
        """Tokens fed per row for a tree of num_nodes draft nodes (-1 = plain pass)."""
        return 1 + max(num_nodes, 0)

    def sizes(self, variant: str) -> tuple[Callable[[int], int], int]:
        """(block_tokens, max_nodes) of proposer set `variant`."""
        return self.block_tokens, self.max_nodes

    def draft_mass(self, view, variant: str = "") -> Optional[torch.Tensor]:
        """[B, max_nodes] the drafter's own probability that each node of its largest tree (of set `variant`)
        is accepted, best first; None when it cannot tell."""
        return None

    def needs_probe(self, view) -> bool:
        """True when the drafter cannot draft this pass until a probe pass (root + masks) refreshes it."""
        return False
