"""Connect to Ray: an existing cluster when there is one (RAY_ADDRESS, `ray job submit`, a local
`ray start --head`), else a local instance this job starts and stops. What each actor asks for, and a
watch on the cluster's head."""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import reaper

log = logging.getLogger("esp_batch")
_HAS_PROC = Path("/proc/self/stat").exists()
_reaper: Optional[Any] = None  # the reaper of the local instance connect() started


class ClusterError(RuntimeError):
    """Ray cannot run the job as configured; one-line message."""


class HeadLost(ClusterError):
    """The cluster's head (its GCS) stopped answering mid-job. Ray stays initialised in this process: its
    shutdown would wait for the lost GCS, so a command-line driver exits at once."""


def ray_temp_dir() -> Path:
    """Ray's temporary directory as `ray start` picks it: $RAY_TMPDIR, else $TMPDIR (Linux), else /tmp; then ray/."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return Path(base or "/tmp") / "ray"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process could take it before the caller
    binds it: rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADDRESS_FORMS = "not an address of the form host:port (or ray://host:port, auto, local)"


def host_port(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of host:port, ray://host:port and the like; None for anything else."""
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def well_formed_address(address: str) -> bool:
    """Whether `ray.address` can name a cluster (checked with the config, before anything starts); empty means
    RAY_ADDRESS or a local instance."""
    return address in ("", "auto", "local") or host_port(address) is not None


def running_local_cluster() -> Optional[str]:
    """The address of the last `ray start --head` on this machine (Ray writes it to
    <ray temp dir>/ray_current_cluster), if it still listens: Ray leaves the file behind when the head is
    killed, and connecting to a dead address waits for minutes."""
    try:
        address = (ray_temp_dir() / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    where = host_port(address)
    return address if where is not None and _refused(*where, timeout=1.0) is None else None


def address_problem(address: str) -> Optional[str]:
    """Why no Ray cluster can answer at `address` (host:port or ray://host:port), or None when a TCP connection to
    it opens: ray.init itself retries an address where nothing listens for as long as it runs. `auto` is Ray's
    to resolve (RAY_ADDRESS, or the address file of a head started with a temporary directory of its own)."""
    if address == "auto":
        return None
    where = host_port(address)
    if where is None:
        return ADDRESS_FORMS
    refused = _refused(*where, timeout=5.0)
    return None if refused is None else f"nothing answers at {where[0]}:{where[1]} ({refused}); is the cluster up?"


def _refused(host: str, port: int, timeout: float) -> Optional[str]:
    """Why a TCP connection to host:port does not open within `timeout` seconds (None: it opens)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def connect(ray_cfg: Any) -> bool:
    """Initialise Ray per `ray.address`; returns True when this call started a local instance."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS", "")
    common = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    if not address:
        address = running_local_cluster() or ""
        if address:
            ray.init(address=address, **common)
            log.info("connected to the running local Ray cluster at %s", address)
            return False
    if address and address != "local":
        problem = address_problem(address)
        if problem:
            raise ClusterError(f"cannot connect to Ray at {address!r}: {problem}")
        try:
            ray.init(address=address, **common)
        except (ConnectionError, ValueError) as exc:
            raise ClusterError(f"cannot connect to Ray at {address!r}: {str(exc).splitlines()[0]}") from None
        log.info("connected to Ray cluster at %s", address)
        return False
    global _reaper
    before = reaper.children(os.getpid()) if _HAS_PROC else set()
    ray.init(address="local", num_cpus=ray_cfg.num_cpus, include_dashboard=False, **common)
    if _HAS_PROC:  # the instance's processes die with this driver, however it ends (see reaper.py)
        _reaper = reaper.start(reaper.children(os.getpid()) - before)
    log.info("started a local Ray instance (%s CPUs)", int(ray.cluster_resources().get("CPU", 0)))
    return True


def stop_local() -> None:
    """Shut down the local instance connect() started, and its reaper."""
    import ray

    global _reaper
    ray.shutdown()
    reaper.release(_reaper)
    _reaper = None


@dataclass
class Resources:
    """What each engine actor asks Ray for."""

    cpus: float
    gpus: float
    note: str = ""  # how the GPUs were chosen, for the start-up line

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0}

    def __str__(self) -> str:
        return ", ".join(f"{v:g} {k}" for k, v in self.bundle().items()) or "no resources"


