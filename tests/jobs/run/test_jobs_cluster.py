"""Node and head loss on a real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`): a worker
node lost mid-job with and without a spare node, the last actor lost for good, and the head lost then a rerun
on a fresh cluster. Each ends with every input id exactly once.

The job runs as `python -m jobs.generate` against the cluster (the head has no CPUs, one engine actor per
one-CPU worker node). The loss happens at a known point, not after a sleep: `fault.hold_shard` makes the
actor that gets that shard write where it runs and wait; the test kills that actor's node (or the head), then
releases the shard, whose retry runs at once wherever it lands. Ray's own timeouts are left at their
defaults: a node is marked dead after its health checks miss (~15 s), which is what the job must live with.
"""
from __future__ import annotations

import json

import pytest

from cluster_helpers import Driver, LocalCluster, clusters, drivers, held_by, job_lines, ray_tmpdir, release  # noqa: F401
from jobs_helpers import read_output, write_jsonl

pytestmark = pytest.mark.slow

ROWS = 24
HELD = 3  # the shard whose actor's node is lost while it runs it


def _ids() -> list[str]:
    return [f"r{i:03d}" for i in range(ROWS)]


def _args(tmp_path, *more: str) -> list[str]:
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": rid, "prompt": f"Question {i}: what is {i} plus {i}?"}
                                              for i, rid in enumerate(_ids())])
    # 12 shards of 2 rows, 2 shards in flight per actor, one actor per one-CPU node
    return ["engine.method=ar", "generation.max_new_tokens=4", "output.progress_interval_s=1",
            f"data.path={data}", f"output.dir={tmp_path / 'out'}", "data.shard_size=2", "engine.max_batch_size=2",
            "ray.num_cpus_per_actor=1", "ray.shards_in_flight_per_actor=2", *more]


def _assert_complete(out) -> None:
    ids = read_output(out).column("id").to_pylist()
    assert sorted(ids) == _ids()  # every input id exactly once
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["complete"] and summary["check"]["output_rows"] == ROWS


def test_worker_node_lost_with_a_spare_node(tmp_path, clusters, drivers):
    cluster = LocalCluster(workers=2)  # one actor, one spare node: the job can only finish on the restarted actor
    clusters.append(cluster)
    out = tmp_path / "out"
    driver = Driver(_args(tmp_path, "ray.num_actors=1", f"fault.hold_shard={HELD}"), cluster.address, tmp_path / "a.log")
    drivers.append(driver)
    where = held_by(out, HELD, driver)
    lost = f"node {where['node_id'][:8]}"
    cluster.kill_node(cluster.node(where["node_id"]))
    spare = f"node {cluster.workers[0].node_id[:8]}"
    release(out)
    assert driver.wait() == 0, driver.report()
    _assert_complete(out)
    lines = job_lines(driver.text())
    assert any("actor(s) ready" in ln and f"actor 0 on {lost}" in ln for ln in lines), lines  # where it runs
    assert any(f"actor 0 lost on {lost}" in ln for ln in lines), lines  # its loss
    assert any(f"actor 0 back on {spare}" in ln and "restarted (1 of ray.max_restarts=3)" in ln for ln in lines), lines


def test_worker_node_lost_without_a_spare_node_the_job_finishes_on_the_others(tmp_path, clusters, drivers):
    cluster = LocalCluster(workers=2)  # two actors, no room to restart the lost one: its shards go to the other
    clusters.append(cluster)
    out = tmp_path / "out"
    driver = Driver(_args(tmp_path, "ray.num_actors=2", f"fault.hold_shard={HELD}"), cluster.address, tmp_path / "b.log")
    drivers.append(driver)
    where = held_by(out, HELD, driver)
    cluster.kill_node(cluster.node(where["node_id"]))
    release(out)
    assert driver.wait() == 0, driver.report()  # the default ray.placement_timeout_s (300 s) is not waited for
    _assert_complete(out)


