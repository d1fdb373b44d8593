"""Input sources: stream rows as dicts in batches, whatever the format and wherever the files are.

`data.path` is a local path or a URI (s3://, gs://, hdfs://, file://; see jobs/io/storage.py), naming
- one file (Parquet, JSONL, JSON, CSV; `.gz`/`.bz2`/`.zst`/`.lz4` compressed text files are decompressed),
- a directory or, in an object store, a prefix: every data file below it, recursively,
- a glob (`*`, `?`, `[...]` within a path component, `**` across components),
- a saved `datasets` directory (local), or a Hugging Face hub dataset name `org/name`.

A multi-file input is one dataset: its files are sorted by path (so row positions, shards and resume are
the same on every run) and read one after another, a batch at a time; nothing is loaded whole except a
JSON array (`.json` whose first character is `[`), which is parsed at once. Names starting with `.` or `_`
(temporary files, `_SUCCESS`, `_job.json`) are skipped, as pyarrow, Spark and our own output do.

A JSONL line that is not valid JSON becomes the row {"__error__": "..."}, so it gets an output row with
that error instead of stopping the job.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from itertools import islice
from pathlib import PurePosixPath
from typing import Any, Iterator, Optional

import pyarrow as pa
import pyarrow.fs as pafs

from .storage import StorageError, is_uri, resolve

ERROR_KEY = "__error__"
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")  # text formats only; pyarrow detects the codec from the name
_LOCAL_LOOKING = (*_EXTENSIONS, *_COMPRESSED, ".txt", ".tsv", ".arrow")
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_GLOB_CHARS = re.compile(r"[*?\[]")


class SourceError(ValueError):
    """The input cannot be opened; one-line message."""


def bundled_prompts() -> str:
    """Path of the small prompt file shipped with the package (the default job's input)."""
    return str(resources.files("jobs") / "data" / "prompts.jsonl")


def file_format(name: str) -> Optional[str]:
    """Format of one file from its name (`x.jsonl.gz` -> jsonl), or None when the name does not tell."""
    p = PurePosixPath(name.lower())
    suffixes = p.suffixes[-2:]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
        fmt = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
        return fmt if fmt != "parquet" else None  # parquet compresses inside the file
    return _EXTENSIONS.get(suffixes[-1]) if suffixes else None


def looks_like_hub_name(path: str) -> bool:
    """`org/name` (one slash, no scheme, no leading `.`, `/` or `~`, no glob, no data-file extension)."""
    return (
        path.count("/") == 1 and not is_uri(path) and not path.startswith((".", "/", "~"))
        and not path.endswith("/") and not _GLOB_CHARS.search(path)
        and not path.lower().endswith(_LOCAL_LOOKING)
    )


def glob_regex(pattern: str) -> re.Pattern:
    """Regex for a path glob: `*` and `?` stay within one component, `**/` spans any number of them.

    >>> bool(glob_regex("d/**/*.jsonl").match("d/a/b/x.jsonl")), bool(glob_regex("d/*.jsonl").match("d/a/x.jsonl"))
    (True, False)
    """
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def list_files(fs: pafs.FileSystem, base: str) -> list[str]:
    """Every visible file below `base` (recursively), sorted by path."""
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    prefix = base.rstrip("/") + "/"
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and not _hidden(i.path[len(prefix):]))


def _expand(fs: pafs.FileSystem, path: str, shown: str) -> tuple[list[str], bool]:
    """(files, is_directory) named by `path` on `fs`: a file, a directory/prefix, or a glob."""
    if _GLOB_CHARS.search(path):
        static = _GLOB_CHARS.split(path, 1)[0]
        base = static.rsplit("/", 1)[0] if "/" in static else ""
        regex = glob_regex(path)
        files = [f for f in list_files(fs, base) if regex.match(f)]
        if not files:
            raise SourceError(f"data.path={shown!r} matches no file")
        return files, True
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path], False
    if info.type == pafs.FileType.Directory:
        return list_files(fs, path), True
    if "/" in path and not isinstance(fs, pafs.LocalFileSystem):  # an object-store prefix such as s3://b/data/part-
        parent, stem = path.rsplit("/", 1)
        files = [f for f in list_files(fs, parent) if f[len(parent) + 1:].startswith(stem)]
        if files:
            return files, True
    raise SourceError(f"data.path={shown!r} does not exist")


