"""Large-job behaviour on a real local Ray head: engines at full batch across shards and turns, a resume
that never duplicates or loses a row when the input changes, the final ids check, actor kills with
several shards in flight, start-up separated from generation, and errors that come before Ray starts."""
from __future__ import annotations

import json
import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from jobs_helpers import FAST, REPO, job_cfg, ray_head, read_output, run_cli, write_jsonl  # noqa: F401
from jobs.run.cluster import ClusterError
from jobs.config import config_hash, load_config
from jobs.run.rows import parse_params
from jobs.run.runner import JobError, run_job
from esp_worker import GenerationParams
from jobs.run.worker import ActorFeed


def _prompts(n: int, prefix: str = "p", start: int = 0) -> list[dict]:
    return [{"id": f"{prefix}{i:03d}", "prompt": f"Question {i}: what is {i} plus {i}?", "category": "qa"}
            for i in range(start, start + n)]


def _summary(out: Path) -> dict:
    return json.loads((out / "_summary.json").read_text())


class _GatedFeed(ActorFeed):
    """A feed the test controls: the engine takes nothing until `expected` requests are queued."""

    def __init__(self, expected: int):
        super().__init__()
        self.expected, self.ready = expected, threading.Event()

    def put(self, requests):
        super().put(requests)
        if len(self) >= self.expected:
            self.ready.set()

    def take(self, n, wait):
        assert self.ready.wait(timeout=300), "the shards never queued their rows"
        return super().take(n, wait)


def test_small_shards_still_fill_the_engine_batch(tmp_path):
    """Worker without Ray: 20 shards of 4 rows in flight at once (the driver keeps several per actor), batch 16.
    The engine batches rows across shards, so it runs at 16 until fewer rows are left. Passes are counted,
    with every row queued before the first pass: no clock."""
    from test_jobs_worker import _worker

    from jobs.run.rows import RowNormalizer

    worker, _ = _worker(tmp_path, "engine.max_batch_size=16", "generation.max_new_tokens=24", "generation.ignore_eos=true")
    turns = [{"id": f"t{i}", "turns": ["Say one thing.", "Now another."], "params": {"max_new_tokens": 3}}
             for i in range(4)]
    norm = RowNormalizer("id", "", "params", "category", [])
    rows = [norm(i, r) for i, r in enumerate(_prompts(76) + turns)]
    worker.feed = _GatedFeed(expected=len(rows))
    tables = {}
    threads = [threading.Thread(target=lambda k: tables.__setitem__(k, worker.run_shard(k, rows[4 * k: 4 * k + 4])), args=(k,))
               for k in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    hist = dict(worker.engine.stats.batch_histogram)
    assert max(hist) == 16, hist  # shards of 4 rows, yet the engine ran at its full batch
    # 76 rows x 23 decode passes + 4 rows x 2 turns x 2: at most 15 rows' last 23 passes run below 16
    assert hist[16] >= sum(hist.values()) / 2, hist
    assert sorted(tables) == list(range(20)) and all(t.num_rows == 4 for t in tables.values())
    got = {r["id"]: r for t in tables.values() for r in t.to_pylist()}
    assert len(got) == 80 and all(len(got[f"t{i}"]["generated_turns"]) == 2 for i in range(4))
    assert all(got[r["id"]]["num_generated_tokens"] == 24 for r in _prompts(76))


@pytest.mark.slow
def test_small_shards_on_ray_write_every_row(ray_head, tmp_path):
    """The same job on Ray: 20 parts, every row, both turns (the batch it reaches depends on when shards arrive:
    see the test above for the batch itself)."""
    turns = [{"id": f"t{i}", "turns": ["Say one thing.", "Now another."], "params": {"max_new_tokens": 3}}
             for i in range(4)]
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(76) + turns)
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "data.shard_size=4", "engine.max_batch_size=16",
                          "ray.num_actors=1", "generation.max_new_tokens=24", "generation.ignore_eos=true"))
    assert sum(res.summary["this_run"]["batch_histogram"].values()) > 0
    spent = res.summary["this_run"]["engine_time"]  # where the engine's time went
    assert spent["prefill_forwards"] >= 1 and spent["prefill_s"] > 0 and spent["decode_s"] > 0
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert len(rows) == 80 and res.summary["complete"] and len(list(out.glob("part-*.parquet"))) == 20
    assert all(len(rows[f"t{i}"]["generated_turns"]) == 2 for i in range(4))


