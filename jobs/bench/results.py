"""The benchmark's results: what `jobs.bench` measured, turned into records and tables.

- `SettingRun`: one timed run of a setting (outputs by prompt id, seconds by category, the engine's timing);
  `Baselines`: the `ar` and `hf generate` runs every setting of a batch size is measured against.
- `summarise(...)`: one record per category (and one for ALL) from a setting's run against the baselines:
  tau, tokens/s, speedup vs ar/hf, exact-match and token-mismatch rates, predicted speedup, cache use.
  With repeats, `speedup_vs_ar_paired` / `speedup_vs_hf_paired` are the median over repeats of the ratio
  within one round-robin round (both settings ran minutes apart), robust to a machine whose speed drifts;
  `_q1` / `_q3` are the quartiles of those ratios (their spread is the machine's noise).
- `against_fastest_fixed(records, rounds)`: each `auto` setting against the fastest fixed-size drafting
  setting of the same run (ratio of medians, paired median and quartiles).
- `token_mismatch_rate(outputs, references)`: divergences per compared token.
- `write_table(path, records)`: records as CSV (bench.csv, cost_curve.csv).

report.md and the PNG plots are written by jobs/bench/report.py.
"""
from __future__ import annotations

import csv
import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from esp_worker.config import NOT_LOSSLESS

from .settings import ALL, HF_METHODS

if TYPE_CHECKING:
    from .settings import Prompt, Setting


@dataclass
class SettingRun:
    """One run of a setting over every prompt: categories run one after another and are timed apart."""

    outputs: dict[str, Any]  # prompt id -> RequestOutput
    seconds: dict[str, float]  # category -> seconds
    timing: dict[str, Any] = field(default_factory=dict)  # the engine's timing record (empty for hf generate)

    @staticmethod
    def median(runs: list["SettingRun"]) -> "SettingRun":
        """One run from repeats: the first repeat's outputs and timing, the median seconds per category."""
        first = runs[0]
        return dataclasses.replace(first, seconds={cat: statistics.median(r.seconds[cat] for r in runs)
                                                   for cat in first.seconds})


@dataclass
class Baselines:
    """What every setting of one batch size is measured against: `ar`'s run (the speedups' denominator and the
    exact-match reference) and hf generate's (None where it did not run), with every repeat's seconds per
    category of both for the paired ratios."""

    ar: SettingRun
    hf: Optional[SettingRun]
    ar_rounds: list[dict[str, float]]
    hf_rounds: list[dict[str, float]]


@dataclass(frozen=True)
class BenchContext:
    """What every record of a bench shares."""

    prompts: list["Prompt"]
    curve: Any  # the measured cost curve, or None
    max_new_tokens: int
    tolerance: float  # predicted against measured speedup


def token_mismatch_rate(outputs: list[list[int]], references: list[list[int]]) -> Optional[float]:
    """Divergences per compared token: each output is compared with its reference up to and including the first
    token that differs (a divergence) or to the shorter end; later tokens are not comparable.

    Example: [1, 2, 3] vs [1, 2, 4] and [5, 6] vs [5, 6] -> 1 divergence in 3 + 2 tokens = 0.2."""
    diverged, compared = 0, 0
    for out, ref in zip(outputs, references):
        n = min(len(out), len(ref))
        first = next((i for i in range(n) if out[i] != ref[i]), None)
        diverged += first is not None
        compared += n if first is None else first + 1
    return diverged / compared if compared else None


