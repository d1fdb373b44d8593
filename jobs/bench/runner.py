"""`python -m jobs.bench [CONFIG.yaml] [key=value ...]`: compare decoding methods on the same prompts.

One process, no Ray: the model is loaded once and every setting of the grid (`bench.methods` x
`bench.block_complexities`, and for esp x `bench.num_masks` x `bench.trees`, each at every
`bench.batch_sizes`) runs the same prompts, category by category, after `bench.warmup` untimed prompts.
`ar` always runs (it is the denominator of every speedup and the reference of the exact-match rate).

Inputs: any `data.*` source the job runner reads. A multi-turn row (Spec-Bench's `turns`) runs every turn, as a
job does: each later turn's prompt holds the setting's own earlier answers (`data.turn_history`), the same for
every setting whenever outputs are exact (jobs/bench/turns.py).

Writes to `output.dir` (default outputs/bench-<model>-<hash8>): bench.json and bench.csv (one record per
method, setting, batch size and category, plus category "all"), cost_curve.json/.csv, report.md and the
PNG plots it links. This module runs the settings (jobs/bench/settings.py lists them); jobs/bench/results.py
turns the runs into those records and tables, jobs/bench/report.py writes report.md and the plots.

Exit codes: 0 done, 2 bad command line, config or input.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import logging
import platform
import re
import sys
import time

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from esp_worker.config import NOT_LOSSLESS
from omegaconf import DictConfig, OmegaConf

from ..report.plots import fmt
from .profiling import matches, profile_run
from .report import bench_plots, write_bench_report
from .results import Baselines, BenchContext, SettingRun, against_fastest_fixed, summarise, write_table
from .retention import add_retention
from .settings import ALL, HF_METHODS, Prompt, Setting, grid
from .turns import Conversation, all_turns

log = logging.getLogger("esp_batch.bench")
AUTOTUNE = "max-autotune-no-cudagraphs"  # the autotune option's engine.compile_mode (the engine captures the graphs)


def load_prompts(cfg: DictConfig, tokenizer: Any) -> tuple[list[Prompt], int]:
    """Prompts (token ids) from `data.*`, in input order, and the number of rows skipped for errors."""
    from ..io.sources import open_source
    from ..run.prompts import PromptBuilder
    from ..run.rows import RowNormalizer

    d = cfg.data
    source = open_source(d.path, d.format, d.split, d.limit, cfg.get("storage"))
    norm = RowNormalizer(d.id_column, d.prompt_column, d.params_column, d.category_column, [])
    builder = PromptBuilder(tokenizer, d.chat_template, OmegaConf.to_container(d.chat_template_kwargs))
    prompts, skipped, position = [], 0, 0
    for batch in source.batches(256):
        for raw in batch:
            row = norm(position, raw)
            position += 1
            if row is None or row.error is not None:
                skipped += row is not None
                continue
            if row.kind == "prompt":
                ids = builder.prompt_ids(row.input)
            elif row.kind == "messages":
                ids = builder.chat_ids(list(row.input))
            else:  # turns: the first one, the later ones after their answers (all_turns)
                conversation = Conversation(list(row.input), builder, d.turn_history)
                prompts.append(Prompt(row.id, row.category or ALL, conversation.ids([]), dict(row.params), conversation))
                continue
            prompts.append(Prompt(row.id, row.category or ALL, ids, dict(row.params)))
    return prompts, skipped


def _requests(prompts: list[Prompt], generation: dict[str, Any]) -> list[Any]:
    from esp_worker import GenerationParams, Request

    return [Request(id=p.id, prompt_ids=p.ids, params=GenerationParams(**{**generation, **p.params})) for p in prompts]


def sample_prompts(prompts: list[Prompt], generation: dict[str, Any], engine_seed: int) -> list[Prompt]:
    """Each prompt whose generation.n (or params n) asks for several samples as one prompt per sample, side by side,
    with the ids and seeds a job gives them (`esp_worker.sample_requests`): every setting decodes the same samples
    and counts their tokens, and hf generate runs them as the copies `num_return_sequences` would make."""
    from esp_worker import GenerationParams, Request, sample_requests

    out = []
    for p in prompts:
        params = GenerationParams(**{**generation, **p.params})
        if params.n == 1:  # (generation.n, or the row's own n = 1 in its params)
            out.append(p)
            continue
        for r in sample_requests(Request(p.id, prompt_ids=p.ids, params=params), engine_seed):
            out.append(dataclasses.replace(p, id=r.id, params={**p.params, "n": 1, "seed": r.params.seed,
                                                               "prompt_logprobs": r.params.prompt_logprobs}))
    return out


def mix_lengths(prompts: list[Prompt], lo_hi: Sequence[int]) -> None:
    """Give each prompt its own max_new_tokens in [lo, hi] (deterministic per id), unless its row set one.

    Example: [16, 128] -> ids "a", "b" get e.g. 93 and 27, every run and every method alike."""
    import zlib

    lo, hi = int(lo_hi[0]), int(lo_hi[1])
    for p in prompts:
        p.params.setdefault("max_new_tokens", lo + zlib.crc32(p.id.encode()) % (hi - lo + 1))


@dataclass
class EngineShare:
    """What the bench's engines share: the cost curve it measured, and per batch size (and compiled step or not) the
    CUDA-graph runner of the first engine with graphs (later engines there replay its graphs: a job's engine lives
    for the whole job and captures each class once, so a bench that built a new engine per run would time captures
    and the eager first pass of each class in every run)."""

    curve: Any = None
    # (batch, compiled step, attention kernel, compile mode of a compiled step) -> GraphRunner
    graphs: dict[tuple[int, bool, str, str], Any] = field(default_factory=dict)


def run_setting(loaded: Any, base: Any, s: Setting, batch: int, prompts: list[Prompt], generation: dict[str, Any],
                warmup: int, share: Optional[EngineShare] = None) -> SettingRun:
    """Generate every prompt with one setting; categories run one after another and are timed apart."""
    from esp_worker import Engine

    if s.logprobs:
        generation = {**generation, "logprobs": True}
    if s.method in HF_METHODS:
        from .hf_baseline import run_hf

        return run_hf(loaded, batch, prompts, generation, warmup, compiled=s.method == "hf_compiled")

    cfg = dataclasses.replace(
        base, method=s.method, num_masks=max(s.num_masks, 1), tree=s.tree or base.tree, max_batch_size=batch,
        expansion=s.expansion,
        block_complexity=s.block_complexity if s.block_complexity == "auto" else max(s.block_complexity, 2),
        # hybrid takes heads only from its own setting (hybrid+heads), so that its label tells
        heads_path=s.heads_path or (base.heads_path if s.method == "cp_heads" else ""),
        cuda_graphs=False if s.eager else base.cuda_graphs,
        cuda_graphs_compile=base.cuda_graphs_compile or s.compiled_graphs,
        compile_mode=AUTOTUNE if s.autotune else base.compile_mode,
        cuda_graphs_run_ahead=False if s.no_run_ahead else True if s.run_ahead else base.cuda_graphs_run_ahead,
        cuda_graphs_probe=base.cuda_graphs_probe and not s.host_probe,
        admission="eager" if s.eager_admission else base.admission,
        prefix_cache_tokens=0 if s.no_prefix_cache else base.prefix_cache_tokens,
        attention_backend=s.attention or base.attention_backend,
        dmtd_tau=s.dmtd_tau, dmtd_path=s.dmtd_path if s.method == "dmtd_verified" else "",
    )
    share = share if share is not None else EngineShare()
    # graphs hold the kernels they captured
    key = (batch, cfg.cuda_graphs_compile, cfg.attention_backend, cfg.compile_mode if cfg.cuda_graphs_compile else "")
    reused = share.graphs.get(key)
    # auto sizing uses the curve measured here
    engine = Engine(loaded, cfg, cost_curve=share.curve, graphs=reused)
    if engine.graphs is not None:
        share.graphs.setdefault(key, engine.graphs)
    if engine.graphs is not None and engine.graphs.capture and reused is None:
        # CUDA graphs, a new runner: a class is captured at its second pass, so the warm-up runs a full batch (its
        # shapes are the timed run's); a class first seen in a timed run is captured there, in its compile_s
        warmup = max(warmup, batch)
    if warmup:
        engine.generate(_requests(prompts[:warmup], generation))
    engine.stats.reset_timing()
    outputs, seconds = {}, {}
    for cat in dict.fromkeys(p.category for p in prompts):
        ps = [p for p in prompts if p.category == cat]
        t0 = time.perf_counter()
        outs = all_turns(ps, lambda turn: {o.id: o for o in engine.generate(_requests(turn, generation))})
        seconds[cat] = time.perf_counter() - t0
        outputs.update(outs)
    # compile time (engine.compile, engine.cuda_graphs' captures), warm-up included: a job pays
    # it once per actor
    graphs = {} if engine.graphs is None else {"graphs": engine.graphs.summary()}
    return SettingRun(outputs, seconds, {**engine.stats.timing(), "compile_s": engine.compile_s, **graphs})


def _graph_timer(loaded: Any, base: Any, b: DictConfig) -> Any:
    """An engine whose CUDA graphs time the cost curve's passes (engine.cuda_graphs on, on CUDA: the curve is then
    that of replayed passes, as the settings run them), or None (the eager forward is timed)."""
    from esp_worker import Engine

    slots = max(base.cuda_graph_max_len, max(b.cost_cache_lens) + b.cost_max_block)
    cfg = dataclasses.replace(base, method="ar", block_complexity=1, max_batch_size=max(b.batch_sizes),
                              cuda_graph_max_len=slots)
    engine = Engine(loaded, cfg) if base.cuda_graphs is True or (base.cuda_graphs == "auto" and
                                                                 loaded.device.type == "cuda") else None
    return engine if engine is not None and engine.graphs is not None and engine.graphs.capture else None


def rotated(items: list, r: int) -> list:
    """items rotated left by r (mod their count): [a, b, c], 1 -> [b, c, a]."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


