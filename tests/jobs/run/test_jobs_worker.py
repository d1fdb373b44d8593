"""The shard worker called directly, without Ray (as Ray's own UDF tests do)."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from jobs_helpers import SPEC_BENCH, TINY_LLAMA, shared, job_cfg
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


@pytest.mark.parametrize("history", ["stripped", "raw"])
def test_turns_answer_each_turn_with_the_earlier_ones_in_context(tmp_path, history):
    """The earlier answers go back as history stripped of surrounding whitespace (Spec-Bench's way, the default)
    or exactly as generated (data.turn_history=raw)."""
    model = shared(TINY_LLAMA)  # trained: its answers start with a space, so the two modes differ
    worker, rows = _worker(tmp_path, f"data.path={shared(SPEC_BENCH)}", "data.id_column=question_id", "data.limit=2",
                           "generation.max_new_tokens=4", f"data.turn_history={history}", f"model.name_or_path={model}")
    out = worker.run_shard(0, rows).to_pylist()
    tok = worker.engine.tokenizer
    assert any(g["generated_turns"][0] != g["generated_turns"][0].strip() for g in out)  # the modes differ here
    for job_row, got in zip(rows, out):
        t1, t2 = job_row.input
        a1, a2 = got["generated_turns"]
        fed = a1.strip() if history == "stripped" else a1
        first = tok(render_plain([{"role": "user", "content": t1}])).input_ids
        second = tok(render_plain([{"role": "user", "content": t1}, {"role": "assistant", "content": fed},
                                   {"role": "user", "content": t2}])).input_ids
        assert got["num_prompt_tokens"] == len(first) + len(second)
        assert got["generated_text"] == a2 and got["num_generated_tokens"] == len(got["generated_token_ids"])


def test_turns_rows_have_per_turn_lists_that_sum_to_the_row(tmp_path):
    """One entry per turn in each per-turn list, summing to the row's counters; the per-pass committed tokens sum
    to the decode tokens; vLLM's names carry our counters."""
    worker, rows = _worker(tmp_path, f"data.path={shared(SPEC_BENCH)}", "data.id_column=question_id", "data.limit=3",
                           "generation.max_new_tokens=24", "engine.method=pld", "engine.block_complexity=10",
                           f"model.name_or_path={shared(TINY_LLAMA)}")
    out = worker.run_shard(0, rows).to_pylist()
    for job_row, got in zip(rows, out):
        n = len(job_row.input)
        assert got["error"] is None
        assert len(got["turn_generated_tokens"]) == len(got["turn_time_s"]) == len(got["turn_decode_passes"]) == n
        assert sum(got["turn_generated_tokens"]) == got["num_generated_tokens"]
        assert sum(got["turn_decode_passes"]) == got["num_decode_passes"]
        assert got["time_s"] == pytest.approx(sum(got["turn_time_s"])) and min(got["turn_time_s"]) > 0
        assert len(got["committed_per_pass"]) == got["num_decode_passes"]
        assert sum(got["committed_per_pass"]) == got["num_decode_tokens"]
        assert got["num_draft_tokens"] == got["num_drafted_tokens"]
        assert got["num_accepted_tokens"] == got["num_accepted_drafts"]
        assert got["num_accepted_tokens_per_pos"] == got["accepted_per_depth"]
        assert 0 <= got["num_drafts"] <= got["num_decode_passes"]
    assert any(got["num_drafts"] for got in out)


def test_error_rows_have_no_time(tmp_path):
    """A row that never reached the engine has no seconds (null), not 0 s a reader would divide by."""
    from jobs_helpers import write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "hello"}, {"id": "bad", "prompt": ""},
                                                {"id": "long", "prompt": "word " * 5000}])
    worker, rows = _worker(tmp_path, f"data.path={data}")
    out = {r["id"]: r for r in worker.run_shard(0, rows).to_pylist()}
    assert out["ok"]["error"] is None and out["ok"]["time_s"] > 0 and len(out["ok"]["turn_time_s"]) == 1
    for rid in ("bad", "long"):
        assert out[rid]["error"] is not None and out[rid]["time_s"] is None and out[rid]["turn_time_s"] == []


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


