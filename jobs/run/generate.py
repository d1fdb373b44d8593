"""`python -m jobs.generate [CONFIG.yaml] [key=value ...]`: run (or resume) a generation job.

Exit codes: 0 done (rows may still carry errors: see the `error` column), 1 the job failed (finished
parts are kept; rerun to resume), 2 bad command line, config, input or output directory.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Optional, Sequence

DESCRIPTION = ("Offline batch generation with ESP speculative decoding on Ray: "
               "rows in (parquet/jsonl/json/csv/datasets), Parquet rows out.")
HELP_EPILOG = """\
examples:
  python -m jobs.generate                                   # embedded default: tiny model, bundled prompts
  python -m jobs.generate configs/llama-3.1-8b-instruct.yaml engine.block_complexity=30 data.path=prompts.parquet
  python -m jobs.generate data.path=q.jsonl engine.method=ar ray.num_actors=1 output.dir=out/q
  python -m jobs.generate --print-config engine.block_complexity=60

config sections (docs/guide/configuration.md; configs/default.yaml lists every key): {sections}
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..config import ConfigError, JobConfig, load_config, parse_command_line, to_yaml

    sections = " ".join(f"{f.name}.*" for f in dataclasses.fields(JobConfig))
    ns = parse_command_line(argv, "esp-batch generate", DESCRIPTION, HELP_EPILOG.format(sections=sections))
    logging.basicConfig(level=logging.INFO, format="esp-batch %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(ns.config, ns.overrides)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    from .cluster import ClusterError, HeadLost
    from .runner import JobError, run_job

    try:
        result = run_job(cfg)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    except HeadLost as exc:  # Ray's shutdown (also at interpreter exit) would wait for the lost head: exit now
        print(f"esp-batch: job failed: {exc}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    except (JobError, ClusterError) as exc:
        print(f"esp-batch: job failed: {exc}", file=sys.stderr)
        return 1
    if result.head_lost:  # finished, but Ray's shutdown would wait for the lost head
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
