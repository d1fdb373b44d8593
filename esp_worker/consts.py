"""Small constant tensors of the decode loop (index ranges, ones), built once per shape and device.

A pass uses a handful of them (slot numbers, row offsets, histogram ones); building each anew costs a tensor
op per use, ~5 us of host time on a CPU. The tensors are shared: never write to them.
Example: `steps(3, dev)` -> tensor([0, 1, 2]), the same object every call.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")
_CACHE: dict[tuple, Any] = {}


def constant(key: tuple, make: Callable[[], T]) -> T:
    """The tensor (or frozen group of tensors) `make()` built once per `key` (key names what it depends on: shape,
    dtype, device). While torch traces a function (`settle.py`) it is built anew: a traced tensor must not outlive
    the trace."""
    if torch.compiler.is_compiling():
        return make()
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = make()
    return t


def steps(n: int, dev: torch.device, start: int = 0) -> torch.Tensor:
    """[n] start .. start + n - 1 (long)."""
    return constant(("steps", n, start, dev), lambda: torch.arange(start, start + n, device=dev))


def ones(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Ones of `shape` and `dtype`."""
    return constant(("ones", tuple(shape), dtype, dev), lambda: torch.ones(shape, dtype=dtype, device=dev))
