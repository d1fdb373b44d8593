"""Compare the loss curves of trained heads on one time axis.

    python -m jobs.loss_plot OUT.png RUN [RUN ...] [--label TEXT ...] [--smooth N] [--tail N]

RUN is the output directory of one `jobs.train_heads` run (or a committed copy under `heads/`: its
`loss_curve.csv` and `heads.json`). `A+B` chains a run B that started from A's heads (`heads.init_from`):
B's curve continues after A's training minutes, so runs are compared at equal total training time. Prints
the mean joint and first-position NLL over each run's last `--tail` logged steps and writes the plot.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass
class Curve:
    label: str
    minutes: list[float]  # [points] total training minutes, chained runs included
    joint: list[float]  # [points] joint NLL (equation 9), nats per position
    first: list[float]  # [points] first-position NLL


def _read_run(run: Path) -> tuple[dict, list[dict]]:
    for name in ("loss_curve.csv", "heads.json"):
        if not (run / name).is_file():
            raise SystemExit(f"loss_plot: {run / name} not found: pass the output.dir of a jobs.train_heads run")
    with open(run / "loss_curve.csv") as f:
        rows = list(csv.DictReader(f))
    return json.loads((run / "heads.json").read_text()), rows


def read_curve(spec: str) -> Curve:
    """`A+B+...`: runs chained by heads.init_from; each continues after the previous one's minutes."""
    minutes: list[float] = []
    joint: list[float] = []
    first: list[float] = []
    offset = 0.0
    labels = []
    for part in spec.split("+"):
        info, rows = _read_run(Path(part))
        minutes += [offset + float(r["elapsed_s"]) / 60 for r in rows]
        joint += [float(r["joint_nll"]) for r in rows]
        first += [float(r["first_nll"]) for r in rows]
        run_minutes = float(info["training"].get("train_minutes") or (float(rows[-1]["elapsed_s"]) / 60 if rows else 0))
        offset += run_minutes
        labels.append(f"rank {info['rank']} ({run_minutes:.0f} min)")
    return Curve(" then ".join(labels), minutes, joint, first)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (training losses on random windows are noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def tail_mean(values: list[float], n: int) -> float:
    tail = values[-n:]
    return sum(tail) / max(len(tail), 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.loss_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the plot to write (.png)")
    parser.add_argument("runs", nargs="+", metavar="RUN[+RUN]")
    parser.add_argument("--smooth", type=int, default=20, help="trailing mean over this many logged points")
    parser.add_argument("--tail", type=int, default=40, help="logged points in the printed end-of-run means")
    parser.add_argument("--label", action="append", default=[], help="legend label of each RUN, in order")
    ns = parser.parse_args(argv)
    if len(ns.label) > len(ns.runs):
        parser.error(f"{len(ns.label)} --label for {len(ns.runs)} runs: give at most one per RUN")
    curves = [read_curve(spec) for spec in ns.runs]
    for c, label in zip(curves, ns.label):
        c.label = label
    for c in curves:
        print(f"{c.label}: {c.minutes[-1]:.1f} min, last {ns.tail} logged points: joint "
              f"{tail_mean(c.joint, ns.tail):.3f}, first {tail_mean(c.first, ns.tail):.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for c in curves:
        ax[0].plot(c.minutes, smooth(c.joint, ns.smooth), label=c.label)
        ax[1].plot(c.minutes, smooth(c.first, ns.smooth), label=c.label)
    ax[0].set_title("joint NLL (eq. 9)"), ax[1].set_title("first-position NLL")
    for a in ax:
        a.set_xlabel("training minutes"), a.set_ylabel("nats / position")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(ns.out, dpi=90)
    plt.close(fig)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