@pytest.mark.parametrize("setting", [["engine.method=ar"], ["engine.method=hybrid", "generation.temperature=0.8"],
                                     ["engine.method=hybrid", "engine.cuda_graphs=true"]])
def test_a_row_that_fails_its_batch_fails_alone_and_the_others_finish(tmp_path, setting):
    """An engine error in a batch (here raised by every decode pass holding row 2, after the pass's work) runs that
    batch's rows again in halves: row 2 gets the error, the others the tokens they get with no fault (sampled
    ones too: a row's stream is its own; the static path too, whose pinned cache outlives the failed batch), and the
    actor takes the next shard."""
    args = ["data.limit=6", "generation.max_new_tokens=8", "engine.max_batch_size=3", "engine.block_complexity=10",
            *setting]
    clean, rows = _worker(tmp_path / "clean", *args)
    want = {r["id"]: r["generated_token_ids"] for r in clean.run_shard(0, rows).to_pylist()}
    bad = rows[2].id
    worker, rows = _worker(tmp_path / "fault", *args, f"fault.fail_row={bad}")
    out = {r["id"]: r for r in worker.run_shard(0, rows).to_pylist()}
    assert list(out) == [r.id for r in rows]
    assert out[bad]["error"] == f"engine error: RuntimeError: fault.fail_row={bad}: a decode pass holding row {bad!r}"
    assert out[bad]["generated_text"] is None and out[bad]["finish_reason"] is None
    for rid, got in out.items():
        if rid != bad:
            assert got["error"] is None and got["generated_token_ids"] == want[rid], rid
    again = worker.run_shard(1, [r for r in rows if r.id != bad]).to_pylist()
    assert [r["generated_token_ids"] for r in again] == [want[r.id] for r in rows if r.id != bad]


def test_an_engine_that_fails_every_row_alone_fails_the_shard(tmp_path):
    """Rows that fail alone one after another mean the engine is broken: the shard, and the next, fail with the
    error (the driver stops the job), rather than every row of the job getting it."""
    from jobs.run.worker import BROKEN_AFTER, EngineFailure

    worker, rows = _worker(tmp_path, "data.limit=5", "engine.max_batch_size=4", "fault.fail_row='*'")
    assert BROKEN_AFTER <= 4
    msg = rf"engine error: RuntimeError: fault.fail_row=\*.* \({BROKEN_AFTER} rows in a row failed alone: the engine"
    with pytest.raises(EngineFailure, match=msg):
        worker.run_shard(0, rows)
    with pytest.raises(EngineFailure, match=msg):
        worker.run_shard(1, rows[:1])


def test_a_batch_whose_cache_outgrows_the_device_runs_its_rows_alone(tmp_path, monkeypatch, caplog):
    """A KV cache growth past the device's free memory is refused before it is allocated (on a CPU the kernel would
    kill the process): the batch's rows run again in halves. With room for the long row alone every row finishes as
    it does with memory to spare, and the engine then admits half as many rows, until enough rows have finished;
    with less memory, the long row gets the refusal and the short ones finish."""
    import esp_worker.memory
    from jobs_helpers import write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "long", "prompt": "word " * 80}] +
                       [{"id": f"short{i}", "prompt": f"Question {i}?"} for i in range(3)])
    args = [f"data.path={data}", "engine.max_batch_size=4", "generation.max_new_tokens=8"]
    clean, rows = _worker(tmp_path / "clean", *args)
    want = {r["id"]: r["generated_token_ids"] for r in clean.run_shard(0, rows).to_pylist()}
    slot = clean.engine.slot_bytes
    monkeypatch.setattr(esp_worker.memory, "free_bytes", lambda device: 600 * slot)  # the long row alone: ~420 slots
    worker, rows = _worker(tmp_path / "alone", *args)
    out = worker.run_shard(0, rows).to_pylist()
    assert [r["error"] for r in out] == [None] * 4 and {r["id"]: r["generated_token_ids"] for r in out} == want
    refused = [m for m in caplog.messages if m.startswith("engine error: MemoryShortError: a ")]
    assert refused and refused[0].endswith("row(s) in the batch; running them again in halves")
    assert worker.engine.max_rows == 2  # 4 rows ran out of memory: the engine admits half as many for a while
    monkeypatch.setattr(esp_worker.memory, "free_bytes", lambda device: 200 * slot)
    out = {r["id"]: r for r in worker.run_shard(1, rows).to_pylist()}
    assert out["long"]["error"].startswith("engine error: MemoryShortError: a KV cache of 1 rows of ")
    assert "lower engine.max_batch_size, or shorten the rows" in out["long"]["error"]
    assert all(out[k]["error"] is None and out[k]["generated_token_ids"] == want[k] for k in want if k != "long")
    # short rows that fit: after REGAIN_AFTER batches' worth of them (at 1 then 2 rows) it admits 4 rows again
    fine = worker.engine.max_rows
    shorts = [r for r in rows if r.id != "long"] * 5
    for i in range(0, len(shorts), 3):
        worker.run_shard(2 + i, shorts[i:i + 3])
    assert fine < 4 and worker.engine.max_rows == 4


