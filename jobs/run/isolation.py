"""Finding the row that kills its engine actor: shards that die too often are split, run alone, and the row blamed.

Most actor deaths are not a row's doing (a lost node, a preempted machine), and the shards an actor held simply
run again elsewhere. But a row can kill the process that runs it (a segfault in a kernel or a tokenizer, a host
out-of-memory the engine's own checks miss), and then every actor that takes its shard dies too. So:

- A shard held by ISOLATE_AFTER actor deaths (1 when ray.max_restarts is 1) is *isolated*: split in halves, each
  run **alone** on an actor (nothing else goes to that actor meanwhile, and nothing is handed out while such a
  piece waits, so an actor drains for it).
- A death while an actor runs a piece alone is that piece's doing, so it is *charged* to the piece, not to the
  actor's ray.max_restarts: a piece of several rows is split again in halves at once; a single row runs alone
  again, and if it kills that actor too (BLAME_AFTER deaths alone) it is *blamed*: it goes back to an actor with
  its `error` set, which returns its output row without running it, and the job goes on.
- When BROKEN_AFTER rows in a row are blamed, with no work finishing between them, the engine or the machines fail
  every row (a driver bug, too little host memory for the model): the job stops, as after any failed shard, rather
  than give every row an error two actor restarts at a time.

A poison row costs ISOLATE_AFTER + log2(data.shard_size) - 1 + BLAME_AFTER actor restarts (14 for 2,048 rows),
and its shard's rows run in smaller batches meanwhile; the other shards run as before. The pieces' tables are put
back together in row order, so the shard's part is written once, as any other. Pure bookkeeping: the dispatcher
submits and collects.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .rows import JobRow

LOST_ACTOR_ERROR = "the engine actor was lost "  # how a blamed row's error begins (output.retry_errors runs it again)
ISOLATE_AFTER = 2  # actor deaths holding a shard that make it suspect (1 when ray.max_restarts = 1)
BLAME_AFTER = 2  # deaths of the actor running a single row alone that make the row the cause
BROKEN_AFTER = 3  # rows blamed one after another, no work finishing between, that make the engine (not rows) the cause


@dataclass(frozen=True, order=True)
class Piece:
    """Rows [start, stop) of shard `shard`: a whole shard, or part of an isolated one."""

    shard: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"shard {self.shard}" if self.start == 0 and self.stop < 0 else (
            f"shard {self.shard} row {self.start}" if self.size == 1 else
            f"shard {self.shard} rows {self.start}-{self.stop - 1}")


def whole(shard: int) -> Piece:
    """The piece that stands for a whole shard (stop -1: its size is the shard's)."""
    return Piece(shard, 0, -1)


@dataclass
class Work:
    """What goes to an actor: a piece's rows."""

    piece: Piece
    rows: list[JobRow]
    fingerprint: str
    alone: bool = False  # runs on an actor with nothing else in flight (a piece of an isolated shard)

    @property
    def settled(self) -> bool:
        """Every row already has its error (bad input, or blamed): the actor returns them without the engine."""
        return all(r.error is not None for r in self.rows)


@dataclass
class _Assembly:
    """An isolated shard's pieces that came back, until they cover its rows."""

    size: int
    tables: dict[int, Any] = dataclasses.field(default_factory=dict)  # piece start -> table

    def covered(self) -> int:
        return sum(t.num_rows for t in self.tables.values())


class Isolation:
    """Actor deaths per piece, and the pieces due to be split or blamed."""

    def __init__(self, max_restarts: int):
        self.isolate_after = ISOLATE_AFTER if max_restarts >= ISOLATE_AFTER else 1
        self.deaths: collections.Counter[Piece] = collections.Counter()  # piece -> deaths of actors holding it
        self.due: dict[Piece, str] = {}  # piece -> the last death's cause, to split (or blame) at its next dispatch
        self.assemblies: dict[int, _Assembly] = {}  # isolated shard -> its pieces back so far
        self.blamed: list[tuple[Piece, str]] = []  # rows given an error (piece, row id)
        self.blamed_in_a_row = 0  # rows blamed since work last finished
        self.broken: Optional[str] = None  # why the engine, not a row, is at fault (BROKEN_AFTER)
        self.isolated: set[int] = set()  # shards split into pieces

    def count_death(self, held: list[Work], cause: str) -> bool:
        """An actor died holding `held` (its pieces in flight, not yet back). Returns whether the death is charged to
        a piece it ran alone (then it does not count toward the actor's ray.max_restarts)."""
        for work in held:
            if work.settled:
                continue
            p = work.piece
            self.deaths[p] += 1
            if (work.alone and (p.size > 1 or self.deaths[p] >= BLAME_AFTER)) or (
                    not work.alone and self.deaths[p] >= self.isolate_after):
                self.due[p] = cause
        return len(held) == 1 and held[0].alone

    def returned(self, work: Work, table: Any) -> Optional[Any]:
        """A piece's table came back: the shard's whole table once its pieces cover it, else None."""
        self.due.pop(work.piece, None)
        if not work.settled:
            self.blamed_in_a_row = 0
        if work.piece.stop < 0:
            return table
        assembly = self.assemblies[work.piece.shard]
        assembly.tables[work.piece.start] = table
        if assembly.covered() < assembly.size:
            return None
        import pyarrow as pa

        del self.assemblies[work.piece.shard]
        return pa.concat_tables([assembly.tables[k] for k in sorted(assembly.tables)])

    def split(self, work: Work) -> Optional[list[Work]]:
        """What replaces `work` at its dispatch when it is due: its halves, run alone, or for a single row run alone
        that killed its actors BLAME_AFTER times, the row with its error set (its output row, no engine). None when
        it is not due."""
        cause = self.due.pop(work.piece, None)
        if cause is None:
            return None
        p, n = work.piece, len(work.rows)
        if p.stop < 0:  # a whole shard: from now on its pieces come back one by one
            self.assemblies[p.shard] = _Assembly(n)
            self.isolated.add(p.shard)
            p = Piece(p.shard, 0, n)
        if n == 1 and not work.alone:  # a one-row shard: run alone first
            return [Work(p, work.rows, work.fingerprint, alone=True)]
        if n == 1:
            row = work.rows[0]
            error = (f"{LOST_ACTOR_ERROR}each of the {self.deaths[work.piece]} times it ran this row alone "
                     f"(its process died: a crash in the engine or the tokenizer, host memory; or its engine stalled): "
                     f"{cause}")
            self.blamed.append((p, row.id))
            self.blamed_in_a_row += 1
            if self.blamed_in_a_row >= BROKEN_AFTER:
                self.broken = (f"{self.blamed_in_a_row} rows in a row took down their engine actor each time they ran "
                               f"alone, none finishing between: the engine fails, not a row (the last: {cause})")
            return [Work(p, [dataclasses.replace(row, error=error, kind=None)], work.fingerprint)]
        half = n // 2
        return [Work(Piece(p.shard, p.start, p.start + half), work.rows[:half], work.fingerprint, alone=True),
                Work(Piece(p.shard, p.start + half, p.stop), work.rows[half:], work.fingerprint, alone=True)]
