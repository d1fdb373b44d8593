"""jobs.loss_plot: chained runs continue on one time axis; the smoothing is a trailing mean; a wrong directory is
one line."""
from __future__ import annotations

import csv
import json

import pytest

from jobs.report.loss_plot import main, read_curve, smooth


def _run(path, rank, minutes, points):
    path.mkdir()
    (path / "heads.json").write_text(json.dumps({"rank": rank, "training": {"train_minutes": minutes}}))
    with open(path / "loss_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "elapsed_s", "joint_nll", "first_nll"])
        w.writeheader()
        for i, (sec, joint) in enumerate(points):
            w.writerow({"step": 10 * (i + 1), "elapsed_s": sec, "joint_nll": joint, "first_nll": joint / 5})
    return path


def test_chained_run_continues_after_the_first_runs_minutes(tmp_path, capsys):
    a = _run(tmp_path / "a", 1, 15.0, [(60, 14.0), (900, 13.0)])
    b = _run(tmp_path / "b", 4, 30.0, [(120, 12.5), (1800, 12.0)])
    c = read_curve(f"{a}+{b}")
    assert c.minutes == [1.0, 15.0, 17.0, 45.0]
    assert c.joint == [14.0, 13.0, 12.5, 12.0] and c.first == pytest.approx([2.8, 2.6, 2.5, 2.4])
    assert c.label == "rank 1 (15 min) then rank 4 (30 min)"
    out = tmp_path / "plot" / "loss.png"
    assert main([str(out), str(a), f"{a}+{b}", "--tail", "2", "--label", "first"]) == 0
    assert out.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "first: 15.0 min, last 2 logged points: joint 13.500" in printed
    assert "then rank 4 (30 min): 45.0 min, last 2 logged points: joint 12.250" in printed


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 10) == [2.0, 3.0]


def test_a_directory_without_a_loss_curve_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="loss_curve.csv not found: pass the output.dir"):
        read_curve(str(tmp_path))


def test_more_labels_than_runs_is_refused(tmp_path, capsys):
    a = _run(tmp_path / "a", 1, 1.0, [(60, 14.0)])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.png"), str(a), "--label", "x", "--label", "y"])
    assert "2 --label for 1 runs" in capsys.readouterr().err
