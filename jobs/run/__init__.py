"""Running a generation job: the Ray driver (runner.py), the engine actor (worker.py), input rows
(rows.py, prompts.py), the output schema (schema.py), counters and progress (stats.py, progress.py), the
Ray connection (cluster.py) and the command line (generate.py, `python -m jobs.generate`)."""