@contextlib.contextmanager
def quiet_heap() -> Iterator[None]:
    """Collect the garbage of the previous setting (its engine, cache and outputs) before a run, and freeze
    what is alive (the model, the bench's records) out of the collector's traversals during it: otherwise
    a setting pays, in its timed run, for freeing its predecessor and for walking every object the bench
    holds, and the settings late in a round-robin round run slower than the same code early in it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class DmtdModels:
    """The model a setting runs: the bench's, or for `dmtd` with a DMTD model directory that model (loaded once,
    with the bench's model.* settings)."""

    def __init__(self, loaded: Any, model_cfg: Any):
        self.loaded, self.model_cfg, self.models = loaded, model_cfg, {}

    def __call__(self, s: Setting) -> Any:
        if s.method != "dmtd" or not s.dmtd_path:
            return self.loaded
        if s.dmtd_path not in self.models:
            from esp_worker import load_model

            self.models[s.dmtd_path] = load_model(dataclasses.replace(self.model_cfg, name_or_path=s.dmtd_path))
        return self.models[s.dmtd_path]


def default_output_dir(cfg: DictConfig) -> str:
    from ..config import config_hash

    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.model.name_or_path.rstrip("/")).name)
    return str(Path("outputs") / f"bench-{model}-{config_hash(cfg)[:8]}")


