"""Job configuration: structured (dataclass) OmegaConf configs, merged from YAML + dotlist overrides.

Every key is typed; an unknown or mistyped key raises ConfigError with a one-line message naming it.
`model.*` is the engine's ModelConfig and `engine.*` mirrors EngineConfig (its base seed comes from
`generation.seed`), so new engine settings appear here without edits; `generation.*` takes its defaults from
the engine's GenerationParams. These dataclasses are the one source of the defaults: configs/default.yaml is
written from them (`python -m jobs.config --write-default`) and a test keeps the two equal.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from esp_worker import EngineConfig, GenerationParams, ModelConfig

from .io.storage import StorageConfig, looks_local, normalize
from .run.cluster import ADDRESS_FORMS, well_formed_address

FORMATS = ("auto", "parquet", "jsonl", "json", "csv", "hf_disk", "hf_hub")
CHAT_TEMPLATE_MODES = ("auto", "always", "never")
PARQUET_CODECS = ("zstd", "snappy", "gzip", "lz4", "brotli", "none")  # output.compression (pyarrow's names)
TURN_HISTORY_MODES = ("stripped", "raw")
# Sections whose values change the generated rows: they make the config hash. ray/output/fault do not.
HASHED_SECTIONS = ("model", "data", "engine", "generation")


class ConfigError(ValueError):
    """A bad config: the message is one line and names the key."""


def _engine_section() -> type:
    """EngineConfig's fields minus `seed` (set from generation.seed), as a dataclass OmegaConf can type."""
    hints = typing.get_type_hints(EngineConfig)
    specs = []
    for f in dataclasses.fields(EngineConfig):
        if f.name == "seed":
            continue
        if f.default_factory is not dataclasses.MISSING:
            spec = field(default_factory=f.default_factory)
        else:
            spec = field(default=f.default)
        specs.append((f.name, hints[f.name], spec))
    return dataclasses.make_dataclass("EngineSection", specs)


EngineSection = _engine_section()


@dataclass
class DataConfig:
    path: str = ""  # local path or URI (s3://, gs://, ...); "" = the bundled prompt file jobs/data/prompts.jsonl
    format: str = "auto"  # auto (from the extension / directory) | parquet | jsonl | json | csv | hf_disk | hf_hub
    split: str = "train"  # split of a hub dataset or of a saved DatasetDict
    id_column: str = "id"  # when absent from the data, ids are derived from position + input
    prompt_column: str = ""  # "" = per row, the first non-null of prompt, messages, turns
    params_column: str = "params"  # optional per-row dict overriding generation.* for that row
    category_column: str = "category"  # optional; carried to the output and used for tau per category
    carry_columns: list[str] = field(default_factory=list)  # extra input columns copied to the output
    chat_template: str = "auto"  # auto (if the tokenizer has one) | always | never
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    limit: Optional[int] = None  # first N input rows only
    # multi-turn (turns) rows: each answer as the next turn's history, stripped of leading and trailing whitespace
    # (as Spec-Bench and FastChat feed it back; Llama 3's chat template trims it too) | raw (exactly as generated)
    turn_history: str = "stripped"
    # rows per shard = per output part = the unit of retry and resume (not of batching: an actor's engine
    # batches rows across every shard in flight to it)
    shard_size: int = 2048


