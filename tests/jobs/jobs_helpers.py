"""Shared helpers for the jobs tests: offline HF settings, a local Ray head, job configs, data files.

Imported by the tests under tests/jobs/ (`from jobs_helpers import ...`; tests/jobs/conftest.py puts this
folder on sys.path).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from jobs.run.cluster import free_port  # noqa: F401  (re-exported)
from shared_data import REPO, SHARED_DATA, SPEC_BENCH, TINY_LLAMA, TINY_PROMPTS, shared  # noqa: F401  (re-exported)


os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test head; see ARCHITECTURE.md
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

# Small, fast jobs: the tiny model, plain decoding unless a test says otherwise, 1 torch thread per actor.
FAST = ["engine.method=ar", "generation.max_new_tokens=6", "ray.num_cpus_per_actor=0.5", "output.progress_interval_s=1"]


@dataclass
class RayHead:
    address: str  # host:port of the GCS
    dashboard: Optional[str] = None  # http://host:port, for `ray job submit` (a head started with its dashboard)


def start_head(dashboard: bool = False) -> tuple[subprocess.Popen, RayHead]:
    """`ray start --head --block` as our own child: stopping it stops the cluster it started. Its ports are free
    ones, the job agent's too (Ray's default 52365 is taken when another Ray instance runs on the machine, and
    then `ray job submit` finds no agent). The dashboard (the jobs API of `ray job submit`) only when asked:
    a job's driver never needs it, and it is eleven more processes, ~7 s of CPU per module on a 2-core
    machine."""
    port, dash = free_port(), free_port()
    ui = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"] if dashboard
          else ["--include-dashboard=false"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--num-cpus=2", "--num-gpus=0", *ui, f"--dashboard-agent-listen-port={free_port()}",
         "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    head = RayHead(address=f"127.0.0.1:{port}", dashboard=f"http://127.0.0.1:{dash}" if dashboard else None)
    deadline = time.time() + 90
    while time.time() < deadline:  # up once the port it serves last (the dashboard's, else the GCS's) accepts
        try:
            with socket.create_connection(("127.0.0.1", dash if dashboard else port), timeout=1):
                return proc, head
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("ray start --head exited")
            time.sleep(0.5)
    stop_head(proc)
    raise RuntimeError("Ray head did not come up in 90 s")


def stop_head(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _started_and_connected(dashboard: bool, tries: int = 3) -> tuple[subprocess.Popen, RayHead]:
    """A head started and this process connected to it as a driver. While the other test workers start clusters
    and compile on the same cores, a head has failed in ways a fresh one does not: its raylet missed the 60 s a
    driver waits for it (`RAY_gcs_server_request_timeout_seconds`), or a port picked free was taken by another
    process before the head bound it (the head then exits). A module's tests would all fail at set-up, so such a
    head is replaced by a fresh one on fresh ports."""
    import ray

    for attempt in range(1, tries + 1):
        try:
            proc, head = start_head(dashboard)  # RuntimeError: it exited, or did not come up
        except RuntimeError:
            if attempt == tries:
                raise
            continue
        try:
            ray.init(address=head.address, logging_level="WARNING")
            return proc, head
        except ConnectionError:
            ray.shutdown()
            stop_head(proc)
            if attempt == tries:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _connected_head(dashboard: bool) -> Iterator[RayHead]:
    import ray

    proc, head = _started_and_connected(dashboard)
    try:
        yield head
    finally:
        ray.shutdown()
        stop_head(proc)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """One local head per test module, with this process connected as a driver."""
    with _connected_head(dashboard=False) as head:
        yield head


@pytest.fixture(scope="module")
def ray_job_head() -> Iterator[RayHead]:
    """As `ray_head`, with the dashboard that `ray job submit --address` talks to."""
    with _connected_head(dashboard=True) as head:
        yield head


def job_cfg(out_dir: Path, *overrides: str) -> Any:
    from jobs.config import load_config

    return load_config(None, [*FAST, f"output.dir={out_dir}", *overrides])


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as-is: bad JSON, raw escapes)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def read_output(out_dir: Path) -> Any:
    import pyarrow.dataset as ds

    return ds.dataset(str(out_dir), format="parquet").to_table()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:  # a hang guard, not a speed bound
    return subprocess.run(
        [sys.executable, "-m", "jobs.generate", *args], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=timeout,
    )


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray instance, started as `fit` starts its own, for the training runs inside (`fit` uses the instance
    it finds, as runs on a cluster do): a run that starts its own takes ~13 s more on a 2-core machine. The DMTD
    training test keeps one run that starts its own instance, which covers that path."""
    import ray

    from jobs.train.common import start_local_ray

    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()


def killed_then_resumed(main, args, weights, logger: str, caplog) -> None:
    """A worker dies right after the checkpoint of step 2 of 4: the run fails (exit 1), keeps that checkpoint and
    writes no weights; the same command again resumes from it and finishes (exit 0). args(*extra) is the
    command; `weights` the file a finished run writes."""
    assert main(args("fault.exit_at_step=2")) == 1
    assert not weights.exists()
    caplog.clear()
    with caplog.at_level("INFO", logger=logger):
        assert main(args()) == 0
    assert any("resuming from" in r.getMessage() for r in caplog.records)