def run_bench(cfg: DictConfig, command: str = "python -m jobs.bench") -> Path:
    """Run the whole benchmark; returns the output directory."""
    import torch

    from esp_worker import load_model
    from esp_worker.auto.cost_model import measure_cost_curve, powers_of_two
    from esp_worker.model.runner import ModelRunner

    from ..config import engine_config, generation_defaults, model_config

    from .settings import check_dmtd_paths

    b = cfg.bench
    check_dmtd_paths(b)
    if b.torch_threads:
        torch.set_num_threads(b.torch_threads)
    out = Path(cfg.output.dir or default_output_dir(cfg))
    settings = grid(b)
    for spec in b.profile:  # before the model loads: a name that matches nothing fails fast
        if not any(matches(spec, s.method, s.block_complexity, s.heads_path) for s in settings):
            raise ValueError(f"bench.profile: {spec!r} names none of this bench's settings "
                             f"({', '.join(s.label for s in settings)})")
    loaded = load_model(model_config(cfg))
    settings = grid(b, accelerator=loaded.device.type != "cpu")  # hf generate compiled: auto on an accelerator
    prompts, skipped = load_prompts(cfg, loaded.tokenizer)
    if not prompts:
        raise ValueError(f"no usable prompt in {cfg.data.path or 'the bundled prompts'}")
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused bench leaves no empty directory
    if b.mixed_max_new_tokens:
        mix_lengths(prompts, b.mixed_max_new_tokens)
    g = cfg.generation
    generation = generation_defaults(cfg)
    base = engine_config(cfg)
    prompts = sample_prompts(prompts, generation, base.seed)  # (after mix_lengths: a row's samples share its length)
    largest = max(collections.Counter(p.category for p in prompts).values())
    for batch in (n for n in b.batch_sizes if n > largest):
        log.warning("batch %d: categories run one at a time and the largest has %d prompts, so its passes hold at "
                    "most %d rows (give each category >= %d prompts to fill it)", batch, largest, largest, batch)
    curve = None
    if b.cost_curve:
        log.info("measuring the cost curve")
        timer = _graph_timer(loaded, base, b)
        curve = measure_cost_curve(ModelRunner(loaded) if timer is None else timer.runner, list(b.batch_sizes),
                                   list(b.cost_cache_lens), powers_of_two(b.cost_max_block), repeats=b.cost_repeats,
                                   passes=None if timer is None else timer.graphs.pass_timer)
        del timer
        (out / "cost_curve.json").write_text(json.dumps(curve.to_dict(), indent=1))
        write_table(out / "cost_curve.csv", curve.records())
    dmtd_models = DmtdModels(loaded, model_config(cfg))
    share = EngineShare(curve)
    ctx = BenchContext(prompts, curve, g.max_new_tokens, b.tolerance)
    records = []
    for batch in b.batch_sizes:
        # repeats run round-robin over the settings (drift hits every setting alike); per category the
        # median time is kept. Round r starts r settings further on, so no setting always runs right after
        # the same one or at the same place in a round (a position's bias spreads over every setting)
        runs: dict[Setting, list[SettingRun]] = {s: [] for s in settings}
        for r in range(-b.warmup_rounds, b.repeats):  # r < 0: an untimed warm-up round
            for s in rotated(settings, r):
                t0 = time.perf_counter()
                with quiet_heap():
                    run = run_setting(dmtd_models(s), base, s, batch, prompts, generation, b.warmup, share)
                if r < 0:
                    log.info("%-24s batch %d warm-up round (%.1fs)", s.label, batch, time.perf_counter() - t0)
                    continue
                # only the first repeat's outputs are read (SettingRun.median): later ones would only grow the heap
                runs[s].append(run if r == 0 else dataclasses.replace(run, outputs={}))
                log.info("%-24s batch %d repeat %d/%d (%.1fs)", s.label, batch, r + 1, b.repeats, time.perf_counter() - t0)
        hf = [s for s in settings if s.method == "hf"]
        secs = {s: [r.seconds for r in runs[s]] for s in settings}
        baselines = Baselines(SettingRun.median(runs[settings[0]]), SettingRun.median(runs[hf[0]]) if hf else None,
                              secs[settings[0]], secs[hf[0]] if hf else [])
        batch_records = []
        for s in settings:
            run = SettingRun.median(runs[s])
            recs = summarise(s, batch, run, secs[s], baselines, ctx)
            if s.method in NOT_LOSSLESS:  # untimed: against ar's greedy output, under the bench's model
                add_retention(recs, loaded, prompts, run.outputs, baselines.ar.outputs)
            batch_records += recs
            top = recs[-1]
            log.info("%-24s batch %d: tau %s, %s tok/s, speedup %s (vs hf %s), exact %s", s.label, batch,
                     fmt(top["tau"]), fmt(top["tokens_per_s"], 1), fmt(top["speedup_vs_ar"]),
                     fmt(top["speedup_vs_hf"]), fmt(top["exact_match_rate"]))
        against_fastest_fixed(batch_records, {s.label: secs[s] for s in settings})
        records += batch_records
        # written after every batch size, so a run cut short keeps the batch sizes it finished
        (out / "bench.json").write_text(json.dumps(records, indent=1))
        write_table(out / "bench.csv", records)
        # profiles after the records (a run cut short while profiling keeps them), over one batch of prompts:
        # a trace of every prompt's passes takes minutes to tabulate and adds nothing per pass
        for s in settings:
            if any(matches(spec, s.method, s.block_complexity, s.heads_path) for spec in b.profile):
                with quiet_heap():
                    path = profile_run(lambda: run_setting(dmtd_models(s), base, s, batch, prompts[:batch], generation,
                                                           b.warmup, share), s.label, batch, out, loaded.device.type)
                log.info("%-24s batch %d: profile in %s", s.label, batch, path)
        for key in [k for k in share.graphs if k[0] == batch]:  # their KV slabs and graph memory, before the next
            del share.graphs[key]
    plots = bench_plots(out, records, curve, b.tolerance)
    env = dict(device=str(loaded.device), torch=torch.__version__, torch_threads=torch.get_num_threads(),
               machine=f"{platform.machine()} {platform.processor() or platform.system()}")
    write_bench_report(out, cfg, command, records, curve, plots, env, skipped)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return out