@dataclass
class GenerationConfig:
    """Each request's defaults (a row's params column overrides them per row); the engine's GenerationParams
    gives the default values, so a job and the Python API generate alike."""

    max_new_tokens: int = GenerationParams.max_new_tokens  # new tokens per request (per turn of a multi-turn row)
    temperature: float = GenerationParams.temperature  # 0 = greedy
    top_p: float = GenerationParams.top_p  # nucleus sampling, in (0, 1]; 1 = off
    top_k: int = GenerationParams.top_k  # 0 = off
    seed: int = EngineConfig.seed  # base seed; each request derives its own from it and the row id
    stop_strings: list[str] = field(default_factory=list)  # stop after any of these (the string is kept)
    ignore_eos: bool = GenerationParams.ignore_eos  # true: generate max_new_tokens even past EOS
    logprobs: bool = GenerationParams.logprobs  # true: each generated token's log-probability (token_logprobs)
    top_logprobs: int = GenerationParams.top_logprobs  # 1 .. 20: also the likeliest tokens at each position
    prompt_logprobs: bool = GenerationParams.prompt_logprobs  # true: each prompt token's too (prompt_logprobs)
    n: int = GenerationParams.n  # samples per row (> 1 needs temperature > 0): every one in the row's `samples`


@dataclass
class OutputConfig:
    dir: str = ""  # local path or URI (s3://, gs://, ...); "" = outputs/<model>-<method>-<config hash>
    overwrite: bool = False  # true: delete this job's files in dir and start over
    compression: str = "zstd"  # Parquet codec of the parts: zstd | snappy | gzip | lz4 | brotli | none
    progress_interval_s: float = 10.0  # seconds between progress lines when stderr is not a terminal
    # hive partitioning of the parts by output columns, e.g. [category]: <dir>/category=code/part-000000.parquet
    partition_by: list[str] = field(default_factory=list)
    # a rerun runs again the rows whose error came from running them (an engine error, such as a batch out of
    # memory; a row that took down its actor each time), keeping the other rows of their parts
    retry_errors: bool = False


@dataclass
class RayConfig:
    address: str = ""  # "" = RAY_ADDRESS, else the running local cluster, else start one | "local" | host:port
    num_actors: int = 2  # engine actors, each with its own copy of the model
    num_cpus_per_actor: float = 1.0  # Ray CPUs reserved per actor
    # Ray GPUs reserved per actor: auto = 1 when the cluster has GPUs when the job starts, else 0; or a number
    num_gpus_per_actor: Any = "auto"
    torch_threads: int = 0  # per actor; 0 = max(1, floor(num_cpus_per_actor))
    num_cpus: Optional[int] = None  # CPUs of a local Ray instance this job starts (None = all cores)
    # restarts of a dead actor (a lost node's actor restarts on another node); a death charged to a row that kills
    # its actor (it then gets an error) does not count
    max_restarts: int = 3
    # shards handed to an actor at once; their rows share one engine batch. 0 = enough to keep the batch
    # full across shard ends: ceil(1.5 x engine.max_batch_size / data.shard_size) + 1
    shards_in_flight_per_actor: int = 0
    # start: fail (exit 1) when the cluster cannot place the actors in this time; mid-job: an actor lost for
    # this long (its node gone, no room elsewhere) is given up, its shards go to the others
    placement_timeout_s: float = 300.0
    head_timeout_s: float = 10.0  # stop (exit 1, run on record) when the cluster's head has not answered this long
    # an actor holding rows whose engine has finished no pass (prefill or decode) this long has stalled (a hung
    # device or kernel): it is killed for Ray to restart, and its shards run again; 0 = never
    stall_timeout_s: float = 600.0


