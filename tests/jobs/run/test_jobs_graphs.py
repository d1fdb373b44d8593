"""A job with engine.cuda_graphs on (on a CPU: the static-buffer path, run eagerly): `_summary.json` carries the
actors' graph counters, and the rows are the eager engine's."""
from __future__ import annotations

import pytest

from jobs_helpers import job_cfg, ray_head, read_output, write_jsonl  # noqa: F401
from jobs.run.runner import run_job


@pytest.mark.slow
def test_summary_reports_cuda_graphs_and_rows_are_the_eager_engines(ray_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} plus {i}?"}
                                               for i in range(6)])
    graphs = run_job(job_cfg(tmp_path / "on", f"data.path={data}", "engine.cuda_graphs=true", "ray.num_actors=1",
                             "engine.max_batch_size=4"))
    g = graphs.summary["this_run"]["cuda_graphs"]
    assert g["actors"] == 1 and g["graph_passes"] > 0 and g["eager_passes"] == {}
    assert {"captured", "capture_s", "graph_mb"} <= set(g)
    eager = run_job(job_cfg(tmp_path / "off", f"data.path={data}", "ray.num_actors=1", "engine.max_batch_size=4"))
    assert eager.summary["this_run"]["cuda_graphs"] is None  # auto: off on a CPU
    rows = lambda out: sorted((r["id"], r["generated_text"]) for r in read_output(out).to_pylist())  # noqa: E731
    assert rows(tmp_path / "on") == rows(tmp_path / "off")