def _pick_format(files: list[str], fmt: str, shown: str) -> tuple[list[str], str]:
    """Keep the data files of one format; `fmt` auto = the one format the file names show."""
    if fmt != "auto":
        mine = [f for f in files if file_format(f) == fmt or (fmt == "jsonl" and file_format(f) == "json")]
        if len(files) > 1:  # a directory: the files of that format, else those whose name tells none
            files = mine or [f for f in files if file_format(f) is None]
        if not files:
            raise SourceError(f"data.path={shown!r} holds no {fmt} file")
        return files, fmt
    if len(files) == 1:
        found = file_format(files[0])
        if found is None:
            raise SourceError(f"data.path={shown!r}: cannot tell the format of {files[0]!r}; set data.format")
        return files, found
    by_format: dict[str, list[str]] = {}
    for f in files:
        if (found := file_format(f)) is not None:
            by_format.setdefault(found, []).append(f)
    if not by_format:
        raise SourceError(f"data.path={shown!r} holds no parquet, jsonl, json or csv file")
    if len(by_format) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_format.items()))
        raise SourceError(f"data.path={shown!r} mixes formats ({counts}); use a glob such as '*.parquet' or set data.format")
    ((found, files),) = by_format.items()
    return files, found


@dataclass
class Source:
    """A readable input: one or more files of one format on one filesystem, a saved `datasets` directory, or
    a hub dataset. `schema` is the Arrow schema when the format carries one (parquet, datasets)."""

    path: str  # as given (URI or local path)
    format: str
    split: str
    limit: Optional[int]
    files: list[str] = field(default_factory=list)  # on `filesystem`, in read order; empty for hf_disk / hf_hub
    filesystem: Optional[pafs.FileSystem] = None
    _footers: dict[str, Any] = field(default_factory=dict, repr=False)

    def num_rows(self) -> Optional[int]:
        """Rows that will be read (after `limit`); None when unknown (hub streaming without split info)."""
        n = self._count()
        if n is None:
            return self.limit
        return n if self.limit is None else min(n, self.limit)

    def schema(self) -> Optional[pa.Schema]:
        if self.format == "parquet":
            schemas = [self._footer(f).schema.to_arrow_schema() for f in self.files]
            try:
                return pa.unify_schemas(schemas) if schemas else None
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise SourceError(f"data.path={self.path!r}: the parquet files' schemas differ: {str(exc).splitlines()[0]}") from None
        if self.format == "hf_disk":
            return self._hf_disk().data.schema
        return None

    def batches(self, batch_size: int) -> Iterator[list[dict[str, Any]]]:
        """Rows in input order, `batch_size` at a time, stopping after `limit` rows."""
        rows = self._rows()
        if self.limit is not None:
            rows = islice(rows, self.limit)
        while batch := list(islice(rows, batch_size)):
            yield batch

    def _count(self) -> Optional[int]:
        if self.format == "parquet":
            return sum(self._footer(f).num_rows for f in self.files)
        if self.format == "hf_disk":
            return len(self._hf_disk())
        if self.format == "hf_hub":
            return self._hf_hub_count()
        if self.format == "jsonl":  # one row per non-blank line: count without parsing
            total = 0
            for f in self.files:
                with self._reading(f), self._open_binary(f) as stream:
                    total += sum(1 for line in io.BufferedReader(stream) if line.strip())
            return total
        return sum(1 for _ in self._rows())

    def _rows(self) -> Iterator[dict[str, Any]]:
        if self.format == "hf_disk":
            for table in self._hf_disk().with_format("arrow").iter(batch_size=1024):
                yield from table.to_pylist()
            return
        if self.format == "hf_hub":
            yield from self._hf_hub()
            return
        for f in self.files:
            yield from self._file_rows(f)

    def _file_rows(self, f: str) -> Iterator[dict[str, Any]]:
        with self._reading(f):
            yield from self._parse(f)

    @contextlib.contextmanager
    def _reading(self, f: str) -> Iterator[None]:
        """A file that cannot be read to its end (a truncated or corrupt compressed stream, a damaged Parquet file,
        a malformed CSV, an object store that fails mid-read) as one SourceError naming it."""
        try:
            yield
        except (OSError, pa.ArrowException, csv.Error) as exc:
            text = str(exc).strip()
            raise SourceError(f"data.path={self.path!r}: cannot read {f}: "
                              f"{text.splitlines()[0] if text else type(exc).__name__}") from None

    def _parse(self, f: str) -> Iterator[dict[str, Any]]:
        if self.format == "parquet":
            import pyarrow.parquet as pq

            with self.filesystem.open_input_file(f) as handle:
                for batch in pq.ParquetFile(handle).iter_batches(batch_size=1024):
                    yield from batch.to_pylist()
        elif self.format in ("jsonl", "json"):
            with self._open_text(f) as text:
                yield from (_json_rows(text) if self.format == "json" else _jsonl_rows(text))
        else:
            with self._open_text(f, newline="") as text:
                yield from csv.DictReader(text)

    def _open_binary(self, f: str) -> Any:
        return self.filesystem.open_input_stream(f)  # compression detected from the name (.gz, .zst, ...)

    def _open_text(self, f: str, newline: Optional[str] = None) -> io.TextIOWrapper:
        return io.TextIOWrapper(self._open_binary(f), encoding="utf-8", errors="surrogateescape", newline=newline)

    def _footer(self, f: str) -> Any:
        if f not in self._footers:
            import pyarrow.parquet as pq

            with self.filesystem.open_input_file(f) as handle:
                self._footers[f] = pq.ParquetFile(handle).metadata
        return self._footers[f]

    def _hf_disk(self) -> Any:
        import datasets

        data = datasets.load_from_disk(self.path)
        if isinstance(data, datasets.DatasetDict):
            if self.split not in data:
                raise SourceError(f"data.split={self.split!r} not in {self.path!r}; splits: {', '.join(data)}")
            data = data[self.split]
        return data

    def _hf_hub(self) -> Iterator[dict[str, Any]]:
        import datasets

        try:
            yield from datasets.load_dataset(self.path, split=self.split, streaming=True)
        except (OSError, ValueError, ConnectionError) as exc:
            raise SourceError(f"cannot load hub dataset {self.path!r}: {str(exc).strip().splitlines()[0]}") from None

    def _hf_hub_count(self) -> Optional[int]:
        import datasets

        try:
            info = datasets.load_dataset_builder(self.path).info
        except (OSError, ValueError, ConnectionError) as exc:
            raise SourceError(f"cannot load hub dataset {self.path!r}: {str(exc).strip().splitlines()[0]}") from None
        split = (info.splits or {}).get(self.split)
        return split.num_examples if split is not None else None


