"""The job report (jobs/report/job_report.py): built from the Parquet parts and _summary.json alone, locally and in an
S3-compatible store; `esp-batch report` rebuilds the same report. Plus the output's column descriptions."""
from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from jobs.cli import main as cli
from jobs.report.job_report import JOB_PLOTS, REPORT, REPORT_DIR, write_job_report
from jobs.run.schema import BASE_FIELDS, DESCRIPTIONS, descriptions, output_schema, to_table
from s3_helpers import FAKE_SECRET, s3  # noqa: F401  (fixture)

CATEGORIES = ["code", "math", "writing"]


def _record(i: int) -> dict:
    """Row i: category by i % 4 (3 = none), an input error on every 7th and 11th row, an engine error on every 13th,
    depth-2 acceptance."""
    error = "empty prompt" if i % 7 == 0 else ("input is null" if i % 11 == 0 else (
        "engine error: MemoryShortError: a KV cache" if i % 13 == 0 else None))
    rec = {"id": f"r{i}", "method": "esp", "category": CATEGORIES[i % 4] if i % 4 < 3 else None, "error": error,
           "num_prompt_tokens": 10 + i}
    if error is None:
        rec.update(generated_text="x", num_generated_tokens=20 + i % 5, finish_reason="length" if i % 2 else "stop",
                   num_decode_passes=10, num_decode_tokens=15, num_drafted_tokens=40, num_accepted_drafts=5,
                   accepted_per_depth=[4, 1], tau=1.5, time_s=0.5)
    return rec


def _write_output(path, n_rows: int = 40, shard: int = 8) -> list[dict]:
    """A job's output directory as the runner leaves it: parts, _job.json, _summary.json."""
    path.mkdir(parents=True)
    schema = output_schema(True, {})
    records = [_record(i) for i in range(n_rows)]
    for s in range(0, n_rows, shard):
        pq.write_table(to_table(records[s:s + shard], schema), path / f"part-{s // shard:06d}.parquet")
    config = {"model": {"name_or_path": "tiny-random-llama"}, "generation": {"max_new_tokens": 24},
              "storage": {"endpoint": "http://127.0.0.1:1", "region": "us-east-1", "anonymous": False}}
    summary = {"rows": n_rows, "model": "tiny-random-llama", "method": "esp", "config_hash": "abc123",
               "tokens_per_s": 42.0, "duplicates_dropped": 0, "finished_at": "2026-01-01T00:00:00+0000", "config": config}
    (path / "_summary.json").write_text(json.dumps(summary))
    (path / "_job.json").write_text(json.dumps({"config_hash": "abc123"}))
    return records


def test_report_lists_every_category_and_the_counts(tmp_path):
    records = _write_output(tmp_path / "out")
    res = write_job_report(str(tmp_path / "out"))
    md = (tmp_path / "out" / REPORT_DIR / REPORT).read_text()
    assert md == res.markdown
    errors = [r for r in records if r["error"]]
    assert len(errors) == 12  # rows 0, 7, 11, 13, 14, 21, 22, 26, 28, 33, 35, 39
    assert f"| 40 | {len(errors)} | 0 |" in md  # rows | errors | duplicates
    for cat in CATEGORIES + ["(none)"]:
        rows = [r for r in records if (r["category"] or "(none)") == cat]
        errs = sum(r["error"] is not None for r in rows)
        assert f"| {cat} | {len(rows)} | {errs} |" in md, cat
    for msg in ("empty prompt", "input is null", "engine error: MemoryShortError: a KV cache"):
        assert f"| {msg} | {sum(r['error'] == msg for r in records)} |" in md
    assert "3 of them came from running the row (the engine, or its actor), not from its input: a rerun with " \
           "`output.retry_errors=true` runs them again." in md
    ok = [r for r in records if not r["error"]]
    assert f"tau {15 * len(ok) / (10 * len(ok)):.3f}" in md and "max_new_tokens: 24" in md
    # passes that committed 1, 2 and 3 tokens, derived from accepted_per_depth [4, 1] of 10 passes
    assert "| share of passes | 60.0% | 30.0% | 10.0% |" in md
    for name in JOB_PLOTS:
        assert (tmp_path / "out" / REPORT_DIR / name).stat().st_size > 5000 and f"]({name})" in md
    # the output directory is still one Parquet dataset for pandas / pyarrow (the report hides under _report)
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "out")) == 40


