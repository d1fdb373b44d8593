"""jobs: the Ray job runner around the esp_worker engine (config, data in, Parquet out, CLI)."""
