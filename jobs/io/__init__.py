"""Data in and out: input sources (sources.py), the output directory of Parquet parts (output.py) and
filesystem / object-store access (storage.py)."""
