"""What engine.cuda_graphs' step needs of a drafter: a drafter whose work after a pass can run as the replayed
pass's last stage inherits `StepHooks`.

On a GPU the replayed pass costs what its kernels cost, while a drafter's eager work after it (an LM head, a top-k,
the next tree: ~25 launches and their Python for ESP) runs on the host before the next pass can be launched. A
stage inside the graph does that work with the pass's own kernels. It is a pure function of the step's tensors
(`ProbeOut` out), so the step stays one graph with no host read, and the drafter takes its results in `observe`
(`PassRecord.probe`) exactly where it would have computed them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ..passes import Block, RowsView


@dataclass
class StepProbe:
    """A pass's probe stage and its per-row input."""

    # hashable (part of the shape class): `drafters.esp.ProbeStage`
    stage: Any
    m: Optional[torch.Tensor] = None  # [B, 1, D] float32 the rows' mask vector before the pass (with a probe)
    mask_owner: Optional[torch.Tensor] = None  # [B|1, T] the block's mask owners (`Block.mask_owner`; stage.owners)


class StepHooks:
    """Default: the drafter's work after a pass runs on the host."""

    def step_probe(self, view: "RowsView", block: "Block") -> Optional[StepProbe]:
        """The stage a replayed pass of `block` may end with (its results come back as `PassRecord.probe`), or None."""
        return None
