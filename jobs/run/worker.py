"""The engine actor: one engine loop per actor, fed by every row of every shard in flight to it.

A plain class (testable without Ray); `jobs.run.runner` wraps it with `ray.remote(max_concurrency=...)`, so
several `run_shard` calls run at once, each in its own Ray thread. Each call puts its rows' requests
into one RequestFeed and waits; a single engine thread decodes whatever the feed holds, so the engine's
batch stays at `engine.max_batch_size` whatever the shard size is. A finished row's slot is refilled at
once, and the next turn of a multi-turn row goes back into the feed as soon as its previous turn ends. A row
that asks for generation.n > 1 samples puts one request per sample into the feed (`esp_worker.sample_requests`)
and gets one output row with them all. A shard's table is built and returned when its last row finishes.

An engine error (a CUDA out-of-memory in one batch, a row that trips a bug) ends the engine loop with every row of
the batch in it. Those rows then run again in halves, and the halves of a half that raises again, down to single
rows: a row that fails alone gets the error in its `error` column and the job goes on; the others finish as they
would have (in float32 a row's tokens do not depend on the rows beside it), and the loop restarts. When BROKEN_AFTER
rows in a row fail alone, with no row finishing between, the engine, not a row, is at fault: every shard in flight
fails with the error, as a load failure does. A batch that ran out of memory halves the rows the engine admits,
until REGAIN_AFTER batches' worth of rows have finished (`_regain_rows`).

Before any of that, an engine error is checked against the device (`_device_lost`): a CUDA error such as an illegal
memory access stays with the process, and every later call on the device fails, so no row is to blame and no rerun
in this process can work. The actor's process then exits: Ray starts it again (one of its ray.max_restarts) and the
driver hands its shards on, as after any actor death.

Heavy imports (torch, transformers, the engine) happen in `__init__`, inside the actor process.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from esp_worker.config import NOT_LOSSLESS
from esp_worker.feed import RequestFeed

from .rows import JobRow
from .schema import CATEGORY, to_table

log = logging.getLogger(__name__)

# between a row id and a sample's index in the engine request of sample i > 0: not `sample_requests`' "#", which
# ids such as "doc#1" hold (requests in flight on an actor need distinct ids)
SAMPLE_SEP = "\x1f"
# rows that fail alone one after another, none finishing between them, that make the engine (not a row) the fault
BROKEN_AFTER = 3
# batches' worth of rows that finish after the engine's admission was halved (it ran out of memory) before it doubles
REGAIN_AFTER = 4


@dataclass
class WorkerSpec:
    """Everything an actor needs, picklable."""

    model: dict[str, Any]  # ModelConfig fields
    engine: dict[str, Any]  # EngineConfig fields
    generation: dict[str, Any]  # GenerationParams defaults from generation.*
    chat_template: str  # auto | always | never
    chat_template_kwargs: dict[str, Any]
    schema: pa.Schema
    torch_threads: int
    fault_dir: str  # where fault-injection attempt markers live
    kill_shard: int = -1
    kill_attempts: int = 0
    hold_shard: int = -1
    turn_history: str = "stripped"  # data.turn_history: stripped | raw
    fail_row: str = ""  # fault injection: the engine raises on every decode pass holding this row id ("*": every pass)
    kill_row: str = ""  # fault injection: the process exits in every decode pass holding this row id
    hang_row: str = ""  # fault injection: the engine hangs in every decode pass holding this row id
    lose_device: int = 0  # fault injection: the first N actor processes lose their device mid-job


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def _counters(st: Any) -> dict[str, Any]:
    """A RequestStats' acceptance counters under their output column names."""
    return {
        "num_decode_passes": st.num_decode_passes,
        "num_decode_tokens": st.num_decode_tokens,
        "num_drafted_tokens": st.num_drafted_tokens,
        "num_accepted_drafts": st.num_accepted_drafts,
        "accepted_per_depth": list(st.accepted_per_depth),
        "committed_histogram": list(st.committed_histogram),
        "accepted_by_proposer": dict(st.accepted_by_proposer),
        "tau": _finite(st.tau),
        "plt": st.plt,
        "committed_per_pass": list(st.committed_per_pass),
    }


