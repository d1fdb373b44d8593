"""The shard worker called directly, without Ray (as Ray's own UDF tests do)."""
from __future__ import annotations

import pytest
import torch

from jobs_helpers import SPEC_BENCH, shared, job_cfg
from esp_worker import ModelConfig
from esp_worker import load_model
from jobs.io.output import OutputDir
from jobs.run.prompts import render_plain
from jobs.run.rows import RowNormalizer
from jobs.run.runner import plan_schema, worker_spec
from jobs.io.sources import open_source
from jobs.run.worker import ShardWorker


def _worker(tmp_path, *overrides):
    cfg = job_cfg(tmp_path / "out", *overrides)
    source = open_source(cfg.data.path, cfg.data.format, cfg.data.split, cfg.data.limit)
    spec = worker_spec(cfg, plan_schema(cfg, source), OutputDir(str(tmp_path / "out")))
    norm = RowNormalizer(cfg.data.id_column, cfg.data.prompt_column, cfg.data.params_column,
                         cfg.data.category_column, list(cfg.data.carry_columns))
    rows = [norm(i, r) for i, r in enumerate(next(source.batches(1000)))]
    threads = torch.get_num_threads()
    worker = ShardWorker(spec)
    torch.set_num_threads(threads)  # the worker sets the process-wide count; leave the test process as it was
    return worker, rows


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelConfig(name_or_path="tiny-random-llama", device="cpu"))


def test_prompt_rows_match_model_generate(tmp_path, tiny):
    worker, rows = _worker(tmp_path, "data.limit=3", "generation.max_new_tokens=8")
    assert worker.info()["error"] is None and worker.info()["chat_template"] is False
    out = worker.run_shard(0, rows).to_pylist()
    assert [r["id"] for r in out] == [r.id for r in rows]
    for job_row, got in zip(rows, out):
        ids = tiny.tokenizer(job_row.input, return_tensors="pt").input_ids  # exactly tokenizer(prompt)
        with torch.inference_mode():
            ref = tiny.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert got["generated_token_ids"] == ref and got["num_prompt_tokens"] == ids.shape[1]


def test_turns_answer_each_turn_with_the_earlier_ones_in_context(tmp_path, tiny):
    worker, rows = _worker(tmp_path, f"data.path={shared(SPEC_BENCH)}", "data.id_column=question_id", "data.limit=2",
                           "generation.max_new_tokens=4")
    out = worker.run_shard(0, rows).to_pylist()
    tok = tiny.tokenizer
    for job_row, got in zip(rows, out):
        t1, t2 = job_row.input
        a1, a2 = got["generated_turns"]
        first = tok(render_plain([{"role": "user", "content": t1}])).input_ids
        second = tok(render_plain([{"role": "user", "content": t1}, {"role": "assistant", "content": a1},
                                   {"role": "user", "content": t2}])).input_ids
        assert got["num_prompt_tokens"] == len(first) + len(second)
        assert got["generated_text"] == a2 and got["num_generated_tokens"] == len(got["generated_token_ids"])


def test_load_errors_are_reported_not_raised(tmp_path):
    worker, _ = _worker(tmp_path, "model.name_or_path=tiny-random-gpt9")
    assert "tiny-random" in worker.info()["error"]
    worker, _ = _worker(tmp_path, "data.chat_template=always")
    assert "no chat template" in worker.info()["error"]


def test_dmtd_rows_say_they_are_not_lossless(tmp_path):
    """engine.method=dmtd rows carry lossless=false and their PLT; a lossless method's rows lossless=true, no PLT."""
    worker, rows = _worker(tmp_path, "data.limit=3", "generation.max_new_tokens=8", "engine.method=dmtd",
                           "engine.dmtd_tau=2", "engine.dmtd_decoding_layers=1")
    out = worker.run_shard(0, rows).to_pylist()
    assert all(r["error"] is None and r["lossless"] is False for r in out)
    assert all(r["method"] == "dmtd" and 0.5 < r["plt"] < 1.0 for r in out)  # tau 2, D 1 of 2 layers: ~0.75
    worker, rows = _worker(tmp_path / "ar", "data.limit=2", "generation.max_new_tokens=4", "engine.method=ar")
    out = worker.run_shard(0, rows).to_pylist()
    assert all(r["lossless"] is True and r["plt"] is None for r in out)
