"""Human-readable reports: `report.md` and PNG plots, for a generation job and for `jobs.bench`.

One module, one copy of the plotting code (the style, the grouped bars, the PNG writer) for both:

- `write_job_report(output_dir, storage)`: reads only the job's Parquet parts and `_summary.json`
  (local directory or URI, through jobs/storage.py) and writes `report.md`, `by_category.png`,
  `acceptance.png` and `lengths.png` into `_report/` beside the parts. (A visible `report.md` or PNG
  among the parts would break `pandas.read_parquet(dir)`, pyarrow and Spark, which read every file not
  starting with `.` or `_` as Parquet.) The job calls it at its end; `esp-batch report
  OUTPUT_DIR` calls the same function, so the report can be rebuilt from the output alone, identically.
- `write_bench_report(...)` / `bench_plots(...)`: the benchmark's report and plots (`jobs.bench`).

Terms, as in the README: tau = tokens committed by decode passes / decode passes (bonus token included,
the prefill's first token not); "tokens/s per request" = a row's generated tokens / its own time from
admission to finish, summed per group (rows share the engine's batches, so the job's throughput is higher).
"""
from __future__ import annotations

import io
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.fs as pafs

from .output import REPORT_DIR, SUMMARY
from .schema import CATEGORY
from .stats import Group
from .storage import join, resolve

REPORT = "report.md"
NO_CATEGORY = "(none)"
JOB_PLOTS = ("by_category.png", "acceptance.png", "lengths.png")
_COLUMNS = ["error", CATEGORY, "finish_reason", "method", "num_prompt_tokens", "num_generated_tokens",
            "num_decode_passes", "num_decode_tokens", "num_drafted_tokens", "num_accepted_drafts",
            "accepted_per_depth", "committed_histogram", "time_s"]
_SECRET_IN_URL = re.compile(r"(://)[^/@\s:]+:[^/@\s]+@")  # user:password@ in an endpoint URL