class EngineFailure(RuntimeError):
    """The actor's engine is broken: every shard in flight on it fails with this one-line message."""


ENGINE_ERROR = "engine error: "  # how a row's error from the engine begins (output.retry_errors runs it again)


def engine_error(exc: BaseException) -> str:
    """The one-line message of an error the engine raised."""
    return f"{ENGINE_ERROR}{_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (at most 300 characters of it)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


class ActorFeed(RequestFeed):
    """The actor's feed; it remembers the requests the engine took and has not answered (the worker forgets each
    as its output arrives), which are the rows an engine error interrupts."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: dict[str, Any] = {}  # request id -> Request, touched only by the engine thread

    def take(self, n: int, wait: bool) -> tuple[list[Any], bool]:
        reqs, closed = super().take(n, wait)
        self.taken.update((str(r.id), r) for r in reqs)
        return reqs, closed


@dataclass
class _Sample:
    """One answer of a row (a row asks for generation.n of them): its conversation so far and what came back."""

    history: list[dict[str, str]] = field(default_factory=list)  # messages so far (turns input)
    answers: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None  # beside token_ids, where the row asked for them
    top_logprobs: Optional[list[list[dict[str, Any]]]] = None  # beside token_ids: per token, its alternatives
    prompt_ids: list[int] = field(default_factory=list)  # the prompt of the turn in the engine
    # (prompt ids, their log-probabilities) of the last answered turn, where the row asked for them
    scored_prompt: Optional[tuple[list[int], list[Optional[float]]]] = None
    num_prompt_tokens: int = 0
    stats: Any = None  # RequestStats merged over turns
    turns: list[Any] = field(default_factory=list)  # each answered turn's own RequestStats, in order
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class _RowState:
    row: JobRow
    shard: "_Shard"
    params: Any = None  # the row's GenerationParams (generation.* and its own params); None when it has an error
    samples: list[_Sample] = field(default_factory=list)  # params.n of them
    error: Optional[str] = None  # the row's own (input, params or prompt), or its first sample's

    def next_turn(self, sample: _Sample) -> Optional[int]:
        """Index of the sample's next turn to answer, or None when it is done."""
        if sample.error is not None or self.error is not None:
            return None
        needed = len(self.row.input) if self.row.kind == "turns" else 1
        return len(sample.answers) if len(sample.answers) < needed else None


@dataclass
class _Shard:
    index: int
    states: list[_RowState] = field(default_factory=list)
    pending: int = 0  # samples of its rows not finished yet
    done: threading.Event = field(default_factory=threading.Event)
    failure: Optional[str] = None


def _out_of_memory(exc: BaseException) -> bool:
    """Whether the engine raised for want of device memory: its own check before an allocation, or CUDA's."""
    import torch

    from esp_worker.memory import MemoryShortError

    return isinstance(exc, (MemoryShortError, torch.OutOfMemoryError))


def _fail_passes_of(engine: Any, row_id: str, what: str = "", then: str = "raise") -> None:
    """Fault injection (fault.fail_row, fault.lose_device, fault.kill_row, fault.hang_row): every decode pass whose
    batch holds row_id ("*": every pass) raises `what` after its work, as an engine error in the middle of that row's
    batch would (the rows' tensors and cache half updated); then="exit" ends the process, as a segfault would;
    then="hang" never returns, as a hung kernel."""
    step = engine._step
    what = what or f"fault.fail_row={row_id}: a decode pass holding row {row_id!r}"

    def failing(rows: Any) -> None:
        held = row_id == "*" or any(str(s.req.id) == row_id for s in rows.seqs)
        step(rows)
        if held and then == "exit":
            os._exit(1)
        while held and then == "hang":
            time.sleep(1.0)
        if held:
            raise RuntimeError(what)

    engine._step = failing


def _faulty_attempt(fault_dir: str, name: str, attempts: int) -> bool:
    """Fault injection: whether this attempt at `name` is one of the first `attempts`, counted across actor restarts
    by the marker file each of those leaves (`<name>.attempt-N`)."""
    markers = Path(fault_dir)
    markers.mkdir(parents=True, exist_ok=True)
    attempt = len(list(markers.glob(f"{name}.attempt-*"))) + 1
    if attempt > attempts:
        return False
    (markers / f"{name}.attempt-{attempt}").touch()
    return True


