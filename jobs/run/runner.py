"""Run a generation job: stream the input into shards, hand them to engine actors, write Parquet parts.

Scheduling uses Ray core: `ray.num_actors` actors (one engine each, placed through a placement group so
a cluster that cannot hold them fails after `ray.placement_timeout_s` instead of waiting forever; see
actors.py for what happens when one is lost). Each actor takes several shards at once
(`ray.shards_in_flight_per_actor`) and batches their rows in one engine loop; the driver (dispatch.py)
writes each shard's part when the actor returns its table, and hands a lost actor's shards on.

The driver reads the input once, in order, `data.shard_size` rows at a time, and holds only the shards in
flight. Shard i is input rows [i * shard_size, (i + 1) * shard_size). A rerun skips a shard whose part
exists and carries the fingerprint of the shard's rows as read now; a shard whose input changed is
regenerated (its part replaced atomically), and parts beyond the input's last shard are removed. At the
end the output's ids are checked against the input's ids: exactly one row per input id.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from esp_worker.config import NOT_LOSSLESS
from omegaconf import DictConfig, OmegaConf

from esp_worker.config import RANDOM_PREFIX

from .actors import ActorPool, StartError
from .cluster import HeadLost, HeadWatch, actor_resources, check_resources, connect, stop_local
from ..config import (ConfigError, config_hash, engine_config, generation_defaults, hashed_part, looks_local,
                      shards_in_flight)
from ..io.output import SUMMARY, OutputDir, PartInfo
from .progress import Progress
from .retry import Retry
from .rows import INPUT_COLUMNS, JobRow, RowNormalizer, shard_fingerprint
from .schema import CATEGORY, carry_types, output_schema, to_table
from ..io.sources import Source, SourceError, open_source
from ..io.storage import is_uri
from .stats import COLUMNS, Totals
from .dispatch import Dispatcher, first_line
from .worker import WorkerSpec

log = logging.getLogger("esp_batch")
_SAMPLE_ROWS = 256  # rows read up front to check columns and infer carried column types
_IDS_SHOWN = 5  # ids named in a failed output check


class JobError(RuntimeError):
    """The job could not finish; one-line message. Finished parts are kept: a rerun resumes."""


@dataclass
class JobResult:
    output_dir: str
    summary_path: str
    summary: dict[str, Any]
    head_lost: bool = False  # the job finished while the cluster's head did not answer: Ray cannot shut down cleanly


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


def plan_schema(cfg: DictConfig, source: Source) -> Any:
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


_WEIGHTS = ("*.safetensors", "*.bin")  # single files or shards; a sharded checkpoint's index is *.index.json


def _model_dir_problem(path: Path) -> Optional[str]:
    """What a local model directory lacks for from_pretrained (config.json, a weights file), or None."""
    if not path.is_dir():
        return "is a file; give the model directory (config.json and weights)"
    config = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()  # a PEFT adapter
    weights = any(any(path.glob(pattern)) for pattern in (*_WEIGHTS, "*.index.json"))
    if config and weights:
        return None
    lacks = " and ".join(what for what, ok in (("no config.json", config), (f"no weights ({', '.join(_WEIGHTS)})", weights))
                         if not ok)
    return (f"holds {lacks}; give a directory written by save_pretrained or downloaded from the hub "
            "(config.json, tokenizer files and weights)")


def _preflight(cfg: DictConfig) -> None:
    """Checks that need no Ray and no model load: a local model directory holds config.json and weights,
    and the heads, DMTD copy and cost curve named exist."""
    name = cfg.model.name_or_path
    if looks_local(name) and not name.startswith(RANDOM_PREFIX):
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(
                f"model.name_or_path={name!r} does not exist (a local path); give an existing model directory "
                "or a hub id such as org/name"
            )
        problem = _model_dir_problem(path)
        if problem:
            raise ConfigError(f"model.name_or_path={name!r} {problem}")
    heads = cfg.engine.heads_path
    if heads and cfg.engine.method in ("cp_heads", "hybrid") and not (Path(heads).expanduser() / "heads.json").is_file():
        raise ConfigError(f"engine.heads_path={heads!r} holds no heads.json; give the output.dir of a jobs.train_heads "
                          "run (or a directory under heads/)")
    curve = cfg.engine.cost_curve_path
    if curve and cfg.engine.block_complexity == "auto" and not Path(curve).expanduser().is_file():
        raise ConfigError(f"engine.cost_curve_path={curve!r} is not a file; give a cost curve jobs.bench wrote "
                          "(cost_curve.json), or leave it empty to measure one at start-up")
    copy = cfg.engine.dmtd_path
    if cfg.engine.method == "dmtd_verified" and not (Path(copy).expanduser() / "dmtd_draft.json").is_file():
        raise ConfigError(f"engine.dmtd_path={copy!r} holds no dmtd_draft.json; give the output.dir of an "
                          "esp-batch train-dmtd dmtd.verified=true run")
    if cfg.engine.method == "dmtd" and not cfg.engine.dmtd_decoding_layers and (looks_local(name) or ":" in name
                                                                               or name.startswith("tiny-random-")):
        config = Path(name).expanduser() / "config.json"
        if not (config.is_file() and "mtp_horizon" in config.read_text()):
            raise ConfigError(f"engine.method=dmtd needs a DMTD model (esp-batch train-dmtd writes one) and "
                              f"model.name_or_path={name!r} has no DMTD split; set engine.dmtd_decoding_layers to split it "
                              "untrained (speed measurements only)")


def _no_rows(cfg: DictConfig, source: Source) -> str:
    """An empty input is refused (exit 2), not run as a 'complete' job of 0 rows: nothing would be
    generated, and an output directory without a part is an error to every reader of it."""
    why = f" (data.limit={cfg.data.limit})" if cfg.data.limit == 0 else ""
    return f"data.path={source.path!r} has no rows{why}; nothing to generate"


def _check_output_location(cfg: DictConfig) -> None:
    """Under `ray job submit --working-dir` the job runs in Ray's temporary copy of the working dir, deleted
    with the cluster's session: refuse a relative (or unset) output.dir, which would be written there."""
    try:
        runtime_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return
    where = cfg.output.dir
    if not runtime_env.get("working_dir") or is_uri(where) or (where and Path(where).expanduser().is_absolute()):
        return
    given = f"output.dir={where!r} is relative" if where else "output.dir is unset"
    raise ConfigError(f"{given}: under `ray job submit --working-dir` it would be written into Ray's temporary copy "
                      "of the working dir, deleted when the cluster stops; give an absolute output.dir (on the head "
                      "node or shared storage) or an object-store URL (s3://...)")


