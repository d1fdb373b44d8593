"""`python -m jobs.generate [CONFIG.yaml] [key=value ...]`: run (or resume) a generation job.

Exit codes: 0 done (rows may still carry errors: see the `error` column), 1 the job failed (finished
parts are kept; rerun to resume), 2 bad command line, config, input or output directory.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

HELP_EPILOG = """\
examples:
  python -m jobs.generate                                   # embedded default: tiny model, bundled prompts
  python -m jobs.generate configs/llama-3.1-8b-instruct_bc30.yaml data.path=prompts.parquet
  python -m jobs.generate data.path=q.jsonl engine.method=ar ray.num_actors=1 output.dir=out/q
  python -m jobs.generate --print-config engine.block_complexity=60

config sections (see README "Config reference"): model.* data.* engine.* generation.* output.* ray.* fault.*
"""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="esp-batch generate",
        description="Offline batch generation with ESP speculative decoding on Ray: "
        "rows in (parquet/jsonl/json/csv/datasets), Parquet rows out.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("args", nargs="*", metavar="[CONFIG.yaml] key=value",
                        help="an optional YAML config file, then dotted overrides such as engine.method=ar")
    parser.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit")
    ns = parser.parse_args(argv)
    ns.config = None
    if ns.args and "=" not in ns.args[0]:
        ns.config, ns.args = ns.args[0], ns.args[1:]
    return ns


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="esp-batch %(levelname)s: %(message)s", stream=sys.stderr)
    from .config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(ns.config, ns.args)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    from .cluster import ClusterError
    from .runner import JobError, run_job

    try:
        run_job(cfg)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    except (JobError, ClusterError) as exc:
        print(f"esp-batch: job failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
