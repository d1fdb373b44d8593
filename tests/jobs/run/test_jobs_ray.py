"""Jobs on a real local Ray head: end to end, resume, changed config, actor kill, bad rows, driver kill,
`ray job submit`. One head for the module; each job is small (tiny model, few tokens)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pytest

from jobs_helpers import FAST, REPO, SPEC_BENCH, shared, job_cfg, ray_job_head, read_output, write_jsonl  # noqa: F401
from jobs.config import ConfigError
from jobs.run.runner import run_job
from jobs.run.schema import BASE_FIELDS

pytestmark = pytest.mark.slow  # every test runs a job on a local Ray head


def _prompts(n: int, prefix: str = "p") -> list[dict]:
    cats = ["qa", "code", "math"]
    return [{"id": f"{prefix}{i:03d}", "prompt": f"Question {i}: what is {i} plus {i}?", "category": cats[i % 3]}
            for i in range(n)]


def test_end_to_end_two_actors_then_resume(ray_job_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(44))
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=2", "data.shard_size=8"))

    table = read_output(out)
    for f in BASE_FIELDS:  # every required column, with its type
        assert table.schema.field(f.name).type == f.type, f.name
    assert table.schema.field("generated_token_ids").type == pa.list_(pa.int32())
    rows = table.to_pylist()
    assert sorted(r["id"] for r in rows) == [f"p{i:03d}" for i in range(44)]
    assert all(r["error"] is None and r["num_generated_tokens"] == len(r["generated_token_ids"]) > 0 for r in rows)
    assert {r["method"] for r in rows} == {"ar"}
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    s = json.loads(Path(res.summary_path).read_text())
    assert s["rows"] == 44 and s["errors"] == 0 and s["parts"] == 6
    assert s["generated_tokens"] == sum(r["num_generated_tokens"] for r in rows)
    assert set(s["tau_per_category"]) == {"qa", "code", "math"} and s["config_hash"]
    assert not list(out.glob(".*tmp"))
    assert len(pd.read_parquet(out)) == 44  # the _-prefixed manifest and summary are skipped by readers
    by_cat = duckdb.sql(f"SELECT category, count(*) FROM '{out}/*.parquet' GROUP BY category").fetchall()
    assert sorted(n for _, n in by_cat) == [14, 15, 15]

    # Rerun after losing two parts: only those shards run again; the others are not rewritten.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    (out / "part-000001.parquet").unlink()
    (out / "part-000004.parquet").unlink()
    res2 = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=2", "data.shard_size=8"))
    assert res2.summary["this_run"]["shards_written"] == 2 and res2.summary["this_run"]["shards_skipped"] == 4
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert all(after[n] == t for n, t in before.items() if n in after and n not in ("part-000001.parquet", "part-000004.parquet"))
    ids = read_output(out).column("id").to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows)

    # A changed config into the same directory is refused, naming the key; overwrite starts over.
    with pytest.raises(ConfigError, match="generation.max_new_tokens"):
        run_job(job_cfg(out, f"data.path={data}", "generation.max_new_tokens=7"))
    # (with two samples per row: one row each, its samples in a list column that DuckDB unnests)
    res3 = run_job(job_cfg(out, f"data.path={data}", "generation.max_new_tokens=2", "data.limit=8",
                           "output.overwrite=true", "ray.num_actors=1", "generation.n=2", "generation.temperature=0.7"))
    assert res3.summary["rows"] == 8 and len(list(out.glob("part-*.parquet"))) == 1
    assert res3.summary["generated_tokens"] == 32 and res3.summary["errors"] == 0
    assert duckdb.sql(f"SELECT count(*), sum(s.num_generated_tokens) FROM (SELECT unnest(samples) AS s "
                      f"FROM '{out}/*.parquet')").fetchall() == [(16, 32)]


def test_actor_killed_mid_shard_is_retried(ray_job_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(24))
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=2", "data.shard_size=6", "fault.kill_shard=1",
                          "fault.kill_attempts=1"))
    assert (out / "_faults" / "shard-1.attempt-1").exists()  # the actor really died once
    ids = read_output(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 24
    assert res.summary["errors"] == 0


BAD_ROWS = [
    {"id": "ok-0", "prompt": "hello there"},
    {"id": "empty", "prompt": ""},
    {"id": "blank", "prompt": "   "},
    {"id": "long", "prompt": "x" * 1500},  # > the tiny model's 1024-token context
    {"id": "null", "prompt": None},
    {"id": "int", "prompt": 42},
    '{"id": "surrogate", "prompt": "bad \\ud800 text"}',  # a lone UTF-16 surrogate: not valid UTF-8
    {"id": "ok-0", "prompt": "duplicate id: dropped"},
    {"id": "bad-temp", "prompt": "hi", "params": {"temperature": -1}},
    {"id": "bad-key", "prompt": "hi", "params": {"colour": "red"}},
    "{this line is not json",
    {"id": "bad-turns", "turns": ["fine", ""]},
    {"id": "bad-list", "prompt": [1, 2]},
    {"id": "ok-1", "messages": [{"role": "user", "content": "hi"}]},
    {"id": "ok-2", "turns": ["one", "two"], "params": {"max_new_tokens": 3}},
]


def test_bad_rows_get_errors_and_the_job_goes_on(ray_job_head, tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=1", "data.shard_size=4"))
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    ids = read_output(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 14  # 15 rows, one duplicate id dropped
    assert res.summary["duplicates_dropped"] == 1 and res.summary["errors"] == 11
    assert rows["ok-0"]["error"] is None and rows["ok-0"]["num_generated_tokens"] > 0
    assert rows["ok-1"]["error"] is None
    assert rows["ok-2"]["error"] is None and len(rows["ok-2"]["generated_turns"]) == 2
    assert rows["ok-2"]["num_generated_tokens"] <= 6
    expected = {"empty": "empty", "blank": "empty", "long": "context", "null": "null", "int": "type int",
                "surrogate": "UTF-8", "bad-temp": "temperature", "bad-key": "colour", "bad-turns": "empty",
                "bad-list": "list"}
    for rid, word in expected.items():
        assert word in rows[rid]["error"], (rid, rows[rid]["error"])
        assert rows[rid]["generated_text"] is None
    bad_json = [r for r in rows.values() if r["id"].startswith("row-")]
    assert len(bad_json) == 1 and "not valid JSON" in bad_json[0]["error"]


def test_spec_bench_turns(ray_job_head, tmp_path):
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={shared(SPEC_BENCH)}", "data.id_column=question_id", "data.limit=6",
                          "ray.num_actors=1", "data.carry_columns=[question_id]", "generation.max_new_tokens=3"))
    rows = read_output(out).to_pylist()
    assert len(rows) == 6 and {r["id"] for r in rows} == {str(r["question_id"]) for r in rows}
    for r in rows:
        assert r["error"] is None
        assert len(r["generated_turns"]) == 2 and r["generated_text"] == r["generated_turns"][-1]
    assert set(res.summary["tau_per_category"]) == {r["category"] for r in rows}


def test_driver_killed_then_restarted_resumes(ray_job_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(40))
    out = tmp_path / "out"
    # one shard at a time: the driver dies right after its third part (a kill at a known point, not a race)
    args = [*FAST, f"data.path={data}", f"output.dir={out}", "data.shard_size=4", "ray.num_actors=1",
            "generation.max_new_tokens=8", "engine.max_batch_size=2", "ray.shards_in_flight_per_actor=1"]
    proc = subprocess.run([sys.executable, "-m", "jobs.generate", *args, "fault.driver_exit_after_parts=3"], cwd=REPO,
                          env={**os.environ, "RAY_ADDRESS": ray_job_head.address}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1 and not (out / "_summary.json").exists(), proc.stderr[-2000:]
    assert len(list(out.glob("part-*.parquet"))) == 3
    res = run_job(job_cfg(out, *args[len(FAST):]))
    assert res.summary["this_run"]["shards_skipped"] == 3 and res.summary["this_run"]["shards_written"] == 7
    ids = read_output(out).column("id").to_pylist()
    assert sorted(ids) == [f"p{i:03d}" for i in range(40)]


def test_ray_job_submit(ray_job_head, tmp_path):
    work = tmp_path / "work"
    for pkg in ("jobs", "esp_worker"):
        shutil.copytree(REPO / pkg, work / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    cmd = ["ray", "job", "submit", "--address", ray_job_head.dashboard, "--working-dir", str(work), "--",
           "python", "-m", "jobs.generate", *FAST, "data.limit=8", "ray.num_actors=1", f"output.dir={out}"]
    ray_bin = str(Path(sys.executable).parent / "ray")
    res = subprocess.run([ray_bin, *cmd[1:]], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "done: 8 rows" in res.stdout + res.stderr
    assert len(read_output(out)) == 8



def test_ray_job_submit_without_an_absolute_output_dir_is_refused(ray_job_head, tmp_path, monkeypatch):
    """The job would write into Ray's temporary copy of --working-dir (deleted with the cluster): one line, exit 2,
    before Ray or any actor starts."""
    work = tmp_path / "work"
    for pkg in ("jobs", "esp_worker"):
        shutil.copytree(REPO / pkg, work / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    ray_bin = str(Path(sys.executable).parent / "ray")
    res = subprocess.run([ray_bin, "job", "submit", "--address", ray_job_head.dashboard, "--working-dir", str(work), "--",
                          "python", "-m", "jobs.generate", *FAST, "data.limit=8", "ray.num_actors=1"],
                         capture_output=True, text=True, timeout=900)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and "exit code 2" in text, text[-3000:]
    line = next(ln for ln in text.splitlines() if ln.startswith("esp-batch: error:"))
    assert "output.dir is unset" in line and "ray job submit --working-dir" in line and "absolute output.dir" in line
    assert "connected to Ray" not in text and not list(work.rglob("part-*.parquet"))
    # a relative output.dir, in the job's environment as Ray's job supervisor sets it
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": str(work)}}))
    with pytest.raises(ConfigError, match="output.dir='out/run1' is relative: under `ray job submit --working-dir`"):
        run_job(job_cfg(Path("out/run1"), "data.limit=8"))