def test_turns_reenter_the_batch_as_soon_as_their_previous_turn_ends(tmp_path):
    """Worker without Ray: two shards in flight at once; a multi-turn row's second turn runs while the
    long single-turn rows of its shard are still decoding (not after the whole shard's round). Passes and
    finish order are counted, with every row queued before the first pass: no clock."""
    from test_jobs_worker import _worker

    worker, _ = _worker(tmp_path, "engine.max_batch_size=8", "generation.max_new_tokens=40")
    from jobs.run.rows import RowNormalizer

    norm = RowNormalizer("id", "", "params", "category", [])
    long_rows = [norm(i, {"id": f"long{i}", "prompt": f"Tell a long story number {i}.",
                          "params": {"max_new_tokens": 40, "ignore_eos": True}}) for i in range(3)]
    turn_rows = [norm(10 + i, {"id": f"turn{i}", "turns": ["hi", "and?"],
                               "params": {"max_new_tokens": 2, "ignore_eos": True}}) for i in range(2)]
    finished: list[str] = []
    absorb = worker._absorb

    def record(sample, row, out):
        absorb(sample, row, out)
        if len(sample.answers) == (len(row.input) if row.kind == "turns" else 1):
            finished.append(row.id)

    worker._absorb = record
    worker.feed = _GatedFeed(expected=5)  # both shards' rows queued before the first pass: no race with the threads
    tables = {}
    threads = [threading.Thread(target=lambda k, rows: tables.__setitem__(k, worker.run_shard(k, rows)), args=(k, rows))
               for k, rows in ((0, long_rows[:2] + turn_rows[:1]), (1, long_rows[2:] + turn_rows[1:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(tables) == {0, 1} and tables[0].num_rows == 3 and tables[1].num_rows == 2
    assert set(finished[:2]) == {"turn0", "turn1"}, finished  # both turns done before any long row
    assert max(worker.engine.stats.batch_histogram) == 5  # both shards' rows in one batch


@pytest.mark.slow
def test_edited_input_ends_with_one_row_per_id(ray_head, tmp_path):
    rows = _prompts(20)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = [f"data.path={data}", "data.shard_size=4", "ray.num_actors=1"]
    first = run_job(job_cfg(out, *args))
    assert first.summary["complete"] and first.summary["num_shards"] == 5
    old = {r["id"]: r for r in read_output(out).to_pylist()}

    # a row gains the top, one row disappears, one prompt is edited: every shard after the top shifts
    edited = [{"id": "new", "prompt": "A brand new first row.", "category": "qa"}] + rows
    del edited[8]  # p007
    edited[3] = {**edited[3], "prompt": "An edited prompt, much longer than the one before it was."}  # p002
    write_jsonl(data, edited)
    second = run_job(job_cfg(out, *args))
    got = read_output(out).to_pylist()
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(r["id"] for r in edited) and len(ids) == len(set(ids)) == 20
    by_id = {r["id"]: r for r in got}
    assert by_id["p002"]["num_prompt_tokens"] != old["p002"]["num_prompt_tokens"]  # regenerated
    assert second.summary["complete"] and second.summary["this_run"]["shards_regenerated"] >= 1
    assert second.summary["input_fingerprint"] != first.summary["input_fingerprint"]

    # the input shrinks by two shards: their parts are removed, nothing else changes
    write_jsonl(data, edited[:12])
    third = run_job(job_cfg(out, *args))
    assert sorted(read_output(out).column("id").to_pylist()) == sorted(r["id"] for r in edited[:12])
    assert third.summary["this_run"]["stale_parts_removed"] == 2 and third.summary["this_run"]["shards_written"] == 0
    # every run is recorded; a rerun never rewrites an earlier run's figures
    runs = _summary(out)["runs"]
    assert len(runs) == 3 and runs[0] == first.summary["this_run"] and runs[0]["generated_tokens"] > 0
    assert runs[2]["generation_tokens_per_s"] is None and runs[0]["generation_tokens_per_s"] > 0


def _on_a_terminal(args: list, env: dict) -> tuple[int, str]:
    """(exit code, stderr) of `python -m jobs.generate ARGS` with stderr on a pseudo-terminal, where the
    progress line is drawn (and drawn once more, final, at the end)."""
    import os
    import pty
    import select
    import sys

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave, env={**os.environ, **env})
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 5.0)
            try:
                data = os.read(master, 65536) if ready else b""
            except OSError:  # EIO: every writer closed the terminal
                data = b""
            chunks.append(data)
            if not data and proc.poll() is not None:
                break
        code = proc.wait(timeout=900)  # a hang guard
    finally:
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_progress_after_an_edit_counts_each_row_once(ray_head, tmp_path):
    """A resume counts the rows of the parts it keeps, not those of parts about to be regenerated or
    removed: the progress line never passes the input's row count."""
    import re

    rows = _prompts(20)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = [f"data.path={data}", "data.shard_size=4", "ray.num_actors=1"]
    assert run_job(job_cfg(out, *args)).summary["complete"]
    rows[9] = {**rows[9], "prompt": "An edited prompt."}  # shard 2 changes: its 4 rows run again
    for input_rows in (rows, rows[:12]):  # then the input shrinks: two parts removed, nothing to run
        write_jsonl(data, input_rows)
        code, err = _on_a_terminal([*FAST, *args, f"output.dir={out}"], {"RAY_ADDRESS": ray_head.address})
        assert code == 0, err[-2000:]
        counts = [(int(a), int(b)) for a, b in re.findall(r"rows (\d+)/(\d+)", err)]
        assert counts and all(b == len(input_rows) and a <= b for a, b in counts), counts
        assert counts[-1] == (len(input_rows), len(input_rows)), counts


@pytest.mark.slow
def test_final_ids_check_catches_a_planted_part(ray_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(8))
    out = tmp_path / "out"
    args = [f"data.path={data}", "data.shard_size=4", "ray.num_actors=1"]
    run_job(job_cfg(out, *args))
    pd.DataFrame({"id": ["intruder", "p001"]}).to_parquet(out / "part-000042.parquet")  # not written by the job
    with pytest.raises(JobError, match=r"output check failed: .*not in the input \(intruder.*part-000042.*p001"):
        run_job(job_cfg(out, *args))
    s = _summary(out)
    assert s["complete"] is False and s["check"]["unexpected_ids"] == ["intruder"]
    assert s["check"]["duplicated_ids"] == ["p001"]


@pytest.mark.slow
def test_actor_killed_with_several_shards_in_flight(ray_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(24))
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=1", "data.shard_size=3",
                          "engine.max_batch_size=8", "fault.kill_shard=2", "fault.kill_attempts=2"))
    assert len(list((out / "_faults").glob("shard-2.attempt-*"))) == 2  # it really died twice
    ids = read_output(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 24 and res.summary["complete"]


def test_a_row_that_fails_the_engine_gets_an_error_and_the_job_finishes(ray_head, tmp_path):
    """An engine error in the batches of one row (fault.fail_row) costs that row alone: it gets the error, every
    other row its generation, and the job completes (a rerun, with nothing left to do, finds it complete; one with
    output.retry_errors runs that row again)."""
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(12))
    out = tmp_path / "out"
    args = (f"data.path={data}", "ray.num_actors=1", "data.shard_size=6", "engine.max_batch_size=4",
            "fault.fail_row=p004")
    res = run_job(job_cfg(out, *args))
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert sorted(rows) == [f"p{i:03d}" for i in range(12)] and res.summary["complete"]
    assert rows["p004"]["error"].startswith("engine error: RuntimeError: fault.fail_row=p004")
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for k, r in rows.items() if k != "p004")
    assert _summary(out)["errors"] == 1 and res.summary["this_run"]["engine_errors"] >= 1
    assert run_job(job_cfg(out, *args)).summary["complete"]
    # the fault gone, output.retry_errors runs p004 again and keeps every other row as it was (time_s included)
    again = run_job(job_cfg(out, *args[:-1], "output.retry_errors=true")).summary
    after = {r["id"]: r for r in read_output(out).to_pylist()}
    assert after["p004"]["error"] is None and after["p004"]["num_generated_tokens"] > 0
    assert all(after[k] == r for k, r in rows.items() if k != "p004")
    assert again["this_run"]["rows_retried"] == 1 and again["this_run"]["shards_written"] == 1
    assert again["errors"] == 0 and again["complete"]


