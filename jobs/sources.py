"""Input sources: stream rows as dicts in batches, whatever the format. Nothing here loads a whole file
except a JSON array (`.json` whose first character is `[`), which is parsed at once.

A JSONL line that is not valid JSON becomes the row {"__error__": "..."}, so it gets an output row with
that error instead of stopping the job.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow as pa

from .storage import looks_local

ERROR_KEY = "__error__"
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv"}


class SourceError(ValueError):
    """The input cannot be opened; one-line message."""


def bundled_prompts() -> str:
    """Path of the small prompt file shipped with the package (the default job's input)."""
    return str(resources.files("jobs") / "data" / "prompts.jsonl")


def detect_format(path: str, fmt: str) -> str:
    """`data.format`, with `auto` resolved from the extension or the directory's contents."""
    if fmt != "auto":
        return fmt
    p = Path(path)
    if p.is_dir():
        if any((p / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf_disk"
        if any(p.rglob("*.parquet")):
            return "parquet"
        raise SourceError(f"data.path={path!r} is a directory with neither a saved dataset nor parquet files")
    if p.exists():
        if p.suffix.lower() in _EXTENSIONS:
            return _EXTENSIONS[p.suffix.lower()]
        raise SourceError(f"data.path={path!r}: cannot tell the format from {p.suffix!r}; set data.format")
    if not looks_local(path) and path.count("/") == 1:
        return "hf_hub"  # org/name
    raise SourceError(f"data.path={path!r} does not exist; give an existing file or directory, or a hub dataset "
                      "name such as org/name")


@dataclass
class Source:
    """A readable input. `schema` is the Arrow schema when the format carries one (parquet, datasets)."""

    path: str
    format: str
    split: str
    limit: Optional[int]

    def num_rows(self) -> Optional[int]:
        """Rows that will be read (after `limit`); None when unknown (hub streaming without split info)."""
        n = self._count()
        if n is None:
            return self.limit
        return n if self.limit is None else min(n, self.limit)

    def schema(self) -> Optional[pa.Schema]:
        if self.format == "parquet":
            return self._parquet().schema
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
            return self._parquet().count_rows()
        if self.format == "hf_disk":
            return len(self._hf_disk())
        if self.format == "hf_hub":
            return self._hf_hub_count()
        if self.format == "jsonl":  # one row per non-blank line: count without parsing
            with open(self.path, "rb") as f:
                return sum(1 for line in f if line.strip())
        return sum(1 for _ in self._rows())

    def _rows(self) -> Iterator[dict[str, Any]]:
        if self.format == "parquet":
            for batch in self._parquet().to_batches(batch_size=1024):
                yield from batch.to_pylist()
        elif self.format == "jsonl":
            yield from _jsonl_rows(self.path)
        elif self.format == "json":
            yield from _json_rows(self.path)
        elif self.format == "csv":
            with open(self.path, newline="", encoding="utf-8", errors="surrogateescape") as f:
                yield from csv.DictReader(f)
        elif self.format == "hf_disk":
            for table in self._hf_disk().with_format("arrow").iter(batch_size=1024):
                yield from table.to_pylist()
        else:
            yield from self._hf_hub()

    def _parquet(self) -> Any:
        import pyarrow.dataset as ds

        return ds.dataset(self.path, format="parquet")

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


def open_source(path: str, fmt: str, split: str, limit: Optional[int]) -> Source:
    """Resolve the format and check the path; raises SourceError."""
    path = path or bundled_prompts()
    return Source(path=path, format=detect_format(path, fmt), split=split, limit=limit)


def _jsonl_rows(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield {ERROR_KEY: f"line {line_no} is not valid JSON: {exc.msg}"}
                continue
            yield row if isinstance(row, dict) else {ERROR_KEY: f"line {line_no} is not a JSON object"}


def _json_rows(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        yield from _jsonl_rows(path)
        return
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    for i, row in enumerate(rows):
        yield row if isinstance(row, dict) else {ERROR_KEY: f"item {i} is not a JSON object"}
