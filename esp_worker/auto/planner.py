"""The engine's side of block sizing: a planner says what each pass drafts and hears how it went.

`FixedPlanner` (a fixed block complexity) plans the drafter's configured tree every pass;
`policy.BlockPolicy` (block_complexity=auto) chooses from measured costs and the drafter's own estimates, and the
engine hands it each pass's committed tokens and times (`observe_pass`).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..passes import PassPlan


class Planner(Protocol):
    def plan(self, view, lens: list[int]) -> PassPlan:
        """This pass's plan."""

    def prepare(self, view, lens: list[int]) -> Optional[torch.Tensor]:
        """At the end of a pass: a device vector to read with the pass's one host read, or None."""

    def receive(self, values: Optional[list[float]]) -> None:
        """That vector's host copy (with passes run ahead of their reads: a pass or two later, in order)."""

    def wants_read(self) -> bool:
        """With a pass in flight, before `plan`: the plan needs that pass's read first."""

    def next_is_plain(self) -> bool:
        """The next pass is known to decode plainly (the drafter's row hints would go unused)."""

    def rows_changed(self) -> None:
        """Rows joined or left the batch."""


class FixedPlanner:
    """A fixed block complexity: the configured tree every pass."""

    def plan(self, view, lens: list[int]) -> PassPlan:
        return PassPlan()

    def prepare(self, view, lens: list[int]) -> Optional[torch.Tensor]:
        return None

    def receive(self, values: Optional[list[float]]) -> None:
        pass

    def wants_read(self) -> bool:
        return False

    def next_is_plain(self) -> bool:
        return False

    def rows_changed(self) -> None:
        pass
