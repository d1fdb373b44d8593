"""Test-wide setup. Being a conftest.py in tests/ (no __init__.py), pytest puts tests/ on sys.path, so test
modules in any subfolder import the helpers here (`from shared_data import ...`, `from engine_helpers import ...`).

Ray starts its workers at niceness 15; on a machine whose cores other processes keep busy they then get a few
per cent of a core and every Ray test crawls. The tests' Ray workers run at the tests' own priority (inherited by
the jobs the tests start in subprocesses), so the suite's speed does not depend on the machine being idle.

The suite runs on three pytest-xdist workers (`-n 3` in pyproject.toml), one more than the 2-core development
machine has cores: much of the jobs tests' time is spent waiting (Ray clusters coming up, Ray Train polling) while
other tests compute, and there three workers finished the suite sooner than two or four (four peaked at 6.6 GiB).

Ray Train's controller polls its workers every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): a training test's run of a
few steps on a tiny model spent about a third of its time waiting for those polls, so the tests poll every 0.2 s.
That is the controller's reporting cadence, not what a run computes or writes; the variable reaches the controller
from the driver's environment (Ray Train propagates it).

Each worker keeps its Ray instances under a RAY_TMPDIR of its own (a test that builds clusters sets a private one
on top). Under a shared /tmp/ray the workers' clusters would meet: Ray records the last cluster started on
the machine in /tmp/ray/ray_current_cluster, a `ray job submit` to one test's head handed its job driver that file's
address (the supervisor resolves RAY_ADDRESS=auto), which was another worker's cluster, and the job's actors then
looked there for the uploaded working directory ("Failed to download runtime_env file package"); a job looking
for a running local instance would find the other worker's in the same way.

The workers share one Inductor cache, as the processes of a machine do: Inductor writes its entries whole or under
file locks, so what one worker compiled (a graph, a kernel, the compiler's precompiled headers and instruction-set
checks: ~15 s before a cache's first torch.compile graph) the other loads."""
import os
import tempfile

os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "RAY_TMPDIR" not in os.environ:  # short: Ray's Unix socket paths live under it
    os.environ["RAY_TMPDIR"] = os.path.join(tempfile.gettempdir(), f"ray-{os.getuid()}-{_WORKER}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)

# The suite is handed to the workers a module at a time (`--dist loadfile` in pyproject.toml): a module's fixtures
# (Ray heads, models, an S3 server) are made once, and the compiled kernels its tests share are compiled once.
# The longest modules (worker seconds in a run of the suite on the 2-core development machine from a clean clone with
# empty compiler caches, as CI runs it: there the modules that compile kernels weigh twice what they do warm) go
# first and the short ones fill in at the end, so that no long module starts last and leaves one worker running it alone
# (`--no-loadscope-reorder` keeps this order: by default xdist hands out the modules with the most tests first,
# which started the two training modules last on one worker).
LONGEST_FIRST = ("jobs/run/test_jobs_integrity.py", "jobs/run/test_jobs_cluster.py",
                 "engine/graphs/test_run_ahead.py", "engine/graphs/test_capture_path.py", "engine/test_lossless.py",
                 "engine/graphs/test_probe_stage.py", "engine/graphs/test_step_compile.py",
                 "jobs/run/test_jobs_ray.py", "jobs/train/test_train_dmtd.py", "jobs/train/test_train_heads.py",
                 "jobs/bench/test_bench.py", "engine/test_host_sync.py", "jobs/export/test_spec_bench_export.py",
                 "jobs/io/test_jobs_s3.py", "engine/test_prefix_cache.py", "engine/drafters/test_cp_heads.py",
                 "engine/graphs/test_static_engine.py", "engine/model/test_flex.py",
                 "jobs/run/test_jobs_dmtd.py", "jobs/run/test_jobs_default.py", "engine/test_logprobs.py",
                 "jobs/run/test_jobs_graphs.py", "jobs/run/test_jobs_local_ray.py", "test_readme.py",
                 "engine/graphs/test_step.py", "engine/auto/test_policy.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        module = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the other modules keep their order
