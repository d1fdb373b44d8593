"""The output directory (local path or object-store URI): one Parquet part per shard, the job manifest,
the summary.

    <output.dir>/part-000000.parquet ...   data (one dataset for pyarrow / pandas / DuckDB / Spark)
    <output.dir>/_job.json                 config + hash of the job that owns the directory
    <output.dir>/_summary.json             totals, completeness check, and one record per run
    <output.dir>/_report/                  report.md + PNG plots (jobs.report)
    <output.dir>/_faults/                  fault-injection markers (tests only)

Visibility: on a local (or HDFS) filesystem a part is written as `.part-NNNNNN.<random>.tmp` and renamed
when complete; on an object store it is uploaded under its final key, which becomes visible only when the
upload completes. Readers skip names starting with `.` or `_`, so they never see a partial file.

Each part carries, in its Parquet key-value metadata (`esp_batch`), the shard index and the fingerprint of
the shard's input rows. A part counts as done only when that fingerprint matches the shard read from the
input now, so an edited input is regenerated shard by shard instead of being silently mixed.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .config import ConfigError
from .storage import StorageError, join, resolve

MANIFEST = "_job.json"
SUMMARY = "_summary.json"
FAULTS = "_faults"
REPORT_DIR = "_report"  # report.md + PNGs (jobs.report)
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
META_KEY = b"esp_batch"


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts. Keys present on one side only are
    ignored: a newer version that adds a setting (with a default) still resumes an older job."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) & set(new))
        return [d for k in keys for d in _diff(old[k], new[k], f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def part_name(shard_index: int) -> str:
    return f"{PART_PREFIX}{shard_index:06d}{PART_SUFFIX}"


def shard_of(name: str) -> Optional[int]:
    """Shard index of a part file name, or None for any other name."""
    if not (name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX)):
        return None
    digits = name[len(PART_PREFIX): -len(PART_SUFFIX)]
    return int(digits) if digits.isdigit() else None


@dataclass
class PartInfo:
    shard: int
    path: str  # on the output filesystem
    fingerprint: Optional[str]  # None: a part this job did not write (no esp_batch metadata)
    rows: int


class OutputDir:
    def __init__(self, location: str, storage: Optional[Any] = None):
        try:
            self.fs, self.root = resolve(location, storage)
        except StorageError as exc:
            raise ConfigError(f"output.dir: {exc}") from None
        self.location = location
        self._atomic_rename = isinstance(self.fs, pafs.LocalFileSystem) or type(self.fs).__name__ == "HadoopFileSystem"

    @property
    def path(self) -> str:
        """Where the data is, as a user would type it (a local absolute path, or the URI)."""
        return self.root if isinstance(self.fs, pafs.LocalFileSystem) else self.location.rstrip("/")

    def file(self, name: str) -> str:
        return join(self.root, name)

    # ---- set-up --------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the directory; a path that is a file or cannot be created is a ConfigError."""
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.File:
            raise ConfigError(f"output.dir={self.location!r} is a file; give a directory (it is created if missing)")
        if info.type == pafs.FileType.Directory:
            return
        try:
            self.fs.create_dir(self.root, recursive=True)
        except (OSError, pa.ArrowException) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"cannot create output.dir={self.location!r}: {reason}") from None

    def claim(self, config_hash: str, hashed: dict[str, Any], full: dict[str, Any], overwrite: bool) -> None:
        """Make the directory this job's: refuse one owned by a different config unless `overwrite`."""
        self.prepare()
        if overwrite:
            self._clear()
        else:
            old = self.read_json(MANIFEST)
            if old is not None:
                changes = _diff(old.get("hashed_config", {}), hashed)
                if changes or "hashed_config" not in old:
                    raise ConfigError(
                        f"output.dir={self.path!r} holds a job with a different config ({'; '.join(changes[:5])}); "
                        "use another output.dir or set output.overwrite=true"
                    )
                return
            if self._part_files():
                raise ConfigError(
                    f"output.dir={self.path!r} holds part files but no {MANIFEST}; "
                    "use another output.dir or set output.overwrite=true"
                )
        self.write_json(MANIFEST, {"config_hash": config_hash, "hashed_config": hashed, "config": full,
                                   "created": time.time()})

    def _clear(self) -> None:
        """Delete this job's files (parts, temp parts, manifest, summary, fault markers) and nothing else."""
        for info in self._listing():
            name = info.base_name
            if (shard_of(name) is not None or (name.startswith(f".{PART_PREFIX}") and name.endswith(".tmp"))
                    or name in (MANIFEST, SUMMARY)):
                self.fs.delete_file(info.path)
        for sub in (FAULTS, REPORT_DIR):
            if self.fs.get_file_info(self.file(sub)).type == pafs.FileType.Directory:
                self.fs.delete_dir(self.file(sub))

    # ---- parts ---------------------------------------------------------------------------------------
    def _listing(self) -> list[pafs.FileInfo]:
        if self.fs.get_file_info(self.root).type != pafs.FileType.Directory:
            return []
        return self.fs.get_file_info(pafs.FileSelector(self.root, recursive=False))

    def _part_files(self) -> list[pafs.FileInfo]:
        return sorted((i for i in self._listing() if shard_of(i.base_name) is not None), key=lambda i: i.base_name)

    def parts(self) -> list[str]:
        """Paths of the finished part files, in shard order."""
        return [i.path for i in self._part_files()]

    def part_infos(self) -> dict[int, PartInfo]:
        """shard index -> PartInfo, from each part's footer (no data read)."""
        out: dict[int, PartInfo] = {}
        for info in self._part_files():
            meta = pq.read_metadata(info.path, filesystem=self.fs)
            kv = meta.metadata or {}
            fp = json.loads(kv[META_KEY]).get("fingerprint") if META_KEY in kv else None
            out[shard_of(info.base_name)] = PartInfo(shard_of(info.base_name), info.path, fp, meta.num_rows)
        return out

    def done_shards(self) -> set[int]:
        return {i.shard for i in self.part_infos().values()}

    def write_part(self, shard_index: int, table: pa.Table, compression: str, fingerprint: Optional[str] = None) -> str:
        """Write the shard's part so that it appears complete or not at all; replaces an older part."""
        meta = dict(table.schema.metadata or {})
        meta[META_KEY] = json.dumps({"shard": shard_index, "fingerprint": fingerprint, "rows": table.num_rows}).encode()
        table = table.replace_schema_metadata(meta)
        final = self.file(part_name(shard_index))
        if not self._atomic_rename:  # object stores: an upload is invisible until it completes
            pq.write_table(table, final, compression=compression, filesystem=self.fs)
            return final
        tmp = self.file(f".{part_name(shard_index)[:-len(PART_SUFFIX)]}.{uuid.uuid4().hex}.tmp")
        pq.write_table(table, tmp, compression=compression, filesystem=self.fs)
        self.fs.move(tmp, final)
        return final

    def delete_part(self, shard_index: int) -> None:
        self.fs.delete_file(self.file(part_name(shard_index)))

    def read_columns(self, columns: list[str]) -> Iterator[tuple[str, pa.Table]]:
        """(part path, the given columns that it has), one part at a time."""
        for path in self.parts():
            names = pq.read_schema(path, filesystem=self.fs).names
            yield path, pq.read_table(path, columns=[c for c in columns if c in names], filesystem=self.fs)

    # ---- small JSON files ----------------------------------------------------------------------------
    def read_json(self, name: str) -> Optional[dict[str, Any]]:
        path = self.file(name)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return json.loads(f.read().decode())

    def write_json(self, name: str, obj: dict[str, Any]) -> str:
        """Written whole: temp + rename locally, a single upload on object stores."""
        data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()
        final = self.file(name)
        target = self.file(f".{name}.{uuid.uuid4().hex}.tmp") if self._atomic_rename else final
        with self.fs.open_output_stream(target) as f:
            f.write(data)
        if target != final:
            self.fs.move(target, final)
        return final

    @property
    def fault_dir(self) -> str:
        """Fault-injection markers: tests run on local directories only."""
        return self.file(FAULTS)
