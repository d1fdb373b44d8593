"""Run a generation job: stream the input into shards, hand them to engine actors, write Parquet parts.

Scheduling uses Ray core: `ray.num_actors` actors (one engine each) with `max_restarts` /
`max_task_retries`, so a shard whose actor dies is retried by Ray on the restarted actor; the driver
keeps at most `shards_in_flight_per_actor` shards per actor and waits with `ray.wait`. The driver
reads the input once, in order, `data.shard_size` rows at a time, and holds only the shards in flight.
Shard i is input rows [i * shard_size, (i + 1) * shard_size): a rerun skips shards whose part exists.
"""
from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from .cluster import check_resources, connect
from .config import ConfigError, config_hash, engine_config, hashed_part
from .output import OutputDir
from .progress import Progress
from .rows import INPUT_COLUMNS, JobRow, RowNormalizer
from .schema import CATEGORY, carry_types, output_schema, to_table
from .sources import Source, SourceError, open_source
from .stats import COLUMNS, Totals
from .worker import ShardWorker, WorkerSpec

log = logging.getLogger("esp_batch")
_SAMPLE_ROWS = 256  # rows read up front to check columns and infer carried column types


class JobError(RuntimeError):
    """The job could not finish; one-line message. Finished parts are kept: a rerun resumes."""


@dataclass
class JobResult:
    output_dir: Path
    summary_path: Path
    summary: dict[str, Any]


def default_output_dir(cfg: DictConfig, chash: str) -> str:
    """outputs/<model>-<method>-<hash8>: a changed config gets its own directory, a rerun the same one."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.model.name_or_path.rstrip("/")).name)
    return str(Path("outputs") / f"{model}-{cfg.engine.method}-{chash[:8]}")


def _iter_shards(source: Source, normalizer: RowNormalizer, shard_size: int) -> Iterator[tuple[int, list[JobRow]]]:
    """(shard index, rows) in input order; duplicate-id rows are dropped by the normalizer."""
    position = 0
    for index, batch in enumerate(source.batches(shard_size)):
        rows = [r for i, raw in enumerate(batch) if (r := normalizer(position + i, raw)) is not None]
        position += len(batch)
        yield index, rows


def _plan_schema(cfg: DictConfig, source: Source) -> Any:
    """Output schema from the input's schema / first rows; refuses inputs without an input column."""
    sample = next(source.batches(_SAMPLE_ROWS), [])
    schema = source.schema()
    names = set(schema.names) if schema is not None else {k for row in sample for k in row}
    data = cfg.data
    if data.prompt_column and names and data.prompt_column not in names:
        raise ConfigError(f"data.prompt_column={data.prompt_column!r} is not in the input (columns: {', '.join(sorted(names))})")
    if not data.prompt_column and names and not names & set(INPUT_COLUMNS) and not names <= {"__error__"}:
        raise ConfigError(
            f"no input column in {source.path!r}: expected one of {', '.join(INPUT_COLUMNS)} "
            f"(columns: {', '.join(sorted(names))}); set data.prompt_column"
        )
    carry = carry_types(list(data.carry_columns), schema, sample)
    return output_schema(data.category_column in names, carry)


def _worker_spec(cfg: DictConfig, schema: Any, out: OutputDir) -> WorkerSpec:
    g = cfg.generation
    return WorkerSpec(
        model=OmegaConf.to_container(cfg.model, resolve=True),
        engine=vars(engine_config(cfg)),
        generation=dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                        stop_strings=tuple(g.stop_strings), ignore_eos=g.ignore_eos),
        chat_template=cfg.data.chat_template,
        chat_template_kwargs=OmegaConf.to_container(cfg.data.chat_template_kwargs, resolve=True),
        schema=schema,
        torch_threads=cfg.ray.torch_threads or max(1, math.floor(cfg.ray.num_cpus_per_actor)),
        fault_dir=str(out.fault_dir),
        kill_shard=cfg.fault.kill_shard,
        kill_attempts=cfg.fault.kill_attempts,
    )


def _start_actors(cfg: DictConfig, spec: WorkerSpec) -> list[Any]:
    import ray

    remote = ray.remote(ShardWorker).options(
        num_cpus=cfg.ray.num_cpus_per_actor,
        num_gpus=cfg.ray.num_gpus_per_actor,
        max_restarts=cfg.ray.max_restarts,
        max_task_retries=cfg.ray.max_restarts,
    )
    actors = [remote.remote(spec) for _ in range(cfg.ray.num_actors)]
    infos = ray.get([a.info.remote() for a in actors])
    bad = next((i["error"] for i in infos if i["error"]), None)
    if bad:
        raise JobError(f"the engine failed to load: {bad}")
    log.info("%d actors ready (max_context %s, chat template %s)", len(actors), infos[0]["max_context"],
             "on" if infos[0]["chat_template"] else "off")
    return actors