def summarise(s: "Setting", batch: int, run: SettingRun, rounds: list[dict[str, float]], base: Baselines,
              ctx: BenchContext) -> list[dict[str, Any]]:
    """One record per category and one for ALL. `rounds`: this setting's seconds per category of every repeat,
    for the paired ratios."""
    from esp_worker import RequestStats
    from esp_worker.auto.cost_model import predict_speedup

    prompts, ar_run, hf_run = ctx.prompts, base.ar, base.hf
    groups = {cat: [p for p in prompts if p.category == cat] for cat in run.seconds}
    if len(groups) > 1:
        groups = {**groups, ALL: prompts}
    ar_tps = {}
    records = []
    for cat, ps in groups.items():
        outs = [run.outputs[p.id] for p in ps]
        st = RequestStats()
        for o in outs:
            st = st.merge(o.stats)
        secs = sum(run.seconds[c] for c in {p.category for p in ps})
        ar_secs = sum(ar_run.seconds[c] for c in {p.category for p in ps})
        ar_tokens = sum(len(ar_run.outputs[p.id].token_ids) for p in ps)
        ar_tps[cat] = ar_tokens / ar_secs if ar_secs else None
        hf_tps = None
        if hf_run is not None:
            hf_secs = sum(hf_run.seconds[c] for c in {p.category for p in ps})
            hf_tps = sum(len(hf_run.outputs[p.id].token_ids) for p in ps) / hf_secs if hf_secs else None
        tokens = sum(len(o.token_ids) for o in outs)
        tps = tokens / secs if secs else None
        tau = st.tau
        fed = sum(q * n for q, n in st.block_size_histogram.items())
        block = fed / st.num_decode_passes if st.num_decode_passes else None
        exact = sum(o.token_ids == ar_run.outputs[p.id].token_ids for o, p in zip(outs, ps)) / len(ps)
        mismatch = token_mismatch_rate([o.token_ids for o in outs], [ar_run.outputs[p.id].token_ids for p in ps])
        rec = dict(
            method=s.method, setting=s.label, block_complexity=s.block_complexity, num_masks=s.num_masks,
            tree=s.tree, expansion=s.expansion, batch_size=batch, category=cat, num_prompts=len(ps),
            # categories run one after another: a batch holds at most one category's prompts
            max_rows=min(batch, max(len(g) for c, g in groups.items() if c != ALL) if cat == ALL and len(groups) > 1
                         else len(ps)),
            num_generated_tokens=tokens,
            accepted_by_proposer=dict(st.accepted_by_proposer) or None,
            num_decode_passes=st.num_decode_passes, tau=tau,
            accepted_per_pass=(st.num_accepted_drafts / st.num_decode_passes if st.num_decode_passes else None),
            calls_saved=(1 - 1 / tau if tau else None), mean_block_size=block, time_s=secs, tokens_per_s=tps,
            speedup_vs_ar=(tps / ar_tps[cat] if tps and ar_tps[cat] else None),
            speedup_vs_hf=(tps / hf_tps if tps and hf_tps else None), exact_match_rate=exact,
            token_mismatch_rate=mismatch,
            errors=sum(o.error is not None for o in outs),
            # tokens fed per sequence per pass -> passes (shows what block_complexity=auto chose)
            block_sizes=" ".join(f"{q}:{n}" for q, n in sorted(st.block_size_histogram.items())),
            # [d] share of decode passes whose accepted path reached depth d+1
            accepted_per_depth=" ".join(f"{n / st.num_decode_passes:.3f}" for n in st.accepted_per_depth)
            if st.num_decode_passes else "",
        )
        cs = {p.category for p in ps}
        rec["time_s_rounds"] = [sum(r[c] for c in cs) for r in rounds] if rounds else None
        for theirs, key in ((base.ar_rounds, "speedup_vs_ar_paired"), (base.hf_rounds, "speedup_vs_hf_paired")):
            q = paired_quartiles(rounds, theirs, cs)
            rec[key] = q[1] if q else None
            if key == "speedup_vs_ar_paired":
                rec[key + "_q1"], rec[key + "_q3"] = (q[0], q[2]) if q else (None, None)
        # dmtd / dmtd_verified: the cycle length, PLT (dmtd: layers per token / layers), whether the output is ar's
        rec.update(dmtd_tau=s.dmtd_tau or None, plt=st.plt, lossless=s.method not in NOT_LOSSLESS)
        rec["predicted_speedup"] = None
        rec["within_tolerance"] = None
        # (the cost curve times whole passes: it says nothing of a pass over some of the layers, dmtd's)
        curve = ctx.curve
        if curve is not None and tau and block and s.method not in (*HF_METHODS, "dmtd"):
            cache = sum(len(p.ids) for p in ps) / len(ps) + ctx.max_new_tokens / 2
            rec["predicted_speedup"] = predict_speedup(tau, block, curve, batch=batch, cache_len=cache)
            if rec["speedup_vs_ar"]:
                rec["within_tolerance"] = abs(rec["speedup_vs_ar"] / rec["predicted_speedup"] - 1) <= ctx.tolerance
        t, t_ar = run.timing, ar_run.timing
        whole = cat == ALL or len(groups) == 1
        rec["host_overhead"] = (t["decode_s"] - t["model_s"]) / t["decode_s"] if whole and t.get("decode_s") else None
        # peak KV-cache bytes of the run (the whole run, so on every record), and against ar's
        rec["peak_cache_mb"] = t["peak_cache_bytes"] / 2**20 if t.get("peak_cache_bytes") else None
        # prefill forwards and their seconds, and seconds in decode passes (the whole run: time_s is about their sum)
        rec["prefill_forwards"], rec["prefill_s"] = t.get("prefill_forwards"), t.get("prefill_s")
        rec["decode_s"] = t.get("decode_s")
        rec["compile_s"] = t.get("compile_s") or None  # engine.compile: seconds compiling (warm-up included)
        # engine.cuda_graphs: passes replayed from graphs and passes run eagerly (timed runs), captures (whole engine)
        g = t.get("graphs")
        rec["graph_passes"], rec["eager_passes"] = t.get("graph_passes"), t.get("eager_passes")
        rec["ahead_passes"] = t.get("ahead_passes")  # of which run ahead of the last read (cuda_graphs_run_ahead)
        rec["kept_ended_passes"] = t.get("kept_ended_passes")  # of which over ended rows kept until the next join
        rec["probe_passes"] = t.get("probe_passes")  # of which ended with the drafter's probe (ESP)
        rec["graphs_captured"] = g["captured"] if g else None
        rec["graph_mb"] = g["graph_bytes"] / 2**20 if g else None
        rec["cache_vs_ar"] = (t["peak_cache_bytes"] / t_ar["peak_cache_bytes"]
                              if t.get("peak_cache_bytes") and t_ar.get("peak_cache_bytes") else None)
        records.append(rec)
    return records


