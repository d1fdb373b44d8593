"""Test-wide setup. Being a conftest.py in tests/ (no __init__.py), pytest puts tests/ on sys.path, so test
modules in any subfolder import the helpers here (`from shared_data import ...`, `from engine_helpers import ...`)."""
