"""A multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`, as Ray's own node-failure tests use),
node loss as a real cluster sees it, and a job driver run as a subprocess against it.

`Cluster.remove_node` kills a node's raylet and agents but leaves the node's worker processes (our engine
actors) running, which a lost machine never does: `LocalCluster.kill_node` kills every process of the node at
once with SIGKILL (raylet, agents, workers), so the driver sees what it sees when a machine goes away: the
actor's connection breaks at once, Ray marks the node dead only after its health checks miss (~15 s at Ray's
defaults), and a restarted actor needs room on another node.

Each cluster lives under its own short RAY_TMPDIR (set for the test by the `ray_tmpdir` fixture): Ray writes
the cluster's address to `<RAY_TMPDIR>/ray/ray_current_cluster`, and under the default /tmp/ray any other
job on the machine that looks up "the running local cluster" would join this one.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from shared_data import REPO


def _descendants(roots: list[int]) -> list[int]:
    """The processes under these pids (the pids included), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


_ATTEMPTS = 3  # node starts tried: Ray gives a starting raylet a fixed 30 s to register, which a busy machine can miss


def _node_pids(node: Any) -> list[int]:
    return _descendants([p.process.pid for procs in node.all_processes.values() for p in procs if p.process is not None])


def _kill_strays(known: set[int]) -> None:
    """Kill what a node start that timed out left behind: this process's Ray children (under this test's
    RAY_TMPDIR) that belong to no node we hold, with everything under them."""
    tmp = os.environ.get("RAY_TMPDIR", "/nonexistent")
    strays = []
    for pid in _descendants([os.getpid()]):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if pid != os.getpid() and pid not in known and tmp in cmdline:
            strays.append(pid)
    for pid in _descendants(strays):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LocalCluster:
    """A head with no CPUs (it runs the driver only, as ray_cluster.yaml's head) and `workers` nodes with one CPU
    each: one engine actor per worker node."""

    def __init__(self, workers: int, gpus_per_worker: int = 0):
        from ray.cluster_utils import Cluster

        for attempt in range(_ATTEMPTS):
            try:
                self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
                break
            except Exception:  # noqa: BLE001 - the head did not register in Ray's 30 s: kill what it left, retry
                _kill_strays(set())
                if attempt == _ATTEMPTS - 1:
                    raise
        self.workers: list[Any] = []
        for _ in range(workers):
            # GPUs as Ray resources only (Ray schedules what a node declares): an actor given one sees no CUDA device
            self.add_worker(gpus_per_worker)
        self.address = self.cluster.address

    def add_worker(self, gpus: int = 0) -> Any:
        """One more one-CPU node, once the cluster counts exactly its nodes as live."""
        for attempt in range(_ATTEMPTS):
            try:
                node = self.cluster.add_node(num_cpus=1, num_gpus=gpus)
                break
            except Exception:  # noqa: BLE001 - as for the head; a late registration is marked dead below
                _kill_strays({p for n in self.cluster.list_all_nodes() for p in _node_pids(n)})
                if attempt == _ATTEMPTS - 1:
                    raise
        self.workers.append(node)
        self.cluster.wait_for_nodes(timeout=300)  # a hang guard, not a speed bound
        return node

    def node(self, node_id: str) -> Any:
        nodes = [n for n in [self.cluster.head_node, *self.workers] if n is not None and n.node_id == node_id]
        assert nodes, f"no node {node_id} in the cluster"
        return nodes[0]

    def kill_node(self, node: Any) -> None:
        """The node's raylet, agents and workers, all at once (SIGKILL): a machine lost."""
        pids = _node_pids(node)
        self.cluster.remove_node(node, allow_graceful=False)
        if node in self.workers:
            self.workers.remove(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def shutdown(self) -> None:
        for node in [*self.workers, self.cluster.head_node]:
            if node is not None:
                self.kill_node(node)


@pytest.fixture
def ray_tmpdir(monkeypatch) -> Iterator[str]:
    """A private, short RAY_TMPDIR (Unix socket paths must stay under ~100 characters) for this test's clusters
    and drivers."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", path)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


@pytest.fixture
def clusters(ray_tmpdir) -> Iterator[list[LocalCluster]]:
    """Start clusters with `clusters.append(LocalCluster(n))`; every one is killed at the end of the test."""
    made: list[LocalCluster] = []
    yield made
    for c in made:
        c.shutdown()


class Driver:
    """`python -m jobs.generate ARGS` against a cluster, as a subprocess (its own process group), output to a
    log file (no pipe to fill while the test waits)."""

    def __init__(self, args: list[str], address: str, log: Path):
        self.log = log
        self._file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.generate", *args], cwd=REPO,
                                     env={**os.environ, "RAY_ADDRESS": address}, stdout=self._file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def report(self) -> str:
        """For assertion messages: the job's own lines, then the log's tail."""
        text = self.text()
        return "\n".join(job_lines(text)) + "\n--- log tail ---\n" + text[-2000:]

    def wait_for_file(self, path: Path, timeout: float = 600) -> dict[str, Any]:  # a hang guard, not a speed bound
        """The JSON in `path` once it exists; fails if the driver exits first."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.proc.poll() is None, f"the driver exited ({self.proc.returncode}) first:\n{self.report()}"
            assert time.monotonic() < deadline, f"no {path.name} after {timeout:.0f} s:\n{self.report()}"
            time.sleep(0.1)
        return json.loads(path.read_text())

    def wait_for_line(self, text: str, timeout: float = 600) -> None:  # a hang guard, not a speed bound
        """Until the driver has logged a line containing `text`; fails if it exits first."""
        deadline = time.monotonic() + timeout
        while not any(text in ln for ln in job_lines(self.text())):
            assert self.proc.poll() is None, f"the driver exited ({self.proc.returncode}) first:\n{self.report()}"
            assert time.monotonic() < deadline, f"no line with {text!r} after {timeout:.0f} s:\n{self.report()}"
            time.sleep(0.1)

    def wait(self, timeout: float = 600) -> int:  # a hang guard, not a speed bound
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"the driver hung (killed after {timeout:.0f} s):\n{self.report()}")
        finally:
            self._file.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._file.close()


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    """Drivers started with `drivers.append(Driver(...))` are killed at the end of the test if still running."""
    made: list[Driver] = []
    yield made
    for d in made:
        d.stop()


def job_lines(text: str) -> list[str]:
    """The lines the job itself wrote (esp-batch's log and error lines), without Ray's."""
    return [ln for ln in text.splitlines() if ln.startswith("esp-batch")]


def release(out: Path) -> None:
    """Let the actor waiting on fault.hold_shard (or its retry) run the shard."""
    (out / "_faults" / "release").touch()


def held_by(out: Path, shard: int, driver: Driver) -> dict[str, Any]:
    """Where the actor holding `shard` runs (node_id, ip, pid), once it holds it."""
    return driver.wait_for_file(out / "_faults" / f"hold-{shard}.json")

