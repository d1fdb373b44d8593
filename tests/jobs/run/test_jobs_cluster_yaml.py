"""ray_cluster.yaml is a valid Ray cluster-launcher config (Ray's own JSON schema) that installs the project."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import ray
import yaml

from jobs_helpers import REPO


def test_cluster_yaml_matches_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]
    workers = [n for name, n in nodes.items() if name != config["head_node_type"]]
    assert head["resources"].get("CPU") == 0  # engine actors stay off the head
    assert workers and all(w["max_workers"] >= 1 for w in workers)
    assert any("esp-batch" in cmd for cmd in config["setup_commands"])
    # the dashboard serves job submission (code execution): only on the head's loopback, reached by `ray dashboard`
    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start
