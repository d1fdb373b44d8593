"""output.retry_errors: a rerun runs again the rows whose error came from running them, keeping the rest of their parts.

An engine error (a batch that ran out of memory, a row that fails alone) or a row that took down its actor each time
it ran alone may not happen again: the memory was another process's, the node was bad, the fault is fixed. Such rows
are found in the parts an earlier run wrote (their `id` and `error` columns), run again with the unchanged shards'
other rows kept, and each part is written again with the old rows and the new ones in input order. Rows whose input
or prompt is bad (`error` from reading or templating them) would fail the same way: they keep their error.
"""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from ..io.output import OutputDir, shard_of
from .isolation import LOST_ACTOR_ERROR
from .rows import JobRow
from .worker import ENGINE_ERROR

RETRYABLE = (ENGINE_ERROR, LOST_ACTOR_ERROR)


def retryable(error: Optional[str]) -> bool:
    """Whether a row's error came from running it (the engine, its actor), not from its input."""
    return error is not None and error.startswith(RETRYABLE)


class Retry:
    """The rows of the existing parts to run again, and the parts' rows put back together."""

    def __init__(self, out: OutputDir):
        self.out = out
        self.ids: dict[int, set[str]] = {}  # shard -> ids of its rows to run again
        for path, table in out.read_columns(["id", "error"]):
            again = {i for i, e in zip(table.column("id").to_pylist(), table.column("error").to_pylist()) if retryable(e)}
            if again:
                self.ids.setdefault(shard_of(path.rpartition("/")[2]), set()).update(again)
        self.order: dict[int, list[str]] = {}  # shard being retried -> its input ids, in order
        self.rows = 0  # rows handed out to run again

    def select(self, shard_index: int, rows: list[JobRow]) -> list[JobRow]:
        """The shard's rows to run again (its part is otherwise kept): none when its part has no such row."""
        ids = self.ids.get(shard_index, set())
        again = [r for r in rows if r.id in ids]
        if again:
            self.order[shard_index] = [r.id for r in rows]
            self.rows += len(again)
        return again

    def merged(self, shard_index: int, table: Any) -> Any:
        """The shard's whole table: the part's kept rows and `table`'s rows run again, in input order."""
        order = self.order.pop(shard_index, None)
        if order is None:
            return table
        new = set(table.column("id").to_pylist())
        old = self.out.read_part(shard_index, table.schema)
        kept = old.filter(pa.array([i not in new for i in old.column("id").to_pylist()], pa.bool_()))
        both = pa.concat_tables([kept, table])
        position = {row_id: i for i, row_id in enumerate(order)}
        ids = both.column("id").to_pylist()
        return both.take(sorted(range(both.num_rows), key=lambda i: position[ids[i]]))
