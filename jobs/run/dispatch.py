"""Hands shards to the engine actors, writes each finished shard's part, and decides what a failed call means.

Each live actor holds up to `cap` shards. A shard whose actor is lost goes back to the front of the queue,
to the live actors (or to that actor when it is back); its part is written once, by the driver, so every
id appears exactly once whatever happened. A shard that keeps killing its actors is isolated (`isolation`):
split into pieces run alone until the row at fault is found and given an error, so one row cannot make a job
unfinishable. A shard fails the job when the engine raised on it (the actor found its engine, not a row, at
fault); the job also stops when no actor is left. Either way the job stops submitting, keeps every finished
part and names the cause.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Any, Optional

from ..io.output import OutputDir
from .actors import Actor, ActorPool
from .isolation import Isolation, Work, whole
from .progress import Progress
from .retry import Retry
from .rows import JobRow

log = logging.getLogger("esp_batch")


def first_line(text: Any, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:limit]


class Dispatcher:
    def __init__(self, pool: ActorPool, cap: int, out: OutputDir, compression: str, progress: Progress,
                 max_restarts: int, exit_after_parts: int = -1):
        self.pool = pool
        self.cap = cap
        self.out = out
        self.compression = compression
        self.progress = progress
        self.queue: collections.deque[Work] = collections.deque()  # shards or pieces waiting for an actor, retries first
        self.in_flight: dict[Any, tuple[Work, Actor]] = {}  # ObjectRef -> (work, actor running it)
        self.isolation = Isolation(max_restarts)
        self.done: set[int] = set()  # shards whose table came back
        self.failures: list[tuple[int, str]] = []  # (shard, cause)
        self.stopped: Optional[str] = None  # why the job stopped without a shard to blame (no actor left)
        self.finished: list[tuple[int, Any, str]] = []  # (shard, table, fingerprint) returned, not yet written
        self.shards_written = 0
        self.exit_after_parts = exit_after_parts  # fault injection (tests): the driver dies after this many parts
        self.retry: Optional[Retry] = None  # output.retry_errors: a shard run again in part is merged with its part
        pool.on_death = self._count_death

    @property
    def can_submit(self) -> bool:
        return not self.failures and self.stopped is None

    @property
    def failed(self) -> bool:
        return not self.can_submit

    def submit(self, shard_index: int, rows: list[JobRow], fingerprint: str) -> None:
        """Queue the shard and return once every queued shard is on an actor (or the job stopped)."""
        self.queue.append(Work(whole(shard_index), rows, fingerprint))
        while self.queue and self.can_submit:
            self._dispatch()
            self.flush()  # write finished parts only now: the actors got their next shards first
            if self.queue:
                self.wait_one()
        self.flush()

    def drain(self) -> None:
        """Wait for every shard in flight or queued (after a failure: only those in flight)."""
        while self.in_flight or (self.queue and self.can_submit):
            if self.can_submit:
                self._dispatch()
            self.flush()
            if self.in_flight or (self.queue and self.can_submit):
                self.wait_one()
        self.flush()

    def _dispatch(self) -> None:
        """Hand out the queue in order. A piece that runs alone waits for an idle actor, and nothing behind it is
        handed out meanwhile: the actors drain for it."""
        while self.queue and self.can_submit:
            work = self.queue[0]
            parts = self.isolation.split(work)
            if self.isolation.broken is not None:
                self.failures.append((work.piece.shard, self.isolation.broken))
                return
            if parts is not None:
                self._note_split(work, parts)
                self.queue.popleft()
                self.queue.extendleft(reversed(parts))
                continue
            alone = {a.index for w, a in self.in_flight.values() if w.alone}
            free = [a for a in self.pool.live() if (a.load == 0 if work.alone else a.load < self.cap)
                    and a.index not in alone]
            if not free:
                return
            actor = min(free, key=lambda a: a.load)
            self.queue.popleft()
            self.in_flight[actor.handle.run_shard.remote(work.piece.shard, work.rows)] = (work, actor)
            actor.load += 1

    def wait_one(self) -> None:
        """Up to a second for a shard to come back (answering lost actors meanwhile); collect it."""
        for ref in self.pool.wait(list(self.in_flight), timeout=1.0):
            self._collect(ref)
        self.progress.update()
        if not self.pool.any_left and self.stopped is None:
            self.pool.head.confirm("no engine actor is left")
            self.stopped = self.pool.none_left()

    def _collect(self, ref: Any) -> None:
        import ray
        from ray.exceptions import RayActorError, RaySystemError, RayTaskError

        work, actor = self.in_flight.pop(ref)
        actor.load -= 1
        shard = work.piece.shard
        try:
            table = ray.get(ref)
        except RayActorError as exc:  # the actor is unreachable or died: the work goes back to the queue
            held = [work] + [w for w, a in self.in_flight.values() if a is actor]
            self.pool.lose(actor, exc, held)
            self.queue.appendleft(work)
            return
        except RayTaskError as exc:  # the engine raised
            cause = exc.cause if exc.cause is not None else exc
            self.failures.append((shard, first_line(cause) or type(cause).__name__))
            return
        except (RaySystemError, ConnectionError) as exc:
            self.failures.append((shard, f"cluster lost: {first_line(exc)}"))
            return
        table = self.isolation.returned(work, table)
        if table is not None:
            self.done.add(shard)
            self.finished.append((shard, table, work.fingerprint))

    def _note_split(self, work: Work, parts: list[Work]) -> None:
        deaths = self.isolation.deaths[work.piece]
        if len(parts) == 1 and parts[0].settled:
            log.error("row %r (%s) took down the engine actor each of the %d times it ran alone: it gets an error and the "
                      "job goes on", parts[0].rows[0].id, parts[0].piece, deaths)
        elif not work.alone:
            log.warning("%s was held by %d actor deaths: it runs in pieces, each alone on an actor, to find a row "
                        "that kills the engine", work.piece, deaths)
        else:
            log.warning("%s killed the engine actor running it alone: it runs again as %s", work.piece,
                        " and ".join(str(p.piece) for p in parts))

    def _count_death(self, actor: Actor, held: list[Work]) -> bool:
        """`actor` died holding `held`; whether the death is charged to a piece it ran alone (`isolation`)."""
        return self.isolation.count_death(held, f"actor {actor.index} on {actor.place}: {actor.error}")

    def flush(self) -> None:
        """Write the parts of the shards collected so far."""
        while self.finished:
            self.write(*self.finished.pop(0))

    def write(self, shard_index: int, table: Any, fingerprint: str) -> None:
        whole = self.retry.merged(shard_index, table) if self.retry is not None else table
        self.out.write_part(shard_index, whole, self.compression, fingerprint)
        self.shards_written += 1
        if self.shards_written == self.exit_after_parts:
            os._exit(1)  # as a killed driver: no cleanup, no summary
        self.progress.run.add(table)
        self.progress.update()

    def failure_message(self) -> str:
        if self.stopped is not None and not self.failures:
            return self.stopped
        shard, cause = self.failures[0]
        more = len(self.failures) - 1
        return f"shard {shard} failed: {cause}" + (f" ({more} more shard(s) failed)" if more else "")