def fmt(x: Any, digits: int = 2) -> str:
    """A table cell: `-` for None, yes/NO for booleans, fixed digits for floats."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


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
def _plt() -> Any:
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


def hbars(ax: Any, labels: list[str], values: list[Optional[float]], xlabel: str, title: str, digits: int = 2,
          overall: Optional[float] = None, note: Optional[list[str]] = None, start: float = 0.0) -> None:
    """Horizontal bars from `start`, first label on top, each bar labelled with its value (and `note`); a
    dashed line at `overall`."""
    ys = list(range(len(labels)))[::-1]
    vals = [v or start for v in values]
    bars = ax.barh(ys, [v - start for v in vals], left=start, color="#4C72B0", height=0.6)
    texts = [fmt(v, digits) + (f"  ({n})" if note else "") for v, n in zip(values, note or [""] * len(values))]
    ax.bar_label(bars, texts, fontsize=8, padding=3, bbox=dict(fc="white", ec="none", pad=0.6))  # readable over lines
    ax.set_yticks(ys, labels)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="y", visible=False)
    hi = max(vals + [overall or 0, start + 1e-9])
    ax.set_xlim(start, start + (hi - start) * 1.35 or 1)  # room for the labels
    if overall is not None:
        ax.axvline(overall, color="#C44E52", ls="--", lw=1.2, label=f"all rows: {fmt(overall, digits)}")
        ax.legend(loc="lower right")


def _empty(ax: Any, title: str, text: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


# ---- job report -------------------------------------------------------------------------------------
@dataclass
class JobStats:
    """Everything the job report shows, accumulated part by part from the output columns."""

    all: Group = field(default_factory=Group)
    categories: dict[str, Group] = field(default_factory=dict)
    has_category: bool = False
    errors: Counter = field(default_factory=Counter)  # message -> rows
    finish_reasons: Counter = field(default_factory=Counter)
    methods: Counter = field(default_factory=Counter)
    accepted_per_depth: list[int] = field(default_factory=list)  # [d] passes whose accepted path reached d+1
    committed: list[int] = field(default_factory=list)  # [n] passes that committed n tokens
    committed_exact: bool = True  # False: derived from accepted_per_depth (see `add`)
    prompt_lengths: list[int] = field(default_factory=list)
    output_lengths: list[int] = field(default_factory=list)  # rows without error

    def add(self, batch: pa.RecordBatch) -> None:
        """Add rows holding (some of) the output columns. Without a `committed_histogram` column, the passes
        that committed n tokens are derived from accepted_per_depth: a pass commits 1 + its accepted depth
        (exact except a last pass cut short by max_new_tokens or a stop string)."""
        cols = {name: batch.column(name).to_pylist() for name in _COLUMNS if name in batch.schema.names}
        n = batch.num_rows
        self.has_category |= CATEGORY in cols
        get = lambda name, i: cols[name][i] if name in cols else None  # noqa: E731
        for i in range(n):
            cat = get(CATEGORY, i)
            groups = [self.all]
            if CATEGORY in cols:
                groups.append(self.categories.setdefault(NO_CATEGORY if cat is None else str(cat), Group()))
            err = get("error", i)
            prompt, gen = get("num_prompt_tokens", i) or 0, get("num_generated_tokens", i) or 0
            passes = get("num_decode_passes", i) or 0
            for g in groups:
                g.rows += 1
                g.errors += err is not None
                g.prompt_tokens += prompt
                g.generated_tokens += gen
                g.decode_tokens += get("num_decode_tokens", i) or 0
                g.decode_passes += passes
                g.drafted += get("num_drafted_tokens", i) or 0
                g.accepted += get("num_accepted_drafts", i) or 0
                if err is None:
                    g.ok_tokens += gen
                    g.ok_time_s += get("time_s", i) or 0.0
            if err is not None:
                self.errors[err] += 1
                continue
            self.finish_reasons[get("finish_reason", i) or "-"] += 1
            self.methods[get("method", i) or "-"] += 1
            self.prompt_lengths.append(prompt)
            self.output_lengths.append(gen)
            depth = get("accepted_per_depth", i) or []
            _add_into(self.accepted_per_depth, depth)
            hist = get("committed_histogram", i)
            if hist is None:
                self.committed_exact = False
                hist = [0, passes - (depth[0] if depth else 0)]
                hist += [depth[d] - (depth[d + 1] if d + 1 < len(depth) else 0) for d in range(len(depth))]
            _add_into(self.committed, hist)


def _add_into(acc: list[int], values: list[int]) -> None:
    if len(values) > len(acc):
        acc.extend([0] * (len(values) - len(acc)))
    for i, v in enumerate(values):
        acc[i] += v or 0


def _read_summary(fs: pafs.FileSystem, base: str) -> Optional[dict[str, Any]]:
    try:
        with fs.open_input_stream(join(base, SUMMARY)) as f:
            return json.loads(f.read())
    except (FileNotFoundError, OSError, ValueError):
        return None


def read_job_stats(fs: pafs.FileSystem, base: str) -> tuple[JobStats, int]:
    """(stats, number of parts) from the Parquet parts under `base` (hive directories included); reads only
    the counter columns, a batch at a time. Names starting with `.` or `_` are not parts."""
    import pyarrow.dataset as ds

    from .sources import list_files

    stats = JobStats()
    files = [f for f in list_files(fs, base) if f.endswith(".parquet")]
    if not files:
        return stats, 0
    dataset = ds.dataset(files, filesystem=fs, format="parquet", partitioning="hive", partition_base_dir=base)
    columns = [c for c in _COLUMNS if c in dataset.schema.names]
    for batch in dataset.to_batches(columns=columns):
        stats.add(batch)
    return stats, len(dataset.files)


@dataclass
class ReportOutput:
    path: str  # report.md (on the output's filesystem)
    plots: list[str]  # PNG names beside it
    markdown: str
    stats: JobStats


def write_job_report(output_dir: str, storage: Optional[Any] = None) -> ReportOutput:
    """Write `report.md` and the PNGs into `output_dir`/_report (local path or URI; `storage` = the `storage.*`
    config section or None) from its Parquet parts and `_summary.json` alone. Raises ValueError when the
    directory holds no part."""
    fs, base = resolve(output_dir, storage)
    stats, num_parts = read_job_stats(fs, base)
    if num_parts == 0:
        raise ValueError(f"{output_dir!r} holds no Parquet part")
    summary = _read_summary(fs, base) or {}
    sink = Sink(fs, join(base, REPORT_DIR))
    plots = job_plots(sink, stats, summary)
    markdown = job_markdown(output_dir, stats, num_parts, summary, plots)
    path = sink.write(REPORT, markdown.encode())
    return ReportOutput(path=path, plots=plots, markdown=markdown, stats=stats)


def _category_rows(stats: JobStats) -> list[tuple[str, Group]]:
    """Categories by name, rows without one last."""
    return sorted(stats.categories.items(), key=lambda kv: (kv[0] == NO_CATEGORY, kv[0]))


def job_plots(sink: Sink, stats: JobStats, summary: dict[str, Any]) -> list[str]:
    plt = _plt()
    names = []
    cats = _category_rows(stats) or [("all rows", stats.all)]
    height = max(3.0, 0.45 * len(cats) + 1.6)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, height))
    labels = [c for c, _ in cats]
    hbars(a1, labels, [g.tau for _, g in cats], "tau (tokens committed per decode pass)",
          "tau by category", digits=3, overall=stats.all.tau if len(cats) > 1 else None,
          note=[f"{g.rows} rows" for _, g in cats], start=1.0)
    hbars(a2, labels, [g.request_tokens_per_s for _, g in cats], "generated tokens / s of request time",
          "tokens/s per request by category", digits=1,
          overall=stats.all.request_tokens_per_s if len(cats) > 1 else None)
    names.append(save(fig, sink, JOB_PLOTS[0]))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    passes = sum(stats.committed)
    if passes:
        ks = list(range(1, len(stats.committed)))
        shares = [stats.committed[k] / passes for k in ks]
        bars = a1.bar(ks, shares, color="#4C72B0")
        a1.bar_label(bars, [f"{s:.0%}" if s >= 0.005 else "" for s in shares], fontsize=8, padding=2)
        a1.set_xticks(ks)
        a1.set_xlim(0.4, max(len(ks), 6) + 0.6)  # a few bars stay narrow
        a1.set_ylim(0, min(1.0, max(shares) * 1.2) or 1)
        a1.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        a1.set_xlabel("tokens committed in the pass (bonus included)")
        a1.set_ylabel("share of decode passes")
        a1.set_title(f"tokens committed per pass (tau {fmt(stats.all.tau, 3)}, {passes} passes)")
        a1.grid(axis="x", visible=False)
    else:
        _empty(a1, "tokens committed per pass", "no decode passes")
    depth_passes = stats.all.decode_passes
    if any(stats.accepted_per_depth) and depth_passes:
        ds_ = list(range(1, len(stats.accepted_per_depth) + 1))
        shares = [v / depth_passes for v in stats.accepted_per_depth]
        bars = a2.bar(ds_, shares, color="#55A868")
        a2.bar_label(bars, [f"{s:.0%}" for s in shares], fontsize=8, padding=2)
        a2.set_xticks(ds_)
        a2.set_xlim(0.4, max(len(ds_), 6) + 0.6)
        a2.set_ylim(0, min(1.0, max(shares) * 1.2))
        a2.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        a2.set_xlabel("draft depth")
        a2.set_ylabel("share of decode passes")
        a2.set_title("passes whose accepted drafts reached each depth")
        a2.grid(axis="x", visible=False)
    else:
        _empty(a2, "accepted drafts per depth", "no draft was accepted" + (
            f" (method {', '.join(stats.methods)})" if stats.methods else ""))
    names.append(save(fig, sink, JOB_PLOTS[1]))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    max_new = ((summary.get("config") or {}).get("generation") or {}).get("max_new_tokens")
    for ax, values, what, color, limit in ((a1, stats.prompt_lengths, "prompt", "#8172B2", None),
                                           (a2, stats.output_lengths, "output", "#DD8452", max_new)):
        if not values:
            _empty(ax, f"{what} length", "no rows without error")
            continue
        lo, hi = min(values), max(values)
        step = max(1, -(-(hi - lo + 1) // 40))  # at most 40 bins of whole tokens
        edges = [x - step / 2 for x in range(lo, hi + step + 1, step)]  # bins centred on whole tokens
        ax.hist(values, bins=edges, color=color, edgecolor="white")
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        if hi - lo < 20:  # a narrow spread: show some room around it
            mid = (hi + lo) / 2
            ax.set_xlim(mid - 12, mid + 12)
        med = _median(values)
        ax.axvline(med, color="black", lw=1.2, ls="--", label=f"median {fmt(med, 0)}")
        if limit:
            ax.axvline(limit, color="#C44E52", lw=1.2, ls=":", label=f"max_new_tokens {limit}")
        ax.set_xlabel(f"{what} tokens per row")
        ax.set_ylabel("rows")
        ax.set_title(f"{what} length ({len(values)} rows)")
        ax.legend()
    names.append(save(fig, sink, JOB_PLOTS[2]))
    return names


def _median(values: list[int]) -> float:
    s = sorted(values)
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _quantile(values: list[int], q: float) -> Optional[int]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _config_yaml(config: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return _SECRET_IN_URL.sub(r"\1***@", OmegaConf.to_yaml(OmegaConf.create(config))).rstrip()


def job_markdown(output_dir: str, stats: JobStats, num_parts: int, summary: dict[str, Any], plots: list[str]) -> str:
    a = stats.all
    model = summary.get("model") or ((summary.get("config") or {}).get("model") or {}).get("name_or_path", "?")
    method = summary.get("method") or ", ".join(sorted(stats.methods)) or "?"
    lines = [f"# Job report: `{model}`, method `{method}`", ""]
    where = f"Output `{output_dir}`: {a.rows} rows in {num_parts} Parquet part(s)"
    if summary:
        run = summary.get("this_run") or {}
        where += (f", config hash `{summary.get('config_hash', '?')}`, finished {run.get('finished_at', '?')}; "
                  f"complete (one row per input id): {fmt(summary.get('complete'))}; {len(summary.get('runs') or [])} run(s), "
                  f"the last: start-up {fmt(run.get('startup_s'), 1)} s, generating {fmt(run.get('generation_s'), 1)} s, "
                  f"mean engine batch {fmt(run.get('mean_batch_size'), 1)}.")
    else:
        where += ". No `_summary.json` (the job is running or was interrupted): everything below is from the parts."
    lines += [where, "",
              "| rows | errors | duplicate ids dropped | prompt tokens | generated tokens | tau | tokens/s (job) | "
              "tokens/s per request |", "|---|---|---|---|---|---|---|---|",
              f"| {a.rows} | {a.errors} | {fmt(summary.get('duplicates_dropped'))} | {a.prompt_tokens} | "
              f"{a.generated_tokens} | {fmt(a.tau, 3)} | {fmt(summary.get('generation_tokens_per_s'), 1)} | "
              f"{fmt(a.request_tokens_per_s, 1)} |", "",
              "tau = tokens committed by decode passes / decode passes (bonus token included, the prefill's first "
              "token not). tokens/s (job) = tokens generated / seconds the engines were generating, over all runs "
              "(start-up excluded); tokens/s per "
              "request = generated tokens / the rows' own time from admission to finish (rows share batches).", ""]
    lines += ["## By category", ""]
    if stats.has_category:
        lines += ["| category | rows | errors | generated tokens | mean output length | tau | tokens/s per request |",
                  "|---|---|---|---|---|---|---|"]
        for cat, g in _category_rows(stats) + [("**all**", a)]:
            ok = g.rows - g.errors
            lines.append(f"| {cat} | {g.rows} | {g.errors} | {g.generated_tokens} | {fmt(_ratio(g.ok_tokens, ok), 1)} | "
                         f"{fmt(g.tau, 3)} | {fmt(g.request_tokens_per_s, 1)} |")
    else:
        lines.append("The input has no category column (`data.category_column`).")
    lines += ["", f"![tau and tokens/s by category]({JOB_PLOTS[0]})", ""]

    lines += ["## Speculation", "",
              f"{a.decode_passes} decode passes committed {a.decode_tokens} tokens (tau {fmt(a.tau, 3)}); "
              f"{a.drafted} draft tokens were verified and {a.accepted} accepted "
              f"(acceptance rate {fmt(_ratio(a.accepted, a.drafted))}, accepted drafts per pass "
              f"{fmt(_ratio(a.accepted, a.decode_passes))}).", ""]
    passes = sum(stats.committed)
    if passes:
        lines += ["| tokens committed in a pass | " + " | ".join(str(k) for k in range(1, len(stats.committed))) + " |",
                  "|---|" + "---|" * (len(stats.committed) - 1),
                  "| share of passes | " + " | ".join(f"{v / passes:.1%}" for v in stats.committed[1:]) + " |", ""]
        if not stats.committed_exact:
            lines += ["(Derived from `accepted_per_depth`: a pass commits 1 + its accepted depth; a last pass cut "
                      "short by `max_new_tokens` or a stop string counts as uncut.)", ""]
    if any(stats.accepted_per_depth):
        lines += ["| draft depth | " + " | ".join(str(d + 1) for d in range(len(stats.accepted_per_depth))) + " |",
                  "|---|" + "---|" * len(stats.accepted_per_depth),
                  "| passes reaching it | " + " | ".join(
                      f"{v} ({v / a.decode_passes:.1%})" for v in stats.accepted_per_depth) + " |", ""]
    lines += [f"![tokens committed per pass and accepted drafts per depth]({JOB_PLOTS[1]})", ""]

    lines += ["## Lengths and finish reasons", "", "| tokens per row | min | median | p90 | max |", "|---|---|---|---|---|"]
    for what, values in (("prompt", stats.prompt_lengths), ("output", stats.output_lengths)):
        if values:
            lines.append(f"| {what} | {min(values)} | {fmt(_median(values), 1)} | {_quantile(values, 0.9)} | {max(values)} |")
    lines += ["", "| finish reason | rows |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(stats.finish_reasons.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines += ["", f"![prompt and output lengths]({JOB_PLOTS[2]})", ""]

    lines += ["## Errors", ""]
    if stats.errors:
        lines += [f"{a.errors} row(s) carry an error (column `error`; their text is null).", "",
                  "| error | rows |", "|---|---|"]
        top = sorted(stats.errors.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"| {msg.replace('|', '/')[:200]} | {n} |" for msg, n in top[:30]]
        if len(top) > 30:
            lines.append(f"| ({len(top) - 30} more messages) | {sum(n for _, n in top[30:])} |")
    else:
        lines.append("No row has an error.")
    lines.append("")

    lines += ["## Config", ""]
    if summary.get("config"):
        lines += ["The merged config of the job (`_summary.json`):", "", "```yaml", _config_yaml(summary["config"]), "```"]
    else:
        lines.append("Not known: no `_summary.json`.")
    lines.append("")
    return "\n".join(lines)


# ---- benchmark report (jobs.bench) --------------------------------------------------------------------
ALL = "all"


def _paired_cell(rec: dict, key: str) -> str:
    """'median [q1-q3]' of a paired ratio (just the median when the quartiles are missing or equal)."""
    mid, q1, q3 = rec.get(key), rec.get(key + "_q1"), rec.get(key + "_q3")
    if mid is None or q1 is None or q3 is None or q1 == q3:
        return fmt(mid)
    return f"{fmt(mid)} [{fmt(q1)}-{fmt(q3)}]"


def _bc_key(bc: Any) -> tuple:
    """Numbers first, ascending, then auto."""
    return (1, 0) if bc == "auto" else (0, bc)


def bench_plots(out: Path, records: list[dict[str, Any]], curve: Any, tolerance: float) -> list[str]:
    """The benchmark's PNG plots in `out`; returns their file names."""
    from .bench import Setting

    plt = _plt()
    sink = Sink.local(out)
    names = []
    batch = records[0]["batch_size"]
    rows = [r for r in records if r["batch_size"] == batch]
    cats = list(dict.fromkeys(r["category"] for r in rows if r["category"] != ALL)) or [ALL]
    rows = [r for r in rows if r["method"] != "hf"]  # hf generate has no tau or block size
    bcs = sorted({r["block_complexity"] for r in rows if r["method"] != "ar"}, key=_bc_key) or [1]
    fig, axes = plt.subplots(len(bcs), 1, figsize=(max(7, 1.3 * len(cats) + 4), 3.4 * len(bcs)), squeeze=False)
    for ax, bc in zip(axes[:, 0], bcs):
        labels = [lab for lab in dict.fromkeys(r["setting"] for r in rows) if lab == "ar" or lab.endswith(f"BC{bc}")]
        series = {lab: [next((r["tau"] or 0 for r in rows if r["setting"] == lab and r["category"] == c), 0) for c in cats]
                  for lab in labels}
        grouped_bars(ax, cats, series, "tau", f"mean acceptance length by category, BC {bc} (batch {batch})")
        ax.set_ylim(0, 1.35 * max([r["tau"] or 1 for r in rows] + [1]))  # room for the legend
    names.append(save(fig, sink, "tau_by_category.png"))

    overall = [r for r in rows if r["category"] == (ALL if len(cats) > 1 else cats[0])]
    family = lambda r: Setting(r["method"], 0, r["num_masks"], r["tree"], r["expansion"]).family  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for fam in dict.fromkeys(family(r) for r in overall if r["method"] != "ar"):
        mine = [r for r in overall if r["method"] != "ar" and family(r) == fam]
        pts = sorted((r["block_complexity"], r["speedup_vs_ar"] or 0) for r in mine if r["block_complexity"] != "auto")
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        for r in mine:  # auto: a star at the mean block it chose
            if r["block_complexity"] == "auto" and r["mean_block_size"]:
                ax.scatter([r["mean_block_size"]], [r["speedup_vs_ar"] or 0], marker="*", s=120,
                           color=line[0].get_color() if line else None, label=f"{fam} auto (x = mean block)")
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="ar")
    ax.set_xlabel("block complexity (tokens fed per pass)")
    ax.set_ylabel("speedup over ar (tokens/s)")
    ax.set_title(f"speedup against block complexity (batch {batch})")
    ax.legend()
    names.append(save(fig, sink, "speedup_vs_bc.png"))

    if curve is not None:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, b in enumerate(curve.batch_sizes):
            for j, c in enumerate(curve.cache_lens):
                base = curve.seconds[i][j][curve.block_sizes.index(1)]
                a1.plot(curve.block_sizes, [x / base for x in curve.seconds[i][j]], marker=".", label=f"batch {b}, cache {c}")
        a1.set_xscale("log", base=2)
        a1.set_xticks(curve.block_sizes, [str(q) for q in curve.block_sizes])
        a1.set_xlabel("block size Q (new tokens per pass)")
        a1.set_ylabel("time(Q) / time(1)")
        a1.set_title("cost of one pass")
        a1.legend()
        pts = [r for r in records if r["category"] == overall[0]["category"] and r["method"] not in ("ar", "hf")
               and r["predicted_speedup"] and r["speedup_vs_ar"]]
        if pts:
            pred = [r["predicted_speedup"] for r in pts]
            meas = [r["speedup_vs_ar"] for r in pts]
            hi = max(pred + meas) * 1.3  # room for the labels
            xs = [0, hi]
            a2.plot(xs, xs, color="gray", lw=1)
            a2.fill_between(xs, [x * (1 - tolerance) for x in xs], [x * (1 + tolerance) for x in xs], color="gray",
                            alpha=0.15, label=f"±{tolerance:.0%}")
            placed: list[tuple[float, float]] = []
            for r in pts:
                x, y = r["predicted_speedup"], r["speedup_vs_ar"]
                a2.scatter(x, y, s=14)
                near = sum(abs(x - px) < 0.03 * hi and abs(y - py) < 0.03 * hi for px, py in placed)
                placed.append((x, y))
                a2.annotate(f"{r['setting']} b{r['batch_size']}", (x, y), xytext=(4, 3 - 10 * near),
                            textcoords="offset points", fontsize=7)  # labels of coinciding points stack
            a2.set_xlim(0, hi)
            a2.set_ylim(0, hi)
            a2.legend()
        a2.set_xlabel("predicted speedup = tau / relative cost")
        a2.set_ylabel("measured speedup")
        a2.set_title("prediction from the cost curve")
        names.append(save(fig, sink, "cost_curve.png"))
    return names