def test_a_device_lost_mid_job_costs_a_restart_not_rows(ray_head, tmp_path):
    """An engine error after which the device no longer works (a CUDA error that stays with the process; here
    fault.lose_device in the first actor process) is no row's fault: the actor's process exits before any row gets
    the error, Ray starts it again and the shards run there, so the job completes with every row generated."""
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(8))
    out = tmp_path / "out"
    res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=1", "data.shard_size=4", "fault.lose_device=1"))
    faults = sorted(p.name for p in (out / "_faults").iterdir())
    assert faults == ["device-lost.attempt-1"]  # the first process lost its device, the one Ray started did not
    rows = read_output(out).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"p{i:03d}" for i in range(8)] and res.summary["complete"]
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for r in rows) and res.summary["errors"] == 0


@pytest.mark.slow
def test_an_actor_dying_past_max_restarts_names_it_and_the_cause(ray_head, tmp_path):
    """Deaths not charged to a row (here a shard that kills its actor, never run alone) count toward
    ray.max_restarts: past them the actor is gone, and with none left the job stops with one line."""
    _job_that_stops(tmp_path, 8, r"no engine actor is left: actor 0 \(last on node \w+ \([\d.]+\)\) is dead and Ray "
                                 r"will not restart it \(ray.max_restarts=0; 1 death\(s\) seen\): \w*Actor",
                    "data.shard_size=4", "ray.max_restarts=0", "fault.kill_shard=1", "fault.kill_attempts=5")


