"""What engine.compile_host's kernels need of a drafter: a drafter that runs per-pass work as kernels, or lets
the settle kernel compute part of its update, inherits `KernelHooks`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ..passes import Block, RowsView
    from .aot import AotKernels


class KernelHooks:
    """Defaults: the drafter runs eagerly and the settle kernel computes nothing of its."""

    def use_compiled(self, kernels: "AotKernels", embed_weight: torch.Tensor) -> None:
        """The drafter may run its per-pass work as kernels of `kernels`, with the plain input embedding's weight
        [V, D] (`ModelRunner.embed_weight`)."""

    def settle_ema(self, view: "RowsView", block: "Block") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(state [B, 1, D], weight columns) of an EMA over this pass's committed tokens that the settle kernel
        may compute with the pass (`drafters.common.ema_apply`, handed back as PassRecord.ema_m); None = none."""
        return None
