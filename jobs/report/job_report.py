"""The job report: `report.md` and PNG plots of a generation job.

`write_job_report(output_dir, storage)` reads only the job's Parquet parts and `_summary.json` (local
directory or URI, through jobs/io/storage.py) and writes `report.md`, `by_category.png`, `acceptance.png`
and `lengths.png` into `_report/` beside the parts. (A visible `report.md` or PNG among the parts would
break `pandas.read_parquet(dir)`, pyarrow and Spark, which read every file not starting with `.` or `_`
as Parquet.) The job calls it at its end; `esp-batch report OUTPUT_DIR` calls the same function, so the
report can be rebuilt from the output alone, identically. The plotting helpers are in jobs/report/plots.py,
shared with the benchmark's report (jobs/bench/report.py).

Terms, as in the README and docs/methods: tau = tokens committed by decode passes / decode passes (bonus token included,
the prefill's first token not); "tokens/s per request" = a row's generated tokens / its own time from
admission to finish, summed per group (rows share the engine's batches, so the job's throughput is higher).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa
import pyarrow.fs as pafs

from esp_worker.config import NOT_LOSSLESS

from ..io.output import REPORT_DIR, SUMMARY
from ..io.storage import is_uri, join, resolve
from ..run.retry import retryable
from ..run.schema import CATEGORY
from ..run.stats import Group
from .plots import REPORT, HBars, Sink, empty, fmt, hbars, pct, pyplot, save, share_axis
NO_CATEGORY = "(none)"
JOB_PLOTS = ("by_category.png", "acceptance.png", "lengths.png")
_COLUMNS = ["error", CATEGORY, "finish_reason", "method", "num_prompt_tokens", "num_generated_tokens",
            "num_decode_passes", "num_decode_tokens", "num_drafted_tokens", "num_accepted_drafts",
            "accepted_per_depth", "committed_histogram", "time_s"]
_SECRET_IN_URL = re.compile(r"(://)[^/@\s:]+:[^/@\s]+@")  # user:password@ in an endpoint URL


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


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

    from ..io.sources import list_files

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
    path: str  # report.md, as the output directory was given (a local path, or a URI with its scheme)
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
    if is_uri(output_dir):
        path = join(output_dir.rstrip("/"), REPORT_DIR, REPORT)
    return ReportOutput(path=path, plots=plots, markdown=markdown, stats=stats)


def _category_rows(stats: JobStats) -> list[tuple[str, Group]]:
    """Categories by name, rows without one last."""
    return sorted(stats.categories.items(), key=lambda kv: (kv[0] == NO_CATEGORY, kv[0]))


def job_plots(sink: Sink, stats: JobStats, summary: dict[str, Any]) -> list[str]:
    plt = pyplot()
    names = []
    cats = _category_rows(stats) or [("all rows", stats.all)]
    height = max(3.0, 0.45 * len(cats) + 1.6)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, height))
    labels = [c for c, _ in cats]
    hbars(a1, HBars(labels, [g.tau for _, g in cats], "tau (tokens committed per decode pass)", "tau by category",
                    digits=3, overall=stats.all.tau if len(cats) > 1 else None,
                    note=[f"{g.rows} rows" for _, g in cats], start=1.0))
    hbars(a2, HBars(labels, [g.request_tokens_per_s for _, g in cats], "generated tokens / s of request time",
                    "tokens/s per request by category", digits=1,
                    overall=stats.all.request_tokens_per_s if len(cats) > 1 else None))
    names.append(save(fig, sink, JOB_PLOTS[0]))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    passes = sum(stats.committed)
    if passes:
        ks = list(range(1, len(stats.committed)))
        shares = [stats.committed[k] / passes for k in ks]
        bars = a1.bar(ks, shares, color="#4C72B0")
        top = max(shares)  # the tail's tiny bars go unlabelled
        a1.bar_label(bars, [pct(s) if s >= top / 200 else "" for s in shares], fontsize=8, padding=2)
        a1.set_xticks(ks)
        a1.set_xlim(0.4, max(len(ks), 6) + 0.6)  # a few bars stay narrow
        share_axis(a1, shares)
        a1.set_xlabel("tokens committed in the pass (bonus included)")
        a1.set_ylabel("share of decode passes")
        a1.set_title(f"tokens committed per pass (tau {fmt(stats.all.tau, 3)}, {passes} passes)")
        a1.grid(axis="x", visible=False)
    else:
        empty(a1, "tokens committed per pass", "no decode passes")
    depth_passes = stats.all.decode_passes
    if any(stats.accepted_per_depth) and depth_passes:
        ds_ = list(range(1, len(stats.accepted_per_depth) + 1))
        shares = [v / depth_passes for v in stats.accepted_per_depth]
        bars = a2.bar(ds_, shares, color="#55A868")
        a2.bar_label(bars, [pct(s) for s in shares], fontsize=8, padding=2)
        a2.set_xticks(ds_)
        a2.set_xlim(0.4, max(len(ds_), 6) + 0.6)
        share_axis(a2, shares)
        a2.set_xlabel("draft depth")
        a2.set_ylabel("share of decode passes")
        a2.set_title("passes whose accepted drafts reached each depth")
        a2.grid(axis="x", visible=False)
    else:
        empty(a2, "accepted drafts per depth", "no draft was accepted" + (
            f" (method {', '.join(stats.methods)})" if stats.methods else ""))
    names.append(save(fig, sink, JOB_PLOTS[1]))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    max_new = ((summary.get("config") or {}).get("generation") or {}).get("max_new_tokens")
    for ax, values, what, color, limit in ((a1, stats.prompt_lengths, "prompt", "#8172B2", None),
                                           (a2, stats.output_lengths, "output", "#DD8452", max_new)):
        if not values:
            empty(ax, f"{what} length", "no rows without error")
            continue
        lo, hi = min(values), max(values)
        ax.hist(values, bins=length_bins(lo, hi), color=color, edgecolor="white")
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


def length_bins(lo: int, hi: int, most: int = 40) -> list[float]:
    """Bin edges for token counts lo..hi: at most `most` bins of `step` whole tokens each, edges halfway
    between whole numbers, the last bin holding hi."""
    step = max(1, -(-(hi - lo + 1) // most))
    return [lo - 0.5 + k * step for k in range(-(-(hi - lo + 1) // step) + 1)]


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
    if summary.get("lossless") is False or method in NOT_LOSSLESS:
        lines += [f"**Not lossless.** `{method}` decodes with a fine-tuned model's layer cycles (DMTD): the text is "
                  "not the base model's own decoding. PLT (layers run per token / the model's layers): "
                  f"{fmt(summary.get('plt'), 3)}.", ""]
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
        again = sum(n for msg, n in top if retryable(msg))
        if again:
            lines += ["", f"{again} of them came from running the row (the engine, or its actor), not from its input: "
                          "a rerun with `output.retry_errors=true` runs them again."]
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
