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
import logging
import time
import urllib.parse
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..config import ConfigError
from .storage import StorageError, join, resolve

log = logging.getLogger("esp_batch")
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


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # the directory value of a null, as Hive and Spark write it


@dataclass
class PartInfo:
    shard: int
    paths: list[str]  # on the output filesystem: one file, or one per partition directory
    fingerprint: Optional[str]  # None: not written by this job (no esp_batch metadata), or incomplete
    rows: int

    @property
    def path(self) -> str:
        return self.paths[0]


def _hive_dir(names: list[str], values: tuple) -> str:
    return "/".join(f"{n}={HIVE_NULL if v is None else urllib.parse.quote(str(v), safe='')}" for n, v in zip(names, values))


def _hive_values(relative_dir: str) -> dict[str, Optional[str]]:
    """{column: value} from `col=value/...` directory names (as readers reconstruct them)."""
    out: dict[str, Optional[str]] = {}
    for seg in filter(None, relative_dir.split("/")):
        if "=" in seg:
            k, v = seg.split("=", 1)
            out[k] = None if v == HIVE_NULL else urllib.parse.unquote(v)
    return out


class OutputDir:
    """partition_by: columns whose values make hive directories (`category=code/part-000003.parquet`);
    a shard then writes one file per partition value, each carrying the shard's fingerprint and file count."""

    def __init__(self, location: str, storage: Optional[Any] = None, partition_by: tuple[str, ...] = ()):
        self.partition_by = list(partition_by)
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
        """`name`'s path on the filesystem (no scheme: `bucket/key` on an object store)."""
        return join(self.root, name)

    def shown(self, name: str) -> str:
        """`name`'s location as a user would type it (`s3://bucket/key`, or the local path), for messages."""
        return join(self.path, name)

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
                if old.get("partition_by", []) != self.partition_by:
                    changes.append(f"output.partition_by: {old.get('partition_by', [])!r} -> {self.partition_by!r}")
                if not changes and "hashed_config" in old:
                    return
                if self._holds_parts():
                    raise ConfigError(
                        f"output.dir={self.path!r} holds a job with a different config ({'; '.join(changes[:5])}); "
                        "use another output.dir or set output.overwrite=true"
                    )
                # the job that claimed it wrote no part (it stopped at start-up, e.g. a model that did not
                # load): it owns no row, so the corrected job takes the directory over instead of being refused
                log.warning("output.dir=%r was claimed by a job with another config that wrote no part (%s); this "
                            "job takes it over", self.path, "; ".join(changes[:5]) or "no config recorded")
                self._clear()
            elif self._part_files():
                raise ConfigError(
                    f"output.dir={self.path!r} holds part files but no {MANIFEST}; "
                    "use another output.dir or set output.overwrite=true"
                )
        self.write_json(MANIFEST, {"config_hash": config_hash, "hashed_config": hashed, "config": full,
                                   "partition_by": self.partition_by, "created": time.time()})

    def _holds_parts(self) -> bool:
        """Any part file (or a part being written) here, in hive directories too, whatever the partitioning."""
        return any(
            info.type == pafs.FileType.File
            and (shard_of(info.base_name) is not None or info.base_name.startswith(f".{PART_PREFIX}"))
            and not any(seg.startswith(("_", ".")) for seg in self._relative_dir(info.path).split("/") if seg)
            for info in self._listing(recursive=True)
        )

    def _clear(self) -> None:
        """Delete this job's files (parts, temp parts, manifest, summary, fault markers) and nothing else."""
        for info in self._listing(recursive=True):
            name = info.base_name
            if info.type == pafs.FileType.File and (
                    shard_of(name) is not None or (name.startswith(f".{PART_PREFIX}") and name.endswith(".tmp"))
                    or name in (MANIFEST, SUMMARY)):
                self.fs.delete_file(info.path)
        for sub in (FAULTS, REPORT_DIR):
            if self.fs.get_file_info(self.file(sub)).type == pafs.FileType.Directory:
                self.fs.delete_dir(self.file(sub))

    # ---- parts ---------------------------------------------------------------------------------------
    def _listing(self, recursive: bool = False) -> list[pafs.FileInfo]:
        if self.fs.get_file_info(self.root).type != pafs.FileType.Directory:
            return []
        return self.fs.get_file_info(pafs.FileSelector(self.root, recursive=recursive))

    def _relative_dir(self, path: str) -> str:
        return path[len(self.root):].strip("/").rpartition("/")[0]

    def _part_files(self) -> list[pafs.FileInfo]:
        """Part files at the top level, or in hive directories when partitioned (never under a `_` or `.`
        directory such as _report/)."""
        files = [
            i for i in self._listing(recursive=bool(self.partition_by))
            if i.type == pafs.FileType.File and shard_of(i.base_name) is not None
            and not any(seg.startswith(("_", ".")) for seg in self._relative_dir(i.path).split("/") if seg)
        ]
        return sorted(files, key=lambda i: (i.base_name, i.path))

    def parts(self) -> list[str]:
        """Paths of the finished part files, in shard order."""
        return [i.path for i in self._part_files()]

    def part_infos(self) -> dict[int, PartInfo]:
        """shard index -> PartInfo, from each part's footer (no data read). A partitioned shard counts as
        written by this job only when all its files are there and agree on the fingerprint."""
        files: dict[int, list[tuple[str, Optional[dict[str, Any]], int]]] = defaultdict(list)
        for info in self._part_files():
            meta = pq.read_metadata(info.path, filesystem=self.fs)
            kv = meta.metadata or {}
            files[shard_of(info.base_name)].append(
                (info.path, json.loads(kv[META_KEY]) if META_KEY in kv else None, meta.num_rows))
        out: dict[int, PartInfo] = {}
        for shard, entries in files.items():
            metas = [m for _, m, _ in entries]
            fps = {m.get("fingerprint") if m else None for m in metas}
            complete = all(m is not None and m.get("files", 1) == len(entries) for m in metas)
            fp = next(iter(fps)) if len(fps) == 1 and complete else None
            out[shard] = PartInfo(shard, [p for p, _, _ in entries], fp, sum(n for _, _, n in entries))
        return out

    def done_shards(self) -> set[int]:
        return {i.shard for i in self.part_infos().values()}

    def write_part(self, shard_index: int, table: pa.Table, compression: str, fingerprint: Optional[str] = None) -> list[str]:
        """Write the shard's part (one file, or one per partition value) so that each file appears complete
        or not at all; replaces the shard's older files."""
        if not self.partition_by:
            return [self._write_file(part_name(shard_index), table, compression, shard_index, fingerprint, 1)]
        names = self.partition_by
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, key in enumerate(zip(*(table.column(n).to_pylist() for n in names))):
            groups[key].append(i)
        if not groups:  # an empty shard still marks itself done
            groups[tuple(None for _ in names)] = []
        self.delete_part(shard_index)  # a redone shard's rows may now fall in other partitions
        data = table.drop_columns(names)  # the directory names carry them (hive convention)
        return [
            self._write_file(f"{_hive_dir(names, key)}/{part_name(shard_index)}", data.take(rows), compression,
                             shard_index, fingerprint, len(groups))
            for key, rows in sorted(groups.items(), key=lambda kv: [str(v) for v in kv[0]])
        ]

    def _write_file(self, name: str, table: pa.Table, compression: str, shard: int, fingerprint: Optional[str],
                    files: int) -> str:
        meta = dict(table.schema.metadata or {})
        meta[META_KEY] = json.dumps({"shard": shard, "fingerprint": fingerprint, "rows": table.num_rows,
                                     "files": files}).encode()
        table = table.replace_schema_metadata(meta)
        final = self.file(name)
        if "/" in name:
            self.fs.create_dir(final.rpartition("/")[0], recursive=True)
        if not self._atomic_rename:  # object stores: an upload is invisible until it completes
            pq.write_table(table, final, compression=compression, filesystem=self.fs)
            return final
        head, _, base = final.rpartition("/")
        tmp = f"{head}/.{base[:-len(PART_SUFFIX)]}.{uuid.uuid4().hex}.tmp"
        pq.write_table(table, tmp, compression=compression, filesystem=self.fs)
        self.fs.move(tmp, final)
        return final

    def delete_part(self, shard_index: int) -> None:
        """Delete every file of the shard (in every partition directory)."""
        for info in self._part_files():
            if shard_of(info.base_name) == shard_index:
                self.fs.delete_file(info.path)

    def read_columns(self, columns: list[str]) -> Iterator[tuple[str, pa.Table]]:
        """(part path, the given columns that it has), one file at a time; partition columns are
        rebuilt from the hive directory names, as readers do."""
        for path in self.parts():
            yield path, self._read_file(path, columns)

    def read_part(self, shard_index: int, schema: pa.Schema) -> pa.Table:
        """The shard's rows as written (from every partition directory, the partition columns rebuilt), in
        `schema`; rows of different partitions come in directory order."""
        tables = [self._read_file(info.path, schema.names).select(schema.names).cast(schema)
                  for info in self._part_files() if shard_of(info.base_name) == shard_index]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def _read_file(self, path: str, columns: list[str]) -> pa.Table:
        """The given columns that the part file has, and the partition columns among them (as strings)."""
        names = pq.read_schema(path, filesystem=self.fs).names
        table = pq.read_table(path, columns=[c for c in columns if c in names], filesystem=self.fs)
        for col, value in _hive_values(self._relative_dir(path)).items():
            if col in columns and col not in table.column_names:
                table = table.append_column(col, pa.array([value] * table.num_rows, pa.string()))
        return table

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
