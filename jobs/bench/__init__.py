"""Benchmarks: `python -m jobs.bench` (runner.py: settings.py, results.py, report.py, profiling.py,
hf_baseline.py; config in config.py), `python -m jobs.job_bench` (job_bench.py) and
`python -m jobs.memory_bench` (memory_bench.py)."""