@dataclass
class FaultConfig:
    """Fault injection for tests: the actor running shard `kill_shard` calls os._exit after its first
    finished request, on each of the first `kill_attempts` attempts; the actor that gets shard `hold_shard`
    writes `<output.dir>/_faults/hold-N.json` (its node id, IP and pid) and waits until `_faults/release`
    exists (a test removes its node, or the head, at a known point); the driver calls os._exit right after
    writing its `driver_exit_after_parts`-th part (a driver killed mid-job, at a known point); every decode pass
    whose batch holds row `fail_row` raises (an engine error that one row causes; "*": every pass, a broken engine);
    the actor's process exits in every decode pass whose batch holds row `kill_row` (a row that crashes the engine),
    and the engine hangs in every decode pass whose batch holds row `hang_row` (a hung kernel or device);
    in the first `lose_device` actor processes every decode pass raises and the device check after it fails, as
    after a CUDA error that stays with the process."""

    kill_shard: int = -1  # -1 = off
    kill_attempts: int = 1  # attempts of kill_shard that die (its retries after that run normally)
    hold_shard: int = -1  # the actor holding this shard waits for _faults/release before running it; -1 = off
    driver_exit_after_parts: int = -1  # the driver exits (code 1, no summary) after writing this many parts; -1 = off
    fail_row: str = ""  # the engine raises in each decode pass holding this row id ('*': every pass); "" = off
    kill_row: str = ""  # the actor's process exits in each decode pass holding this row id; "" = off
    hang_row: str = ""  # the engine hangs in each decode pass holding this row id; "" = off
    lose_device: int = 0  # actor processes (the first ones started) whose device is lost mid-job; 0 = off


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineSection = field(default_factory=EngineSection)  # type: ignore[valid-type]
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)



# keys a release removed -> what to do instead (a config that still sets one gets this, not "unknown")
REMOVED_KEYS = {
    "engine.compile_host": "engine.compile_host was removed (CPU-only kernels that gained ~2-3%); delete the key",
}


def _one_line(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    msg = str(getattr(exc, "msg", None) or exc).strip().splitlines()[0]
    if msg.startswith("Key ") and " not in " in msg:
        return REMOVED_KEYS.get(str(key), f"unknown config key '{key}'")
    return f"config key '{key}': {msg}"


def load_config(
    path: Optional[str] = None, overrides: typing.Sequence[str] = (), schema: type = None
) -> DictConfig:
    """Defaults <- YAML file <- `key=value` overrides, then validated. Raises ConfigError.

    schema: the structured config class (default JobConfig; the benchmark passes its BenchConfig)."""
    cfg = merge_config(schema or JobConfig, path, overrides)
    validate(cfg)
    return cfg


def merge_config(schema: type, path: Optional[str], overrides: typing.Sequence[str]) -> DictConfig:
    """The dataclass `schema`'s defaults <- YAML file <- `key=value` overrides, type-checked (no semantic
    checks). Raises ConfigError naming the key."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value")
    try:
        cfg = OmegaConf.structured(schema)
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path!r} does not exist")
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    return cfg


@dataclass
class CommandLine:
    """`[CONFIG.yaml] [key=value ...] [--print-config]`, the command line of every config-driven command."""

    config: Optional[str]  # the YAML file: the first argument, when it is not key=value
    overrides: list[str]  # dotted key=value overrides, applied after the file
    print_config: bool  # print the merged config as YAML and exit


def parse_command_line(argv: Optional[typing.Sequence[str]], prog: str, description: str, epilog: str = "") -> CommandLine:
    """Parse `[CONFIG.yaml] [key=value ...] [--print-config]` (argv None = sys.argv[1:]); --help prints
    `description` and `epilog` and exits. Used by `jobs.generate`, `jobs.bench` and `jobs.train_heads`."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog or None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="[CONFIG.yaml] key=value",
                        help="an optional YAML config file, then dotted overrides such as engine.method=ar")
    parser.add_argument("--print-config", action="store_true", help="print the merged config as YAML and exit")
    ns = parser.parse_intermixed_args(argv)  # --print-config may come anywhere
    args = list(ns.args)
    config = args.pop(0) if args and "=" not in args[0] else None
    return CommandLine(config, args, ns.print_config)


def engine_config(cfg: DictConfig) -> EngineConfig:
    return EngineConfig(**OmegaConf.to_container(cfg.engine, resolve=True), seed=cfg.generation.seed)


def model_config(cfg: DictConfig) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))