def _job_that_stops(tmp_path: Path, n: int, match: str, *overrides: str) -> None:
    """A job of n rows on one actor that stops with the one line `match`, its summary incomplete."""
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(n))
    out = tmp_path / "out"
    with pytest.raises(JobError, match=match):
        run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=1", *overrides))
    assert _summary(out)["complete"] is False


def _job_with_a_bad_row(tmp_path: Path, caplog: Any, n: int, bad: str, *overrides: str) -> tuple[Any, dict, list[str]]:
    """A job of n rows in shards of 2 (one actor, unless `overrides` say otherwise) whose row `bad` takes down its
    actor every time (the fault in `overrides`): it completes, `bad` has the error of a row found running alone,
    every other row its generation. Returns the result, the rows by id and the driver's log."""
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(n))
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="esp_batch"):
        res = run_job(job_cfg(out, f"data.path={data}", "ray.num_actors=1", "data.shard_size=2",
                              "engine.max_batch_size=2", *overrides))
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert sorted(rows) == [f"p{i:03d}" for i in range(n)] and res.summary["complete"]
    assert rows[bad]["error"].startswith("the engine actor was lost each of the 2 times it ran this row alone")
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for k, r in rows.items() if k != bad)
    assert _summary(out)["errors"] == 1 and res.summary["this_run"]["rows_killing_actors"] == [bad]
    return res, rows, caplog.messages


@pytest.mark.slow
def test_a_row_that_kills_its_actor_every_time_gets_an_error_and_the_job_finishes(ray_head, tmp_path, caplog):
    """fault.kill_row: the process dies in every decode pass holding p003, as on a segfault. Its shard (and the one
    in flight beside it) is held by two deaths, then runs in pieces alone; p003 kills its actor alone twice and gets
    an error, every other row its generation, and the job completes. Those two deaths are charged to the row, not to
    ray.max_restarts=2 (used up by the first two): Ray will not restart the actor, so a new one takes its place."""
    res, _, log = _job_with_a_bad_row(tmp_path, caplog, 6, "p003", "ray.max_restarts=2", "fault.kill_row=p003")
    assert any(m.startswith("shard 1 was held by 2 actor deaths: it runs in pieces") for m in log), log
    assert any(m.startswith("row 'p003' (shard 1 row 1) took down the engine actor each of the 2 times") for m in log), log
    assert sum("a new actor takes its place (2 of ray.max_restarts=2 used)" in m for m in log) == 2, log
    assert 1 in res.summary["this_run"]["isolated_shards"]  # (the shards beside it, maybe too)