class _Dispatcher:
    """Keeps up to `cap` shards in flight per actor, writes each finished shard's part."""

    def __init__(self, actors: list[Any], cap: int, out: OutputDir, compression: str, progress: Progress):
        self.actors = actors
        self.cap = cap
        self.out = out
        self.compression = compression
        self.progress = progress
        self.in_flight: dict[Any, tuple[int, int]] = {}  # ObjectRef -> (shard index, actor index)
        self.load = [0] * len(actors)
        self.failures: list[str] = []
        self.shards_written = 0

    def submit(self, shard_index: int, rows: list[JobRow]) -> None:
        while min(self.load) >= self.cap:
            self.wait_one()
        a = self.load.index(min(self.load))
        ref = self.actors[a].run_shard.remote(shard_index, rows)
        self.in_flight[ref] = (shard_index, a)
        self.load[a] += 1

    def wait_one(self) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ready: list[Any] = []
        while not ready:
            ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=1.0)
            self.progress.update()
        ref = ready[0]
        shard_index, a = self.in_flight.pop(ref)
        self.load[a] -= 1
        try:
            table = ray.get(ref)
        except RayActorError as exc:
            self.failures.append(f"shard {shard_index}: its actor died more than ray.max_restarts times ({type(exc).__name__})")
            return
        except RayTaskError as exc:
            cause = str(exc.cause if exc.cause is not None else exc).strip().splitlines()
            self.failures.append(f"shard {shard_index}: {cause[-1] if cause else type(exc).__name__}")
            return
        self.write(shard_index, table)

    def write(self, shard_index: int, table: Any) -> None:
        self.out.write_part(shard_index, table, self.compression)
        self.shards_written += 1
        self.progress.run.add(table)
        self.progress.update()

    def drain(self) -> None:
        while self.in_flight:
            self.wait_one()


def _rows_in(parts: list[Path]) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in parts)


def run_job(cfg: DictConfig) -> JobResult:
    """Run (or resume) the job. Raises ConfigError (bad config/data/output dir) or JobError."""
    import ray

    chash = config_hash(cfg)
    out = OutputDir(cfg.output.dir or default_output_dir(cfg, chash))
    try:
        source = open_source(cfg.data.path, cfg.data.format, cfg.data.split, cfg.data.limit)
        schema = _plan_schema(cfg, source)
        total_rows = source.num_rows()
    except SourceError as exc:
        raise ConfigError(str(exc)) from None
    out.claim(chash, hashed_part(cfg), OmegaConf.to_container(cfg, resolve=True), cfg.output.overwrite)
    done = out.done_shards()
    log.info("job %s: %s rows from %s (%s) -> %s; %d shards already done",
             chash, "?" if total_rows is None else total_rows, source.path, source.format, out.path, len(done))

    started = False
    try:
        t0 = time.monotonic()
        progress = Progress(total_rows, _rows_in(out.parts()), cfg.output.progress_interval_s)
        normalizer = RowNormalizer(cfg.data.id_column, cfg.data.prompt_column, cfg.data.params_column,
                                   cfg.data.category_column, list(cfg.data.carry_columns))
        actors: Optional[list[Any]] = None
        dispatcher: Optional[_Dispatcher] = None
        skipped = 0
        for shard_index, rows in _iter_shards(source, normalizer, cfg.data.shard_size):
            if shard_index in done:
                skipped += 1
                continue
            if dispatcher is None:  # Ray and the engines start only when there is work
                started = connect(cfg.ray)
                check_resources(cfg.ray, started)
                actors = _start_actors(cfg, _worker_spec(cfg, schema, out))
                dispatcher = _Dispatcher(actors, cfg.ray.shards_in_flight_per_actor, out, cfg.output.compression, progress)
            if dispatcher.failures:
                break
            if rows:
                dispatcher.submit(shard_index, rows)
            else:  # every row was a duplicate: an empty part marks the shard done
                dispatcher.write(shard_index, to_table([], schema))
        if dispatcher is not None:
            dispatcher.drain()
            for actor in actors or []:
                ray.kill(actor)
        progress.close()
        wall = time.monotonic() - t0
        if dispatcher is not None and dispatcher.failures:
            raise JobError(
                f"{len(dispatcher.failures)} shard(s) failed, e.g. {dispatcher.failures[0]}; "
                f"finished parts are kept in {out.path}: rerun the same command to resume"
            )
        return _finish(cfg, chash, out, total_rows, normalizer.duplicates_dropped, progress.run, wall,
                       dispatcher.shards_written if dispatcher else 0, skipped, CATEGORY in schema.names)
    finally:
        if started:
            ray.shutdown()


def _finish(cfg: DictConfig, chash: str, out: OutputDir, input_rows: Optional[int], duplicates: int, run: Totals,
            wall_s: float, shards_written: int, shards_skipped: int, has_category: bool) -> JobResult:
    totals = Totals()
    for table in out.read_columns(COLUMNS + [CATEGORY]):
        totals.add(table)
    tokens_per_s = run.generated_tokens / wall_s if wall_s > 0 else None
    summary: dict[str, Any] = {
        "output_dir": str(out.path),
        "parts": len(out.parts()),
        "input_rows": input_rows,
        "rows": totals.rows,
        "errors": totals.errors,
        "duplicates_dropped": duplicates,
        "prompt_tokens": totals.prompt_tokens,
        "generated_tokens": totals.generated_tokens,
        "tau": totals.tau,
        "tokens_per_s": tokens_per_s,  # this run: tokens generated by this run / its wall time
        "this_run": {
            "rows": run.rows, "shards_written": shards_written, "shards_skipped": shards_skipped,
            "generated_tokens": run.generated_tokens, "wall_s": wall_s,
        },
        "model": cfg.model.name_or_path,
        "method": cfg.engine.method,
        "config_hash": chash,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if has_category:
        summary["tau_per_category"] = totals.tau_per_category()
    path = out.write_summary(summary)
    tau = "-" if totals.tau is None else f"{totals.tau:.3f}"
    rate = "-" if tokens_per_s is None else f"{tokens_per_s:.1f}"
    log.info("done: %d rows (%d errors, %d duplicate ids dropped), %s tok/s, tau %s -> data %s/part-*.parquet, summary %s",
             totals.rows, totals.errors, duplicates, rate, tau, out.path, path)
    return JobResult(output_dir=out.path, summary_path=path, summary=summary)
