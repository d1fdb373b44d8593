"""`esp-batch export OUTPUT_DIR FILE --format spec-bench`: Spec-Bench answer files from a job's output.

The format is checked here as Spec-Bench's `evaluation/speed.py` and `evaluation/equal.py` read it (the fields
they use and what they compute from them). Spec-Bench's own scripts run on the exported files where a checkout
of github hemingkx/Spec-Bench is named by SPEC_BENCH_DIR (its `evaluation/` folder is used unmodified).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs_helpers import REPO, SPEC_BENCH, TINY_LLAMA, job_cfg, ray_head, shared, write_jsonl  # noqa: F401
from s3_helpers import s3  # noqa: F401
from esp_worker import EngineConfig
from jobs.export.cli import main as export_main
from jobs.io.output import SUMMARY, OutputDir
from jobs.io.sources import open_source
from jobs.run.rows import RowNormalizer
from jobs.run.runner import plan_schema, worker_spec
from jobs.run.worker import ShardWorker

MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def spec_bench_rows(n: int) -> list[dict[str, Any]]:
    """Dev questions: the first n two-turn (mt_bench) ones, n of math_reasoning and one of translation."""
    rows = [json.loads(line) for line in shared(SPEC_BENCH).read_text().splitlines()]
    two = [r for r in rows if len(r["turns"]) == 2][:n]
    one = [r for r in rows if r["category"] == "math_reasoning"][:n] + [r for r in rows if r["category"] == "translation"][:1]
    return [{k: v for k, v in r.items() if k != "reference"} for r in two + one]


def write_job(tmp_path: Path, location: str, rows: list[dict[str, Any]], *overrides: str, storage: Any = None) -> dict:
    """A job's output without Ray: the shard worker's part and a summary with what export reads."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = job_cfg(tmp_path / "unused", f"data.path={data}", "data.id_column=question_id", "engine.max_batch_size=1",
                  f"model.name_or_path={shared(TINY_LLAMA)}", "generation.max_new_tokens=24", *overrides)
    source = open_source(cfg.data.path, cfg.data.format, cfg.data.split, cfg.data.limit)
    out = OutputDir(location, storage)
    out.prepare()
    norm = RowNormalizer(cfg.data.id_column, cfg.data.prompt_column, cfg.data.params_column, cfg.data.category_column,
                         [])
    job_rows = [norm(i, r) for i, r in enumerate(next(source.batches(1000)))]
    worker = ShardWorker(worker_spec(cfg, plan_schema(cfg, source), out))
    table = worker.run_shard(0, job_rows)
    out.write_part(0, table, "zstd")
    summary = {"model": cfg.model.name_or_path, "method": cfg.engine.method, "config_hash": "abc",
               "input_id_types": sorted(norm.id_types)}
    out.write_json(SUMMARY, summary)
    return {"rows": table.to_pylist(), "summary": summary}