def test_report_marks_a_method_that_is_not_lossless(tmp_path):
    """A dmtd job's report says, before anything else, that its text is not the base model's decoding."""
    _write_output(tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert "Not lossless" not in write_job_report(str(tmp_path / "out")).markdown
    summary.update(method="dmtd", lossless=False, plt=0.5678)
    (tmp_path / "out" / "_summary.json").write_text(json.dumps(summary))
    md = write_job_report(str(tmp_path / "out")).markdown
    assert "**Not lossless.** `dmtd`" in md and "0.568" in md
    assert md.index("Not lossless") < md.index("| rows | errors |")


def test_esp_batch_report_rebuilds_the_same_report(tmp_path, capsys):
    _write_output(tmp_path / "out")
    first = write_job_report(str(tmp_path / "out"))
    pngs = {n: (tmp_path / "out" / REPORT_DIR / n).read_bytes() for n in JOB_PLOTS}
    shutil.rmtree(tmp_path / "out" / REPORT_DIR)
    assert cli(["report", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{REPORT_DIR}/{REPORT}")
    assert (tmp_path / "out" / REPORT_DIR / REPORT).read_text() == first.markdown
    assert {n: (tmp_path / "out" / REPORT_DIR / n).read_bytes() for n in JOB_PLOTS} == pngs
    assert cli(["report", str(tmp_path / "empty")]) == 2
    assert cli(["report", str(tmp_path / "out"), "storage.password=x"]) == 2


def test_report_without_summary_or_categories(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    schema = output_schema(False, {})
    pq.write_table(to_table([{k: v for k, v in _record(i).items() if k != "category"} for i in range(1, 6)], schema),
                   out / "part-000000.parquet")
    md = write_job_report(str(out)).markdown
    assert "No `_summary.json`" in md and "no category column" in md and "No row has an error." in md


@pytest.mark.slow
def test_report_in_an_object_store(s3, tmp_path, capsys):
    _write_output(tmp_path / "out")
    for f in (tmp_path / "out").iterdir():
        s3.put(f"jobs/run1/{f.name}", f.read_bytes())
    uri = s3.uri("jobs/run1")
    assert cli(["report", uri, f"storage.endpoint={s3.endpoint}"]) == 0
    assert capsys.readouterr().out.strip() == f"{uri}/{REPORT_DIR}/{REPORT}"  # with its scheme
    with s3.fs.open_input_stream(s3.path("jobs/run1", REPORT_DIR, REPORT)) as f:
        md = f.read().decode()
    local = write_job_report(str(tmp_path / "out")).markdown
    assert md == local.replace(str(tmp_path / "out"), uri)
    assert "| code |" in md and FAKE_SECRET not in md
    for name in JOB_PLOTS:
        assert s3.fs.get_file_info(s3.path("jobs/run1", REPORT_DIR, name)).size > 5000


def test_parquet_columns_carry_descriptions(tmp_path):
    schema = output_schema(True, {"question_id": __import__("pyarrow").int64()})
    pq.write_table(to_table([{"id": "a", "question_id": 3}], schema), tmp_path / "p.parquet")
    back = descriptions(pq.read_schema(tmp_path / "p.parquet"))
    assert all(back[f.name] == DESCRIPTIONS[f.name] for f in BASE_FIELDS)
    assert back["category"] and "question_id" in back["question_id"]
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"select question_id from '{tmp_path}/*.parquet'").fetchall() == [(3,)]


def _plotted(monkeypatch, tmp_path, stats) -> dict:
    """The job report's figures as drawn (before they are written), by PNG name."""
    from jobs.report import job_report
    from jobs.report.plots import Sink

    figs = {}
    monkeypatch.setattr(job_report, "save", lambda fig, sink, name: figs.setdefault(name, fig) and name)
    job_report.job_plots(Sink.local(tmp_path / "plots"), stats, {})
    return figs


@pytest.mark.parametrize("lo, hi", [(0, 83), (5, 45), (12, 251), (7, 7), (3, 22), (0, 1199)])
def test_length_histograms_count_every_row(monkeypatch, tmp_path, lo, hi):
    """Every row is in a bin, the longest included (bins of whole tokens, at most 40 of them)."""
    from jobs.report.job_report import JobStats

    values = sorted({lo, hi, *range(lo, hi + 1, max(1, (hi - lo) // 47 or 1))})
    stats = JobStats(prompt_lengths=values, output_lengths=[v + 1 for v in values])
    fig = _plotted(monkeypatch, tmp_path, stats)["lengths.png"]
    for ax, shown in zip(fig.axes, (values, [v + 1 for v in values])):
        heights = [p.get_height() for p in ax.patches]
        assert sum(heights) == len(shown) and len(heights) <= 40, (lo, hi, ax.get_title())
        bins = [(p.get_x(), p.get_x() + p.get_width()) for p in ax.patches]
        assert bins[0][0] < min(shown) and bins[-1][1] > max(shown)  # no value on an outer edge
    _close(fig)


def _acceptance_stats(passes: int, committed: list, depth: list):
    from jobs.report.job_report import JobStats

    stats = JobStats(accepted_per_depth=depth, committed=committed)
    stats.all.decode_passes = passes
    return stats


def _share_ticks(ax) -> list:
    """The y tick labels shown (ticks inside the axis range that have a label)."""
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo - 1e-12 <= t <= hi + 1e-12]
    return [s for s in ax.yaxis.get_major_formatter().format_ticks(ticks) if s]


@pytest.mark.parametrize("passes, committed, depth", [
    (1000, [0, 994, 4, 2], [6, 2]),  # low acceptance: shares of a fraction of a per cent
    (500, [0, 500], []),  # plain decoding: every pass commits one token (a 100% bar)
    (100, [0, 5, 10, 85], [95, 85]),  # high acceptance: a 95% bar
])
def test_acceptance_plot_axes_read_their_shares(monkeypatch, tmp_path, passes, committed, depth):
    """Share axes: distinct tick labels, none above 100%, room above the highest bar for its label."""
    fig = _plotted(monkeypatch, tmp_path, _acceptance_stats(passes, committed, depth))["acceptance.png"]
    panels = fig.axes if depth else fig.axes[:1]
    for ax in panels:
        bars = [p.get_height() for p in ax.patches]
        labels = _share_ticks(ax)
        assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
        assert all(float(s.rstrip("%")) <= 100 for s in labels), labels
        assert ax.get_ylim()[1] >= 1.15 * max(bars), (ax.get_title(), ax.get_ylim(), max(bars))
        shown = [t.get_text() for t in ax.texts if t.get_text()]
        assert shown and all(s != "0%" for s in shown), shown  # a bar's label gives its share, not 0%
    _close(fig)


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_method_column_description_lists_every_method():
    from esp_worker.config import METHODS

    described = DESCRIPTIONS["method"]
    assert all(f" {m}" in described for m in METHODS), described