@pytest.mark.slow
def test_an_engine_that_dies_in_every_pass_stops_the_job_with_one_line(ray_head, tmp_path):
    """fault.kill_row='*': the process dies in every decode pass, whatever rows it holds (a driver bug, too little
    host memory for the model). The search for a row that kills its actor blames three rows in a row with nothing
    finishing between, and the job stops naming the engine: it neither hangs nor gives every row an error."""
    _job_that_stops(tmp_path, 6, r"shard \d+ failed: 3 rows in a row took down their engine actor each time they ran "
                                 r"alone, none finishing between: the engine fails, not a row \(the last: ",
                    "data.shard_size=2", "engine.max_batch_size=2", "ray.max_restarts=1", "fault.kill_row='*'")


@pytest.mark.slow
def test_a_row_that_kills_its_actor_is_found_while_another_actor_works_on(ray_head, tmp_path, caplog):
    """Two actors, shards of 2: p009 kills whichever actor runs it. Its shard splits and its pieces run alone (no
    other work goes to that actor meanwhile); the other actor runs the rest. p009 alone gets the error."""
    res, _, log = _job_with_a_bad_row(tmp_path, caplog, 12, "p009", "ray.num_actors=2", "ray.num_cpus_per_actor=1",
                                      "ray.max_restarts=6", "fault.kill_row=p009")
    assert 4 in res.summary["this_run"]["isolated_shards"], res.summary["this_run"]
    assert any(m.startswith("row 'p009' (shard 4 row 1) took down the engine actor each of the 2 times") for m in log), log


@pytest.mark.slow
def test_a_row_that_hangs_its_engine_stalls_its_actor_then_gets_an_error(ray_head, tmp_path, caplog):
    """fault.hang_row: the engine hangs in every decode pass holding p001, as on a hung kernel, and raises nothing.
    The driver sees no pass finish for ray.stall_timeout_s, kills the actor for Ray to restart, and the stalls are
    deaths like any other: with ray.max_restarts=1 the first splits the shard, the row is found running alone, gets
    an error, and the job completes."""
    _, rows, log = _job_with_a_bad_row(tmp_path, caplog, 2, "p001", "ray.max_restarts=1", "ray.stall_timeout_s=4",
                                       "fault.hang_row=p001")
    assert "its engine finished no pass for " in rows["p001"]["error"], rows["p001"]["error"]
    stalls = [m for m in log if m.startswith("actor 0 on ") and m.endswith("(ray.stall_timeout_s=4): killed, for Ray "
                                                                         "to restart it")]
    assert len(stalls) == 3, log  # the shard's, then the row's twice alone
    assert any(m.startswith("shard 0 was held by 1 actor deaths: it runs in pieces") for m in log), log


@pytest.mark.slow
def test_cluster_too_small_fails_with_resources(ray_head, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(4))
    with pytest.raises(ClusterError, match=r"could not place 3 actors x \(1 CPU\).*CPU .* free of 2"):
        run_job(job_cfg(tmp_path / "out", f"data.path={data}", "ray.num_actors=3", "ray.num_cpus_per_actor=1",
                        "data.shard_size=1", "ray.placement_timeout_s=3"))


def test_errors_before_ray_starts(tmp_path):
    import gzip

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    truncated = tmp_path / "rows.jsonl.gz"
    truncated.write_bytes(gzip.compress(b"".join(b'{"prompt": "p %d"}\n' % i for i in range(100)))[:60])
    cases = [
        ([f"output.dir={a_file}"], 2, "is a file"),
        ([f"output.dir={a_file}/sub"], 2, "cannot create output.dir"),
        ([f"model.name_or_path={tmp_path}/no-such-model", f"output.dir={tmp_path}/o1"], 2, "does not exist"),
        (["model.name_or_path=./no-such-model", f"output.dir={tmp_path}/o2"], 2, "does not exist"),
        (["data.path=data/my_prompts.jsonl", f"output.dir={tmp_path}/o3"], 2, "does not exist"),
        (["engine.method=hybrid", f"engine.heads_path={tmp_path}", f"output.dir={tmp_path}/o4"], 2, "holds no heads.json"),
        ([f"engine.cost_curve_path={tmp_path}/curve.json", f"output.dir={tmp_path}/o5"], 2, "is not a file"),
        ([f"data.path={truncated}", f"output.dir={tmp_path}/o6"], 2, "Truncated compressed stream"),
    ]
    for args, code, needle in cases:
        res = run_cli(*FAST, *args)
        line = res.stderr.strip().splitlines()[-1]
        assert res.returncode == code and needle in line and line.startswith("esp-batch: error:"), (args, res.stderr[-800:])
        assert "Traceback" not in res.stderr and "Ray" not in res.stderr, args  # failed before Ray started


