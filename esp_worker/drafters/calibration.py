"""Online calibration of a drafter's acceptance estimates, per cell (proposer x depth).

A drafter that ranks its candidates by an estimated chance of acceptance (hybrid) gives every candidate
a cell index c and its own conditional estimate q = P(accepted | parent accepted). After the pass, every
node whose parent was accepted counts q into `pred[c]` and 1 into `acc[c]` if it was itself accepted;
the counts decay by `decay` per pass and start from a prior of one pass (acc = prior[c], pred = 1), so

    factor[c] = (acc[c] + prior[c]) / (pred[c] + 1)

is the running ratio of accepted to predicted, and `min(1, factor[c] * q)` the calibrated estimate. All
tensor ops on the rows' device: no host read.

Example: a cell whose candidates are predicted 0.5 and accepted every time drifts from factor prior[c] to 2.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..tree import DraftTree


class AcceptanceCalibration:
    def __init__(self, prior: torch.Tensor, decay: float = 0.99) -> None:
        self.prior = prior.float()  # [C]
        self.pred = torch.zeros_like(self.prior)  # [C] decayed sum of q over reached nodes
        self.acc = torch.zeros_like(self.prior)  # [C] decayed count of accepted reached nodes
        self.decay = decay

    def to(self, dev: torch.device) -> None:
        """Move the counters to where the rows live. Called when rows start (the prefill), outside a decode pass:
        a copy from host memory to a GPU synchronises."""
        if self.pred.device != dev:
            self.pred, self.acc, self.prior = self.pred.to(dev), self.acc.to(dev), self.prior.to(dev)

    def factors(self, dev: torch.device) -> torch.Tensor:
        """[C] accepted / predicted per cell."""
        self.to(dev)
        return (self.acc + self.prior) / (self.pred + 1.0)

    def update(self, tree: DraftTree, path_slots: torch.Tensor, num_committed: torch.Tensor,
               cell: torch.Tensor, q: torch.Tensor, live: Optional[torch.Tensor] = None) -> None:
        """One pass: tree [B, T] slots, path_slots [B, S] (root first, valid up to num_committed [B] entries,
        the last of which is the bonus), cell [B, T] (any value for the root), q [B, T] the estimates the
        tree was built from. live [B] bool: the rows the pass counted for (None: all); a pass that counted for
        none (run ahead over rows that had all ended) neither counts nor decays."""
        b, t = tree.tokens.shape
        dev = tree.tokens.device
        self.to(dev)
        steps = torch.arange(path_slots.shape[1], device=dev)[None]
        on_path = (steps < num_committed[:, None]).long()  # root + accepted nodes
        accepted = torch.zeros((b, t), dtype=torch.long, device=dev).scatter_add_(1, path_slots, on_path) > 0
        reached = tree.valid & accepted.gather(1, tree.parents.clamp(min=0))
        reached[:, 0] = False
        decay = self.decay
        if live is not None:
            reached &= live[:, None]
            decay = torch.where(live.any(), decay, 1.0)
        idx = cell.clamp(0, self.pred.shape[0] - 1).reshape(-1)
        self.pred = decay * self.pred + torch.zeros_like(self.pred).scatter_add_(0, idx, (q * reached).reshape(-1))
        self.acc = decay * self.acc + torch.zeros_like(self.acc).scatter_add_(
            0, idx, (reached & accepted).float().reshape(-1))
