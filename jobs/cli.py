"""The `esp-batch` console script: `esp-batch generate [CONFIG.yaml] [key=value ...]`, `esp-batch report DIR`,
`esp-batch export DIR FILE --format spec-bench`."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """\
usage: esp-batch <command> [args]

commands:
  generate [CONFIG.yaml] [key=value ...] [--print-config]
            run or resume a generation job (same as python -m jobs.generate)
  train-heads [CONFIG.yaml] [key=value ...]
            train rank-r CP multi-token heads for engine.method=cp_heads on Ray Train
            (same as python -m jobs.train_heads; resumes from its last checkpoint when rerun)
  train-dmtd [CONFIG.yaml] [key=value ...]
            fine-tune a model for engine.method=dmtd (or its verified copy) on Ray Train
            (same as python -m jobs.train_dmtd; resumes from its last checkpoint when rerun)
  report OUTPUT_DIR [storage.endpoint=URL] [storage.region=R] [storage.anonymous=true]
            (re)write OUTPUT_DIR/_report/report.md and its PNG plots from the Parquet parts and
            _summary.json alone; OUTPUT_DIR is a local path or a URI (s3://, gs://, hdfs://, file://)
  export OUTPUT_DIR FILE --format spec-bench [--model-id ID] [storage.KEY=VALUE ...]
            write the job's rows as a Spec-Bench answer file (docs/guide/spec-bench.md)
            (same as python -m jobs.export)

run `esp-batch generate --help` for the options.
"""
REPORT_KEYS = ("endpoint", "region", "anonymous")


def report(args: list[str]) -> int:
    """`esp-batch report OUTPUT_DIR [storage.key=value ...]`: exit 0 written, 2 bad arguments or no parts."""
    from .io.storage import StorageConfig, StorageError
    from .report.job_report import write_job_report

    if len(args) < 1 or args[0].startswith("-") or "=" in args[0]:
        sys.stderr.write(f"esp-batch report: error: expected OUTPUT_DIR\n{USAGE}")
        return 2
    storage = StorageConfig()
    for item in args[1:]:
        key, _, value = item.partition("=")
        name = key.removeprefix("storage.")
        if not _ or name not in REPORT_KEYS:
            sys.stderr.write(f"esp-batch report: error: unknown argument {item!r}; expected storage.{{{','.join(REPORT_KEYS)}}}=...\n")
            return 2
        setattr(storage, name, value.lower() in ("1", "true", "yes") if name == "anonymous" else value)
    try:
        out = write_job_report(args[0], storage)
    except (StorageError, ValueError, OSError) as exc:
        sys.stderr.write(f"esp-batch report: error: {str(exc).strip().splitlines()[0]}\n")
        return 2
    print(out.path)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    if args[0] == "report":
        return report(args[1:])
    if args[0] == "export":
        from .export.cli import main as export

        return export(args[1:])
    if args[0] == "train-heads":
        from .train.heads import main as train_heads

        return train_heads(args[1:])
    if args[0] == "train-dmtd":
        from .train.dmtd import main as train_dmtd

        return train_dmtd(args[1:])
    if args[0] != "generate":
        sys.stderr.write(f"esp-batch: error: unknown command {args[0]!r}\n{USAGE}")
        return 2
    from .run.generate import main as generate

    return generate(args[1:])


if __name__ == "__main__":
    sys.exit(main())