def _check_partitioning(cfg: DictConfig, schema: Any) -> None:
    """output.partition_by names output columns of a scalar type (not the id)."""
    import pyarrow as pa

    for name in cfg.output.partition_by:
        if name not in schema.names or name == "id":
            raise ConfigError(f"output.partition_by: {name!r} is not a column the output can be partitioned by "
                              f"(choose from: {', '.join(n for n in schema.names if n != 'id')})")
        typ = schema.field(name).type
        if not (pa.types.is_string(typ) or pa.types.is_integer(typ) or pa.types.is_boolean(typ)):
            raise ConfigError(f"output.partition_by: column {name!r} has type {typ}; partition by a string, "
                              "integer or boolean column")


def worker_spec(cfg: DictConfig, schema: Any, out: OutputDir) -> WorkerSpec:
    """What each engine actor is built from (a ShardWorker takes it without Ray too, as the tests do)."""
    return WorkerSpec(
        model=OmegaConf.to_container(cfg.model, resolve=True),
        engine=vars(engine_config(cfg)),
        generation=generation_defaults(cfg),
        chat_template=cfg.data.chat_template,
        chat_template_kwargs=OmegaConf.to_container(cfg.data.chat_template_kwargs, resolve=True),
        schema=schema,
        torch_threads=cfg.ray.torch_threads or max(1, math.floor(cfg.ray.num_cpus_per_actor)),
        fault_dir=out.fault_dir,
        kill_shard=cfg.fault.kill_shard,
        kill_attempts=cfg.fault.kill_attempts,
        hold_shard=cfg.fault.hold_shard,
        fail_row=str(cfg.fault.fail_row),
        kill_row=str(cfg.fault.kill_row),
        hang_row=str(cfg.fault.hang_row),
        lose_device=int(cfg.fault.lose_device),
        turn_history=cfg.data.turn_history,
    )


