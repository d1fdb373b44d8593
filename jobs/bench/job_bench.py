"""`python -m jobs.job_bench`: does the Ray job keep its engines as busy as the engine alone?

Runs, on the same rows (dev prompts repeated to `--rows`, each with its own `max_new_tokens` between
`--min-new` and `--max-new` through the params column):
  - engine:     the engine in this process, `Engine.generate_iter` over every row, batch `--batch`;
  - job s=N:    the Ray job (`jobs.run.runner.run_job`), one actor, shard size N (8 and the default);
  - job 2 act.: the same job on two actors (at the smallest shard size, so both actors get shards).
Each actor and this process use one torch thread. Job figures are generation tokens/s from the job's
summary (engines ready -> last part written: Ray and model start-up excluded). Settings run round-robin,
`--repeats` times; medians are reported with ratios to the engine and to one actor.

Writes job_bench.json and job_bench.md under --out.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def make_rows(prompts_file: Path, n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    base = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        src = base[i % len(base)]
        prompt = src.get("prompt") or src.get("text") or str(src)
        rows.append({"id": f"r{i:05d}", "prompt": prompt, "category": src.get("category"),
                     "params": {"max_new_tokens": rng.randint(lo, hi)}})
    return rows


def engine_tokens_per_s(model: str, rows: list[dict[str, Any]], batch: int) -> tuple[float, int]:
    import torch

    from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request

    torch.set_num_threads(1)
    eng = Engine.from_config(ModelConfig(name_or_path=model), EngineConfig(method="ar", max_batch_size=batch))
    reqs = [Request(id=r["id"], prompt=r["prompt"], params=GenerationParams(**r["params"])) for r in rows]
    list(eng.generate_iter(reqs[: min(8, len(reqs))]))  # warm-up
    t0 = time.perf_counter()
    tokens = sum(len(o.token_ids) for o in eng.generate_iter(reqs))
    return tokens / (time.perf_counter() - t0), tokens


def job_tokens_per_s(model: str, data: Path, out: Path, batch: int, shard_size: int, actors: int) -> tuple[float, int, float]:
    from ..config import load_config
    from ..run.runner import run_job

    cfg = load_config(None, [
        f"model.name_or_path={model}", f"data.path={data}", f"output.dir={out}", "output.overwrite=true",
        "engine.method=ar", f"engine.max_batch_size={batch}", f"data.shard_size={shard_size}",
        f"ray.num_actors={actors}", "ray.num_cpus_per_actor=1", "ray.torch_threads=1", "ray.address=local",
        "output.progress_interval_s=60",
    ])
    run = run_job(cfg).summary["this_run"]
    return run["generation_tokens_per_s"], run["generated_tokens"], run["mean_batch_size"]


def main(argv: list[str] | None = None) -> int:
    default_model = SHARED / "models" / "esp-tiny-llama"
    ap = argparse.ArgumentParser(prog="python -m jobs.job_bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model) if default_model.exists() else "tiny-random-llama")
    ap.add_argument("--prompts", default=str(SHARED / "data" / "tiny_prompts_dev.jsonl"))
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shard-sizes", default="8,default", help="comma list; 'default' = data.shard_size's default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/job_bench")
    ns = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ..config import DataConfig

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(Path(ns.prompts), ns.rows, ns.min_new, ns.max_new, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="job-bench-"))  # the rows and the jobs' outputs: removed at the end
    atexit.register(shutil.rmtree, tmp, True)
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = [DataConfig.shard_size if s == "default" else int(s) for s in ns.shard_sizes.split(",")]
    settings: list[tuple[str, Any]] = [("engine (1 process)", None)]
    settings += [(f"job, 1 actor, shard_size={s}", (s, 1)) for s in sizes]
    # two actors need at least two shards: compare at the smallest shard size
    settings += [(f"job, 2 actors, shard_size={sizes[0]}", (sizes[0], 2))]
    results: dict[str, list[float]] = {name: [] for name, _ in settings}
    batches: dict[str, list[float]] = {name: [] for name, _ in settings}
    tokens = {}
    for rep in range(ns.repeats):
        for name, job in settings:
            if job is None:
                rate, n = engine_tokens_per_s(ns.model, rows, ns.batch)
            else:
                rate, n, mean_batch = job_tokens_per_s(ns.model, data, tmp / "out", ns.batch, *job)
                batches[name].append(mean_batch)
            results[name].append(rate)
            tokens[name] = n
            print(f"[{rep + 1}/{ns.repeats}] {name}: {rate:.1f} tok/s ({n} tokens)", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    eng = med[settings[0][0]]
    one = med[settings[1][0]]  # one actor at the same shard size as the two-actor row
    lines = [
        f"model `{Path(ns.model).name}`, {ns.rows} rows, max_new_tokens per row {ns.min_new}-{ns.max_new}, `ar`, "
        f"engine.max_batch_size={ns.batch}, one torch thread per process, median of {ns.repeats}",
        "",
        "| setting | generation tokens/s | vs engine | vs 1 actor | mean engine batch |",
        "|---|---|---|---|---|",
    ]
    for name, _ in settings:
        mb = statistics.median(batches[name]) if batches[name] else None
        lines.append(f"| {name} | {med[name]:.1f} | {med[name] / eng:.2f}x | "
                     f"{'' if 'engine' in name else f'{med[name] / one:.2f}x'} | {'-' if mb is None else f'{mb:.1f}'} |")
    table = "\n".join(lines)
    print(table)
    (out / "job_bench.md").write_text(table + "\n")
    (out / "job_bench.json").write_text(json.dumps({"settings": results, "median": med, "tokens": tokens,
                                                     "mean_batch": batches, "args": vars(ns)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
