"""The report's shared pieces: table cells (`fmt`), a directory to write into on any pyarrow filesystem
(`Sink`) and the plotting helpers (style, grouped and horizontal bars, the PNG writer) that the job report
(jobs/report/job_report.py) and the benchmark report (jobs/bench/report.py) both draw with."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

from ..io.storage import join

REPORT = "report.md"


def fmt(x: Any, digits: int = 2) -> str:
    """A table cell: `-` for None, yes/NO for booleans, fixed digits for floats."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


# ---- writing beside the data (local or object store) ------------------------------------------------
class Sink:
    """A directory on a pyarrow filesystem that reports are written into (each file appears when complete)."""

    def __init__(self, fs: pafs.FileSystem, base: str):
        self.fs, self.base = fs, base
        fs.create_dir(base, recursive=True)

    @classmethod
    def local(cls, path: Path) -> "Sink":
        return cls(pafs.LocalFileSystem(), str(Path(path).resolve()))

    def write(self, name: str, data: bytes) -> str:
        path = join(self.base, name)
        with self.fs.open_output_stream(path) as f:
            f.write(data)
        return path


# ---- shared plotting --------------------------------------------------------------------------------
def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.labelsize": 10,
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.fontsize": 8, "legend.frameon": False, "figure.dpi": 100, "svg.hashsalt": "esp-batch",
    })
    return plt


def save(fig: Any, sink: Sink, name: str) -> str:
    """Write `fig` as `name` (PNG) into `sink`, close it, return the name."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    fig.clear()
    import matplotlib.pyplot as plt

    plt.close(fig)
    sink.write(name, buf.getvalue())
    return name


def grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                 labels: bool = False, digits: int = 2) -> None:
    """Vertical bars: one cluster per group, one bar per series (a legend when there are several)."""
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + j * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        if labels:
            ax.bar_label(bars, [fmt(v, digits) for v in values], fontsize=8, padding=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=20 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="x", visible=False)
    if len(series) > 1:
        ax.legend(ncol=3)


@dataclass
class HBars:
    """Horizontal bars from `start`, first label on top, each bar labelled with its value (and its `note`); a
    dashed line at `overall`."""
    labels: list[str]
    values: list[Optional[float]]
    xlabel: str
    title: str
    digits: int = 2
    overall: Optional[float] = None
    note: Optional[list[str]] = None
    start: float = 0.0


def hbars(ax: Any, spec: HBars) -> None:
    """Draw `spec` on `ax`."""
    start, digits, overall = spec.start, spec.digits, spec.overall
    ys = list(range(len(spec.labels)))[::-1]
    vals = [v or start for v in spec.values]
    bars = ax.barh(ys, [v - start for v in vals], left=start, color="#4C72B0", height=0.6)
    notes = spec.note or [""] * len(spec.values)
    texts = [fmt(v, digits) + (f"  ({n})" if spec.note else "") for v, n in zip(spec.values, notes)]
    ax.bar_label(bars, texts, fontsize=8, padding=3, bbox=dict(fc="white", ec="none", pad=0.6))  # readable over lines
    ax.set_yticks(ys, spec.labels)
    ax.set_xlabel(spec.xlabel)
    ax.set_title(spec.title)
    ax.grid(axis="y", visible=False)
    hi = max(vals + [overall or 0, start + 1e-9])
    ax.set_xlim(start, start + (hi - start) * 1.35 or 1)  # room for the labels
    if overall is not None:
        ax.axvline(overall, color="#C44E52", ls="--", lw=1.2, label=f"all rows: {fmt(overall, digits)}")
        ax.legend(loc="lower right")


def pct(share: float) -> str:
    """A share as a bar label: whole per cents, and the decimals a share under 1% needs to not read 0%."""
    if share == 0 or share >= 0.01:
        return f"{share:.0%}"
    return f"{share:.{min(3, math.ceil(-math.log10(share)) - 2)}%}"


def share_axis(ax: Any, shares: list[float]) -> None:
    """A y axis of shares (0..1): room above the highest bar for its label (below the title), and tick
    labels with as many decimals as the range needs (0.1%, 0.2%, ... at low shares, not 0% on every tick);
    no tick above 100%."""
    from matplotlib.ticker import PercentFormatter

    class Shares(PercentFormatter):
        def __call__(self, x: float, pos: Any = None) -> str:
            return "" if x > 1 + 1e-9 else super().__call__(x, pos)

    ax.set_ylim(0, 1.25 * max(shares) or 1)
    ax.yaxis.set_major_formatter(Shares(xmax=1.0, decimals=None))


def empty(ax: Any, title: str, text: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])