@dataclass
class _Decision:
    """What a run does with one shard."""

    rows: Optional[list[JobRow]]  # the rows to run; None: none (its part is kept as it is)
    kept: int = 0  # rows of its existing part that are kept


@dataclass
class _Plan:
    """What a run does with the shards it reads."""

    parts: dict[int, PartInfo]  # parts found in output.dir at the start
    retry: Optional[Retry] = None  # output.retry_errors: the parts' rows to run again
    num_shards: int = 0
    skipped: int = 0
    regenerated: list[int] = field(default_factory=list)  # shards whose part existed with another fingerprint
    fingerprints: Any = field(default_factory=hashlib.sha256)  # running hash of every shard's fingerprint

    def decide(self, shard_index: int, fingerprint: str, rows: list[JobRow]) -> _Decision:
        """Run all of the shard's rows (no part, or a part made from other input), those of its part to run again
        (output.retry_errors), or none (its part is kept as it is)."""
        self.num_shards = shard_index + 1
        self.fingerprints.update(fingerprint.encode())
        old = self.parts.get(shard_index)
        if old is not None and old.fingerprint == fingerprint:
            again = self.retry.select(shard_index, rows) if self.retry is not None else []
            if again:
                return _Decision(again, old.rows - len(again))
            self.skipped += 1
            return _Decision(None, old.rows)
        if old is not None:
            if not self.regenerated:
                log.warning("shard %d changed since the last run (input edited): regenerating it, and every "
                            "later shard whose rows changed", shard_index)
            self.regenerated.append(shard_index)
        return _Decision(rows)


