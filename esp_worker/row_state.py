"""Typed per-row drafter state.

Each drafter declares the [B, ...] tensors it keeps per row as a `RowState` dataclass (`Drafter.state_type`);
the engine creates one per batch and moves its rows (`select` when rows leave, `extend` when rows join)
without knowing the fields, and nothing but the drafter reads them. A field is None until the drafter's
`start_rows` sets it; assigning a name that is not a field raises (a typo fails at once, not as a stale key).

Example: ESP keeps `m` [B, 1, D] (the running mask vector) and `has_probe` [B]; when rows 0 and 2 of three stay,
`state.select(tensor([0, 2]))` keeps those rows of every set field.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def cat_rows(a: torch.Tensor, b: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """Rows of `a` then rows of `b`, padding every dim after the first (history capacity, histogram and list
    widths) to the larger size with `fill`."""
    if a.ndim >= 2 and a.shape[1:] != b.shape[1:]:
        shape = [max(x, y) for x, y in zip(a.shape[1:], b.shape[1:])]
        grow = lambda t: torch.nn.functional.pad(  # noqa: E731  (pad takes the last dim first)
            t, [p for w, have in zip(reversed(shape), reversed(t.shape[1:])) for p in (0, w - have)], value=fill)
        a, b = grow(a), grow(b)
    return torch.cat([a, b])


def row_field(fill: float = 0) -> Optional[torch.Tensor]:
    """A [B, ...] state tensor; `fill` pads dim 1 when batches of different widths join."""
    return dataclasses.field(default=None, metadata={"fill": fill})


_FIELD_NAMES: dict[type, frozenset[str]] = {}


@dataclasses.dataclass
class RowState:
    """Base of every drafter's state (no fields: a drafter that keeps nothing per row)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name not in self._names():
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        object.__setattr__(self, name, value)

    @classmethod
    def _names(cls) -> frozenset[str]:
        names = _FIELD_NAMES.get(cls)
        if names is None:  # once per class (a field set is a few per pass)
            names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        return names

    def update(self, **values: Optional[torch.Tensor]) -> None:
        """Set several fields at once (unknown names raise)."""
        for name, value in values.items():
            setattr(self, name, value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` [R] (in that order) of every set field."""
        for name, value in self.tensors().items():
            setattr(self, name, value.index_select(0, rows))

    def extend(self, other: "RowState") -> None:
        """Append `other`'s rows (same type) to every set field."""
        assert type(other) is type(self), (type(self).__name__, type(other).__name__)
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is not None and b is not None:
                setattr(self, f.name, cat_rows(a, b, f.metadata.get("fill", 0)))
            elif a is not None or b is not None:
                raise ValueError(f"{type(self).__name__}.{f.name} is set on one side of a join only")
