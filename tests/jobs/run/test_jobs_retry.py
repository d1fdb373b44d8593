"""output.retry_errors: which rows of the written parts run again, and how a part is put back together (real
Parquet parts, partitioned as a user may ask)."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from jobs.io.output import OutputDir
from jobs.run.retry import Retry, retryable
from jobs.run.rows import JobRow
from jobs.run.schema import output_schema, to_table

SCHEMA = output_schema(True, {"year": pa.int64()})
ENGINE = "engine error: MemoryShortError: a KV cache of 64 rows ..."
LOST = "the engine actor was lost each of the 2 times it ran this row alone (...): actor 0 ..."


def _records(spec: list[tuple[str, str, object, str]]) -> list[dict]:
    return [{"id": i, "category": c, "year": y, "error": e, "generated_text": None if e else f"text {i}"}
            for i, c, y, e in spec]


def test_only_errors_from_running_a_row_are_retried():
    assert retryable(ENGINE) and retryable(LOST)
    assert not any(retryable(e) for e in (None, "", "no input column: expected one of prompt, messages, turns",
                                          "cannot build the prompt: TemplateError: ..."))


def test_a_partitioned_part_is_rebuilt_in_input_order_with_the_rows_run_again(tmp_path: Path):
    out = OutputDir(str(tmp_path / "out"), partition_by=("category", "year"))
    old = _records([("a", "x", 2020, ENGINE), ("b", "y", 2021, None), ("c", None, None, "cannot build the prompt: ..."),
                    ("d", "x", 2021, LOST), ("e", "y", 2020, None)])
    out.write_part(3, to_table(old, SCHEMA), "zstd", "fp")
    out.write_part(4, to_table(_records([("f", "x", 2020, None)]), SCHEMA), "zstd", "fp")

    retry = Retry(out)
    assert retry.ids == {3: {"a", "d"}}
    rows = [JobRow(id=i, kind="prompt", input=i) for i in "abcde"]
    assert retry.select(4, [JobRow(id="f", kind="prompt", input="f")]) == []
    assert [r.id for r in retry.select(3, rows)] == ["a", "d"] and retry.rows == 2

    new = to_table(_records([("a", "x", 2020, None), ("d", "z", 2021, ENGINE)]), SCHEMA)  # d failed again
    whole = retry.merged(3, new)
    assert whole.schema == SCHEMA
    assert whole.select(["id", "category", "year", "error", "generated_text"]).to_pylist() == [
        {"id": "a", "category": "x", "year": 2020, "error": None, "generated_text": "text a"},
        {"id": "b", "category": "y", "year": 2021, "error": None, "generated_text": "text b"},
        {"id": "c", "category": None, "year": None, "error": "cannot build the prompt: ...", "generated_text": None},
        {"id": "d", "category": "z", "year": 2021, "error": ENGINE, "generated_text": None},
        {"id": "e", "category": "y", "year": 2020, "error": None, "generated_text": "text e"},
    ]
    out.write_part(3, whole, "zstd", "fp")  # d's row moved to another partition: no copy is left in the old one
    assert sorted(out.read_part(3, SCHEMA).column("id").to_pylist()) == list("abcde")
    assert retry.merged(4, new) is new  # a shard not being retried passes through
