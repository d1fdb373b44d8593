"""Jobs against a real S3-compatible server (moto, reached only through pyarrow's S3 client): a multi-file
prefix in, parts out, resume after a killed driver, parts invisible while written, no credentials in
any written file."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest

from jobs_helpers import FAST, REPO, job_cfg, ray_head  # noqa: F401
from jobs.io.output import OutputDir
from jobs.run.runner import run_job
from s3_helpers import FAKE_KEY_ID, FAKE_SECRET, s3  # noqa: F401

pytestmark = pytest.mark.slow  # an S3 server (moto), and Ray for the jobs


def _upload_prompts(s3, prefix: str, n_files: int, per_file: int) -> list[str]:
    ids = []
    for f in range(n_files):
        lines = []
        for i in range(per_file):
            rid = f"f{f}-{i:02d}"
            ids.append(rid)
            lines.append(json.dumps({"id": rid, "prompt": f"Question {f}.{i}: say something.", "category": f"c{f}"}))
        s3.put(f"{prefix}/part-{f}.jsonl", ("\n".join(lines) + "\n").encode())
    return ids


def _parts(s3, prefix: str) -> list[str]:
    return [i.path for i in s3.fs.get_file_info(pafs.FileSelector(s3.path(prefix)))
            if i.base_name.startswith("part-") and i.base_name.endswith(".parquet")]


def _ids(s3, prefix: str) -> list[str]:
    files = _parts(s3, prefix)
    return ds.dataset(files, filesystem=s3.fs, format="parquet").to_table(columns=["id"]).column("id").to_pylist()


def _all_text(s3, prefix: str) -> str:
    out = []
    for info in s3.fs.get_file_info(pafs.FileSelector(s3.path(prefix), recursive=True)):
        if info.type == pafs.FileType.File:
            with s3.fs.open_input_stream(info.path) as f:
                out.append(f.read().decode("utf-8", "replace"))
    return "\n".join(out)


def test_job_reads_a_prefix_and_writes_parts_to_s3(ray_head, s3, tmp_path, caplog):
    ids = _upload_prompts(s3, "in", n_files=3, per_file=6)
    out_uri = s3.uri("out", "job1")
    caplog.set_level("INFO", logger="esp_batch")
    res = run_job(job_cfg(tmp_path / "unused", f"data.path={s3.uri('in')}/", f"output.dir={out_uri}",
                          "data.shard_size=4", "ray.num_actors=1", f"storage.endpoint={s3.endpoint}"))
    assert res.summary["complete"] and res.output_dir == out_uri
    # every location the job prints carries its scheme (s3://bucket/..., not bucket/...)
    assert res.summary_path == f"{out_uri}/_summary.json"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"summary {out_uri}/_summary.json" in logged and f"report: {out_uri}/_report/report.md" in logged, logged
    assert not re.search(rf"(?<!s3://){re.escape(s3.path('out'))}", logged), logged
    got = _ids(s3, "out/job1")
    assert sorted(got) == sorted(ids) and len(got) == len(set(got))
    names = {i.base_name for i in s3.fs.get_file_info(pafs.FileSelector(s3.path("out", "job1")))}
    assert {"_job.json", "_summary.json", "_report"} <= names and not any(n.endswith(".tmp") for n in names)
    text = _all_text(s3, "out/job1")
    assert FAKE_SECRET not in text and FAKE_KEY_ID not in text  # summary, manifest, report: no credentials
    # a rerun resumes: nothing to do, figures appended
    again = run_job(job_cfg(tmp_path / "unused", f"data.path={s3.uri('in')}/", f"output.dir={out_uri}",
                            "data.shard_size=4", "ray.num_actors=1", f"storage.endpoint={s3.endpoint}"))
    assert again.summary["this_run"]["shards_skipped"] == 5 and len(again.summary["runs"]) == 2


def test_driver_killed_then_rerun_resumes_on_s3(ray_head, s3, tmp_path):
    ids = _upload_prompts(s3, "in2", n_files=2, per_file=32)
    out_uri = s3.uri("out", "job2")
    # one shard at a time: the driver dies right after its second part (a kill at a known point, not a race)
    args = [*FAST, f"data.path={s3.uri('in2')}", f"output.dir={out_uri}", "data.shard_size=4", "ray.num_actors=1",
            "generation.max_new_tokens=8", "engine.max_batch_size=2", "ray.shards_in_flight_per_actor=1"]
    proc = subprocess.run([sys.executable, "-m", "jobs.generate", *args, "fault.driver_exit_after_parts=2"], cwd=REPO,
                          env={**os.environ, "RAY_ADDRESS": ray_head.address}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(_parts(s3, "out/job2")) == 2 and len(_ids(s3, "out/job2")) == 8
    res = run_job(job_cfg(tmp_path / "unused", *args[len(FAST):]))
    got = _ids(s3, "out/job2")
    assert sorted(got) == sorted(ids) and len(got) == len(set(got)) and res.summary["complete"]
    assert res.summary["this_run"]["shards_skipped"] == 2


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_part_being_written_is_never_listed(s3, tmp_path, where):
    out = OutputDir(str(tmp_path / "o") if where == "local" else s3.uri("listing", "o"), s3.storage())
    out.prepare()
    big = pa.table({"id": [f"x{i}" for i in range(200_000)], "blob": ["y" * 40] * 200_000})
    if where == "local":
        tmp = out.file(".part-000001.abc.tmp")  # the name write_part uses until its rename
        with out.fs.open_output_stream(tmp) as f:
            f.write(b"PAR1 partial")
            assert out.parts() == []
    else:
        with out.fs.open_output_stream(out.file("part-000001.parquet")) as f:
            f.write(b"x" * (6 << 20))  # a multipart upload in progress under the final key
            assert out.parts() == []
    out.write_part(1, big, "zstd", "fp")
    assert [p.rsplit("/", 1)[-1] for p in out.parts()] == ["part-000001.parquet"]
    assert out.part_infos()[1].fingerprint == "fp" and out.part_infos()[1].rows == 200_000
