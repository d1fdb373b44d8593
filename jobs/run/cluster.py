"""Connect to Ray: an existing cluster when there is one (RAY_ADDRESS, `ray job submit`, a local
`ray start --head`), else a local instance this job starts and stops."""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

log = logging.getLogger("esp_batch")

_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")  # written by `ray start --head`


class ClusterError(RuntimeError):
    """Ray cannot run the job as configured; one-line message."""


def _local_cluster_alive() -> bool:
    """Whether the last `ray start --head` on this machine still listens: Ray leaves its address file
    behind when the head is killed, and connecting to a dead address waits for minutes."""
    try:
        host, port = _CURRENT_CLUSTER.read_text().strip().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def connect(ray_cfg: Any) -> bool:
    """Initialise Ray per `ray.address`; returns True when this call started a local instance."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS", "")
    common = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    if not address and _local_cluster_alive():
        ray.init(address="auto", **common)
        log.info("connected to the running local Ray cluster")
        return False
    if address and address != "local":
        try:
            ray.init(address=address, **common)
        except ConnectionError as exc:
            raise ClusterError(f"cannot connect to Ray at {address!r}: {str(exc).splitlines()[0]}") from None
        log.info("connected to Ray cluster at %s", address)
        return False
    ray.init(address="local", num_cpus=ray_cfg.num_cpus, include_dashboard=False, **common)
    log.info("started a local Ray instance (%s CPUs)", int(ray.cluster_resources().get("CPU", 0)))
    return True


def check_resources(ray_cfg: Any, started_locally: bool) -> None:
    """A local instance cannot grow: refuse actor requests it can never place (they would hang)."""
    import ray

    need_cpu = ray_cfg.num_actors * ray_cfg.num_cpus_per_actor
    need_gpu = ray_cfg.num_actors * ray_cfg.num_gpus_per_actor
    have = ray.cluster_resources()
    short = []
    if need_cpu > have.get("CPU", 0):
        short.append(f"{need_cpu:g} CPUs (ray.num_actors x ray.num_cpus_per_actor) but the cluster has {have.get('CPU', 0):g}")
    if need_gpu > have.get("GPU", 0):
        short.append(f"{need_gpu:g} GPUs (ray.num_actors x ray.num_gpus_per_actor) but the cluster has {have.get('GPU', 0):g}")
    if not short:
        return
    if started_locally:
        raise ClusterError(f"the actors need {short[0]}; lower ray.num_actors or the per-actor resources")
    log.warning("the actors need %s; waiting for the cluster to scale up", short[0])
