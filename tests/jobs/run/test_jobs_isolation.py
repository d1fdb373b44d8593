"""Finding the row that kills its actor: which deaths split a shard, which are charged to a piece run alone, when a
row is blamed, and how the pieces' tables come back together as the shard's."""
from __future__ import annotations

import pyarrow as pa

from jobs.run.isolation import Isolation, Piece, Work, whole
from jobs.run.rows import JobRow


def _shard(index: int, n: int) -> Work:
    return Work(whole(index), [JobRow(id=f"s{index}r{i}", kind="prompt", input=f"p{i}") for i in range(n)], "fp")


def _next(iso: Isolation, work: Work) -> list[Work]:
    """What the dispatcher would send for `work` (its parts when due, else itself)."""
    parts = iso.split(work)
    return [work] if parts is None else parts


def _table(work: Work) -> pa.Table:
    schema = pa.schema([("id", pa.string()), ("error", pa.string())])  # as the job's schema: one per job
    return pa.table({"id": [r.id for r in work.rows], "error": [r.error for r in work.rows]}, schema=schema)


def test_a_poison_row_is_bisected_then_blamed_and_the_shard_comes_back_whole_in_order():
    iso = Isolation(max_restarts=3)
    shard = _shard(7, 4)  # row 2 kills every actor that runs it
    assert not iso.count_death([shard, _shard(8, 4)], "died")  # held with another shard: both suspect once
    assert _next(iso, shard) == [shard]  # one death (a lost node, say): the shard runs again as it was
    assert not iso.count_death([shard], "died")  # the second death: not charged (it did not run alone)
    halves = _next(iso, shard)
    assert [w.piece for w in halves] == [Piece(7, 0, 2), Piece(7, 2, 4)] and all(w.alone for w in halves)
    assert [r.id for r in halves[1].rows] == ["s7r2", "s7r3"]
    assert iso.returned(halves[0], _table(halves[0])) is None  # the shard is not whole yet
    assert iso.count_death([halves[1]], "died alone")  # charged to the piece it ran alone
    quarter = _next(iso, halves[1])  # a piece of several rows that killed its actor alone: split at once
    assert [w.piece for w in quarter] == [Piece(7, 2, 3), Piece(7, 3, 4)]
    poison, fine = quarter
    assert iso.returned(fine, _table(fine)) is None
    assert iso.count_death([poison], "died alone")
    assert _next(iso, poison) == [poison]  # one death alone does not convict: it runs alone once more
    assert iso.count_death([poison], "segfault")
    [blamed] = _next(iso, poison)
    assert not blamed.alone and blamed.settled and blamed.rows[0].id == "s7r2"
    assert blamed.rows[0].error.startswith("the engine actor was lost each of the 2 times it ran this row "
                                           "alone") and blamed.rows[0].error.endswith(": segfault")
    assert iso.blamed == [(Piece(7, 2, 3), "s7r2")]
    table = iso.returned(blamed, _table(blamed))
    assert table.column("id").to_pylist() == ["s7r0", "s7r1", "s7r2", "s7r3"]
    assert table.column("error").to_pylist()[2] == blamed.rows[0].error


def test_a_blamed_row_held_by_a_later_death_keeps_its_error():
    iso = Isolation(max_restarts=3)
    shard = _shard(0, 1)
    iso.count_death([shard], "x")
    iso.count_death([shard], "x")
    [alone] = _next(iso, shard)  # a one-row shard held by two deaths runs alone before it is blamed
    assert alone.alone and alone.piece == Piece(0, 0, 1)
    iso.count_death([alone], "x")
    iso.count_death([alone], "x")
    [blamed] = _next(iso, alone)
    assert blamed.settled
    assert not iso.count_death([blamed, _shard(1, 2)], "a lost node")  # settled rows never count
    assert _next(iso, blamed) == [blamed]


def test_a_returned_piece_is_no_longer_due_and_whole_shards_pass_through():
    iso = Isolation(max_restarts=3)
    shard = _shard(3, 2)
    iso.count_death([shard], "x")
    iso.count_death([shard], "x")  # due to be split, but an actor already had it again and finished it
    table = _table(shard)
    assert iso.returned(shard, table) is table
    assert iso.split(shard) is None


def test_with_one_restart_allowed_a_shard_is_isolated_after_one_death():
    iso = Isolation(max_restarts=1)
    shard = _shard(0, 2)
    iso.count_death([shard], "x")
    assert [w.piece for w in _next(iso, shard)] == [Piece(0, 0, 1), Piece(0, 1, 2)]


def test_pieces_read_as_shards_and_rows():
    assert [str(p) for p in (whole(4), Piece(4, 2, 3), Piece(4, 0, 2))] == ["shard 4", "shard 4 row 2",
                                                                            "shard 4 rows 0-1"]


def _blame(iso: Isolation, shard: int) -> Work:
    """A one-row shard that takes down every actor running it, to its blamed row."""
    work = _shard(shard, 1)
    iso.count_death([work], "x")
    iso.count_death([work], "x")
    [alone] = _next(iso, work)
    iso.count_death([alone], "x")
    iso.count_death([alone], "x")
    [blamed] = _next(iso, alone)
    assert blamed.settled
    return blamed


def test_rows_blamed_one_after_another_with_nothing_finishing_between_make_the_engine_the_cause():
    iso = Isolation(max_restarts=3)
    blamed = _blame(iso, 0)
    iso.returned(blamed, _table(blamed))  # a blamed row's own output is no sign that the engine works
    _blame(iso, 1)
    fine = _shard(2, 2)
    iso.returned(fine, _table(fine))  # work finished: the rows before were bad rows, not a bad engine
    _blame(iso, 3)
    _blame(iso, 4)
    assert iso.broken is None
    _blame(iso, 5)
    assert iso.broken.startswith("3 rows in a row took down their engine actor each time they ran alone, none "
                                 "finishing between: the engine fails, not a row (the last: x)")