def test_a_long_row_past_the_pinned_slab_finishes_alone_where_the_grown_slab_cannot_fit(tmp_path, monkeypatch):
    """On the static (CUDA-graph) path a row longer than engine.cuda_graph_max_len grows the pinned slab for all
    engine.max_batch_size rows. Where the device cannot hold that (free memory patched to 600 slots: the long row alone), the rows spill
    into a cache of their own instead, so the batch's halves, and then the long row alone, fit and finish with the
    tokens of a run with memory to spare."""
    import esp_worker.memory
    from jobs_helpers import write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "long", "prompt": "word " * 80}] +
                       [{"id": f"short{i}", "prompt": f"Question {i}?"} for i in range(3)])
    args = [f"data.path={data}", "engine.max_batch_size=4", "generation.max_new_tokens=8", "engine.method=pld",
            "engine.block_complexity=10", "engine.cuda_graphs=true", "engine.cuda_graph_max_len=48"]
    clean, rows = _worker(tmp_path / "clean", *args)
    want = {r["id"]: r["generated_token_ids"] for r in clean.run_shard(0, rows).to_pylist()}
    worker, rows = _worker(tmp_path / "short", *args)
    monkeypatch.setattr(esp_worker.memory, "free_bytes", lambda device: 600 * worker.engine.slot_bytes)
    out = worker.run_shard(0, rows).to_pylist()
    assert [r["error"] for r in out] == [None] * 4 and {r["id"]: r["generated_token_ids"] for r in out} == want
    graphs = worker.engine.stats.graphs
    assert graphs.eager_passes["spilled"] > 0 and worker.engine.graphs.cache.pinned_slab.shape[4] == 48


def test_a_shard_sent_again_while_its_first_call_runs_waits_for_those_rows(tmp_path):
    """After a call that Ray reported failed while the actor's node was unreachable, the same process gets the shard
    again while the first call may still run it: the second call returns the first call's rows (no row runs twice,
    and not `row id ... already in flight`)."""
    import threading
    import time

    worker, rows = _worker(tmp_path, "data.limit=3", "generation.max_new_tokens=8")
    found = threading.Event()  # the second call found the first one's shard
    running, step = worker._running, worker.engine._step

    def spy(index, shard_rows):
        shard = running(index, shard_rows)
        if shard is not None:
            found.set()
        return shard

    def gated(batch):  # the engine's passes wait until the second call has arrived
        assert found.wait(120), "the second call did not find the first one's shard"
        step(batch)

    worker._running, worker.engine._step = spy, gated
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", worker.run_shard(0, rows)))
    first.start()
    deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
    while not worker._shard_objs and time.monotonic() < deadline:
        time.sleep(0.01)
    second = worker.run_shard(0, rows)
    first.join(120)
    assert second.to_pylist() == results["first"].to_pylist()
    assert all(r["error"] is None and r["num_generated_tokens"] == 8 for r in second.to_pylist())
    passes = worker.passes()
    worker._running, worker.engine._step = running, step
    again = worker.run_shard(0, rows)  # the shard once more, alone: as many passes as both calls took together
    assert worker.passes() - passes == passes
    assert [r["generated_token_ids"] for r in again.to_pylist()] == [r["generated_token_ids"] for r in second.to_pylist()]


