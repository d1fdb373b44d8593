"""The output directory: one Parquet part per shard, plus the job manifest and summary.

    <output.dir>/part-000000.parquet ...   data (one dataset for pyarrow / pandas / DuckDB / Spark)
    <output.dir>/_job.json                 config + hash of the job that owns the directory
    <output.dir>/_summary.json             written at the end of each run
    <output.dir>/_faults/                  fault-injection markers (tests only)

Parts are written as `.part-NNNNNN.<random>.tmp` and renamed when complete; readers skip names
starting with `.` or `_`, so they never see a partial file. A finished shard is a part file that exists.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError

MANIFEST = "_job.json"
SUMMARY = "_summary.json"
FAULTS = "_faults"
PART_GLOB = "part-*.parquet"


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts. Keys present on one side only are
    ignored: a newer version that adds a setting (with a default) still resumes an older job."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) & set(new))
        return [d for k in keys for d in _diff(old[k], new[k], f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class OutputDir:
    def __init__(self, path: str):
        self.path = Path(path).resolve()

    def part_path(self, shard_index: int) -> Path:
        return self.path / f"part-{shard_index:06d}.parquet"

    def claim(self, config_hash: str, hashed: dict[str, Any], full: dict[str, Any], overwrite: bool) -> None:
        """Make the directory this job's: refuse one owned by a different config unless `overwrite`."""
        manifest = self.path / MANIFEST
        if overwrite:
            self._clear()
        elif manifest.exists():
            old = json.loads(manifest.read_text())
            changes = _diff(old.get("hashed_config", {}), hashed)
            if changes or "hashed_config" not in old:
                raise ConfigError(
                    f"output.dir={str(self.path)!r} holds a job with a different config ({'; '.join(changes[:5])}); "
                    "use another output.dir or set output.overwrite=true"
                )
            return
        elif any(self.path.glob(PART_GLOB)):
            raise ConfigError(
                f"output.dir={str(self.path)!r} holds part files but no {MANIFEST}; "
                "use another output.dir or set output.overwrite=true"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(
            manifest, {"config_hash": config_hash, "hashed_config": hashed, "config": full, "created": time.time()}
        )

    def _clear(self) -> None:
        """Delete this job's files (parts, temp parts, manifest, summary, fault markers) and nothing else."""
        if not self.path.exists():
            return
        for p in [*self.path.glob(PART_GLOB), *self.path.glob(".part-*.tmp"), self.path / MANIFEST, self.path / SUMMARY]:
            p.unlink(missing_ok=True)
        shutil.rmtree(self.path / FAULTS, ignore_errors=True)

    def done_shards(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.path.glob(PART_GLOB)}

    def write_part(self, shard_index: int, table: pa.Table, compression: str) -> Path:
        """Write under a temporary name, then rename: the part appears complete or not at all."""
        final = self.part_path(shard_index)
        tmp = self.path / f".{final.stem}.{uuid.uuid4().hex}.tmp"
        pq.write_table(table, tmp, compression=compression)
        os.replace(tmp, final)
        return final

    def parts(self) -> list[Path]:
        return sorted(self.path.glob(PART_GLOB))

    def read_columns(self, columns: list[str]) -> Iterator[pa.Table]:
        """The given columns (those present), one part at a time."""
        for part in self.parts():
            names = pq.read_schema(part).names
            yield pq.read_table(part, columns=[c for c in columns if c in names])

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.path / SUMMARY
        _write_json_atomic(path, summary)
        return path

    @property
    def fault_dir(self) -> Path:
        return self.path / FAULTS