def actor_resources(ray_cfg: Any) -> Resources:
    """ray.num_cpus_per_actor, and ray.num_gpus_per_actor with `auto` resolved on the connected cluster: one
    GPU per actor when the cluster has GPUs, none otherwise. An explicit 0 on a GPU cluster is logged."""
    import ray

    have = ray.cluster_resources().get("GPU", 0)
    asked = ray_cfg.num_gpus_per_actor
    if asked == "auto":
        gpus = 1.0 if have > 0 else 0.0
        note = (f"ray.num_gpus_per_actor=auto: the cluster has {have:g} GPU{'s' if have != 1 else ''}" if have
                else "ray.num_gpus_per_actor=auto: the cluster has no GPU")
        return Resources(float(ray_cfg.num_cpus_per_actor), gpus, note)
    if float(asked) == 0 and have > 0:
        log.warning("ray.num_gpus_per_actor=0 on a cluster with %g GPU(s): the engines run on CPU "
                    "(ray.num_gpus_per_actor=auto or 1 gives each actor a GPU)", have)
    return Resources(float(ray_cfg.num_cpus_per_actor), float(asked))


def check_resources(ray_cfg: Any, resources: Resources, started_locally: bool) -> int:
    """How many actors to start: ray.num_actors, or fewer where `auto` gave each a GPU and a local instance
    (which cannot grow) has fewer GPUs, so the default job uses a one-GPU workstation's GPU instead of
    being refused. Other requests a local instance can never place are refused (they would hang)."""
    import ray

    have = ray.cluster_resources()
    n = ray_cfg.num_actors
    gpus_here = have.get("GPU", 0)
    if started_locally and ray_cfg.num_gpus_per_actor == "auto" and 0 < resources.gpus and gpus_here < n * resources.gpus:
        n = max(1, int(gpus_here // resources.gpus))
        log.info("ray.num_actors=%d but this machine has %g GPU(s): starting %d actor(s), one per GPU",
                 ray_cfg.num_actors, gpus_here, n)
    need_cpu = n * resources.cpus
    need_gpu = n * resources.gpus
    short = []
    if need_cpu > have.get("CPU", 0):
        short.append(f"{need_cpu:g} CPUs (ray.num_actors x ray.num_cpus_per_actor) but the cluster has {have.get('CPU', 0):g}")
    if need_gpu > gpus_here:
        short.append(f"{need_gpu:g} GPUs (ray.num_actors x ray.num_gpus_per_actor) but the cluster has {gpus_here:g}")
    if not short:
        return n
    if started_locally:
        raise ClusterError(f"the actors need {short[0]}; lower ray.num_actors or the per-actor resources")
    log.warning("the actors need %s; waiting for the cluster to scale up", short[0])
    return n


class HeadWatch:
    """Notices a lost head within ray.head_timeout_s. Without it a driver whose GCS is gone waits for Ray's
    own limit (60 s, gcs_rpc_server_reconnect_timeout_s), spinning, then dies without a word or a record.
    `check()` is called from the driver's wait loops; at most once a second it opens a TCP connection to
    the GCS (cheap; a GCS restarted under fault tolerance answers again within the timeout)."""

    def __init__(self, timeout_s: float, every_s: float = 1.0):
        import ray

        self.timeout_s = timeout_s
        self.every_s = every_s
        try:
            self.address: Optional[str] = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - e.g. Ray Client: no GCS address to watch
            self.address = None
        self._checked = 0.0
        self._down_since: Optional[float] = None

    @property
    def down(self) -> bool:
        """Whether the GCS did not answer the last check (calls through it would wait for Ray's 60 s)."""
        return self._down_since is not None

    def _answers(self) -> Optional[OSError]:
        """None when the GCS accepts a connection now, else the error."""
        host, port = self.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return None
        except OSError as exc:
            return exc

    def answers_now(self) -> bool:
        """One check now: whether the GCS accepts a connection (True when there is no address to watch)."""
        return self.address is None or self._answers() is None

    def confirm(self, what: str) -> None:
        """Raises HeadLost when the GCS does not answer now: `what` (every actor gone, say) is then the head's loss."""
        if self.address is not None and (exc := self._answers()) is not None:
            raise HeadLost(f"lost the cluster's head: its GCS at {self.address} does not answer "
                           f"({exc.strerror or type(exc).__name__}) and {what}")

    def check(self) -> None:
        """Raises HeadLost once the GCS has not answered for ray.head_timeout_s."""
        now = time.monotonic()
        if self.address is None or now - self._checked < self.every_s:
            return
        self._checked = now
        exc = self._answers()
        if exc is not None:
            if self._down_since is None:
                self._down_since = now
                log.warning("the cluster's head (GCS at %s) does not answer (%s); waiting up to "
                            "ray.head_timeout_s=%gs", self.address, exc.strerror or type(exc).__name__, self.timeout_s)
            elif now - self._down_since >= self.timeout_s:
                raise HeadLost(f"lost the cluster's head: its GCS at {self.address} has not answered for "
                               f"{now - self._down_since:.0f}s (ray.head_timeout_s={self.timeout_s:g})") from None
            return
        if self._down_since is not None:
            log.info("the cluster's head answers again after %.0fs", now - self._down_since)
            self._down_since = None
