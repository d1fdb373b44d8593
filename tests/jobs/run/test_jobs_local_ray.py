"""The local Ray instance a job starts or joins: found under RAY_TMPDIR as Ray writes it, and gone with a
driver killed by SIGKILL (agents and actors included)."""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from cluster_helpers import Driver, _descendants, drivers, ray_tmpdir  # noqa: F401
from jobs_helpers import write_jsonl
from jobs.run.cluster import running_local_cluster


def test_the_running_local_cluster_is_looked_up_under_ray_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert running_local_cluster() is None  # no address file there (whatever /tmp/ray holds)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address + "\n")  # as `ray start --head` writes it
        assert running_local_cluster() == address
    assert running_local_cluster() is None  # the head is gone: not joined (connecting would wait for minutes)


def _running(pids: list[int]) -> list[str]:
    """The names of the processes still running (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80] or stat.split()[1])
    return alive


@pytest.mark.slow
def test_driver_killed_leaves_no_process_of_its_local_instance(tmp_path, ray_tmpdir, drivers):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"q {i}"} for i in range(8)])
    out = tmp_path / "out"
    driver = Driver(["engine.method=ar", "generation.max_new_tokens=4", f"data.path={data}", f"output.dir={out}",
                     "ray.address=local", "ray.num_cpus=1", "ray.num_actors=1", "ray.num_cpus_per_actor=1",
                     "data.shard_size=4", "fault.hold_shard=0"], "", tmp_path / "driver.log")
    drivers.append(driver)
    driver.wait_for_file(out / "_faults" / "hold-0.json")  # the instance is up and its actor runs a shard
    instance = [p for p in _descendants([driver.proc.pid]) if p != driver.proc.pid]
    assert len(instance) >= 5, instance  # GCS, raylet, agents, the actor, ...
    os.kill(driver.proc.pid, signal.SIGKILL)
    driver.proc.wait()
    # Ray's agents alone would outlive the driver by ~60 s (they report their raylet's death to the dead GCS
    # with a fixed 60 s timeout); the reaper kills them at once. 40 s is a hang guard for that kill.
    deadline = time.monotonic() + 40
    while _running(instance) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(instance), _running(instance)
