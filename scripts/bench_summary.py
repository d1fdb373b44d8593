"""Compact tables of `jobs.bench` output directories (what `scripts/gpu_checks.sh` keeps per step):

    python scripts/bench_summary.py DIR [DIR ...]

Per directory and batch size, one line per setting over all prompts: tokens/s, tau, speedup against ar (median
and paired), against hf generate, exact match against ar, passes replayed from graphs and run eagerly, capture
and compile seconds, prefill forwards and their seconds (timed runs), the block sizes used. Then the ratios issue 40 asks for, paired per round-robin round:
ar over replayed passes (as the default runs it, and with compiled graphs and / or run ahead where the directory
has them) over `ar eager` (also over the decode passes alone: the prefill is eager in both) and over
`hf generate compiled`. Then the cost curve, when the directory has one."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


# ar over replayed passes, as the default runs it and under the options `scripts/gpu_checks.sh` compares
REPLAYED_AR = ("ar", "ar compiled graphs", "ar run ahead", "ar compiled graphs run ahead",
               "ar compiled graphs flex attention", "ar compiled graphs autotuned")


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _paired(mine: list, theirs: list):
    """Median over rounds of theirs / mine (seconds): how many times faster `mine` ran than `theirs`."""
    ratios = [b / a for a, b in zip(mine or [], theirs or []) if a]
    return statistics.median(ratios) if ratios else None


def summarise(out: Path) -> str:
    lines = [f"# {out.name}"]
    bench = out / "bench.json"
    if not bench.exists():
        return "\n".join(lines + ["(no bench.json)"])
    records = json.loads(bench.read_text())
    overall = [r for r in records if r["category"] == "all"] or records
    for batch in sorted({r["batch_size"] for r in overall}):
        rows = [r for r in overall if r["batch_size"] == batch]
        held = rows[0].get("max_rows", batch)
        lines.append(f"## batch {batch}" + (f" (at most {held} rows in flight: one category at a time)" if held < batch else ""))
        lines.append("setting | tok/s | tau | vs ar | vs ar paired | vs hf | exact | graph (ahead)/eager passes | capture+compile s"
                     " | prefill forwards, s | blocks")
        for r in rows:
            lines.append(" | ".join([
                r["setting"], _fmt(r["tokens_per_s"], 1), _fmt(r["tau"]), _fmt(r["speedup_vs_ar"]),
                _fmt(r.get("speedup_vs_ar_paired")), _fmt(r.get("speedup_vs_hf")), _fmt(r["exact_match_rate"]),
                f"{_fmt(r.get('graph_passes'))} ({_fmt(r.get('ahead_passes'))})/{_fmt(r.get('eager_passes'))}",
                _fmt(r.get("compile_s"), 1),
                f"{_fmt(r.get('prefill_forwards'))}, {_fmt(r.get('prefill_s'))}", (r.get("block_sizes") or "")[:60]]))
        by = {r["setting"]: r for r in rows}
        for name in REPLAYED_AR:
            ar = by.get(name)
            for other in ("ar eager", "hf generate", "hf generate compiled"):
                if ar and other in by:
                    ratio = _paired(ar.get("time_s_rounds"), by[other].get("time_s_rounds"))
                    lines.append(f"{name} / {other}: {_fmt(ratio)}x paired, "
                                 f"{_fmt(ar['tokens_per_s'] / by[other]['tokens_per_s'])}x medians"
                                 if by[other]["tokens_per_s"] else f"{name} / {other}: -")
                    if other == "ar eager" and ar.get("decode_s") and by[other].get("decode_s"):
                        lines.append(f"  decode passes only (prefill apart): {_fmt(by[other]['decode_s'] / ar['decode_s'])}x")
    curve = out / "cost_curve.json"
    if curve.exists():
        c = json.loads(curve.read_text())
        lines.append(f"## cost curve ({c.get('device')}): ms per pass, Q = {c['block_sizes']}")
        for i, b in enumerate(c["batch_sizes"]):
            for j, s in enumerate(c["cache_lens"]):
                ms = [x * 1000 for x in c["seconds"][i][j]]
                lines.append(f"batch {b}, cache {s}: " + " ".join(f"{x:.2f}" for x in ms)
                             + f"  (x Q=1: {' '.join(f'{x / ms[0]:.2f}' for x in ms)})")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(summarise(Path(d)) for d in sys.argv[1:]))
