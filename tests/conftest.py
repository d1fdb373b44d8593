"""Test-wide setup. Being a conftest.py in tests/ (no __init__.py), pytest puts tests/ on sys.path, so test
modules in any subfolder import the helpers here (`from shared_data import ...`, `from engine_helpers import ...`).

Ray starts its workers at niceness 15; on a machine whose cores other processes keep busy they then get a few
per cent of a core and every Ray test crawls. The tests' Ray workers run at the tests' own priority (inherited by
the jobs the tests start in subprocesses), so the suite's speed does not depend on the machine being idle.

The suite runs on two pytest-xdist workers (`-n 2` in pyproject.toml): most of the jobs tests' time is spent waiting
(Ray clusters coming up, Ray Train polling) while the engine tests compute. Every test under tests/jobs/ runs on
one worker, in file order (`xdist_group`), so at most one Ray instance, S3 server or job runs at a time, as in a
serial run; the engine tests fill both workers around them."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_worker_niceness", "0")


JOBS = Path(__file__).parent / "jobs"


def pytest_collection_modifyitems(items):
    for item in items:
        if JOBS in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("jobs"))
