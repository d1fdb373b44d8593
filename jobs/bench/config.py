"""Benchmark configuration: the job config (model.*, data.*, engine.*, generation.*, output.*) plus `bench.*`.

`engine.*` gives the settings every run shares (max_batch_size is replaced by each `bench.batch_sizes`
entry); the grid sets method, block_complexity, num_masks and tree per run.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional, Union

from omegaconf import DictConfig

from esp_worker.config import ATTENTION_BACKENDS, EXPANSIONS, METHODS, TREES

from ..config import ConfigError, JobConfig, load_config

# what may follow METHOD:BC in bench.settings, each a Setting field of the same name (settings.py)
# (and attention_NAME for each engine.attention_backend but torch's own)
ATTENTION_OPTIONS = tuple(f"attention_{name}" for name in ATTENTION_BACKENDS if name != "torch")
OPTIONS = ("eager", "compiled_graphs", "autotune", "run_ahead", "no_run_ahead", "host_probe", "eager_admission",
           "logprobs", "no_prefix_cache", *ATTENTION_OPTIONS)

HYBRID_HEADS = "hybrid+heads"  # bench.settings: hybrid with each of bench.heads_paths as a proposer
AUTO_METHODS = ("esp", "pld", "hybrid", "cp_heads")  # block_complexity=auto needs the drafter's own estimate
DMTD_METHODS = ("dmtd", "dmtd_verified")  # bench.settings "dmtd:TAU" / "dmtd_verified:TAU" (bench.dmtd_paths)


def options_of(opt: str) -> list[str]:
    """The options of a bench.settings entry's third part: "compiled_graphs+run_ahead" -> both; "" -> none."""
    return [o for o in opt.split("+") if o] if opt else []


@dataclass
class BenchSection:
    methods: list[str] = field(default_factory=lambda: ["ar", "pld", "stand", "lade", "esp", "hybrid"])
    # numbers, or "auto" (esp, pld, hybrid, cp_heads: the engine picks the size per pass)
    block_complexities: list[Union[int, str]] = field(default_factory=lambda: [10, 30, 60])
    num_masks: list[int] = field(default_factory=lambda: [1, 2])  # esp only
    trees: list[str] = field(default_factory=lambda: ["static", "dynamic"])  # esp only
    # esp dynamic trees with k >= 2: top1 (paper, Appendix D) and/or frontier (literal Algorithm 1)
    expansions: list[str] = field(default_factory=lambda: ["top1", "frontier"])
    heads_paths: list[str] = field(default_factory=list)  # cp_heads: one setting per trained heads directory
    # dmtd / dmtd_verified (bench.settings dmtd:TAU, dmtd_verified:TAU): DMTD model directories and trained copies
    # (esp-batch train-dmtd); dmtd runs each model trained with that tau, dmtd_verified each copy at that tau.
    # Their records carry PLT, lossless and the retention against ar (the bench's model's greedy output)
    dmtd_paths: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # engine.max_batch_size per run
    warmup: int = 2  # prompts generated (untimed) by each setting before its timed run
    repeats: int = 1  # timed runs per setting, round-robin over the settings; the median time is reported
    # untimed rounds (every setting, every prompt) before the timed ones, per batch size: on a GPU the first
    # round of a run's shapes cost 2-5x the next ones on an H200 (the first settings most), which one warm-up
    # prompt does not cover
    warmup_rounds: int = 0
    torch_threads: int = 1  # pinned for the whole bench (0 = leave torch's default)
    cost_curve: bool = True  # measure this hardware's pass cost and predict each method's speedup
    cost_cache_lens: list[int] = field(default_factory=lambda: [64, 512])
    cost_max_block: int = 128  # blocks Q = 1, 2, 4, ... up to this
    cost_repeats: int = 5
    tolerance: float = 0.25  # |measured / predicted speedup - 1| allowed before the report flags a setting
    hf_baseline: bool = True  # also run Hugging Face model.generate on the same prompts (row "hf generate")
    # also run generate with a static cache and its forward compiled (row "hf generate compiled"): auto = on an
    # accelerator (on a CPU its compiles take minutes)
    hf_compiled: Union[bool, str] = "auto"
    # [lo, hi]: each prompt asks for its own max_new_tokens in [lo, hi] (deterministic per id); [] = generation.*
    mixed_max_new_tokens: list[int] = field(default_factory=list)
    # explicit settings instead of the grid, "method:BC" (BC an integer >= 2 or auto; esp takes the first of
    # num_masks, trees and expansions; cp_heads one per heads path), e.g. [pld:30,esp:auto,hybrid:auto]; ar
    # (and hf) still run first. Fewer settings per round-robin round pair each with ar more closely in time.
    # "method:BC:eager" (and "ar:1:eager") runs that setting with engine.cuda_graphs=false (the eager engine
    # beside the default's);
    # "method:BC:compiled_graphs" (and "ar:1:compiled_graphs") with engine.cuda_graphs_compile=true;
    # "ar:1:run_ahead" with engine.cuda_graphs_run_ahead=true and "ar:1:no_run_ahead" (or "esp:30:no_run_ahead",
    # "hybrid:auto:no_run_ahead") with false (the default, auto, runs passes ahead wherever they are replayed); "METHOD:BC:attention_math" (and
    # _cudnn, _efficient) with that engine.attention_backend; "esp:BC:host_probe" (and hybrid) with
    # engine.cuda_graphs_probe=false (the drafter's probe on the host after each replay); "METHOD:BC:eager_admission" (and
    # "ar:1:eager_admission") with engine.admission=eager; "METHOD:BC:logprobs" (and "ar:1:logprobs") with every request
    # asking for its tokens' log-probabilities (generation.logprobs); "METHOD:BC:no_prefix_cache" with
    # engine.prefix_cache_tokens=0 (every prompt prefilled whole); options join with "+" ("ar:1:compiled_graphs+run_ahead").
    settings: list[str] = field(default_factory=list)
    # settings to run once more under torch.profiler after the timed runs (over one batch of prompts),
    # "method:BC" as in `settings` (or ar, hf): op tables per setting and batch size in
    # profile-<label>-b<batch>.txt (jobs/bench/profiling.py)
    profile: list[str] = field(default_factory=list)


