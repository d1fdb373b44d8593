"""The progress line: rows, errors, tokens/s, tau, time so far and the time left at this run's pace."""
from __future__ import annotations

import io
import logging

import pyarrow as pa

from jobs.run.progress import Progress, duration


def _rows(n: int, errors: int = 0) -> pa.Table:
    return pa.table({"id": [f"r{i}" for i in range(n)], "error": ["bad"] * errors + [None] * (n - errors),
                     "num_generated_tokens": [10] * n})


def test_line_counts_kept_rows_and_paces_the_rest_by_this_runs_rows():
    now = [100.0]
    progress = Progress(100, 30.0, io.StringIO(), clock=lambda: now[0])
    progress.kept(20)  # an earlier run's parts: done, but not this run's pace
    progress.restart()
    assert progress.line() == "rows 20/100 (20%), errors 0, 0.0 tok/s, tau -, 0s"  # nothing finished: no estimate
    now[0] += 50
    progress.run.add(_rows(20, errors=1))
    assert progress.line() == "rows 40/100 (40%), errors 1, 4.0 tok/s, tau -, 50s, ~2m30s left"
    now[0] += 7250
    progress.run.add(_rows(59))
    assert progress.line().endswith(", 2h01m, ~1m32s left")
    progress.run.add(_rows(1))
    assert progress.line().startswith("rows 100/100 (100%)") and "left" not in progress.line()


def test_unknown_total_has_no_estimate(caplog):
    now = [0.0]
    progress = Progress(None, 30.0, io.StringIO(), clock=lambda: now[0])
    now[0] += 10
    progress.run.add(_rows(5))
    with caplog.at_level(logging.INFO, logger="esp_batch"):
        progress.update(force=True)
    assert caplog.messages == ["progress: rows 5/?, errors 0, 5.0 tok/s, tau -, 10s"]


def test_duration():
    assert [duration(s) for s in (0.4, 59.4, 60, 605, 3599, 3600, 11220, 360000)] == \
        ["0s", "59s", "1m00s", "10m05s", "59m59s", "1h00m", "3h07m", "100h00m"]
