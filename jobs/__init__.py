"""jobs: the Ray job runner around the esp_worker engine (config, data in, Parquet out, CLI).

Rooms: run/ (the driver, the engine actor, rows, the output schema), io/ (sources, output directory,
storage), report/ (the job report and plots), bench/ (benchmarks), train/ (CP heads training).
cli.py (`esp-batch`) and config.py (the job config and its command line) stay at the top.
"""