DESCRIPTION = "Benchmark ar/pld/stand/lade/esp on the same prompts: tau, tokens/s, speedup, exact match."
EPILOG = (
    "examples:\n  python -m jobs.bench data.path=prompts.jsonl bench.methods=[ar,pld,esp] "
    "bench.block_complexities=[30]\n\n"
    "only the Hugging Face comparison rows (hf generate, ar, esp BC 30), quickly:\n"
    "  batch 1:  python -m jobs.bench MODEL DATA bench.methods=[ar,esp] bench.block_complexities=[30] "
    "bench.num_masks=[1] bench.trees=[static] bench.cost_curve=false bench.repeats=3 data.limit=12\n"
    "  batch 16, mixed lengths: the same with bench.batch_sizes=[16] bench.mixed_max_new_tokens=[16,128]\n"
    "  (MODEL = model.name_or_path=..., DATA = data.path=...; bench.hf_baseline=false drops the hf row)\n\n"
    "sections: model.* data.* engine.* generation.* output.* bench.*"
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..config import ConfigError, parse_command_line, to_yaml
    from ..io.sources import SourceError
    from .config import load_bench_config

    ns = parse_command_line(argv, "python -m jobs.bench", DESCRIPTION, EPILOG)
    logging.basicConfig(level=logging.INFO, format="esp-bench %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load_bench_config(ns.config, ns.overrides)
        if ns.print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0
        out = run_bench(cfg, " ".join(["python -m jobs.bench", *(argv if argv is not None else sys.argv[1:])]))
    except (ConfigError, SourceError, ValueError) as exc:
        print(f"esp-bench: error: {exc}", file=sys.stderr)
        return 2
    print((out / "report.md").read_text())
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
