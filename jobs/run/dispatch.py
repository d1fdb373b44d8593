"""Hands shards to the engine actors, writes each finished shard's part, and decides what a failed call means.

Each live actor holds up to `cap` shards. A shard whose actor is lost goes back to the front of the queue,
to the live actors (or to that actor when it is back); its part is written once, by the driver, so every
id appears exactly once whatever happened. A shard fails the job when the engine raised on it, or when the
actors running it died more than ray.max_restarts times (a shard that kills its actor); the job also stops
when no actor is left. Either way the job stops submitting, keeps every finished part and names the cause.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..io.output import OutputDir
from .actors import Actor, ActorPool
from .progress import Progress
from .rows import JobRow


@dataclass
class _Shard:
    index: int
    rows: list[JobRow]
    fingerprint: str


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
        self.max_restarts = max_restarts
        self.queue: collections.deque[_Shard] = collections.deque()  # shards waiting for an actor, retries first
        self.in_flight: dict[Any, tuple[_Shard, Actor]] = {}  # ObjectRef -> (shard, actor running it)
        self.deaths: collections.Counter[int] = collections.Counter()  # shard -> actors that died holding it
        self.done: set[int] = set()  # shards whose table came back
        self.failures: list[tuple[int, str]] = []  # (shard, cause)
        self.stopped: Optional[str] = None  # why the job stopped without a shard to blame (no actor left)
        self.finished: list[tuple[int, Any, str]] = []  # (shard, table, fingerprint) returned, not yet written
        self.shards_written = 0
        self.exit_after_parts = exit_after_parts  # fault injection (tests): the driver dies after this many parts
        pool.on_death = self._count_death

    @property
    def can_submit(self) -> bool:
        return not self.failures and self.stopped is None

    @property
    def failed(self) -> bool:
        return not self.can_submit

    def submit(self, shard_index: int, rows: list[JobRow], fingerprint: str) -> None:
        """Queue the shard and return once every queued shard is on an actor (or the job stopped)."""
        self.queue.append(_Shard(shard_index, rows, fingerprint))
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
        while self.queue and self.can_submit:
            free = [a for a in self.pool.live() if a.load < self.cap]
            if not free:
                return
            actor = min(free, key=lambda a: a.load)
            shard = self.queue.popleft()
            self.in_flight[actor.handle.run_shard.remote(shard.index, shard.rows)] = (shard, actor)
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

        shard, actor = self.in_flight.pop(ref)
        actor.load -= 1
        try:
            table = ray.get(ref)
        except RayActorError as exc:  # the actor is unreachable or died: the shard goes back to the queue
            held = [shard.index] + [s.index for s, a in self.in_flight.values() if a is actor]
            self.pool.lose(actor, exc, held)
            self.queue.appendleft(shard)
            return
        except RayTaskError as exc:  # the engine raised
            cause = exc.cause if exc.cause is not None else exc
            self.failures.append((shard.index, first_line(cause) or type(cause).__name__))
            return
        except (RaySystemError, ConnectionError) as exc:
            self.failures.append((shard.index, f"cluster lost: {first_line(exc)}"))
            return
        self.done.add(shard.index)
        self.finished.append((shard.index, table, shard.fingerprint))

    def _count_death(self, actor: Actor, shards: list[int]) -> None:
        """`actor` died holding `shards`: a shard that outlived ray.max_restarts actors fails the job."""
        for s in shards:
            if s in self.done:
                continue
            self.deaths[s] += 1
            if self.deaths[s] > self.max_restarts and all(f != s for f, _ in self.failures):
                self.failures.append((s, f"the actors running it died {self.deaths[s]} times (more than "
                                         f"ray.max_restarts={self.max_restarts}); the last, actor {actor.index} on "
                                         f"{actor.place}: {actor.error}"))

    def flush(self) -> None:
        """Write the parts of the shards collected so far."""
        while self.finished:
            self.write(*self.finished.pop(0))

    def write(self, shard_index: int, table: Any, fingerprint: str) -> None:
        self.out.write_part(shard_index, table, self.compression, fingerprint)
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