def read_answers(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_as_speed_py_reads(answers: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Every field speed.py and equal.py read, and what they compute from it, against the Parquet rows."""
    by_id = {r["id"]: r for r in rows}
    for a in answers:
        assert set(a) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
        c = a["choices"][0]
        assert c["index"] == 0 and set(c) == {"index", "turns", "decoding_steps", "new_tokens", "wall_time",
                                              "accept_lengths"}
        row = by_id[str(a["question_id"])]
        n = len(row["generated_turns"] or [row["generated_text"]])
        assert len(c["turns"]) == len(c["decoding_steps"]) == len(c["new_tokens"]) == len(c["wall_time"]) == n
        assert sum(c["new_tokens"]) == row["num_generated_tokens"] and sum(c["decoding_steps"]) == row["num_decode_passes"]
        assert sum(c["wall_time"]) == pytest.approx(row["time_s"]) and min(c["wall_time"]) > 0  # speed.py divides
        assert c["accept_lengths"] == row["committed_per_pass"] and len(c["accept_lengths"]) == sum(c["decoding_steps"])
        assert sum(c["accept_lengths"]) == row["num_decode_tokens"]
        assert c["turns"] == [t.strip() for t in (row["generated_turns"] or [row["generated_text"]])]


def test_export_writes_spec_bench_answers(tmp_path, capsys):
    rows = spec_bench_rows(3) + [{"question_id": 5, "category": "writing", "turns": ["Hello.", ""]}]
    job = write_job(tmp_path, str(tmp_path / "out"), rows, "engine.method=pld", "engine.block_complexity=10")
    target = tmp_path / "answers" / "pld.jsonl"
    capsys.readouterr()  # the model load's own lines
    assert export_main([str(tmp_path / "out"), str(target), "--format", "spec-bench"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(target)
    assert err.count("\n") == 1 and "7 answers" in err and "skipped 1 row(s) with an error (ids 5)" in err
    answers = read_answers(target)
    ids = [a["question_id"] for a in answers]
    assert all(isinstance(i, int) for i in ids) and ids == sorted(ids) and 5 not in ids  # ints, sorted, error left out
    assert {a["model_id"] for a in answers} == {"esp-tiny-llama-pld"}
    assert {a["category"] for a in answers} == {r["category"] for r in rows[:-1]}
    check_as_speed_py_reads(answers, job["rows"])
    assert any(max(a["choices"][0]["accept_lengths"], default=1) > 1 for a in answers)  # drafts were accepted
    # speed.py's "#Mean accepted tokens" = the mean of every accept length of a group = the rows' pooled tau
    lengths = [x for a in answers for x in a["choices"][0]["accept_lengths"]]
    ok = [r for r in job["rows"] if r["error"] is None]
    assert sum(lengths) / len(lengths) == pytest.approx(
        sum(r["num_decode_tokens"] for r in ok) / sum(r["num_decode_passes"] for r in ok), rel=1e-12)
    assert export_main([str(tmp_path / "out"), str(target), "--format", "spec-bench", "--model-id", "mine"]) == 0
    assert {a["model_id"] for a in read_answers(target)} == {"mine"}


def test_string_ids_stay_strings(tmp_path):
    rows = [{"question_id": f"q{i}", "category": "qa", "turns": [t]} for i, t in enumerate(["Say hi.", "Name a fruit."])]
    write_job(tmp_path, str(tmp_path / "out"), rows)
    assert export_main([str(tmp_path / "out"), str(tmp_path / "a.jsonl"), "--format", "spec-bench"]) == 0
    assert [a["question_id"] for a in read_answers(tmp_path / "a.jsonl")] == ["q0", "q1"]


def test_samples_are_choices(tmp_path):
    """generation.n: one choice per sample, in order, each with its own turns and counters."""
    rows = spec_bench_rows(1)[:1] + [{"question_id": 9, "category": "qa", "turns": ["Say hi."]}]
    job = write_job(tmp_path, str(tmp_path / "out"), rows, "generation.n=3", "generation.temperature=0.8",
                    "generation.max_new_tokens=6")
    assert export_main([str(tmp_path / "out"), str(tmp_path / "a.jsonl"), "--format", "spec-bench"]) == 0
    by_id = {r["id"]: r for r in job["rows"]}
    for a in read_answers(tmp_path / "a.jsonl"):
        samples = by_id[str(a["question_id"])]["samples"]
        assert [c["index"] for c in a["choices"]] == [0, 1, 2]
        for c, x in zip(a["choices"], samples):
            assert c["turns"] == [t.strip() for t in x["turns"]] and c["new_tokens"] == x["turn_generated_tokens"]
            assert c["accept_lengths"] == x["committed_per_pass"] and c["decoding_steps"] == x["turn_decode_passes"]
            assert c["wall_time"] == x["turn_time_s"]


def test_export_errors_are_one_line_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(empty), str(tmp_path / "a.jsonl"), "--format", "spec-bench"]) == 2
    assert "no Parquet parts" in capsys.readouterr().err
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = tmp_path / "old"
    old.mkdir()
    pq.write_table(pa.table({"id": ["1"], "generated_text": ["x"], "error": [None]}), old / "part-000000.parquet")
    assert export_main([str(old), str(tmp_path / "a.jsonl"), "--format", "spec-bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "older esp-batch" in err and "turn_generated_tokens" in err
    assert export_main([str(old), str(tmp_path / "a.jsonl"), "storage.color=red", "--format", "spec-bench"]) == 2
    assert "unknown argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        export_main([str(old), str(tmp_path / "a.jsonl"), "--format", "alpaca"])
    assert exc.value.code == 2


def test_export_through_the_console_command(tmp_path):
    """`esp-batch export` is `python -m jobs.cli export`; `python -m jobs.export` is the same command."""
    write_job(tmp_path, str(tmp_path / "out"), [{"question_id": 3, "category": "qa", "turns": ["Say hi."]}])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for cmd in (["jobs.cli", "export"], ["jobs.export"]):
        target = tmp_path / f"{cmd[0]}.jsonl"
        res = subprocess.run([sys.executable, "-m", *cmd, str(tmp_path / "out"), str(target), "--format",
                              "spec-bench"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert [a["question_id"] for a in read_answers(target)] == [3]


# ---- Spec-Bench's own scripts ---------------------------------------------------------------------------------
def spec_bench_dir() -> Path:
    """A checkout of github hemingkx/Spec-Bench (SPEC_BENCH_DIR); the test skips without one."""
    where = os.environ.get("SPEC_BENCH_DIR")
    if not where or not (Path(where) / "evaluation" / "speed.py").is_file():
        pytest.skip("set SPEC_BENCH_DIR to a checkout of github hemingkx/Spec-Bench to run its evaluation scripts")
    return Path(where)


def run_equal(folder: Path, a: str, b: str) -> str:
    """Spec-Bench's evaluation/equal.py on two answer files in `folder`, as its command line runs it."""
    res = subprocess.run([sys.executable, str(spec_bench_dir() / "evaluation" / "equal.py"), "--file-path",
                          f"{folder}/", "--jsonfile1", a, "--jsonfile2", b], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def speed_module() -> Any:
    """Spec-Bench's evaluation/speed.py, imported as it is (its command line reads hard-coded paths; its
    `speed` function is what it computes per task)."""
    spec = importlib.util.spec_from_file_location("spec_bench_speed", spec_bench_dir() / "evaluation" / "speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_with_spec_bench(folder: Path, method: str, base: str, summary: dict[str, Any], tokenizer: Path) -> None:
    """equal.py finds the answers equal; speed.py's mean accepted tokens per task = the summary's pooled tau."""
    assert "Result totally Equal!" in run_equal(folder, f"{base}.jsonl", f"{method}.jsonl")
    speed = speed_module()
    per = summary["tau_per_category"]
    answers = read_answers(folder / f"{method}.jsonl")
    for task in ["mt_bench", *sorted({a["category"] for a in answers} - set(MT_BENCH))]:
        cats = MT_BENCH if task == "mt_bench" else [task]
        tps, tps_base, speedup, lengths = speed.speed(str(folder / f"{method}.jsonl"), str(folder / f"{base}.jsonl"),
                                                      str(tokenizer), task=task, report=False)
        tau = sum(per[c]["decode_tokens"] for c in cats if c in per) / sum(
            per[c]["decode_passes"] for c in cats if c in per)
        assert sum(lengths) / len(lengths) == pytest.approx(tau, rel=1e-12), task
        assert tps > 0 and tps_base > 0 and speedup > 0


def test_spec_bench_scripts_read_the_exported_files(tmp_path):
    """Spec-Bench's equal.py and speed.py, unmodified, on answers exported from ar and pld outputs."""
    spec_bench_dir()
    rows = spec_bench_rows(2)
    summaries = {}
    for method in ("ar", "pld"):
        job = write_job(tmp_path / method, str(tmp_path / method / "out"), rows, f"engine.method={method}")
        assert export_main([str(tmp_path / method / "out"), str(tmp_path / "answers" / f"{method}.jsonl"),
                            "--format", "spec-bench"]) == 0
        from jobs.run.stats import Totals
        import pyarrow as pa

        totals = Totals()
        totals.add(pa.Table.from_pylist(job["rows"]))
        summaries[method] = {"tau_per_category": totals.tau_per_category()}
    check_with_spec_bench(tmp_path / "answers", "pld", "ar", summaries["pld"], shared(TINY_LLAMA))


# ---- real jobs (Ray, S3) ---------------------------------------------------------------------------------------
def run_spec_bench_job(tmp_path: Path, location: str, method: str, rows: list[dict[str, Any]], *more: str) -> dict:
    """A real job as the Spec-Bench guide runs it: batch 1, one actor; returns its _summary.json."""
    from jobs.run.runner import run_job

    data = tmp_path / "questions.jsonl"
    if not data.exists():
        write_jsonl(data, rows)
    cfg = job_cfg(tmp_path / "unused", f"data.path={data}", "data.id_column=question_id", f"output.dir={location}",
                  f"model.name_or_path={shared(TINY_LLAMA)}", "generation.max_new_tokens=24", "engine.max_batch_size=1",
                  "ray.num_actors=1", "data.shard_size=4", f"engine.method={EngineConfig.method if method == 'default' else method}",
                  *more)
    return run_job(cfg).summary


@pytest.mark.slow
def test_real_jobs_exported_and_checked_as_spec_bench_does(ray_head, tmp_path):
    """ar and the default method as jobs on Ray, exported: one answer per question, per-turn lists that sum to the
    row totals, speed.py's mean accepted tokens per task group = the summary's pooled tau (and, with
    SPEC_BENCH_DIR, Spec-Bench's own equal.py and speed.py on the files)."""
    import pyarrow.dataset as ds

    rows = spec_bench_rows(3) + [{"question_id": 999, "category": "writing", "turns": ["Hello.", ""]}]
    folder = tmp_path / "answers"
    summaries = {}
    for method in ("ar", "default"):
        out = tmp_path / method
        summaries[method] = s = run_spec_bench_job(tmp_path, str(out), method, rows)
        assert s["complete"] and s["input_id_types"] == ["int"] and s["errors"] == 1
        assert export_main([str(out), str(folder / f"{method}.jsonl"), "--format", "spec-bench"]) == 0
        answers = read_answers(folder / f"{method}.jsonl")
        assert [a["question_id"] for a in answers] == sorted(r["question_id"] for r in rows[:-1])
        check_as_speed_py_reads(answers, ds.dataset(str(out), format="parquet").to_table().to_pylist())
        per = s["tau_per_category"]
        for cats in (MT_BENCH, ["math_reasoning"], ["translation"]):
            lengths = [x for a in answers if a["category"] in cats for x in a["choices"][0]["accept_lengths"]]
            pooled = sum(per[c]["decode_tokens"] for c in cats if c in per) / sum(
                per[c]["decode_passes"] for c in cats if c in per)
            assert sum(lengths) / len(lengths) == pytest.approx(pooled, rel=1e-12)
    assert summaries["ar"]["tau"] == 1.0 and summaries["default"]["tau"] > 1.0
    ar, default = (read_answers(folder / f"{m}.jsonl") for m in ("ar", "default"))
    assert [a["choices"][0]["turns"] for a in ar] == [a["choices"][0]["turns"] for a in default]  # lossless
    if os.environ.get("SPEC_BENCH_DIR"):
        check_with_spec_bench(folder, "default", "ar", summaries["default"], shared(TINY_LLAMA))


@pytest.mark.slow
def test_export_reads_an_object_store_output_dir(s3, tmp_path):
    rows = [{"question_id": 2, "category": "qa", "turns": ["Say hi."]},
            {"question_id": 1, "category": "qa", "turns": ["Name a fruit.", "Another one."]}]
    write_job(tmp_path, s3.uri("run1"), rows, storage=s3.storage())
    target = tmp_path / "a.jsonl"
    assert export_main([s3.uri("run1"), str(target), "--format", "spec-bench", f"storage.endpoint={s3.endpoint}"]) == 0
    answers = read_answers(target)
    assert [a["question_id"] for a in answers] == [1, 2] and len(answers[0]["choices"][0]["turns"]) == 2