def open_source(path: str, fmt: str, split: str, limit: Optional[int], storage: Optional[Any] = None) -> Source:
    """Resolve the location, list its files and the format; raises SourceError.

    `storage` is the `storage.*` config section (a jobs.io.storage.StorageConfig-like object) or None (the
    store's environment variables). A local-looking path that does not exist is an error, never a hub
    lookup; `org/name` that is not a local path is a hub dataset."""
    path = path or bundled_prompts()
    if fmt == "hf_hub":
        return Source(path=path, format="hf_hub", split=split, limit=limit)
    try:
        fs, where = resolve(path, storage)
    except StorageError as exc:
        raise SourceError(str(exc)) from None
    local = isinstance(fs, pafs.LocalFileSystem)
    if local and not _GLOB_CHARS.search(where) and fs.get_file_info(where).type == pafs.FileType.NotFound:
        if not is_uri(path) and looks_like_hub_name(path) and fmt == "auto":
            return Source(path=path, format="hf_hub", split=split, limit=limit)
        raise SourceError(f"data.path={path!r} does not exist")
    if fmt == "hf_disk" or (fmt == "auto" and local and fs.get_file_info(where).type == pafs.FileType.Directory
                            and any(fs.get_file_info(f"{where}/{m}").type == pafs.FileType.File for m in _HF_DISK_MARKERS)):
        if not local:
            raise SourceError(f"data.path={path!r}: a saved datasets directory must be local; write it as parquet instead")
        return Source(path=where, format="hf_disk", split=split, limit=limit)
    try:
        files, is_dir = _expand(fs, where, path)
    except OSError as exc:
        raise SourceError(f"cannot list data.path={path!r}: {str(exc).strip().splitlines()[0]}") from None
    if not files:
        raise SourceError(f"data.path={path!r} is a directory with neither a saved dataset nor data files")
    files, found = _pick_format(files, fmt, path)
    return Source(path=path, format=found, split=split, limit=limit, files=files, filesystem=fs)


def detect_format(path: str, fmt: str, storage: Optional[Any] = None) -> str:
    """`data.format`, with `auto` resolved from the file names or the directory's contents."""
    return open_source(path, fmt, "train", None, storage).format


def _jsonl_rows(text: io.TextIOBase) -> Iterator[dict[str, Any]]:
    for line_no, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield {ERROR_KEY: f"line {line_no} is not valid JSON: {exc.msg} (column {exc.colno})"}
            continue
        yield row if isinstance(row, dict) else {ERROR_KEY: f"line {line_no} is not a JSON object"}


def _json_rows(text: io.TextIOBase) -> Iterator[dict[str, Any]]:
    """A JSON array (parsed whole), or JSON lines under a .json name."""
    head = text.read(4096)
    if not head.lstrip().startswith("["):
        yield from _jsonl_rows(_chain(head, text))
        return
    try:
        rows = json.loads(head + text.read())
    except json.JSONDecodeError as exc:
        raise SourceError(f"not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    for i, row in enumerate(rows):
        yield row if isinstance(row, dict) else {ERROR_KEY: f"item {i} is not a JSON object"}


def _chain(head: str, rest: io.TextIOBase) -> Iterator[str]:
    """The lines of `head` + `rest` (head is the start of the same stream, already read)."""
    lines = head.splitlines(keepends=True)
    carry = lines.pop() if lines and not lines[-1].endswith("\n") else ""
    yield from lines
    for line in rest:
        if carry:
            line, carry = carry + line, ""
        yield line
    if carry:
        yield carry
