"""The jobs tests. Being a conftest.py in tests/jobs/ (no __init__.py), pytest puts tests/jobs/ on sys.path, so the
tests in its subfolders import `jobs_helpers` and `s3_helpers` from here."""