def test_rows_sharing_a_system_prompt_prefill_it_once_and_match_model_generate(tmp_path, tiny):
    from jobs_helpers import write_jsonl

    system = "You are a careful assistant. Answer in one short paragraph, and say so when you do not know. "
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": system + f"Question {i}: what is {i} plus {i}?"}
                                               for i in range(6)])
    worker, rows = _worker(tmp_path, f"data.path={data}", "generation.max_new_tokens=8", "engine.max_batch_size=4")
    out = worker.run_shard(0, rows).to_pylist()
    for job_row, got in zip(rows, out):
        ids = tiny.tokenizer(job_row.input, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = tiny.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert got["generated_token_ids"] == ref and got["num_prompt_tokens"] == ids.shape[1]
    spent = worker.stats()["engine_time"]  # what the job's _summary.json sums over its actors
    assert spent["prefill_cached_tokens"] >= 4 * len(tiny.tokenizer(system).input_ids) // 2
    assert spent["prefill_tokens"] + spent["prefill_cached_tokens"] >= sum(r["num_prompt_tokens"] for r in out)
    assert sum(r["num_cached_prompt_tokens"] for r in out) == spent["prefill_cached_tokens"]  # each row's share


def test_token_logprobs_are_the_models_and_null_unless_asked(tmp_path, tiny):
    worker, rows = _worker(tmp_path, "data.limit=3", "generation.max_new_tokens=8", "generation.top_logprobs=3")
    table = worker.run_shard(0, rows)
    assert table.schema.field("top_logprobs").type == pa.list_(pa.list_(
        pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))
    for job_row, got in zip(rows, table.to_pylist()):
        ids = tiny.tokenizer(job_row.input)["input_ids"]
        seq = torch.tensor([ids + got["generated_token_ids"]])
        with torch.inference_mode():
            logp = tiny.model(seq).logits[0].float().log_softmax(-1)[len(ids) - 1: -1]
        want = logp.gather(1, torch.tensor(got["generated_token_ids"])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got["token_logprobs"]), want, atol=1e-4)
        best = logp.topk(3, -1)
        assert [[a["token_id"] for a in alts] for alts in got["top_logprobs"]] == best.indices.tolist()
        assert torch.allclose(torch.tensor([[a["logprob"] for a in alts] for alts in got["top_logprobs"]]),
                              best.values, atol=1e-4)
    worker, rows = _worker(tmp_path / "off", "data.limit=2", "generation.max_new_tokens=4")
    assert [(r["token_logprobs"], r["top_logprobs"], r["prompt_token_ids"], r["prompt_logprobs"])
            for r in worker.run_shard(0, rows).to_pylist()] == [(None,) * 4] * 2


def test_prompt_logprobs_with_the_prompt_the_model_read(tmp_path, tiny):
    worker, rows = _worker(tmp_path, "data.limit=3", "generation.max_new_tokens=2", "generation.prompt_logprobs=true")
    for job_row, got in zip(rows, worker.run_shard(0, rows).to_pylist()):
        ids = tiny.tokenizer(job_row.input)["input_ids"]
        assert got["prompt_token_ids"] == ids and got["token_logprobs"] is None
        with torch.inference_mode():
            logp = tiny.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert got["prompt_logprobs"][0] is None
        assert torch.allclose(torch.tensor(got["prompt_logprobs"][1:]), want, atol=1e-4)