def _length_note(cfg: Any) -> str:
    lo_hi = cfg.bench.get("mixed_max_new_tokens") if hasattr(cfg.bench, "get") else None
    if lo_hi:
        return f"max_new_tokens drawn per prompt in [{lo_hi[0]}, {lo_hi[1]}] (hf generate runs each batch to its longest)"
    return f"{cfg.generation.max_new_tokens} new tokens"


def write_bench_report(out: Path, cfg: Any, command: str, records: list[dict[str, Any]], curve: Any, plots: list[str],
                       env: dict[str, Any], skipped: int) -> None:
    """The benchmark's report.md in `out` (see jobs/bench_results.py for the records)."""
    b = cfg.bench
    cats = list(dict.fromkeys(r["category"] for r in records if r["category"] != ALL))
    overall = [r for r in records if r["category"] == ALL or len(cats) <= 1]
    lines = [
        "# Decoding benchmark", "",
        f"Command: `{command}`", "",
        f"Model `{cfg.model.name_or_path}` ({cfg.model.dtype}, {env['device']}), data `{cfg.data.path or 'bundled prompts'}` "
        f"({overall[0]['num_prompts']} prompts{f', {skipped} rows skipped for errors' if skipped else ''}), "
        f"{_length_note(cfg)}, temperature {cfg.generation.temperature}, "
        f"torch {env['torch']} with {env['torch_threads']} thread(s) on {env['machine']}; {b.warmup} warm-up prompt(s) per "
        f"setting, {b.repeats} timed repeat(s) per setting run round-robin, each round starting one setting "
        f"further on (median time; 'paired': the median over repeats of the ratio within one round, [its "
        f"quartiles]). tau = tokens committed per decode pass (bonus included, prefill not counted); speedup and "
        "exact match are against `ar` in the same run.", "",
        "## All prompts", "",
        "| setting | batch | tau | accepted/pass | 1-1/tau | tokens fed/pass | tokens/s | speedup | vs hf | paired vs ar / hf | "
        "predicted | host overhead | KV cache MB (vs ar) | exact match | token mismatch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in overall:
        mem = f"{fmt(r.get('peak_cache_mb'), 1)} ({fmt(r.get('cache_vs_ar'))})" if r.get("peak_cache_mb") else "-"
        lines.append(
            f"| {r['setting']} | {r['batch_size']} | {fmt(r['tau'])} | {fmt(r['accepted_per_pass'])} | "
            f"{fmt(r['calls_saved'])} | {fmt(r['mean_block_size'], 1)} | {fmt(r['tokens_per_s'], 1)} | "
            f"{fmt(r['speedup_vs_ar'])} | {fmt(r.get('speedup_vs_hf'))} | "
            f"{_paired_cell(r, 'speedup_vs_ar_paired')} / {fmt(r.get('speedup_vs_hf_paired'))} | {fmt(r['predicted_speedup'])} | "
            f"{fmt(r['host_overhead'], 3)} | {mem} | {fmt(r['exact_match_rate'])} | {fmt(r.get('token_mismatch_rate'), 4)} |"
        )
    auto = [r for r in overall if r["block_complexity"] == "auto"]
    if auto:
        lines += ["", "## block_complexity=auto", "",
                  "Tokens fed per sequence per pass : number of passes (1 = plain decoding); against the fastest "
                  "fixed-size drafting setting of this run at the same batch size: the ratio of median tokens/s, "
                  "and paired (per-round ratios: median [quartiles]).", "",
                  "| setting | batch | block sizes | fastest fixed setting | vs it | paired |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['batch_size']} | {r['block_sizes']} | {r.get('fastest_fixed') or '-'} | "
                  f"{fmt(r.get('vs_fastest_fixed'))} | {_paired_cell(r, 'vs_fastest_fixed_paired')} |" for r in auto]
    if cats:
        lines += ["", "## tau by category", "", "| setting | batch | " + " | ".join(cats) + " |",
                  "|---|---|" + "---|" * len(cats)]
        keys = list(dict.fromkeys((r["setting"], r["batch_size"]) for r in records))
        for lab, bs in keys:
            tau = {r["category"]: r["tau"] for r in records if r["setting"] == lab and r["batch_size"] == bs}
            lines.append(f"| {lab} | {bs} | " + " | ".join(fmt(tau.get(c)) for c in cats) + " |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    if curve is not None:
        off = [r for r in overall if r["within_tolerance"] is False]
        lines += [
            "", "## Cost curve and predicted speedup", "",
            f"One pass (forward + LM head over Q new tokens) was timed at batch {curve.batch_sizes}, cache lengths "
            f"{curve.cache_lens} and Q = {curve.block_sizes} (median of {b.cost_repeats}); see cost_curve.csv. "
            "Predicted speedup = tau / (time(Q) / time(1)) at the run's mean tokens fed per pass, batch size and "
            "mean cache length. Stated tolerance: measured within "
            f"±{b.tolerance:.0%} of predicted.", "",
        ]
        if off:
            lines.append(
                "Outside the tolerance: " + ", ".join(f"{r['setting']} (batch {r['batch_size']}: measured "
                f"{fmt(r['speedup_vs_ar'])} vs {fmt(r['predicted_speedup'])})" for r in off) + ". "
                "The prediction counts only model time. What it leaves out shows in the `host overhead` column "
                "(share of decode time spent outside the model: building trees, n-gram and logit-store lookups, "
                "verification, KV bookkeeping in Python). On a small model each forward takes milliseconds, so "
                "this overhead is a large share and measured speedups fall below the prediction; the prefill "
                "and warm-cache effects between settings add a few percent either way."
            )
        else:
            lines.append("Every setting is within the tolerance.")
    lines.append("")
    Sink.local(out).write(REPORT, "\n".join(lines).encode())