def paired_ratios(mine: list[dict[str, float]], theirs: list[dict[str, float]], cats: set[str]) -> list[float]:
    """Per round, the base's seconds over this setting's (over categories `cats`): the tokens are the same in
    both (lossless), so each is the tokens/s ratio of that round-robin round."""
    return [sum(b[c] for c in cats) / sum(a[c] for c in cats) for a, b in zip(mine, theirs) if sum(a[c] for c in cats)]


def paired_quartiles(mine: list[dict[str, float]], theirs: list[dict[str, float]],
                     cats: set[str]) -> Optional[tuple[float, float, float]]:
    """(q1, median, q3) of the per-round ratios (one round: all three the same); None without rounds."""
    ratios = paired_ratios(mine, theirs, cats)
    if not ratios:
        return None
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, statistics.median(ratios), q3


def against_fastest_fixed(records: list[dict[str, Any]], rounds: dict[str, list[dict[str, float]]]) -> None:
    """Adds to each whole-run record of an `auto` setting how it compares with the fastest fixed-size drafting
    setting of the same run and batch size, lossless ones only (the question `auto` answers: is choosing per pass
    better than the best size a user could have picked after the fact?): `fastest_fixed` (its label), `vs_fastest_fixed`
    (ratio of median tokens/s) and `vs_fastest_fixed_paired` with `_q1` / `_q3` (per-round ratios).
    rounds: setting label -> seconds per category of every repeat. Records without a fixed rival are left."""
    has_all = any(r["category"] == ALL for r in records)  # several categories; else the one category's records
    whole = [r for r in records if r["category"] == ALL or not has_all]
    for batch in {r["batch_size"] for r in whole}:
        here = [r for r in whole if r["batch_size"] == batch and r["tokens_per_s"]]
        fixed = [r for r in here if r["method"] not in ("ar", *HF_METHODS) and r["block_complexity"] != "auto"
                 and r.get("lossless") is not False]  # a rival gives the same tokens: not dmtd's own model
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        for r in here:
            if r["block_complexity"] != "auto":
                continue
            mine = rounds.get(r["setting"], [])
            q = paired_quartiles(mine, rounds.get(best["setting"], []), set(mine[0]) if mine else set())  # whole run
            r.update(fastest_fixed=best["setting"], vs_fastest_fixed=r["tokens_per_s"] / best["tokens_per_s"],
                     vs_fastest_fixed_paired=q[1] if q else None, vs_fastest_fixed_paired_q1=q[0] if q else None,
                     vs_fastest_fixed_paired_q3=q[2] if q else None)


def write_table(path: Path, records: list[dict[str, Any]]) -> None:
    """`records` as a CSV file with a header row (every key of any record, in order of first appearance)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in records for k in r)))
        w.writeheader()
        w.writerows(records)
