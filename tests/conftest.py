"""Test-wide setup. Being a conftest.py in tests/ (no __init__.py), pytest puts tests/ on sys.path, so test
modules in any subfolder import the helpers here (`from shared_data import ...`, `from engine_helpers import ...`).

Ray starts its workers at niceness 15; on a machine whose cores other processes keep busy they then get a few
per cent of a core and every Ray test crawls. The tests' Ray workers run at the tests' own priority (inherited by
the jobs the tests start in subprocesses), so the suite's speed does not depend on the machine being idle.

The suite runs on two pytest-xdist workers (`-n 2` in pyproject.toml): most of the jobs tests' time is spent waiting
(Ray clusters coming up, Ray Train polling) while the engine tests compute. Every test under tests/jobs/ runs on
one worker, in file order (`xdist_group`), so at most one Ray instance, S3 server or job runs at a time, as in a
serial run; the engine tests fill both workers around them.

Each worker compiles into an Inductor cache of its own: in one shared cache, two workers compiling the same
graph at once can read the other's half-written entry (an AOTInductor package failed that way, its kernel
then missing from a test that counts on it)."""
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("RAY_worker_niceness", "0")
if os.environ.get("PYTEST_XDIST_WORKER") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-{os.getuid()}-{os.environ['PYTEST_XDIST_WORKER']}")


JOBS = Path(__file__).parent / "jobs"


def pytest_collection_modifyitems(items):
    for item in items:
        if JOBS in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("jobs"))
