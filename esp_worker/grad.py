"""`inference`: torch.inference_mode for functions that are mostly called from inside it.

Entering `torch.inference_mode()` costs ~1-2 us of Python even when it is already on; the decode loop enters
it once per pass (`Engine._step`) and calls a dozen decorated functions (the model's forward, its LM head,
cache moves) inside, which then only check the flag.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference(fn: F) -> F:
    """fn under torch.inference_mode(), entered only when it is not on already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        # while torch.compile traces (the captured pass, graphs/step.py) the caller decides: dynamo cannot trace
        # torch.is_inference_mode_enabled(), and asks is_compiling() first
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