def validate(cfg: DictConfig) -> None:
    """Semantic checks beyond types. Raises ConfigError naming the key."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(cfg.data.format in FORMATS, f"data.format={cfg.data.format!r} is unknown; choose one of {', '.join(FORMATS)}")
    need(
        cfg.data.chat_template in CHAT_TEMPLATE_MODES,
        f"data.chat_template={cfg.data.chat_template!r} is unknown; choose auto, always or never",
    )
    need(cfg.data.turn_history in TURN_HISTORY_MODES,
         f"data.turn_history={cfg.data.turn_history!r} is unknown; choose stripped or raw")
    need(cfg.data.limit is None or cfg.data.limit >= 0, f"data.limit={cfg.data.limit} must be >= 0")
    need(cfg.data.shard_size >= 1, f"data.shard_size={cfg.data.shard_size} must be >= 1")
    need(cfg.data.id_column != "", "data.id_column must not be empty")
    need(well_formed_address(cfg.ray.address),
         f"ray.address={cfg.ray.address!r} is {ADDRESS_FORMS}; empty = RAY_ADDRESS or a local instance")
    need(cfg.output.compression.lower() in PARQUET_CODECS,
         f"output.compression={cfg.output.compression!r} is unknown; choose one of {', '.join(PARQUET_CODECS)}")
    need(cfg.ray.num_actors >= 1, f"ray.num_actors={cfg.ray.num_actors} must be >= 1")
    need(cfg.ray.num_cpus_per_actor >= 0, f"ray.num_cpus_per_actor={cfg.ray.num_cpus_per_actor} must be >= 0")
    gpus = cfg.ray.num_gpus_per_actor
    need(gpus == "auto" or (isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and gpus >= 0),
         f"ray.num_gpus_per_actor={gpus!r} must be auto or a number >= 0")
    need(cfg.ray.torch_threads >= 0, f"ray.torch_threads={cfg.ray.torch_threads} must be >= 0")
    need(cfg.ray.max_restarts >= 0, f"ray.max_restarts={cfg.ray.max_restarts} must be >= 0")
    need(
        cfg.ray.shards_in_flight_per_actor >= 0,
        f"ray.shards_in_flight_per_actor={cfg.ray.shards_in_flight_per_actor} must be >= 0 (0 = auto)",
    )
    need(cfg.ray.placement_timeout_s > 0, "ray.placement_timeout_s must be > 0")
    need(cfg.ray.stall_timeout_s >= 0, "ray.stall_timeout_s must be >= 0 (0 = never)")
    need(cfg.ray.head_timeout_s > 0, "ray.head_timeout_s must be > 0")
    need(cfg.output.progress_interval_s > 0, "output.progress_interval_s must be > 0")
    need(cfg.fault.kill_attempts >= 0, "fault.kill_attempts must be >= 0")
    need(cfg.fault.lose_device >= 0, "fault.lose_device must be >= 0")
    problem = _generation_problem(cfg)
    need(problem is None, f"generation.{problem}")
    try:
        engine_config(cfg).validate()
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def generation_defaults(cfg: DictConfig) -> dict[str, Any]:
    """`generation.*` as GenerationParams keyword arguments: every request's defaults (a row's params override
    them). The one place the job turns its generation section into the engine's terms."""
    g = cfg.generation
    return dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                stop_strings=tuple(g.stop_strings), ignore_eos=g.ignore_eos, logprobs=g.logprobs,
                top_logprobs=g.top_logprobs, prompt_logprobs=g.prompt_logprobs, n=g.n)


def _generation_problem(cfg: DictConfig) -> Optional[str]:
    return GenerationParams(**generation_defaults(cfg)).problem()


