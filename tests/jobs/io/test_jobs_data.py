"""Data in and out without Ray: sources, row normalisation, prompt building, output schema and directory."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from pathlib import Path

import pytest

from jobs_helpers import SPEC_BENCH, shared, TINY_PROMPTS, write_jsonl
from esp_worker.model.load import build_tiny_tokenizer
from jobs.config import ConfigError
from jobs.io.output import OutputDir
from jobs.run.prompts import PromptBuilder, render_plain
from jobs.run.rows import RowNormalizer, derived_id, input_problem, parse_params
from jobs.run.schema import BASE_FIELDS, carry_types, output_schema, to_table
from jobs.io.sources import SourceError, bundled_prompts, detect_format, open_source

ROWS = [{"id": f"r{i}", "prompt": f"text {i}", "category": "a" if i % 2 else "b"} for i in range(10)]


def _read(path, fmt="auto", limit=None, split="train"):
    src = open_source(str(path), fmt, split, limit)
    return src, [r for batch in src.batches(3) for r in batch]


def test_every_format_streams_the_same_rows(tmp_path):
    import datasets

    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), (tmp_path / "pdir").mkdir() or tmp_path / "pdir" / "x.parquet")
    with open(tmp_path / "a.csv", "w") as f:
        f.write("id,prompt,category\n" + "".join(f"{r['id']},{r['prompt']},{r['category']}\n" for r in ROWS))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hfdict"))
    for path, fmt in [(jsonl, "jsonl"), (tmp_path / "a.json", "json"), (tmp_path / "a.parquet", "parquet"),
                      (tmp_path / "a.csv", "csv"), (tmp_path / "hf", "hf_disk")]:
        src, rows = _read(path)
        assert src.format == fmt and rows == ROWS and src.num_rows() == 10, fmt
    src, rows = _read(tmp_path / "hfdict", split="test", limit=4)
    assert rows == ROWS[:4] and src.num_rows() == 4
    assert _read(tmp_path / "pdir")[1] == ROWS[:4]
    assert open_source(str(tmp_path / "a.parquet"), "auto", "train", None).schema().names == ["id", "prompt", "category"]


def test_format_detection_errors(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(SourceError, match="set data.format"):
        detect_format(str(tmp_path / "a.txt"), "auto")
    with pytest.raises(SourceError, match="does not exist"):
        detect_format(str(tmp_path / "missing.jsonl"), "auto")
    assert detect_format("org/dataset", "auto") == "hf_hub"


def test_shared_dev_sets_and_bundled_prompts():
    src, rows = _read(shared(SPEC_BENCH))
    assert src.num_rows() == 240 and all(isinstance(r["turns"], list) for r in rows)
    src, rows = _read(shared(TINY_PROMPTS), limit=5)
    assert len(rows) == 5 and all("prompt" in r and "id" in r for r in rows)
    _, rows = _read(bundled_prompts())
    norm = RowNormalizer("id", "", "params", "category", [])
    jobs = [norm(i, r) for i, r in enumerate(rows)]
    assert len(jobs) == 48 and all(j.error is None for j in jobs)
    assert {j.kind for j in jobs} == {"prompt", "messages", "turns"}
    assert any(j.category is None for j in jobs) and any(j.category for j in jobs)


@pytest.mark.parametrize(
    "value, kind, error",
    [
        ("hi", "prompt", None),
        ("", None, "empty prompt"),
        (" \n", None, "empty prompt"),
        (None, None, "null"),
        (3.5, None, "type float"),
        ("a\ud800b", None, "UTF-8"),
        (["t1", "t2"], "turns", None),
        (["t1", ""], None, "turn is empty"),
        ([], None, "empty list"),
        ([{"role": "user", "content": "x"}], "messages", None),
        ([{"role": "user"}], None, "only strings"),
        (["t", {"role": "user", "content": "x"}], None, "only strings"),
    ],
)
def test_input_kinds_and_problems(value, kind, error):
    got_kind, got_error = input_problem(value)
    assert got_kind == kind
    assert (got_error is None) if error is None else (error in got_error)


def test_normalizer_ids_params_carry_and_duplicates():
    norm = RowNormalizer("id", "", "params", "category", ["src"])
    a = norm(0, {"prompt": "x", "src": 1})
    assert a.id == derived_id(0, "x") and a.id.startswith("row-000000-") and a.carry == {"src": 1}
    assert RowNormalizer("id", "", "params", "category", [])(0, {"prompt": "x"}).id == a.id  # deterministic
    assert norm(1, {"id": 7, "turns": ["a"], "messages": None}).id == "7"
    assert norm(2, {"id": 7, "prompt": "dup"}) is None and norm.duplicates_dropped == 1
    b = norm(3, {"id": "b", "prompt": None, "messages": [{"role": "user", "content": "m"}]})
    assert b.kind == "messages"
    c = norm(4, {"id": "c", "prompt": "x", "params": '{"max_new_tokens": 3}', "category": 5})
    assert c.params == {"max_new_tokens": 3} and c.category == "5" and c.error is None
    d = norm(5, {"id": "d", "text": "x"})
    assert "no input column" in d.error
    e = norm(6, {"id": "e\ud800", "prompt": "x"})
    assert e.id == "e\\ud800"
    only = RowNormalizer("id", "question", "params", "category", [])
    assert only(0, {"question": "q?"}).kind == "prompt" and "missing" in only(1, {"prompt": "p"}).error


def test_parse_params():
    assert parse_params({"temperature": 0.5, "top_k": None}) == ({"temperature": 0.5}, None)
    assert "unknown params key" in parse_params({"temp": 1})[1]
    assert "JSON object" in parse_params("{nope")[1]
    assert parse_params(None) == ({}, None)


def test_plain_prompts_tokenize_exactly_like_the_tokenizer():
    tok = build_tiny_tokenizer()
    builder = PromptBuilder(tok, "auto", {})
    assert not builder.use_template
    assert builder.prompt_ids("Hello world") == tok("Hello world").input_ids
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_plain(msgs) == "System: S\nUser: U\nAssistant:"
    assert builder.chat_ids(msgs) == tok("System: S\nUser: U\nAssistant:").input_ids
    with pytest.raises(ValueError, match="no chat template"):
        PromptBuilder(tok, "always", {})


def test_chat_template_is_applied_when_present():
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    builder = PromptBuilder(tok, "auto", {})
    assert builder.use_template
    assert builder.prompt_ids("hi") == tok("<user>hi<assistant>", add_special_tokens=False).input_ids
    assert not PromptBuilder(tok, "never", {}).use_template


def test_output_schema_and_tables():
    schema = output_schema(True, carry_types(["n", "s"], None, [{"n": 1, "s": None}, {"n": 2, "s": None}]))
    assert schema.names[: len(BASE_FIELDS)] == [f.name for f in BASE_FIELDS]
    assert schema.field("n").type == pa.int64() and schema.field("s").type == pa.string()
    table = to_table([{"id": "a", "n": "not an int", "s": "ok"}, {"id": "b", "n": 3, "s": "x\ud800"}], schema)
    assert table.schema == schema
    assert table.column("n").to_pylist() == [None, 3] and table.column("s").to_pylist() == ["ok", None]
    assert to_table([], schema).num_rows == 0


def test_output_dir_claims_and_writes_atomically(tmp_path):
    out = OutputDir(str(tmp_path / "o"))
    out.claim("h1", {"engine": {"x": 1}}, {}, overwrite=False)
    out.claim("h1", {"engine": {"x": 1}}, {}, overwrite=False)  # same job: fine
    out.claim("h1b", {"engine": {"x": 1, "new_setting": 0}}, {}, overwrite=False)  # a key added by a newer version
    table = pa.table({"id": ["a"]})
    out.write_part(3, table, "zstd")
    assert out.done_shards() == {3} and not list(Path(out.path).glob(".*"))
    with pytest.raises(ConfigError, match=r"engine.x: 1 -> 2"):
        out.claim("h2", {"engine": {"x": 2}}, {}, overwrite=False)
    (Path(out.path) / "notes.txt").write_text("user file")
    out.claim("h2", {"engine": {"x": 2}}, {}, overwrite=True)
    assert out.done_shards() == set() and (Path(out.path) / "notes.txt").exists()
    foreign = OutputDir(str(tmp_path / "f"))
    Path(foreign.path).mkdir()
    pq.write_table(table, Path(foreign.path) / "part-000000.parquet")
    with pytest.raises(ConfigError, match="no _job.json"):
        foreign.claim("h", {}, {}, overwrite=False)


def test_normalizer_records_the_input_id_types():
    """The output's id is a string; the input's id types are kept so that an exporter can give them back."""
    norm = RowNormalizer("id", "", "params", "category", [])
    norm(0, {"id": 81, "prompt": "x"})
    norm(1, {"id": 82, "prompt": "y"})
    assert norm.id_types == {"int"}
    norm(2, {"prompt": "z"})
    norm(3, {"id": "q4", "prompt": "w"})
    assert norm.id_types == {"int", "derived", "str"}


def test_tau_per_category_carries_the_counts_that_pool_groups():
    import pyarrow as pa

    from jobs.run.stats import Totals

    totals = Totals()
    totals.add(pa.table({"category": ["writing", "math", "math", "qa"], "num_decode_tokens": [10, 6, 3, 4],
                         "num_decode_passes": [4, 2, 3, 4], "error": [None, None, None, "x"]}))
    per = totals.tau_per_category()
    assert per["math"] == {"rows": 2, "tau": 9 / 5, "decode_tokens": 9, "decode_passes": 5}
    pooled = sum(per[c]["decode_tokens"] for c in ("writing", "math")) / sum(
        per[c]["decode_passes"] for c in ("writing", "math"))
    assert pooled == 19 / 9


def test_a_malformed_jsonl_line_names_its_line_and_column(tmp_path):
    """The row's error says where the JSON breaks (the decoder's position), not only what broke."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "fine"}, '{"id": "b", "prompt": "x",, "c": 1}',
                                               {"id": "c", "prompt": "fine"}, "[1, 2]"])
    _, rows = _read(path)
    error = rows[1]["__error__"]
    assert error.startswith("line 2 is not valid JSON: ") and "column 27" in error and "property name" in error
    assert rows[3]["__error__"] == "line 4 is not a JSON object" and rows[2]["id"] == "c"
    array = tmp_path / "in.json"
    array.write_text('[{"id": "a"},\n {"id": "b",}]')
    with pytest.raises(SourceError, match=r"line 2 column 13"):
        _read(array)