def device_failure(device: Any) -> Optional[str]:
    """Why `device` no longer works for this process, or None: on CUDA a wait for the device and a tiny operation,
    which fail for good after a sticky error (an illegal memory access, a device-side assert, a device fallen off
    the bus). For the error path, never in a pass (it waits for the device)."""
    if device.type != "cuda":
        return None
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).cpu()
    except torch.OutOfMemoryError:  # full, not broken: the rows run again in halves
        return None
    except Exception as exc:  # noqa: BLE001 - any other error here: the device is gone for this process
        return _one_line(exc)
    return None


def where() -> dict[str, Any]:
    """This process's host, pid and, inside a Ray worker, its node id and IP."""
    place: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "node_id": "", "ip": ""}
    try:
        import ray

        if ray.is_initialized():
            place["node_id"] = ray.get_runtime_context().get_node_id()
            place["ip"] = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - where we run is for the log only
        pass
    return place


class ShardWorker:
    def __init__(self, spec: WorkerSpec):
        import torch

        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.load_error: Optional[str] = None
        self._lock = threading.Lock()  # guards _active, _shard_objs, _loop, _failure
        # request id (a row's id; sample i > 0 of a row with generation.n > 1: `<id>SAMPLE_SEP<i>`) -> the row and
        # the index of the sample whose turn it is
        self._active: dict[str, tuple[_RowState, int]] = {}
        self._shard_objs: dict[int, _Shard] = {}  # id(shard) -> shard in flight
        self._loop: Optional[threading.Thread] = None
        self._failure: Optional[str] = None
        self._failed_alone = 0  # rows that failed alone since a row last finished (engine thread only)
        self._fine_rows = 0  # rows finished since the engine's admission was last lowered or raised
        self.engine_errors = 0  # batches the engine raised in (their rows then ran again in halves)
        self._device_fault = False  # fault.lose_device: this process's device counts as lost
        self.feed = ActorFeed()
        try:
            from esp_worker import Engine, EngineConfig, ModelConfig

            from .prompts import PromptBuilder

            self.engine = Engine.from_config(ModelConfig(**spec.model), EngineConfig(**spec.engine))
            self.prompts = PromptBuilder(self.engine.tokenizer, spec.chat_template, spec.chat_template_kwargs)
            if spec.fail_row:
                _fail_passes_of(self.engine, spec.fail_row)
            if spec.kill_row:
                _fail_passes_of(self.engine, spec.kill_row, then="exit")
            if spec.hang_row:
                _fail_passes_of(self.engine, spec.hang_row, then="hang")
            if spec.lose_device and _faulty_attempt(spec.fault_dir, "device-lost", spec.lose_device):
                self._device_fault = True
                _fail_passes_of(self.engine, "*", "fault.lose_device: CUDA error: an illegal memory access was "
                                                  "encountered (injected)")
        except Exception as exc:  # reported by info(): the driver prints it as one line and stops
            text = str(exc).strip()
            self.load_error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

    def info(self) -> dict[str, Any]:
        """Load status and where this actor runs (node id, IP, pid: the driver logs them and tells a
        restarted actor from one that was only unreachable)."""
        if self.load_error is not None:
            return {"error": self.load_error, **where()}
        return {
            "error": None,
            **where(),
            "max_context": self.engine.loaded.max_context,
            "chat_template": self.prompts.use_template,
            "device": str(self.engine.loaded.device),
        }

    def stats(self) -> dict[str, Any]:
        """The engine's batch-size histogram (rows in the batch -> decode passes) since the actor started, where
        its time went (prefill forwards and seconds, decode seconds), its CUDA graphs' counters (captures, capture
        seconds, graph memory, replayed and eager passes; None: off), and how many batches raised an engine error
        (their rows run again in halves)."""
        stats, graphs = self.engine.stats, self.engine.stats.graphs
        return {"pid": os.getpid(), "batch_histogram": dict(stats.batch_histogram),
                "engine_time": {"prefill_forwards": stats.prefill_forwards, "prefill_s": stats.prefill_s,
                                "prefill_tokens": stats.prefill_tokens,
                                "prefill_cached_tokens": stats.prefill_cached_tokens, "decode_s": stats.decode_s},
                "cuda_graphs": None if graphs is None else graphs.record(), "engine_errors": self.engine_errors}

    def passes(self) -> int:
        """Engine passes (prefill forwards and decode passes) finished so far: the driver's sign of progress."""
        stats = self.engine.stats
        return stats.prefill_forwards + stats.decode_passes

    def run_shard(self, shard_index: int, rows: list[JobRow]) -> pa.Table:
        """One output row per input row (its samples in it), in input order. Safe to call from several threads at once.

        The same rows of the same shard sent while an earlier call still runs them wait for that call's rows: Ray
        reports a call as failed when the actor's node is unreachable for a while (ActorUnavailableError), the call
        may run on, and when the actor answers again from the same process the driver sends it the shard again."""
        self._maybe_hold(shard_index)
        with self._lock:
            if self._failure is not None:
                raise EngineFailure(self._failure)
            running = self._running(shard_index, rows)
            shard, requests = (running, []) if running is not None else self._admit(shard_index, rows)
        if requests:
            self.feed.put(requests)
        if shard.pending:  # (0 once its last row finished, and then `done` is set)
            shard.done.wait()
        if shard.failure is not None:
            raise EngineFailure(shard.failure)
        return to_table([self._record(s) for s in shard.states], self.spec.schema)

    def _admit(self, shard_index: int, rows: list[JobRow]) -> tuple[_Shard, list[Any]]:
        """A new shard of these rows and the requests of their samples' first turns, registered (called under the
        lock)."""
        shard = _Shard(shard_index)
        shard.states = [self._row_state(r, shard) for r in rows]
        requests = []
        for s in shard.states:
            for i, sample in enumerate(s.samples):
                if s.next_turn(sample) is not None and (req := self._request(s, i)) is not None:
                    if req.id in self._active:
                        raise EngineFailure(f"request id {req.id!r} is already in flight on this actor")
                    self._active[req.id] = (s, i)
                    requests.append(req)
        shard.pending = len(requests)
        if shard.pending:
            self._shard_objs[id(shard)] = shard
            self._start_loop()
        return shard, requests

    def _running(self, shard_index: int, rows: list[JobRow]) -> Optional[_Shard]:
        """The shard in flight here with exactly these rows, if any (called under the lock)."""
        ids = [r.id for r in rows]
        return next((s for s in self._shard_objs.values()
                     if s.index == shard_index and [st.row.id for st in s.states] == ids), None)

    # ---- the engine thread ---------------------------------------------------------------------------
    def _start_loop(self) -> None:
        """Start the engine thread once (called under the lock)."""
        if self._loop is None:
            self._loop = threading.Thread(target=self._run_engine, name="engine", daemon=True)
            self._loop.start()

    def _run_engine(self) -> None:
        while True:
            try:
                for out in self.engine.generate_iter(self.feed):
                    self._on_output(out)
                return
            except Exception as exc:  # noqa: BLE001 - the rows it interrupted run again, in halves
                msg, memory = engine_error(exc), _out_of_memory(exc)
            except BaseException as exc:  # noqa: BLE001 - reported to every waiting shard
                self._fail_all(engine_error(exc))
                return
            # out of the except block, so that the failed loop's frames (its batch, its KV cache) are freed first
            try:
                self._exit_if_device_lost(msg)
                if not self._isolate(msg, memory):
                    return
            except BaseException as exc:  # noqa: BLE001 - never a silent engine thread: every waiting shard hears it
                self._fail_all(engine_error(exc))
                return

    def _isolate(self, msg: str, memory: bool) -> bool:
        """The engine raised `msg` with the rows the feed handed it unanswered: run them again in halves (`_retry`);
        False (every shard in flight failed) when the engine, not a row, is at fault. After a batch ran out of
        memory the engine admits at most half its rows for a while: rows like these would fill it again."""
        import torch

        suspects = list(self.feed.taken.values())
        self.feed.taken.clear()
        self.engine_errors += 1
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed batch held, for the rows run again
        log.warning("%s, with %d row(s) in the batch; running them again in halves", msg, len(suspects))
        if memory and 1 < len(suspects) and len(suspects) // 2 < self.engine.max_rows:
            self.engine.max_rows, self._fine_rows = len(suspects) // 2, 0
            log.warning("the engine ran out of memory with %d rows in its batch: it admits at most %d for a while "
                        "(engine.max_batch_size=%d may be too many rows of these lengths for this device)",
                        len(suspects), self.engine.max_rows, self.engine.cfg.max_batch_size)
        return self._halves(suspects)

    def _halves(self, reqs: list[Any]) -> bool:
        """Each half of reqs run again (`_retry`); False as soon as the engine is found broken."""
        half = (len(reqs) + 1) // 2
        return all(self._retry(part) for part in (reqs[:half], reqs[half:]) if part)

    def _regain_rows(self) -> None:
        """A row finished: once REGAIN_AFTER batches' worth have finished since the engine's admission was lowered,
        admit twice as many again (up to engine.max_batch_size). A few long rows that once filled the memory do
        not halve the batch for the rest of the job; rows that fill it again halve it again."""
        engine = self.engine
        if engine.max_rows >= engine.cfg.max_batch_size:
            return
        self._fine_rows += 1
        if self._fine_rows >= REGAIN_AFTER * engine.max_rows:
            engine.max_rows, self._fine_rows = min(2 * engine.max_rows, engine.cfg.max_batch_size), 0
            log.warning("the engine admits up to %d rows again (engine.max_batch_size=%d)", engine.max_rows,
                        engine.cfg.max_batch_size)

    def _retry(self, reqs: list[Any]) -> bool:
        """Run reqs as a batch of their own; where the engine raises again, each half of the rows it left unanswered
        the same way, down to single rows: a bad row costs log2(rows) reruns of shrinking batches, a batch that was
        too large as a whole finishes in halves. A single row that raises gets the error; False (every shard in
        flight failed) when BROKEN_AFTER single rows in a row did."""
        from esp_worker import RequestOutput, RequestStats

        pending = {str(r.id): r for r in reqs}
        error = None
        try:
            for out in self.engine.generate_iter(list(pending.values())):
                pending.pop(out.id, None)
                self._on_output(out)
        except Exception as exc:  # noqa: BLE001 - its rows are split, or the single row gets it
            error = engine_error(exc)
        if error is None:
            return True
        left = list(pending.values())
        if len(left) > 1:
            return self._halves(left)
        if not left:  # every row was answered, the error came after: nothing to rerun
            return True
        self._exit_if_device_lost(error)
        self._failed_alone += 1
        log.warning("row %r failed alone: %s", left[0].id, error)
        if self._failed_alone >= BROKEN_AFTER:
            self._fail_all(f"{error} ({self._failed_alone} rows in a row failed alone: the engine fails, not a row)")
            return False
        self._on_output(RequestOutput(id=str(left[0].id), token_ids=[], text="", finish_reason=None,
                                      stats=RequestStats(), error=error))
        return True

    def _exit_if_device_lost(self, msg: str) -> None:
        """After the engine raised `msg`: end this process when its device no longer works (see the module
        docstring), before any row is given the error."""
        lost = self._device_lost()
        if lost is None:
            return
        log.error("%s; the device no longer works (%s): this actor's process exits so that Ray starts it again, "
                  "and its shards run again", msg, lost)
        os._exit(1)

    def _device_lost(self) -> Optional[str]:
        """Why the engine's device no longer works (`device_failure`), or None."""
        return "fault.lose_device" if self._device_fault else device_failure(self.engine.device)

    def _fail_all(self, msg: str) -> None:
        """Every shard in flight, and every shard given to this actor from now on, fails with msg."""
        with self._lock:
            self._failure = msg
            shards = list(self._shard_objs.values())
            self._shard_objs.clear()
        for shard in shards:
            shard.failure = msg
            shard.done.set()

    def _on_output(self, out: Any) -> None:
        """A turn finished: absorb it, queue the row's next turn at once, release a finished shard."""
        self.feed.taken.pop(out.id, None)
        if out.error is None:
            self._failed_alone = 0
            self._regain_rows()
        with self._lock:
            s, i = self._active.pop(out.id)
        self._maybe_die(s.shard.index)
        self._absorb(s.samples[i], s.row, out)
        nxt = self._request(s, i) if s.next_turn(s.samples[i]) is not None else None
        if nxt is not None:
            with self._lock:
                self._active[nxt.id] = (s, i)
            self.feed.put([nxt])
            return
        shard = s.shard
        shard.pending -= 1  # only this thread decrements
        if shard.pending == 0:
            with self._lock:
                self._shard_objs.pop(id(shard), None)
            shard.done.set()

    # ---- rows ----------------------------------------------------------------------------------------
    def _row_state(self, row: JobRow, shard: _Shard) -> _RowState:
        """A row's state: its generation parameters (generation.* and the row's own) and one sample per params.n;
        an input or params problem is the row's error."""
        from esp_worker import GenerationParams, RequestStats

        s = _RowState(row=row, shard=shard, error=row.error)
        if s.error is not None:
            return s
        try:
            params = GenerationParams(**{**self.spec.generation, **row.params})
            problem = params.problem()
        except Exception as exc:  # noqa: BLE001 - any malformed value: the row's error, not the job's
            problem = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        if problem:
            s.error = f"invalid generation parameter: {problem}"
            return s
        s.params = params
        s.samples = [_Sample(stats=RequestStats()) for _ in range(params.n)]
        return s

    def _request(self, s: _RowState, i: int) -> Any:
        """The engine request for the next turn of the row's sample i; None (with the row's error set) if it cannot
        be built."""
        from esp_worker import Request
        from esp_worker.types import sample_request

        row, sample = s.row, s.samples[i]
        try:
            if i and row.kind != "turns":  # sample 0's prompt (its request is built first): tokenized once
                ids = s.samples[0].prompt_ids
            elif row.kind == "prompt":
                ids = self.prompts.prompt_ids(row.input)
            elif row.kind == "messages":
                ids = self.prompts.chat_ids(list(row.input))
            else:
                sample.history.append({"role": "user", "content": row.input[len(sample.answers)]})
                ids = self.prompts.chat_ids(sample.history)
        except Exception as exc:  # tokenizer or template failure on this row's content
            s.error = f"cannot build the prompt: {type(exc).__name__}: {str(exc).strip()[:200]}"
            return None
        sample.num_prompt_tokens += len(ids)
        sample.prompt_ids = ids
        # the row id is the request id: the engine derives the row's sampling seed from it, so results
        # do not depend on sharding or on which rows share a batch (sample i: see `esp_worker.sample_requests`)
        req = Request(id=row.id, prompt_ids=ids, params=s.params)
        if s.params.n == 1:
            return req
        sample = sample_request(req, i, self.engine.cfg.seed)  # its seed set: the id no longer chooses it
        return sample if i == 0 else replace(sample, id=f"{row.id}{SAMPLE_SEP}{i}")

    def _absorb(self, sample: _Sample, row: JobRow, out: Any) -> None:
        sample.stats = sample.stats.merge(out.stats)
        if out.error is not None:
            sample.error = out.error
            return
        sample.answers.append(out.text)
        sample.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            sample.scored_prompt = (sample.prompt_ids, out.prompt_logprobs)
        if out.top_logprobs is not None:
            sample.top_logprobs = (sample.top_logprobs or []) + [[{"token_id": t, "logprob": lp} for t, lp in alts]
                                                                 for alts in out.top_logprobs]
        sample.turns.append(out.stats)
        sample.finish_reason = out.finish_reason
        if row.kind == "turns":
            answer = out.text.strip() if self.spec.turn_history == "stripped" else out.text
            sample.history.append({"role": "assistant", "content": answer})

    def _record(self, s: _RowState) -> dict[str, Any]:
        """The row's output record: sample 0's answer in the answer columns (what n = 1 gives), the counters summed
        over every sample's turns, and with n > 1 each sample's own answer and counters in `samples`."""
        from esp_worker import RequestStats

        first = s.samples[0] if s.samples else _Sample(stats=RequestStats())
        error = s.error or next((x.error for x in s.samples if x.error is not None), None)
        st = RequestStats()
        for x in s.samples:
            st = st.merge(x.stats)
        turns = [t for x in s.samples for t in x.turns]
        answer = self._sample_record(s.row, first)  # sample 0's: the row's answer columns
        rec = {
            "id": s.row.id,
            "generated_text": first.answers[-1] if first.answers else None,
            "generated_turns": first.answers if s.row.kind == "turns" else None,
            "samples": [self._sample_record(s.row, x) for x in s.samples] if len(s.samples) > 1 else None,
            "generated_token_ids": first.token_ids if first.answers else None,
            "token_logprobs": first.logprobs if first.answers else None,
            "top_logprobs": first.top_logprobs if first.answers else None,
            "prompt_token_ids": first.scored_prompt[0] if first.scored_prompt else None,
            "prompt_logprobs": first.scored_prompt[1] if first.scored_prompt else None,
            "num_prompt_tokens": sum(x.num_prompt_tokens for x in s.samples),
            "num_cached_prompt_tokens": st.num_cached_prompt_tokens,
            "num_generated_tokens": sum(len(x.token_ids) for x in s.samples),
            "finish_reason": first.finish_reason if error is None else None,
            "method": self.spec.engine["method"],
            "lossless": self.spec.engine["method"] not in NOT_LOSSLESS,
            **_counters(st),
            "time_s": sum(t.time_s for t in turns) if turns else None,  # no turn ran: no time to divide by
            "error": error,
            **{k: answer[k] for k in ("turn_generated_tokens", "turn_time_s", "turn_decode_passes")},
            "num_drafts": st.num_drafts,
            "num_draft_tokens": st.num_drafted_tokens,
            "num_accepted_tokens": st.num_accepted_drafts,
            "num_accepted_tokens_per_pos": list(st.accepted_per_depth),
            CATEGORY: s.row.category,
        }
        rec.update({k: v for k, v in s.row.carry.items() if k not in rec})
        return rec

    @staticmethod
    def _sample_record(row: JobRow, x: _Sample) -> dict[str, Any]:
        """One sample's entry in `samples` (schema.SAMPLE)."""
        return {
            "text": x.answers[-1] if x.answers else None,
            "turns": x.answers if row.kind == "turns" else None,
            "token_ids": x.token_ids if x.answers else None,
            "token_logprobs": x.logprobs if x.answers else None,
            "finish_reason": x.finish_reason if x.error is None else None,
            "num_generated_tokens": len(x.token_ids),
            "num_decode_passes": x.stats.num_decode_passes,
            "num_decode_tokens": x.stats.num_decode_tokens,
            "tau": _finite(x.stats.tau),
            "time_s": sum(t.time_s for t in x.turns) if x.turns else None,
            "error": x.error,
            "turn_generated_tokens": [t.num_generated_tokens for t in x.turns],
            "turn_time_s": [t.time_s for t in x.turns],
            "turn_decode_passes": [t.num_decode_passes for t in x.turns],
            "committed_per_pass": list(x.stats.committed_per_pass),
        }

    def _maybe_hold(self, shard_index: int) -> None:
        """Fault injection: on `hold_shard`, write hold-N.json (where this actor runs) and wait until the
        test writes `release` (after removing this actor's node, or the head). A retry that starts after
        the release runs at once."""
        if shard_index != self.spec.hold_shard:
            return
        markers = Path(self.spec.fault_dir)
        release = markers / "release"
        if release.exists():
            return
        markers.mkdir(parents=True, exist_ok=True)
        tmp = markers / f".hold-{shard_index}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(where()))
        tmp.rename(markers / f"hold-{shard_index}.json")
        deadline = time.monotonic() + 900  # a hang guard: a test that never releases does not leave it waiting
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _maybe_die(self, shard_index: int) -> None:
        """Fault injection: exit the process when a row of `kill_shard` finishes, on the first
        `kill_attempts` attempts (markers in fault_dir count the attempts across restarts)."""
        if shard_index == self.spec.kill_shard and _faulty_attempt(self.spec.fault_dir, f"shard-{shard_index}",
                                                                   self.spec.kill_attempts):
            os._exit(1)