def test_last_actor_lost_for_good_stops_with_one_line_then_resumes(tmp_path, clusters, drivers):
    cluster = LocalCluster(workers=1)
    clusters.append(cluster)
    out = tmp_path / "out"
    args = _args(tmp_path, "ray.num_actors=1", "ray.placement_timeout_s=8")  # (placing waits for resources only)
    driver = Driver([*args, f"fault.hold_shard={HELD}"], cluster.address, tmp_path / "c.log")
    drivers.append(driver)
    where = held_by(out, HELD, driver)
    cluster.kill_node(cluster.node(where["node_id"]))
    release(out)
    assert driver.wait() == 1, driver.report()
    last = job_lines(driver.text())[-1]
    assert last.startswith("esp-batch: job failed:") and "ray.placement_timeout_s=8" in last, last
    assert f"node {where['node_id'][:8]}" in last and "CPU" in last, last  # the node lost, the resources missing
    assert "Traceback" not in driver.text()
    run = json.loads((out / "_summary.json").read_text())["runs"][-1]
    assert run["failure"] == last.split("job failed: ", 1)[1].split("; finished parts", 1)[0]
    done = len(list(out.glob("part-*.parquet")))
    assert 0 < done < ROWS // 2  # the finished parts are kept

    cluster.add_worker()  # a node comes back: the same command resumes
    rerun = Driver(args, cluster.address, tmp_path / "c2.log")
    drivers.append(rerun)
    assert rerun.wait() == 0, rerun.report()
    _assert_complete(out)
    assert json.loads((out / "_summary.json").read_text())["this_run"]["shards_skipped"] == done


def test_head_lost_one_line_then_a_fresh_cluster_resumes(tmp_path, clusters, drivers):
    cluster = LocalCluster(workers=2)
    clusters.append(cluster)
    out = tmp_path / "out"
    args = _args(tmp_path, "ray.num_actors=2")
    driver = Driver([*args, f"fault.hold_shard={HELD}"], cluster.address, tmp_path / "d.log")
    drivers.append(driver)
    held_by(out, HELD, driver)
    cluster.kill_node(cluster.cluster.head_node)
    assert driver.wait() == 1, driver.report()
    last = job_lines(driver.text())[-1]
    assert last.startswith("esp-batch: job failed:") and "head" in last, last
    assert "Traceback" not in driver.text()
    run = json.loads((out / "_summary.json").read_text())["runs"][-1]  # the run is on record
    assert "head" in run["failure"]
    cluster.shutdown()

    fresh = LocalCluster(workers=1)  # (ray.* is not part of the config a resume must match)
    clusters.append(fresh)
    rerun = Driver([*args, "ray.num_actors=1"], fresh.address, tmp_path / "d2.log")
    drivers.append(rerun)
    assert rerun.wait() == 0, rerun.report()
    _assert_complete(out)


def test_head_lost_during_start_up_one_line(tmp_path, clusters, drivers):
    cluster = LocalCluster(workers=0)  # no room for the actor: the driver waits for the cluster to place it
    clusters.append(cluster)
    driver = Driver(_args(tmp_path, "ray.num_actors=1"), cluster.address, tmp_path / "e.log")
    drivers.append(driver)
    driver.wait_for_line("waiting for the cluster to place 1 actors")  # it says what it waits for
    cluster.kill_node(cluster.cluster.head_node)
    assert driver.wait() == 1, driver.report()
    last = job_lines(driver.text())[-1]
    assert last.startswith("esp-batch: job failed: lost the cluster's head"), last
    assert "Traceback" not in driver.text()


def test_gpus_by_default_where_the_cluster_has_them(tmp_path, clusters, drivers):
    """ray.num_gpus_per_actor=auto reserves one GPU per actor on a cluster with GPUs (declared as Ray resources
    here: the engine itself then runs on CPU), and says so; an explicit 0 there is warned about."""
    cluster = LocalCluster(workers=1, gpus_per_worker=1)
    clusters.append(cluster)
    auto = Driver(_args(tmp_path, "ray.num_actors=1"), cluster.address, tmp_path / "auto.log")
    drivers.append(auto)
    assert auto.wait() == 0, auto.report()
    ready = next(ln for ln in job_lines(auto.text()) if "actor(s) ready" in ln)
    assert "(1 CPU, 1 GPU each; ray.num_gpus_per_actor=auto: the cluster has 1 GPU)" in ready, ready

    cpu = Driver(_args(tmp_path, "ray.num_actors=1", "ray.num_gpus_per_actor=0", "output.overwrite=true"),
                 cluster.address, tmp_path / "cpu.log")
    drivers.append(cpu)
    assert cpu.wait() == 0, cpu.report()
    lines = job_lines(cpu.text())
    assert any("ray.num_gpus_per_actor=0 on a cluster with 1 GPU(s): the engines run on CPU" in ln for ln in lines), lines
    assert "(1 CPU each)" in next(ln for ln in lines if "actor(s) ready" in ln)