def test_a_claim_without_parts_passes_to_a_different_config(tmp_path):
    """A job that stopped before its first part (a model that would not load) owns nothing yet: a different
    config may take the directory over. Once a part is written, the claim holds."""
    out = OutputDir(str(tmp_path / "o"))
    out.claim("h1", {"model": {"name_or_path": "/models/typo"}}, {"model": "typo"}, overwrite=False)
    out.write_json("_summary.json", {"runs": [{"rows": 0}]})  # the failed start's run record
    out.claim("h2", {"model": {"name_or_path": "/models/right"}}, {"model": "right"}, overwrite=False)
    assert out.read_json("_job.json")["config_hash"] == "h2" and out.read_json("_summary.json") is None
    out.write_part(0, pa.table({"id": ["a"]}), "zstd", "fp")
    with pytest.raises(ConfigError, match=r"holds a job with a different config .*model.name_or_path"):
        out.claim("h1", {"model": {"name_or_path": "/models/typo"}}, {}, overwrite=False)
    assert out.read_json("_job.json")["config_hash"] == "h2" and out.done_shards() == {0}
    hive = OutputDir(str(tmp_path / "hive"), partition_by=("category",))
    hive.claim("p", {"engine": {"x": 1}}, {}, overwrite=False)
    hive.write_part(0, pa.table({"id": ["a"], "category": ["c"]}), "zstd", "fp")
    flat = OutputDir(str(tmp_path / "hive"))  # unpartitioned: its parts are in category=c/, still parts
    with pytest.raises(ConfigError, match="output.partition_by"):
        flat.claim("p", {"engine": {"x": 1}}, {}, overwrite=False)
    assert hive.done_shards() == {0}
