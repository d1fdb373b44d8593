"""The benchmark's report.md and PNG plots (`python -m jobs.bench`; the records come from jobs/bench/results.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..report.plots import REPORT, Sink, fmt, grouped_bars, pyplot, save
from .settings import ALL, HF_METHODS, Setting


def paired_cell(rec: dict, key: str) -> str:
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
    plt = pyplot()
    sink = Sink.local(out)
    names = []
    batch = records[0]["batch_size"]
    rows = [r for r in records if r["batch_size"] == batch]
    cats = list(dict.fromkeys(r["category"] for r in rows if r["category"] != ALL)) or [ALL]
    rows = [r for r in rows if r["method"] not in HF_METHODS]  # hf generate has no tau or block size
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
        pts = [r for r in records if r["category"] == overall[0]["category"] and r["method"] not in ("ar", *HF_METHODS)
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
    """The benchmark's report.md in `out` (see jobs/bench/results.py for the records)."""
    b = cfg.bench
    cats = list(dict.fromkeys(r["category"] for r in records if r["category"] != ALL))
    overall = [r for r in records if r["category"] == ALL or len(cats) <= 1]
    lines = [
        "# Decoding benchmark", "",
        f"Command: `{command}`", "",
        f"Model `{cfg.model.name_or_path}` ({cfg.model.dtype}, {env['device']}), data `{cfg.data.path or 'bundled prompts'}` "
        f"({overall[0]['num_prompts']} prompts{f', {skipped} rows skipped for errors' if skipped else ''}"
        f"{_rows_note(overall)}), "
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
        direct = r.get("lossless") is False  # dmtd: a pass is a cycle of the model's own tokens, nothing is accepted
        lines.append(
            f"| {r['setting']}{' (not lossless)' if direct else ''} | {r['batch_size']} | {fmt(r['tau'])} | "
            f"{'-' if direct else fmt(r['accepted_per_pass'])} | {'-' if direct else fmt(r['calls_saved'])} | "
            f"{fmt(r['mean_block_size'], 1)} | {fmt(r['tokens_per_s'], 1)} | "
            f"{fmt(r['speedup_vs_ar'])} | {fmt(r.get('speedup_vs_hf'))} | "
            f"{paired_cell(r, 'speedup_vs_ar_paired')} / {fmt(r.get('speedup_vs_hf_paired'))} | {fmt(r['predicted_speedup'])} | "
            f"{fmt(r['host_overhead'], 3)} | {mem} | {fmt(r['exact_match_rate'])} | {fmt(r.get('token_mismatch_rate'), 4)} |"
        )
    dmtd = [r for r in overall if r.get("dmtd_tau")]
    if dmtd:
        lines += ["", "## DMTD", "",
                  "`dmtd` decodes with a DMTD model's cycles (docs/methods/dmtd.md): **not lossless**, its retention is "
                  "measured against `ar` (this model's greedy output): token agreement (equal tokens at equal positions / "
                  "ar's tokens), the mean first divergence (token index), and this model's mean NLL (nats per token) "
                  "of the output beside that of its own greedy output. `dmtd_verified` is lossless. PLT = layers run "
                  "per token / the model's layers.", "",
                  "| setting | batch | tau | PLT | tokens/s | speedup | lossless | token agreement | first divergence | "
                  "NLL (vs ar's) |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['batch_size']} | {r['dmtd_tau']} | {fmt(r.get('plt'), 3)} | "
                  f"{fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup_vs_ar'])} | {'yes' if r['lossless'] else '**no**'} | "
                  f"{fmt(r.get('token_agreement'), 3)} | {fmt(r.get('first_divergence'), 1)} | "
                  f"{fmt(r.get('base_nll'), 3)} ({fmt(r.get('base_nll_ar'), 3)}) |" for r in dmtd]
    auto = [r for r in overall if r["block_complexity"] == "auto"]
    if auto:
        lines += ["", "## block_complexity=auto", "",
                  "Tokens fed per sequence per pass : number of passes (1 = plain decoding); against the fastest "
                  "fixed-size drafting setting of this run at the same batch size: the ratio of median tokens/s, "
                  "and paired (per-round ratios: median [quartiles]).", "",
                  "| setting | batch | block sizes | fastest fixed setting | vs it | paired |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['setting']} | {r['batch_size']} | {r['block_sizes']} | {r.get('fastest_fixed') or '-'} | "
                  f"{fmt(r.get('vs_fastest_fixed'))} | {paired_cell(r, 'vs_fastest_fixed_paired')} |" for r in auto]
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


def _rows_note(overall: list[dict]) -> str:
    """Batch sizes whose passes never held that many rows (categories run one at a time)."""
    short = sorted({(r["batch_size"], r["max_rows"]) for r in overall
                    if r.get("max_rows", r["batch_size"]) < r["batch_size"]})
    return "".join(f"; batch {b} holds at most {m} rows, one category at a time" for b, m in short)