@dataclass
class BenchConfig(JobConfig):
    bench: BenchSection = field(default_factory=BenchSection)


def load_bench_config(path: Optional[str] = None, overrides: typing.Sequence[str] = ()) -> DictConfig:
    """Defaults <- YAML file <- `key=value` overrides, validated like a job config. Raises ConfigError."""
    cfg = load_config(path, overrides, schema=BenchConfig)
    validate_bench(cfg)
    return cfg


def validate_bench(cfg: DictConfig) -> None:
    b = cfg.bench

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(len(b.methods) > 0, "bench.methods must name at least one method")
    for m in b.methods:
        need(m in METHODS, f"bench.methods: {m!r} is unknown; choose from {', '.join(METHODS)}")
        need(m not in DMTD_METHODS, f"bench.methods: {m} runs from bench.settings=[{m}:TAU] (and bench.dmtd_paths)")
    need("cp_heads" not in b.methods or len(b.heads_paths) > 0, "bench.methods has cp_heads: give bench.heads_paths=[DIR,...]")
    need(all(t in TREES for t in b.trees), f"bench.trees={list(b.trees)} must hold static and/or dynamic")
    need(len(b.expansions) > 0 and all(e in EXPANSIONS for e in b.expansions),
         f"bench.expansions={list(b.expansions)} must hold top1 and/or frontier")
    need(
        all(bc == "auto" or (isinstance(bc, int) and bc >= 2) for bc in b.block_complexities),
        f"bench.block_complexities={list(b.block_complexities)} must be integers >= 2 or auto",
    )
    need(all(1 <= k <= 8 for k in b.num_masks), "bench.num_masks must be between 1 and 8")
    need(len(b.batch_sizes) > 0 and all(x >= 1 for x in b.batch_sizes), "bench.batch_sizes must be >= 1")
    need(b.warmup >= 0, "bench.warmup must be >= 0")
    need(b.repeats >= 1, "bench.repeats must be >= 1")
    need(b.warmup_rounds >= 0, "bench.warmup_rounds must be >= 0")
    need(b.torch_threads >= 0, "bench.torch_threads must be >= 0")
    need(b.cost_max_block >= 1 and b.cost_repeats >= 1, "bench.cost_max_block and bench.cost_repeats must be >= 1")
    need(len(b.cost_cache_lens) > 0 and all(c >= 1 for c in b.cost_cache_lens), "bench.cost_cache_lens must be >= 1")
    need(b.tolerance > 0, "bench.tolerance must be > 0")
    need(b.hf_compiled in ("auto", True, False), f"bench.hf_compiled={b.hf_compiled!r} must be auto, true or false")
    for spec in b.settings:
        method, _, rest = str(spec).partition(":")
        bc, _, opt = rest.partition(":")
        if method in DMTD_METHODS:
            need(bc.isdigit() and int(bc) >= (1 if method == "dmtd" else 2) and opt == "",
                 f"bench.settings: {spec!r} must be {method}:TAU with TAU an integer >= {1 if method == 'dmtd' else 2}")
            continue
        opts = options_of(opt)
        need(all(o in OPTIONS for o in opts), f"bench.settings: {spec!r}: the options after METHOD:BC are "
             ":eager, :compiled_graphs, :autotune (with compiled_graphs), :run_ahead or :no_run_ahead, "
             ":host_probe (esp, hybrid), :eager_admission, :logprobs, :no_prefix_cache and :attention_cudnn, :attention_efficient, :attention_math or :attention_flex (with "
             "compiled_graphs) (engine.attention_backend), or several joined by +")
        need(sum(o.startswith("attention_") for o in opts) <= 1,
             f"bench.settings: {spec!r}: one attention_ option at most")
        need(not {"run_ahead", "no_run_ahead"} <= set(opts), f"bench.settings: {spec!r}: run_ahead or no_run_ahead")
        need("autotune" not in opts or "compiled_graphs" in opts,
             f"bench.settings: {spec!r}: autotune tunes the compiled graphs' kernels: compiled_graphs+autotune")
        need("attention_flex" not in opts or "compiled_graphs" in opts,
             f"bench.settings: {spec!r}: FlexAttention runs in the compiled graphs: compiled_graphs+attention_flex")
        need(not ("eager" in opts and ({"compiled_graphs", "run_ahead", "no_run_ahead", "host_probe"} & set(opts))),
             f"bench.settings: {spec!r}: compiled_graphs, run_ahead and host_probe apply to replayed passes, not :eager")
        need("host_probe" not in opts or method in ("esp", "hybrid"),
             f"bench.settings: {spec!r}: host_probe moves ESP's and the hybrid's probe out of the replayed pass: "
             "esp:BC:host_probe, hybrid:BC:host_probe")
        if method == "ar":  # ar itself always runs first; an entry can only add it under an option
            need(bc == "1" and len(opts) > 0, f"bench.settings: {spec!r}: ar always runs; the ar entries are "
                 "ar:1:eager, ar:1:compiled_graphs, ar:1:no_run_ahead (or, e.g., "
                 "ar:1:compiled_graphs+run_ahead)")
            continue
        heads = method == HYBRID_HEADS
        method = "hybrid" if heads else method
        need(method in METHODS and method != "ar" and bc != "" and (bc == "auto" or (bc.isdigit() and int(bc) >= 2)),
             f"bench.settings: {spec!r} must be METHOD:BC with METHOD one of {', '.join(m for m in METHODS if m != 'ar')}, "
             f"{HYBRID_HEADS} "
             "and BC an integer >= 2 or auto (ar always runs)")
        need(bc != "auto" or method in AUTO_METHODS, f"bench.settings: {spec!r}: auto works with {', '.join(AUTO_METHODS)} only")
        need((method != "cp_heads" and not heads) or len(b.heads_paths) > 0,
             f"bench.settings has {spec!r}: give bench.heads_paths=[DIR,...]")
        need(method != "esp" or not bc.isdigit() or int(bc) >= 2 * (b.num_masks[0] + 1),
             f"bench.settings: {spec!r} leaves no draft node with num_masks={b.num_masks[0]}; use BC >= {2 * (b.num_masks[0] + 1)}")
    for spec in b.profile:
        method, _, bc = str(spec).partition(":")
        need((method in ("ar", "hf") and bc == "") or (method in (*METHODS, HYBRID_HEADS) and method != "ar"
                                                        and (bc == "auto" or bc.isdigit())),
             f"bench.profile: {spec!r} must be ar, hf or METHOD:BC naming one of the bench's settings")
    m = list(b.mixed_max_new_tokens)
    need(not m or (len(m) == 2 and 1 <= m[0] <= m[1]), "bench.mixed_max_new_tokens must be [] or [lo, hi] with 1 <= lo <= hi")

