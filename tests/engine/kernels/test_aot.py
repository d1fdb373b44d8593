"""AotKernels: compile once a key recurs, run the package, leave nothing behind in the temporary directory."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from esp_worker.kernels import aot


class _Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(4))  # a program no other test compiled (the process cache)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:  # positional tensors, as AotKernels exports
        return args[0] * 2 + self.shift


def _unpacked() -> set[str]:
    """The directories package loaders unpacked into under ours (other processes may unpack into /tmp meanwhile:
    the check looks where the library went, not at what else appeared)."""
    return set(glob.glob(os.path.join(aot._PACKAGES.name, "aotinductor_*")))


@pytest.mark.slow
def test_a_kernel_compiles_when_asked_again_and_unpacks_into_our_own_directory(monkeypatch):
    monkeypatch.setattr(aot, "COMPILE_AFTER", 2)
    module = _Affine()
    x = torch.randn(3, 4)
    kernels = aot.AotKernels("affine")
    before, tmpdir = _unpacked(), os.environ.get("TMPDIR")
    assert kernels.get(("k",), lambda: module, [x], [{0: "batch"}]) is None  # the first ask runs eagerly
    kernel = kernels.get(("k",), lambda: module, [x], [{0: "batch"}])
    assert kernel is not None and kernels.compile_s > 0
    (out,) = kernel.boxed_run([x])
    torch.testing.assert_close(out, module(x))
    assert len(_unpacked() - before) == 1, "the package's library was unpacked outside our temporary directory"
    assert os.environ.get("TMPDIR") == tmpdir
