"""A dmtd job on a real local Ray head: its rows and _summary.json say it is not lossless, with the job's PLT, and
the job report leads with it; a dmtd job that cannot run fails in one line before Ray starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs_helpers import FAST, job_cfg, ray_head, read_output, run_cli, write_jsonl  # noqa: F401
from jobs.report.job_report import write_job_report
from jobs.run.runner import run_job


@pytest.mark.slow  # a job on a local Ray head
def test_dmtd_job_is_marked_not_lossless(ray_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": f"Question {i}: {'x' * i}?"} for i in range(6)])
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "engine.method=dmtd", "engine.dmtd_tau=3",
                          "engine.dmtd_decoding_layers=1", "generation.max_new_tokens=12", "generation.ignore_eos=true"))
    rows = read_output(out).to_pylist()
    assert len(rows) == 6 and all(r["error"] is None and r["lossless"] is False for r in rows)
    s = json.loads(Path(res.summary_path).read_text())
    assert s["lossless"] is False and s["method"] == "dmtd"
    weighted = sum(r["plt"] * r["num_decode_tokens"] for r in rows) / sum(r["num_decode_tokens"] for r in rows)
    assert s["plt"] == pytest.approx(weighted) and 0.5 < s["plt"] < 1.0
    assert "**Not lossless.** `dmtd`" in write_job_report(str(out)).markdown


def test_dmtd_errors_before_ray_starts(tmp_path):
    cases = [
        (["engine.method=dmtd_verified", f"engine.dmtd_path={tmp_path}"], "holds no dmtd_draft.json"),
        (["engine.method=dmtd"], "needs a DMTD model"),
    ]
    for args, needle in cases:
        res = run_cli(*FAST, *args, f"output.dir={tmp_path}/o")
        line = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and needle in line and line.startswith("esp-batch: error:"), (args, res.stderr[-800:])
        assert "Traceback" not in res.stderr and "Ray" not in res.stderr, args