def test_logprobs_of_turns_follow_the_concatenated_tokens_and_the_last_prompt(tmp_path):
    worker, rows = _worker(tmp_path, f"data.path={shared(SPEC_BENCH)}", "data.id_column=question_id", "data.limit=2",
                           "generation.max_new_tokens=4", "generation.logprobs=true", "generation.prompt_logprobs=true",
                           f"model.name_or_path={shared(TINY_LLAMA)}")
    for got in worker.run_shard(0, rows).to_pylist():
        assert len(got["generated_turns"]) == 2
        assert len(got["token_logprobs"]) == len(got["generated_token_ids"]) == got["num_generated_tokens"]
        assert all(lp <= 0 for lp in got["token_logprobs"])
        # the last turn's prompt: the whole conversation before its answer
        assert len(got["prompt_logprobs"]) == len(got["prompt_token_ids"]) > got["num_prompt_tokens"] // 2
        assert got["prompt_logprobs"][0] is None and all(lp <= 0 for lp in got["prompt_logprobs"][1:])


def test_samples_of_a_row_sample_0_the_single_answer_and_the_counters_their_sums(tmp_path):
    """generation.n (here a row's params): one output row per input row, each sample's answer in `samples`, sample 0
    the answer the row gives with n = 1; the row's counters add up every sample's. Greedy samples are refused."""
    from jobs_helpers import write_jsonl

    inputs = [{"id": "a", "prompt": "Once upon a time", "params": {"n": 3}},
              {"id": "a#1", "prompt": "The weather today"},  # (the id sample_requests gives a's sample 1)
              {"id": "c", "prompt": "Greedy", "params": {"n": 2, "temperature": 0.0}},
              {"id": "d", "turns": ["Hello there", "And then?"], "params": {"n": 2}}]
    common = ("generation.max_new_tokens=8", "generation.temperature=0.9", "generation.logprobs=true")
    worker, rows = _worker(tmp_path / "n", f"data.path={write_jsonl(tmp_path / 'n.jsonl', inputs)}", *common)
    out = {r["id"]: r for r in worker.run_shard(0, rows).to_pylist()}
    singles = [{k: v for k, v in r.items() if k != "params"} for r in inputs]
    worker, rows = _worker(tmp_path / "one", f"data.path={write_jsonl(tmp_path / 'one.jsonl', singles)}", *common)
    single = {r["id"]: r for r in worker.run_shard(0, rows).to_pylist()}

    assert list(out) == ["a", "a#1", "c", "d"] and out["a#1"]["samples"] is None
    assert "n=2 needs temperature > 0" in out["c"]["error"] and out["c"]["samples"] is None
    for rid, n in (("a", 3), ("d", 2)):
        row, samples = out[rid], out[rid]["samples"]
        assert row["error"] is None and len(samples) == n
        assert samples[0]["token_ids"] == row["generated_token_ids"] == single[rid]["generated_token_ids"]
        assert samples[0]["text"] == row["generated_text"] and row["token_logprobs"] == samples[0]["token_logprobs"]
        assert len({tuple(x["token_ids"]) for x in samples}) > 1  # seeds differ
        for x in samples:
            assert x["error"] is None and x["finish_reason"] == "length"
            assert len(x["token_logprobs"]) == len(x["token_ids"]) == x["num_generated_tokens"]
            assert sum(x["committed_per_pass"]) == x["num_decode_tokens"] and len(x["committed_per_pass"]) == \
                x["num_decode_passes"]
        assert row["num_generated_tokens"] == sum(x["num_generated_tokens"] for x in samples)
        assert row["num_decode_passes"] == sum(x["num_decode_passes"] for x in samples)
        assert row["committed_per_pass"] == [c for x in samples for c in x["committed_per_pass"]]
        assert row["time_s"] == pytest.approx(sum(x["time_s"] for x in samples))
    assert out["a"]["num_prompt_tokens"] == 3 * single["a"]["num_prompt_tokens"]  # (a turn's prompt holds its answers)
    assert [len(x["turns"]) for x in out["d"]["samples"]] == [2, 2]
    assert out["d"]["generated_turns"] == out["d"]["samples"][0]["turns"] == single["d"]["generated_turns"]
    assert out["d"]["turn_generated_tokens"] == out["d"]["samples"][0]["turn_generated_tokens"] == [8, 8]
