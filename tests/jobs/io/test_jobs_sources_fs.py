"""Inputs from any pyarrow filesystem and multi-file inputs: a real S3-compatible server (moto) reached
through pyarrow's S3 client, local globs, directories and prefixes, read in a stable order."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs_helpers import write_jsonl
from jobs.io.sources import SourceError, glob_regex, looks_like_hub_name, open_source
from s3_helpers import s3  # noqa: F401  (fixture)


def _rows(prefix: str, n: int, start: int = 0) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": f"{prefix} text {i}", "category": prefix} for i in range(start, start + n)]


def _read(path: str, fmt: str = "auto", batch: int = 3, **kw) -> tuple:
    src = open_source(path, fmt, "train", kw.pop("limit", None), kw.pop("storage", None))
    return src, [r for b in src.batches(batch) for r in b]


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet_bytes(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


@pytest.mark.slow
def test_s3_prefix_of_many_files_reads_in_sorted_order(s3):
    a, b, c = _rows("a", 4), _rows("b", 5), _rows("c", 3)
    # uploaded out of order, plus files a reader must skip
    s3.put("in/jsonl/part-2.jsonl", _jsonl_bytes(c))
    s3.put("in/jsonl/part-0.jsonl", _jsonl_bytes(a))
    s3.put("in/jsonl/sub/part-1.jsonl", _jsonl_bytes(b))  # nested: sorted by full path, after part-2
    s3.put("in/jsonl/_SUCCESS", b"")
    s3.put("in/jsonl/.part-9.jsonl.tmp", b"{broken")
    for path, storage in [(s3.uri("in/jsonl"), None), (s3.uri("in/jsonl/"), s3.storage())]:
        src, rows = _read(path, storage=storage)
        assert src.format == "jsonl" and src.num_rows() == 12
        assert [r["id"] for r in rows] == [r["id"] for r in a + c + b]
        assert src.files == sorted(src.files) and len(src.files) == 3
    # a prefix that is not a "directory", and a glob
    assert [r["id"] for r in _read(s3.uri("in/jsonl/part-"))[1]] == [r["id"] for r in a + c]
    assert [r["id"] for r in _read(s3.uri("in/jsonl/**/part-1.jsonl"))[1]] == [r["id"] for r in b]
    # parquet shards: schema and counts from the footers, rows streamed file by file, limit across files
    for i, rows in enumerate([a, b, c]):
        s3.put(f"in/pq/part-{i:05d}.parquet", _parquet_bytes(rows))
    src, rows = _read(s3.uri("in/pq"), limit=7)
    assert src.format == "parquet" and src.schema().names == ["id", "prompt", "category"]
    assert src.num_rows() == 7 and rows == (a + b)[:7]
    # the same rows every time
    assert _read(s3.uri("in/pq"))[1] == _read(s3.uri("in/pq"), batch=5)[1] == a + b + c


@pytest.mark.slow
def test_s3_missing_prefix_and_mixed_formats(s3):
    with pytest.raises(SourceError, match="does not exist"):
        open_source(s3.uri("nothing/here"), "auto", "train", None)
    s3.put("mixed/a.jsonl", _jsonl_bytes(_rows("a", 1)))
    s3.put("mixed/b.parquet", _parquet_bytes(_rows("b", 1)))
    with pytest.raises(SourceError, match=r"mixes formats \(1 jsonl, 1 parquet\)"):
        open_source(s3.uri("mixed"), "auto", "train", None)
    assert _read(s3.uri("mixed/*.parquet"))[1] == _rows("b", 1)
    assert _read(s3.uri("mixed"), fmt="jsonl")[1] == _rows("a", 1)


def test_local_glob_of_three_files_is_stable(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    parts = {"part-2.jsonl": _rows("c", 3), "part-0.jsonl": _rows("a", 4), "part-1.jsonl": _rows("b", 2)}
    for name, rows in parts.items():  # written out of order
        write_jsonl(d / name, rows)
    (d / "notes.txt").write_text("not data")
    expected = _rows("a", 4) + _rows("b", 2) + _rows("c", 3)
    runs = [_read(str(d / "part-*.jsonl"), batch=b)[1] for b in (1, 3, 4, 100)]
    assert all(rows == expected for rows in runs)
    src = open_source(str(d / "*.jsonl"), "auto", "train", None)
    assert src.num_rows() == 9 and [f.rsplit("/", 1)[1] for f in src.files] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    assert _read(str(d))[1] == expected  # the directory: its data files (notes.txt has no data extension)
    # CSV and parquet globs, and gzip-compressed JSONL
    for i, rows in enumerate([_rows("a", 2), _rows("b", 2), _rows("c", 2)]):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"p{i}.parquet")
        with open(tmp_path / f"c{i}.csv", "w") as f:
            f.write("id,prompt,category\n" + "".join(f"{r['id']},{r['prompt']},{r['category']}\n" for r in rows))
        with gzip.open(tmp_path / f"z{i}.jsonl.gz", "wb") as f:
            f.write(_jsonl_bytes(rows))
    six = _rows("a", 2) + _rows("b", 2) + _rows("c", 2)
    for pattern, fmt in (("p*.parquet", "parquet"), ("c?.csv", "csv"), ("z[0-9].jsonl.gz", "jsonl")):
        src, rows = _read(str(tmp_path / pattern))
        assert src.format == fmt and rows == six and src.num_rows() == 6, pattern
    assert _read(f"file://{tmp_path}/p*.parquet")[1] == six


def test_local_looking_paths_fail_without_a_hub_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ["missing.jsonl", "./data", "data/prompts.parquet", "../x/y", "a/b/c", str(tmp_path / "none"),
                 "nodir/*.jsonl", "org/name.jsonl"]:
        with pytest.raises(SourceError, match=r"does not exist|matches no file"):
            open_source(path, "auto", "train", None)
    src = open_source("org/name", "auto", "train", None)  # a hub name: opened lazily, nothing fetched here
    assert src.format == "hf_hub" and src.path == "org/name"
    assert looks_like_hub_name("teknium/OpenHermes-2.5") and not looks_like_hub_name("org/x.csv")


@pytest.mark.parametrize("pattern, path, match", [
    ("d/*.jsonl", "d/a.jsonl", True),
    ("d/*.jsonl", "d/e/a.jsonl", False),
    ("d/**/*.jsonl", "d/a.jsonl", True),
    ("d/**/*.jsonl", "d/e/f/a.jsonl", True),
    ("d/part-?.csv", "d/part-1.csv", True),
    ("d/part-[!0].csv", "d/part-0.csv", False),
])
def test_glob_regex(pattern, path, match):
    assert bool(glob_regex(pattern).match(path)) is match


def test_a_file_that_breaks_off_is_one_error_naming_it(tmp_path):
    """A truncated compressed file fails counting (before anything starts); a Parquet file whose footer reads but
    whose data is damaged fails where its rows are read; either way a SourceError naming the file."""
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(200))
    whole = (tmp_path / "rows.jsonl.gz").read_bytes()
    (tmp_path / "rows.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SourceError, match=r"cannot read .*rows.jsonl.gz: Truncated compressed stream"):
        open_source(str(tmp_path / "rows.jsonl.gz"), "auto", "train", None).num_rows()
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(8)], "prompt": [f"beta {i} " * 200 for i in range(8)]}),
                   tmp_path / "damaged.parquet", compression="zstd")
    data = bytearray((tmp_path / "damaged.parquet").read_bytes())
    data[30:400] = b"Z" * 370  # the first data page; the footer still reads
    (tmp_path / "damaged.parquet").write_bytes(bytes(data))
    source = open_source(str(tmp_path / "damaged.parquet"), "auto", "train", None)
    assert source.num_rows() == 8
    with pytest.raises(SourceError, match=r"cannot read .*damaged.parquet: "):
        list(source.batches(4))
