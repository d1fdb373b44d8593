"""The actor's device check on CUDA (jobs/run/worker.py, `device_failure`): it passes on a working device and fails
after a CUDA error that stays with the process, which is when an actor's process exits for Ray to start it again.
The sticky error is raised in a process of its own, so that the tests after it keep a working device. Skipped
without CUDA."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shared_data import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = """
import torch
from jobs.run.worker import device_failure
cuda = torch.device("cuda")
assert device_failure(cuda) is None
x = torch.zeros(4, device=cuda)
try:
    x[torch.tensor([10], device=cuda)].cpu()  # an index past the end: a device-side assert, sticky
except RuntimeError:
    pass
print("LOST:", device_failure(cuda))
"""


def test_the_device_check_passes_then_fails_after_a_sticky_cuda_error():
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lost = next(ln for ln in res.stdout.splitlines() if ln.startswith("LOST:"))
    assert lost != "LOST: None" and "CUDA" in lost, lost
