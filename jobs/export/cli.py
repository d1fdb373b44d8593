"""`esp-batch export OUTPUT_DIR FILE --format spec-bench [--model-id ID] [storage.key=value ...]` (also
`python -m jobs.export ...`): a job's output directory (local or object store, as `esp-batch report` reads it)
written as another tool's answer file.

Exit codes: 0 written (rows with an error are left out and counted on stderr), 2 bad arguments, an output
directory without parts, or parts written before esp-batch kept the per-turn columns.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..config import ConfigError
from ..io.output import SUMMARY, OutputDir
from ..io.storage import StorageConfig, StorageError, is_uri, resolve
from . import spec_bench

FORMATS = ("spec-bench",)
STORAGE_KEYS = ("endpoint", "region", "anonymous")
PROG = "esp-batch export"


class ExportError(ValueError):
    """One line for the user; exit 2."""


def parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="Write a job's output as another tool's answer file.",
                                 epilog="example: esp-batch export outputs/sb-esp answers/esp.jsonl --format spec-bench")
    ap.add_argument("output_dir", metavar="OUTPUT_DIR", help="the job's output.dir: a local path or a URI (s3://, ...)")
    ap.add_argument("file", metavar="FILE", help="the answer file to write (local path or URI)")
    ap.add_argument("storage", nargs="*", metavar="storage.KEY=VALUE",
                    help=f"object-store options, as for esp-batch report: {', '.join(STORAGE_KEYS)}")
    ap.add_argument("--format", required=True, choices=FORMATS, help="spec-bench: Spec-Bench's model_answer jsonl")
    ap.add_argument("--model-id", default=None, help="the answers' model_id (default: <model>-<method>)")
    return ap.parse_intermixed_args(argv)


def storage_config(items: Sequence[str]) -> StorageConfig:
    storage = StorageConfig()
    for item in items:
        key, eq, value = item.partition("=")
        name = key.removeprefix("storage.")
        if not eq or not key.startswith("storage.") or name not in STORAGE_KEYS:
            raise ExportError(f"unknown argument {item!r}; expected storage.{{{','.join(STORAGE_KEYS)}}}=...")
        setattr(storage, name, value.lower() in ("1", "true", "yes") if name == "anonymous" else value)
    return storage


def spec_bench_answers(location: str, storage: StorageConfig, model_id: Optional[str]) -> spec_bench.Answers:
    """Every row of the job's parts as Spec-Bench answers (error rows counted in `skipped`)."""
    try:
        out = OutputDir(location, storage)
    except ConfigError as exc:
        raise ExportError(str(exc).removeprefix("output.dir: ")) from None
    if not out.parts():
        raise ExportError(f"no Parquet parts in {out.path!r}: give the output.dir of a generation job")
    summary = out.read_json(SUMMARY)
    answers = spec_bench.Answers(model_id or spec_bench.default_model_id(summary), spec_bench.int_ids(summary),
                                 time.time(), salt=str((summary or {}).get("config_hash", "")))
    for path, table in out.read_columns(spec_bench.COLUMNS):
        missing = spec_bench.missing_columns(table.column_names)
        if missing:
            raise ExportError(f"{path.rsplit('/', 1)[-1]} has no {', '.join(missing)} column(s): it was written by an "
                              "older esp-batch; rerun the job with output.overwrite=true")
        for row in table.to_pylist():
            answers.add(row)
    return answers


def write_lines(target: str, lines: list[str], storage: StorageConfig) -> str:
    """The lines to a local file (its directory created) or an object-store URI; returns where."""
    data = "".join(line + "\n" for line in lines).encode()
    if not is_uri(target):
        path = Path(target).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return str(path)
    fs, where = resolve(target, storage)
    with fs.open_output_stream(where) as f:
        f.write(data)
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        storage = storage_config(ns.storage)
        answers = spec_bench_answers(ns.output_dir, storage, ns.model_id)
        lines = [json.dumps(rec) for rec in answers.sorted()]
        where = write_lines(ns.file, lines, storage)
    except (ExportError, StorageError, OSError) as exc:
        sys.stderr.write(f"{PROG}: error: {str(exc).strip().splitlines()[0]}\n")
        return 2
    skipped = answers.skipped
    note = (f"; skipped {len(skipped)} row(s) with an error (ids {', '.join(sorted(skipped)[:5])}"
            f"{', ...' if len(skipped) > 5 else ''})") if skipped else ""
    sys.stderr.write(f"{PROG}: {len(lines)} answers (model_id {answers.model_id}){note}\n")
    print(where)
    return 0