def shards_in_flight(cfg: DictConfig) -> int:
    """Shards per actor: the configured number, or (0) enough rows queued to keep the batch full
    across shard ends: ceil(1.5 * engine.max_batch_size / data.shard_size) + 1."""
    n = cfg.ray.shards_in_flight_per_actor
    # 1.5 batches of rows (so the batch stays full while a finished shard's part is written and the next
    # shard travels to the actor), plus the shard whose last rows are finishing
    return n if n > 0 else -(-3 * cfg.engine.max_batch_size // (2 * cfg.data.shard_size)) + 1


def hashed_part(cfg: DictConfig) -> dict[str, Any]:
    """The sections that determine the output rows (see HASHED_SECTIONS), with local paths spelled
    canonically (absolute, resolved), so `data/x.jsonl` and its absolute path are the same input."""
    part = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in HASHED_SECTIONS}
    part["data"]["path"] = normalize(part["data"]["path"])
    name = part["model"]["name_or_path"]
    if looks_local(name):
        part["model"]["name_or_path"] = normalize(name)
    return part


def config_hash(cfg: DictConfig) -> str:
    """sha256 (16 hex) of the output-determining sections, canonical JSON."""
    blob = json.dumps(hashed_part(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


# ---- configs/default.yaml: written from the dataclasses above ------------------------------------------
DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
# keys whose dataclass field carries no comment of its own
_MORE_COMMENTS = {
    "model.trust_remote_code": "run the model repository's own code (hub models that need it)",
    "model.revision": "hub revision (branch, tag or commit); null = the default branch",
    "engine.pld_min_ngram": "shortest suffix tried",
    "engine.pld_depth": "longest continuation drafted",
    "engine.max_batch_size": "rows decoded together per actor",
    "engine.stand_min_ngram": "shortest suffix tried",
    "engine.hybrid_mask_min_nodes": "see hybrid_mask_every",
}
_SOURCES = {"engine": EngineConfig}  # the job's engine section is EngineConfig's fields less seed


def field_comments(cls: type) -> dict[str, tuple[list[str], str]]:
    """Per field of `cls`, as written in its source: (the comment lines right above it, its trailing comment)."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: (t.string[1:].strip(), t.line.strip().startswith("#"))
                for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            text, alone = comments.get(node.end_lineno, ("", True))
            out[node.target.id] = (above, "" if alone else text)
    return out


def _yaml_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.+/-]*", value) and value.lower() not in (
            "true", "false", "null", "yes", "no", "on", "off", "y", "n", "~")
        return value if plain else json.dumps(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def default_yaml() -> str:
    """configs/default.yaml: every key of JobConfig with its default and its comment from the dataclasses."""
    defaults = OmegaConf.to_container(OmegaConf.structured(JobConfig))
    lines = [
        "# Every job key with its default: `python -m jobs.generate` with no arguments runs exactly this.",
        "# Written by `python -m jobs.config --write-default` from the dataclasses (jobs/config.py, esp_worker's",
        "# EngineConfig, ModelConfig and GenerationParams); edit those, then rewrite this file. Override any key:",
        "#   python -m jobs.generate configs/default.yaml engine.method=ar generation.max_new_tokens=32",
    ]
    for section in dataclasses.fields(JobConfig):
        cls = _SOURCES.get(section.name) or typing.get_type_hints(JobConfig)[section.name]
        doc = field_comments(cls)
        lines.append(f"{section.name}:")
        for key, value in defaults[section.name].items():
            above, trailing = doc.get(key, ([], ""))
            trailing = trailing or _MORE_COMMENTS.get(f"{section.name}.{key}", "")
            lines += [f"  # {c}" if c else "  #" for c in above]
            item = f"  {key}: {_yaml_value(value)}"
            lines.append(f"{item:<36}  # {trailing}" if trailing else item)
    return "\n".join(lines) + "\n"


def main(argv: Optional[typing.Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.config", description="Write or check configs/default.yaml.")
    parser.add_argument("--write-default", nargs="?", const=str(DEFAULT_YAML), metavar="PATH",
                        help="write the defaults of every job key (default path: configs/default.yaml)")
    ns = parser.parse_args(argv)
    text = default_yaml()
    if ns.write_default:
        Path(ns.write_default).write_text(text)
        print(ns.write_default)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
