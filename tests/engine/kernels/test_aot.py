"""esp_worker/kernels/aot.py: a kernel's package is built once per machine, under a lock, and loaded by the
processes that reach it later (the actors of one machine, a restarted actor, the next job)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

# One process: builds (or loads) the kernel of `x * c + 1` over a dynamic batch and prints what it did.
_PROCESS = """
import json, sys, torch
from esp_worker.kernels import aot

aot.COMPILE_AFTER = 1
c = float(sys.argv[1])

class F(torch.nn.Module):
    def forward(self, *args):  # the kernels' functions take their tensors as *args
        return (args[0] * c + 1,)

kernels = aot.AotKernels("test")
x = torch.arange(6.0).reshape(3, 2)
kernel = kernels.get(("f",), F, [x], [{0: "batch"}])
out = kernel.boxed_run([x.clone()])[0]
print(json.dumps({"built": kernels.built, "compiled": kernels.compiled, "right": torch.equal(out, x * c + 1)}))
"""


def _start(c: float, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PROCESS, str(c)], env=env, stdout=subprocess.PIPE, text=True)


def _report(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_processes_that_reach_one_kernel_at_once_build_it_once_and_a_later_one_loads_it():
    c = random.uniform(2.0, 3.0)  # a kernel no earlier run has built (the graph holds the constant)
    env = dict(os.environ)
    first = [_report(p) for p in [_start(c, env), _start(c, env)]]
    assert all(r["compiled"] == 1 and r["right"] for r in first), first
    assert sorted(r["built"] for r in first) == [0, 1], first  # one built it; the other waited, then loaded it
    later = _report(_start(c, env))
    assert later == {"built": 0, "compiled": 1, "right": True}