def run_job(cfg: DictConfig) -> JobResult:
    """Run (or resume) the job. Raises ConfigError (bad config/data/output dir), ClusterError or JobError
    (HeadLost, a ClusterError, when the cluster's head is lost mid-job: the run is on record in _summary.json
    and Ray is left initialised, since its shutdown would wait for the lost head)."""
    import ray

    t_start = time.monotonic()
    chash = config_hash(cfg)
    _preflight(cfg)
    _check_output_location(cfg)
    out = OutputDir(cfg.output.dir or default_output_dir(cfg, chash), cfg.storage, tuple(cfg.output.partition_by))
    try:
        source = open_source(cfg.data.path, cfg.data.format, cfg.data.split, cfg.data.limit, cfg.storage)
        schema = plan_schema(cfg, source)
        _check_partitioning(cfg, schema)
        total_rows = source.num_rows()
    except SourceError as exc:
        raise ConfigError(str(exc)) from None
    if total_rows == 0:
        raise ConfigError(_no_rows(cfg, source))
    out.claim(chash, hashed_part(cfg), OmegaConf.to_container(cfg, resolve=True), cfg.output.overwrite)
    plan = _Plan(out.part_infos(), Retry(out) if cfg.output.retry_errors else None)
    if plan.retry is not None:
        log.info("output.retry_errors: %d row(s) of %d part(s) have an error from running them, to run again",
                 sum(map(len, plan.retry.ids.values())), len(plan.retry.ids))
    log.info("job %s: %s rows from %s (%s) -> %s; %d parts already there",
             chash, "?" if total_rows is None else total_rows, source.path, source.format, out.path, len(plan.parts))

    started = False
    lost = False  # the cluster's head is gone: Ray cannot be used (nor shut down) any more
    cap = shards_in_flight(cfg)
    pool: Optional[ActorPool] = None
    try:
        progress = Progress(total_rows, cfg.output.progress_interval_s)
        normalizer = RowNormalizer(cfg.data.id_column, cfg.data.prompt_column, cfg.data.params_column,
                                   cfg.data.category_column, list(cfg.data.carry_columns))
        dispatcher: Optional[Dispatcher] = None
        t_ready: Optional[float] = None
        failure: Optional[str] = None
        try:
            for shard_index, shard_rows in _iter_shards(source, normalizer, cfg.data.shard_size):
                fingerprint = shard_fingerprint(shard_rows)
                decision = plan.decide(shard_index, fingerprint, shard_rows)
                progress.kept(decision.kept)
                if decision.rows is None:
                    continue
                rows = decision.rows
                if dispatcher is None:  # Ray and the engines start only when there is work
                    started = connect(cfg.ray)
                    resources = actor_resources(cfg.ray)
                    n = check_resources(cfg.ray, resources, started)
                    if total_rows is not None:  # no more actors than shards left to run
                        n = max(1, min(n, -(-(total_rows - shard_index * cfg.data.shard_size) // cfg.data.shard_size)))
                    pool = ActorPool(cfg, worker_spec(cfg, schema, out), n, cap, resources,
                                     HeadWatch(cfg.ray.head_timeout_s))
                    try:
                        pool.start()
                    except StartError as exc:
                        raise JobError(str(exc)) from None
                    dispatcher = Dispatcher(pool, cap, out, cfg.output.compression, progress, cfg.ray.max_restarts,
                                            cfg.fault.driver_exit_after_parts)
                    dispatcher.retry = plan.retry
                    t_ready = time.monotonic()
                    progress.restart()
                if not dispatcher.can_submit:
                    break
                if rows:
                    dispatcher.submit(shard_index, rows, fingerprint)
                else:  # every row was a duplicate: an empty part marks the shard done
                    dispatcher.write(shard_index, to_table([], schema), fingerprint)
            if plan.num_shards == 0:  # an input of unknown length (a hub stream) that held no row
                raise ConfigError(_no_rows(cfg, source))
            if dispatcher is not None:
                dispatcher.drain()
        except HeadLost as exc:
            lost, failure = True, str(exc)
        except SourceError as exc:  # the input broke off mid-stream: the shards in flight still finish and are written
            failure = f"{exc} (fix the input)"
            try:
                if dispatcher is not None:
                    dispatcher.drain()
            except HeadLost:
                lost = True
        if pool is not None and not lost and not pool.head.answers_now():  # every shard back, the head silent
            lost = True
            log.warning("the cluster's head does not answer: the actors are left to the cluster")
        histogram = pool.batch_histogram() if pool is not None and not lost else {}
        if pool is not None and not lost:
            pool.stop()
        progress.close()
        t_end = time.monotonic()
        run = _run_record(t_start, t_ready, t_end, progress.run, dispatcher, plan, histogram)
        run["cuda_graphs"] = pool.cuda_graphs() if pool is not None and not lost else None
        # batches the engine raised in, whose rows then ran again in halves (rows that failed alone are errors)
        run["engine_errors"] = pool.engine_errors if pool is not None and not lost else None
        run["engine_time"] = ({k: round(v, 3) for k, v in pool.engine_time.items()}
                              if pool is not None and not lost else None)
        if failure is None and dispatcher is not None and dispatcher.failed:
            failure = dispatcher.failure_message()
        if failure is not None:
            run["failure"] = failure
            _write_summary(cfg, chash, out, total_rows, normalizer, plan, run, check=None)
            error = HeadLost if lost else JobError
            raise error(f"{failure}; finished parts are kept in {out.path}: rerun the same command to resume")
        run["stale_parts_removed"] = _remove_stale_parts(out, plan)
        check = _check_ids(out, normalizer.seen)
        result = _write_summary(cfg, chash, out, total_rows, normalizer, plan, run, check)
        _write_report(out, cfg)
        if not check["complete"]:
            raise JobError(f"output check failed: {check['problem']}; see {out.shown(SUMMARY)}")
        result.head_lost = lost
        return result
    finally:
        if pool is not None and not lost and ray.is_initialized():  # an exception left them running
            pool.stop()
        if started and not lost:
            stop_local()


def _write_report(out: OutputDir, cfg: DictConfig) -> None:
    """report.md + PNGs in <output.dir>/_report; a plotting failure never fails a finished job."""
    from ..report.job_report import write_job_report

    try:
        rep = write_job_report(out.location if out.location != out.path else out.path, cfg.storage)
        log.info("report: %s", rep.path)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not write the report: %s", first_line(exc))


def _remove_stale_parts(out: OutputDir, plan: _Plan) -> int:
    """Parts beyond the input's last shard, written by this job for an input that was longer, no longer
    belong to any shard: remove them. A part without our metadata is left for the ids check to report."""
    stale = [p for i, p in plan.parts.items() if i >= plan.num_shards and p.fingerprint is not None]
    for p in stale:
        log.warning("removing %s: the input has only %d shards now", out.shown(p.path[len(out.root):].lstrip("/")),
                    plan.num_shards)
        out.delete_part(p.shard)
    return len(stale)


def _check_ids(out: OutputDir, expected: set[str]) -> dict[str, Any]:
    """Exactly one output row per input id (after de-duplication)?"""
    counts: collections.Counter[str] = collections.Counter()
    where: dict[str, str] = {}
    for path, table in out.read_columns(["id"]):
        for rid in table.column("id").to_pylist() if "id" in table.column_names else []:
            counts[rid] += 1
            where.setdefault(rid, path)
    missing = sorted(expected - counts.keys())
    extra = sorted(counts.keys() - expected)
    dups = sorted(r for r, n in counts.items() if n > 1)
    problems = []
    if missing:
        problems.append(f"{len(missing)} input id(s) have no output row ({', '.join(missing[:_IDS_SHOWN])})")
    if extra:
        problems.append(f"{len(extra)} output id(s) are not in the input ({', '.join(extra[:_IDS_SHOWN])}, "
                        f"e.g. in {where[extra[0]].rsplit('/', 1)[-1]})")
    if dups:
        problems.append(f"{len(dups)} id(s) appear more than once ({', '.join(dups[:_IDS_SHOWN])})")
    return {
        "complete": not problems, "input_ids": len(expected), "output_rows": sum(counts.values()),
        "missing_ids": missing[:100], "unexpected_ids": extra[:100], "duplicated_ids": dups[:100],
        "problem": "; ".join(problems) or None,
    }


def _run_record(t_start: float, t_ready: Optional[float], t_end: float, run: Totals, dispatcher: Optional[Dispatcher],
                plan: _Plan, histogram: dict[int, int]) -> dict[str, Any]:
    startup = (t_ready if t_ready is not None else t_end) - t_start
    gen_s = t_end - t_ready if t_ready is not None else 0.0
    passes = sum(histogram.values())
    return {
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "startup_s": round(startup, 3),  # input planning, Ray start/connect, actor placement, model load
        "generation_s": round(gen_s, 3),  # engines ready -> last part written
        "rows": run.rows,
        "generated_tokens": run.generated_tokens,
        "generation_tokens_per_s": run.generated_tokens / gen_s if gen_s > 0 and run.rows else None,
        "shards_written": dispatcher.shards_written if dispatcher else 0,
        "shards_skipped": plan.skipped,
        "shards_regenerated": len(plan.regenerated),
        "failed_shards": sorted(s for s, _ in dispatcher.failures) if dispatcher else [],
        # shards held by repeated actor deaths, run in pieces alone, and the rows found killing their actor
        "isolated_shards": sorted(dispatcher.isolation.isolated) if dispatcher else [],
        "rows_killing_actors": [row for _, row in dispatcher.isolation.blamed] if dispatcher else [],
        "rows_retried": plan.retry.rows if plan.retry is not None else 0,  # output.retry_errors
        "batch_histogram": {str(k): v for k, v in histogram.items()},  # rows in the engine batch -> passes
        "mean_batch_size": sum(k * v for k, v in histogram.items()) / passes if passes else None,
    }


def _write_summary(cfg: DictConfig, chash: str, out: OutputDir, input_rows: Optional[int], normalizer: RowNormalizer,
                   plan: _Plan, run: dict[str, Any], check: Optional[dict[str, Any]]) -> JobResult:
    totals = Totals()
    for _, table in out.read_columns(COLUMNS + [CATEGORY]):
        totals.add(table)
    previous = out.read_json(SUMMARY) or {}
    runs = list(previous.get("runs", [])) + [run]
    gen_tokens = sum(r["generated_tokens"] for r in runs)
    gen_s = sum(r["generation_s"] for r in runs)
    summary: dict[str, Any] = {
        "output_dir": out.path,
        "complete": bool(check and check["complete"]),  # exactly one output row per input id
        "check": check,
        "parts": len(out.parts()),
        "num_shards": plan.num_shards,
        "input_rows": input_rows,
        "input_fingerprint": plan.fingerprints.hexdigest()[:16],  # of every shard's rows, in order
        "rows": totals.rows,
        "errors": totals.errors,
        "duplicates_dropped": normalizer.duplicates_dropped,
        "input_id_types": sorted(normalizer.id_types),  # e.g. ["int"]: `esp-batch export` restores int ids
        "prompt_tokens": totals.prompt_tokens,
        "generated_tokens": totals.generated_tokens,
        "tau": totals.tau,
        # false for a method whose output is not the model's own decoding (dmtd); plt: its layers per token / layers
        "lossless": cfg.engine.method not in NOT_LOSSLESS,
        "plt": totals.plt,
        # all runs: tokens generated / seconds the engines were generating (start-up excluded)
        "generation_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else None,
        "this_run": run,
        "runs": runs,  # one record per run, appended; earlier runs' figures are never rewritten
        "model": cfg.model.name_or_path,
        "method": cfg.engine.method,
        "config_hash": chash,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if totals.per_category:
        summary["tau_per_category"] = totals.tau_per_category()
    out.write_json(SUMMARY, summary)
    path = out.shown(SUMMARY)
    tau = "-" if totals.tau is None else f"{totals.tau:.3f}"
    rate = run["generation_tokens_per_s"]
    batch = run["mean_batch_size"]
    log.info("done: %d rows (%d errors, %d duplicate ids dropped), %s; this run: %d tokens in %.1fs = %s tok/s "
             "generating (start-up %.1fs, mean batch %s), tau %s -> data %s/part-*.parquet, summary %s",
             totals.rows, totals.errors, normalizer.duplicates_dropped,
             "complete" if summary["complete"] else "INCOMPLETE", run["generated_tokens"], run["generation_s"],
             "-" if rate is None else f"{rate:.1f}", run["startup_s"], "-" if batch is None else f"{batch:.1f}",
             tau, out.path, path)
    if run.get("rows_killing_actors"):
        log.warning("%d row(s) took down their engine actor each time they ran alone: %s",
                    len(run["rows_killing_actors"]), ", ".join(run["rows_killing_actors"][:10]))
    if run.get("engine_errors"):
        log.warning("the engine raised in %d batch(es) this run; their rows ran again in smaller batches (the "
                    "actors' log has each error)", run["engine_errors"])
    return JobResult(output_dir=out.path, summary_path=path, summary=summary)