def test_an_address_where_no_cluster_answers_is_one_line_at_once(tmp_path):
    """ray.address (or RAY_ADDRESS) naming a port where nothing listens: one line, exit 1, within seconds (ray.init
    retried such an address for as long as it ran, printing a GCS timeout every 40 s)."""
    from jobs_helpers import free_port

    for args, env in (([f"ray.address=127.0.0.1:{free_port()}"], None), ([], {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"})):
        res = run_cli(*FAST, f"output.dir={tmp_path}/out", *args, env=env, timeout=120)
        line = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 1 and "nothing answers at 127.0.0.1:" in line, res.stderr[-800:]
        assert "Traceback" not in res.stderr and "GCS" not in res.stderr


@pytest.mark.slow
def test_an_input_file_damaged_past_the_first_shards_fails_with_one_line_and_keeps_the_parts(tmp_path):
    """The second of two Parquet files has a readable footer (so the rows count) and a damaged data page: the job
    generates the first file's shards, then stops with one line naming the file (exit 1), its parts kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(300)], "prompt": [f"alpha {i}" for i in range(300)]}),
                   tmp_path / "in" / "part-0.parquet")
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(8)], "prompt": [f"beta {i} " * 200 for i in range(8)]}),
                   tmp_path / "in" / "part-1.parquet", compression="zstd")
    data = bytearray((tmp_path / "in" / "part-1.parquet").read_bytes())
    data[30:400] = b"Z" * 370
    (tmp_path / "in" / "part-1.parquet").write_bytes(bytes(data))
    out = tmp_path / "out"
    res = run_cli(*FAST, "generation.max_new_tokens=2", f"data.path={tmp_path / 'in'}", "data.shard_size=100",
                  f"output.dir={out}", "ray.num_actors=1")
    line = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "cannot read" in line and "part-1.parquet" in line and "rerun" in line, res.stderr[-800:]
    assert "Traceback" not in res.stderr
    assert sorted(read_output(out).column("id").to_pylist()) == sorted(f"a{i}" for i in range(300))


def test_an_empty_input_is_refused_before_ray(tmp_path):
    """No input row: one line, exit 2, before Ray starts and before output.dir is claimed (not a 'complete'
    job of 0 rows whose report cannot be written)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "header.csv").write_text("id,prompt\n")
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                   tmp_path / "none.parquet")
    rows = write_jsonl(tmp_path / "rows.jsonl", _prompts(3))
    cases = [([f"data.path={tmp_path / n}"], "has no rows") for n in ("empty.jsonl", "blank.jsonl", "header.csv",
                                                                        "none.parquet")]
    cases.append(([f"data.path={rows}", "data.limit=0"], "has no rows (data.limit=0)"))
    for i, (args, needle) in enumerate(cases):
        res = run_cli(*FAST, *args, f"output.dir={tmp_path}/o{i}")
        line = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and line.startswith("esp-batch: error: data.path=") and needle in line, (args, res.stderr[-800:])
        assert "Traceback" not in res.stderr and "Ray" not in res.stderr, res.stderr[-800:]
        assert not (tmp_path / f"o{i}").exists()


def test_a_local_model_directory_without_config_or_weights_is_refused_before_ray(tmp_path):
    """A local model directory must hold config.json and a weights file: one line, exit 2, before Ray and
    the engine start (not a tokenizer error from inside an actor)."""
    empty, no_weights, no_config = (tmp_path / n for n in ("empty", "no-weights", "no-config"))
    for d in (empty, no_weights, no_config):
        d.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    (no_weights / "tokenizer.json").write_text("{}")
    (no_config / "model.safetensors").write_bytes(b"x")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    cases = [(empty, ["no config.json", "no weights"]), (no_weights, ["no weights", "*.safetensors"]),
             (no_config, ["no config.json"]), (a_file, ["is a file"])]
    for i, (model, needles) in enumerate(cases):
        res = run_cli(*FAST, f"model.name_or_path={model}", f"output.dir={tmp_path}/o{i}")
        line = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and line.startswith("esp-batch: error: model.name_or_path="), (model, res.stderr[-800:])
        assert all(n in line for n in needles), (needles, line)
        assert "Traceback" not in res.stderr and "Ray" not in res.stderr, res.stderr[-800:]  # failed before Ray started
        assert not (tmp_path / f"o{i}").exists()  # and before the output directory was claimed


@pytest.mark.slow
def test_rerun_with_the_model_path_corrected_after_a_failed_load(ray_head, tmp_path):
    """A start that fails at model load leaves no row; the rerun with the right model into the same
    output.dir runs (it is not refused as a job with a different config)."""
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    data = write_jsonl(tmp_path / "in.jsonl", _prompts(4))
    args = [*FAST, f"data.path={data}", f"output.dir={tmp_path / 'out'}", "ray.num_actors=1"]
    env = {"RAY_ADDRESS": ray_head.address}
    res = run_cli(*args, f"model.name_or_path={broken}", env=env)
    assert res.returncode == 1 and "the engine failed to load" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    res = run_cli(*args, "model.name_or_path=tiny-random-llama", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(read_output(tmp_path / "out").column("id").to_pylist()) == [f"p{i:03d}" for i in range(4)]
    assert _summary(tmp_path / "out")["model"] == "tiny-random-llama"


def test_paths_and_stop_strings_mean_what_users_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    rel = load_config(None, ["data.path=in.jsonl"])
    absolute = load_config(None, [f"data.path={tmp_path / 'in.jsonl'}"])
    dotted = load_config(None, [f"data.path=./sub/../in.jsonl"])
    assert config_hash(rel) == config_hash(absolute) == config_hash(dotted)
    params, err = parse_params({"stop_strings": "abc", "stop_token_ids": 7})
    assert err is None and params["stop_strings"] == ["abc"] and params["stop_token_ids"] == [7]
    assert GenerationParams(stop_strings="abc").stop_strings == ("abc",)


def test_no_absolute_machine_paths_in_the_repository():
    out = subprocess.run(["git", "grep", "-n", "-I", "-E", r"[\"' ]/[A-Za-z0-9_.-]+/shared/(data|models|docs|papers)"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.stdout == "", out.stdout


@pytest.mark.slow
def test_hive_partitioned_output_reads_as_one_table(ray_head, tmp_path):
    import duckdb

    rows = [{**r, "category": ["qa", "code", "math"][i % 3]} for i, r in enumerate(_prompts(18))]
    rows[4]["category"] = None
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = [f"data.path={data}", "data.shard_size=4", "ray.num_actors=1", "output.partition_by=[category]"]
    res = run_job(job_cfg(out, *args))
    assert res.summary["complete"] and res.summary["tau_per_category"]["qa"]["rows"] == 6
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith("_"))
    assert dirs == ["category=__HIVE_DEFAULT_PARTITION__", "category=code", "category=math", "category=qa"]
    got = duckdb.sql(f"SELECT category, count(*) FROM read_parquet('{out}/*/*.parquet', hive_partitioning=1) "
                     "GROUP BY category ORDER BY category").fetchall()
    assert got == [("code", 5), ("math", 6), ("qa", 6), (None, 1)]  # row 4 (code) has no category
    import pyarrow.dataset as pads

    # pandas' default dictionary inference cannot unify a null partition with the others (a pyarrow
    # limitation, documented in the README): read partition values as plain strings
    df = pd.read_parquet(out, partitioning=pads.HivePartitioning.discover(infer_dictionary=False))
    assert len(df) == 18 and set(df["category"].dropna().astype(str)) >= {"qa", "code", "math"}
    again = run_job(job_cfg(out, *args))  # resume sees every shard's files
    assert again.summary["this_run"]["shards_skipped"] == 5 and again.summary["complete"]
    with pytest.raises(Exception, match="output.partition_by"):
        run_job(job_cfg(out, *args[:-1]))
