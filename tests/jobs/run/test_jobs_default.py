"""The embedded default job, exactly as a new user runs it: no arguments, a local Ray it starts itself."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from jobs_helpers import REPO, read_output


@pytest.mark.slow
def test_default_job_without_arguments(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "jobs.generate"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    last = [line for line in res.stderr.splitlines() if "done:" in line][-1]
    assert "48 rows (0 errors" in last and "_summary.json" in last
    (out,) = (tmp_path / "outputs").iterdir()
    assert out.name.startswith("tiny-random-llama-hybrid-")
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == 48 and summary["tau"] is not None and summary["tau_per_category"]
    assert summary["runs"][-1]["engine_errors"] == 0  # no batch fell back to running its rows in halves
    assert len(read_output(out)) == 48
    print(f"default job: {elapsed:.1f}s wall")


def test_console_script_when_installed():
    exe = shutil.which("esp-batch")
    if exe is None:
        pytest.skip("esp-batch is not installed in this environment (pip install -e .)")
    res = subprocess.run([exe, "generate", "--print-config", "ray.num_actors=3"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "num_actors: 3" in res.stdout
