"""Test-wide setup. Being a conftest.py in tests/ (no __init__.py), pytest puts tests/ on sys.path, so test
modules in any subfolder import the helpers here (`from shared_data import ...`, `from engine_helpers import ...`).

Ray starts its workers at niceness 15; on a machine whose cores other processes keep busy they then get a few
per cent of a core and every Ray test crawls. The tests' Ray workers run at the tests' own priority (inherited by
the jobs the tests start in subprocesses), so the suite's speed does not depend on the machine being idle."""
import os

os.environ.setdefault("RAY_worker_niceness", "0")
