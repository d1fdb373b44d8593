"""`python -m jobs.bench` end to end on a tiny model, plus the cost-curve arithmetic."""
from __future__ import annotations

import csv
import json

import pytest

from esp_worker.auto.cost_model import CostCurve, predict_speedup
from jobs.bench.runner import main
from jobs.config import ConfigError
from jobs_helpers import write_jsonl


def prompts(tmp_path, texts: list[str]):
    """A prompts file of `texts`, ids p0, p1, ..."""
    return write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": w} for i, w in enumerate(texts)])

REQUIRED = {"method", "block_complexity", "num_masks", "tree", "category", "num_prompts", "tau", "tokens_per_s",
            "speedup_vs_ar", "exact_match_rate"}


@pytest.mark.slow
def test_bench_end_to_end(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "a", "category": "code", "prompt": "def f(x):\n    return x\n\ndef f("},
        {"id": "b", "category": "code", "prompt": "for i in range(10):\n    print(i)\nfor i in"},
        {"id": "c", "category": "mt-bench", "turns": ["Say hello twice.", "Now say it again."]},
        {"id": "d", "category": "mt-bench", "prompt": "the cat sat on the mat, the cat sat on the"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main([
        f"data.path={data}", f"output.dir={out}", "generation.max_new_tokens=16",
        "bench.methods=[ar,pld,esp]", "bench.block_complexities=[10]", "bench.num_masks=[1]",
        "bench.trees=[static]", "bench.warmup=1", "bench.cost_cache_lens=[16]", "bench.cost_max_block=16",
        "bench.cost_repeats=1",
    ])
    assert code == 0
    records = json.loads((out / "bench.json").read_text())
    assert {r["setting"] for r in records} == {"ar", "hf generate", "pld BC10", "esp k1 static BC10"}
    assert {r["category"] for r in records} == {"code", "mt-bench", "all"}
    for r in records:
        assert REQUIRED <= set(r)
        assert r["exact_match_rate"] == 1.0  # float32: every method reproduces ar
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0
    assert all(r["speedup_vs_ar"] == 1.0 for r in records if r["method"] == "ar")
    assert all(r["speedup_vs_hf"] == 1.0 for r in records if r["method"] == "hf")
    assert all(r["speedup_vs_ar_paired"] == 1.0 for r in records if r["method"] == "ar")
    assert all(r["speedup_vs_ar_paired"] > 0 and r["speedup_vs_hf_paired"] > 0 for r in records)
    assert all(r["peak_cache_mb"] > 0 for r in records if r["method"] != "hf")
    assert all(len(r["time_s_rounds"]) == 1 and r["time_s_rounds"][0] == pytest.approx(r["time_s"]) for r in records)
    assert next(r for r in records if r["setting"] == "ar" and r["category"] == "all")["num_prompts"] == 4
    with open(out / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(records)
    report = (out / "report.md").read_text()
    assert "| esp k1 static BC10 | 1 |" in report and "| hf generate | 1 |" in report and "tolerance" in report
    for name in ("tau_by_category.png", "speedup_vs_bc.png", "cost_curve.png"):
        assert (out / name).stat().st_size > 1000 and f"]({name})" in report
    curve = CostCurve.from_dict(json.loads((out / "cost_curve.json").read_text()))
    assert curve.block_sizes == [1, 2, 4, 8, 16] and curve.relative_cost(1, 1, 16) == 1.0


def test_bench_mixed_lengths_batched_hf_row(tmp_path):
    """Per-prompt max_new_tokens in [lo, hi]; hf generate runs left-padded batches and still matches ar."""
    data = prompts(tmp_path, ["the cat sat on the mat", "def f(x):\n    return", "one two three one two", "abc abc abc",
                              "x = 1\ny ="])
    out = tmp_path / "out"
    code = main([
        f"data.path={data}", f"output.dir={out}", "bench.methods=[ar]", "bench.batch_sizes=[3]",
        "bench.mixed_max_new_tokens=[4,12]", "bench.warmup=0", "bench.cost_curve=false",
    ])
    assert code == 0
    records = json.loads((out / "bench.json").read_text())
    assert [r["setting"] for r in records] == ["ar", "hf generate"]
    assert all(r["exact_match_rate"] == 1.0 and r["batch_size"] == 3 for r in records)
    assert 5 * 4 <= records[0]["num_generated_tokens"] <= 5 * 12


def test_samples_run_as_a_job_seeds_them(tmp_path):
    """generation.n: each prompt's samples are prompts of their own, seeded as a job seeds them: every setting
    decodes the same samples (exact match) and every sample's tokens count."""
    data = prompts(tmp_path, ["the cat sat on the mat", "def f(x):\n    return"])
    common = [f"data.path={data}", "generation.temperature=0.8", "generation.max_new_tokens=6", "bench.warmup=0",
              "bench.cost_curve=false", "bench.hf_baseline=false", "bench.batch_sizes=[3]"]
    assert main([*common, f"output.dir={tmp_path / 'n'}", "generation.n=3", "bench.settings=[hybrid:auto]"]) == 0
    assert main([*common, f"output.dir={tmp_path / 'one'}", "bench.settings=[hybrid:auto]"]) == 0
    records = {o: json.loads((tmp_path / o / "bench.json").read_text()) for o in ("n", "one")}
    assert all(r["exact_match_rate"] == 1.0 for r in records["n"])
    many, one = (next(r for r in records[o] if r["setting"] == "ar") for o in ("n", "one"))
    assert many["num_prompts"] == 6 and many["num_generated_tokens"] == 3 * one["num_generated_tokens"] == 36


def test_a_batch_larger_than_a_category_says_how_many_rows_it_held(tmp_path, caplog):
    """Categories run one after another, so batch 4 over categories of 1 and 3 prompts holds 3 rows at most: the
    records, the log and the report say so (a "batch 4" number would otherwise claim a batch it never ran)."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"id": f"{c}{i}", "category": c, "prompt": f"{c} {i} one two one two"}
            for c, n in (("x", 1), ("y", 3)) for i in range(n)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        code = main([f"data.path={data}", f"output.dir={out}", "bench.methods=[ar]", "bench.batch_sizes=[1,4]",
                     "bench.warmup=0", "bench.cost_curve=false", "bench.hf_baseline=false",
                     "generation.max_new_tokens=4"])
    assert code == 0
    records = json.loads((out / "bench.json").read_text())
    held = {(r["batch_size"], r["category"]): r["max_rows"] for r in records}
    assert held == {(1, "x"): 1, (1, "y"): 1, (1, "all"): 1, (4, "x"): 1, (4, "y"): 3, (4, "all"): 3}
    assert "batch 4: categories run one at a time and the largest has 3 prompts" in caplog.text
    assert "batch 4 holds at most 3 rows, one category at a time" in (out / "report.md").read_text()


def test_bench_rejects_unknown_method(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a default output.dir would land here, not in the checkout
    assert main(["bench.methods=[ar,medusa]"]) == 2
    assert "bench.methods" in capsys.readouterr().err


def test_explicit_settings_replace_the_grid():
    from jobs.bench.settings import grid
    from jobs.bench.config import load_bench_config

    cfg = load_bench_config(None, ["bench.settings=[pld:30,esp:auto,hybrid:auto,esp:30:logprobs,ar:1:no_prefix_cache]",
                                   "bench.num_masks=[2,1]", "bench.trees=[dynamic]", "bench.expansions=[frontier]"])
    settings = grid(cfg.bench)
    assert [s.label for s in settings] == ["ar", "hf generate", "pld BC30", "esp k2 dynamic-frontier BCauto",
                                           "hybrid BCauto", "esp k2 dynamic-frontier BC30 logprobs",
                                           "ar no prefix cache"]
    assert [s.logprobs for s in settings] == [False] * 5 + [True, False]
    assert [s.no_prefix_cache for s in settings] == [False] * 6 + [True]


def test_eager_option_and_the_compiled_hf_baseline_in_the_grid():
    """METHOD:BC:eager runs a setting with engine.cuda_graphs=false; `hf generate compiled` follows `hf generate`
    when asked, and by default (auto) on an accelerator only."""
    from jobs.bench.settings import grid
    from jobs.bench.config import load_bench_config

    cfg = load_bench_config(None, ["bench.settings=[ar:1:eager,pld:10:eager,pld:10,ar:1:compiled_graphs,"
                                   "ar:1:compiled_graphs+run_ahead]"])
    assert [s.label for s in grid(cfg.bench)] == ["ar", "hf generate", "ar eager", "pld BC10 eager", "pld BC10",
                                                  "ar compiled graphs", "ar compiled graphs run ahead"]
    assert [s.compiled_graphs for s in grid(cfg.bench)] == [False] * 5 + [True, True]
    assert [s.run_ahead for s in grid(cfg.bench)] == [False] * 6 + [True]
    assert [s.label for s in grid(cfg.bench, accelerator=True)][:3] == ["ar", "hf generate", "hf generate compiled"]
    assert [s.eager for s in grid(cfg.bench)] == [False, False, True, True, False, False, False]
    off = load_bench_config(None, ["bench.settings=[pld:10]", "bench.hf_compiled=false"])
    assert "hf generate compiled" not in [s.label for s in grid(off.bench, accelerator=True)]
    on = load_bench_config(None, ["bench.settings=[pld:10]", "bench.hf_compiled=true", "bench.hf_baseline=false"])
    assert [s.label for s in grid(on.bench)] == ["ar", "hf generate compiled", "pld BC10"]


def test_run_ahead_and_attention_options_in_the_grid():
    """ar:1:no_run_ahead reads each pass (engine.cuda_graphs_run_ahead=false); METHOD:BC:attention_NAME names the
    decode passes' attention kernel, one at most; autotune and attention_flex go with compiled_graphs only."""
    from jobs.bench.config import load_bench_config
    from jobs.bench.settings import grid

    cfg = load_bench_config(None, ["bench.settings=[ar:1:no_run_ahead,ar:1:attention_math,esp:30:attention_efficient,"
                                   "ar:1:compiled_graphs+autotune,ar:1:compiled_graphs+attention_flex,esp:30:host_probe]",
                                   "bench.hf_baseline=false"])
    settings = grid(cfg.bench)
    assert [s.label for s in settings] == ["ar", "ar no run ahead", "ar math attention",
                                           "esp k1 static BC30 efficient attention", "ar compiled graphs autotuned",
                                           "ar compiled graphs flex attention", "esp k1 static BC30 host probe"]
    assert [s.attention for s in settings] == ["", "", "math", "efficient", "", "flex", ""]
    assert [s.no_run_ahead for s in settings] == [False, True, False, False, False, False, False]
    assert [s.autotune for s in settings] == [False, False, False, False, True, False, False]
    assert [s.host_probe for s in settings] == [False] * 6 + [True]
    drafting = grid(load_bench_config(None, ["bench.settings=[pld:10:no_run_ahead,hybrid:auto:no_run_ahead,"
                                             "ar:1:eager_admission,hybrid:auto:logprobs,hybrid:auto:no_prefix_cache]"]).bench)
    assert [(s.label, s.no_run_ahead) for s in drafting][-5:-3] == [("pld BC10 no run ahead", True),
                                                                   ("hybrid BCauto no run ahead", True)]
    assert drafting[-3].label == "ar eager admission" and drafting[-3].eager_admission
    assert drafting[-2].label == "hybrid BCauto logprobs" and drafting[-2].logprobs
    assert drafting[-1].label == "hybrid BCauto no prefix cache" and drafting[-1].no_prefix_cache
    for bad in ("ar:1:attention_math+attention_cudnn", "ar:1:run_ahead+no_run_ahead",
                "ar:1:attention_flash", "ar:1:autotune", "esp:30:eager+autotune", "ar:1:attention_flex",
                "pld:10:host_probe", "ar:1:host_probe", "esp:30:eager+host_probe", "stand:10:host_probe"):
        with pytest.raises(ConfigError):
            load_bench_config(None, [f"bench.settings=[{bad}]"])


@pytest.mark.slow
def test_bench_graphs_against_the_eager_engine_and_compiled_generate(tmp_path):
    """The issue's comparison on a CPU: ar over the static-buffer path (engine.cuda_graphs=true), the eager
    engine's ar, eager generate and generate with a static cache and a compiled forward (asked for: on a CPU
    it is off by default); every row reproduces ar and the graph counters say which path ran (ar's plain passes
    run ahead by default; ar:1:no_run_ahead reads each one before the next; ESP's passes end with its probe unless
    esp:BC:host_probe)."""
    data = prompts(tmp_path, ["the cat sat on the mat, the cat", "def f(x):\n    return"])
    out = tmp_path / "out"
    code = main([f"data.path={data}", f"output.dir={out}", "generation.max_new_tokens=12", "engine.cuda_graphs=true",
                 "bench.hf_compiled=true", "bench.settings=[ar:1:eager,ar:1:no_run_ahead,esp:10,esp:10:host_probe]",
                 "bench.warmup=1", "bench.num_masks=[1]", "bench.trees=[static]",
                 "bench.cost_curve=false"])
    assert code == 0
    records = {r["setting"]: r for r in json.loads((out / "bench.json").read_text()) if r["category"] == "all"}
    assert list(records) == ["ar", "hf generate", "hf generate compiled", "ar eager", "ar no run ahead",
                             "esp k1 static BC10", "esp k1 static BC10 host probe"]
    assert all(r["exact_match_rate"] == 1.0 for r in records.values())
    assert records["ar"]["graph_passes"] > 0 and records["ar"]["eager_passes"] == 0
    assert records["ar"]["ahead_passes"] > 0 and records["ar no run ahead"]["ahead_passes"] == 0
    assert records["ar eager"]["graph_passes"] is None
    assert records["esp k1 static BC10"]["probe_passes"] > 0 and records["esp k1 static BC10 host probe"]["probe_passes"] == 0


@pytest.mark.parametrize("spec,words", [
    ("pld", "METHOD:BC"), ("ar:10", "ar:1:eager"), ("pld:1", "METHOD:BC"), ("stand:auto", "auto works with"),
    ("pld:10:fast", ":eager, :compiled_graphs"), ("ar:1:fast", ":compiled_graphs"),
    ("esp:3", "leaves no draft node"), ("cp_heads:10", "heads_paths"),
    ("ar:1:eager+run_ahead", "not :eager"), ("ar:1:run_ahead+fast", "joined by +"),
])
def test_bench_rejects_bad_settings(tmp_path, monkeypatch, capsys, spec, words):
    monkeypatch.chdir(tmp_path)  # a default output.dir would land here, not in the checkout
    assert main([f"bench.settings=[{spec}]", "bench.num_masks=[1]"]) == 2
    err = capsys.readouterr().err
    assert "bench.settings" in err and words in err and "Traceback" not in err


@pytest.mark.parametrize(
    "batch,block,cache,expected",
    [
        (1, 1, 100, 1.0),  # the baseline
        (1, 4, 100, 2.0),  # a grid point: 0.02 / 0.01
        (1, 3, 100, 1.75),  # halfway between Q 2 (1.5) and Q 4 (2.0)
        (1, 4, 300, 2.5),  # halfway between cache 100 (2.0) and 500 (3.0)
        (1, 64, 1000, 3.0),  # clamped to the largest block and cache
    ],
)
def test_cost_curve_interpolation(batch, block, cache, expected):
    curve = CostCurve([1], [100, 500], [1, 2, 4], [[[0.01, 0.015, 0.02], [0.01, 0.02, 0.03]]])
    assert curve.relative_cost(batch, block, cache) == pytest.approx(expected)


def test_predict_speedup():
    curve = CostCurve([1], [100], [1, 16], [[[0.01, 0.016]]])
    assert predict_speedup(2.0, 16, curve) == pytest.approx(1.25)


def test_token_mismatch_rate():
    from jobs.bench.results import token_mismatch_rate

    assert token_mismatch_rate([[1, 2, 3], [5, 6]], [[1, 2, 4], [5, 6]]) == pytest.approx(0.2)
    assert token_mismatch_rate([[1, 2]], [[1, 2, 3]]) == 0.0


def test_paired_ratio_is_the_median_of_per_round_ratios():
    from jobs.bench.results import paired_quartiles

    mine = [{"a": 1.0, "b": 1.0}, {"a": 4.0, "b": 4.0}, {"a": 1.5, "b": 0.5}]
    ar = [{"a": 2.0, "b": 2.0}, {"a": 4.0, "b": 4.0}, {"a": 1.0, "b": 2.0}]
    # per round: 4/2 = 2.0, 8/8 = 1.0, 3/2 = 1.5 -> median 1.5; category a alone: 2.0, 1.0, 0.67 -> 1.0
    assert paired_quartiles(mine, ar, {"a", "b"})[1] == 1.5 and paired_quartiles(mine, ar, {"a"})[1] == 1.0
    assert paired_quartiles(mine, [], {"a"}) is None


def test_paired_quartiles():
    from jobs.bench.results import paired_quartiles

    mine = [{"a": 1.0}, {"a": 1.0}, {"a": 1.0}, {"a": 1.0}, {"a": 1.0}]
    theirs = [{"a": 0.9}, {"a": 1.0}, {"a": 1.1}, {"a": 1.2}, {"a": 1.3}]
    assert paired_quartiles(mine, theirs, {"a"}) == pytest.approx((1.0, 1.1, 1.2))
    assert paired_quartiles(mine[:1], theirs[:1], {"a"}) == pytest.approx((0.9, 0.9, 0.9))
    assert paired_quartiles([], theirs, {"a"}) is None


def test_auto_settings_are_compared_with_the_fastest_fixed_setting_of_their_batch():
    from jobs.bench.results import against_fastest_fixed
    from jobs.bench.report import paired_cell

    def rec(setting, method, bc, batch, tps, cat="all"):
        return dict(setting=setting, method=method, block_complexity=bc, batch_size=batch, tokens_per_s=tps,
                    category=cat)

    records = [rec("ar", "ar", 1, 1, 100.0), rec("hf generate", "hf", 1, 1, 300.0),  # baselines are no rival
               rec("pld BC10", "pld", 10, 1, 150.0), rec("pld BC30", "pld", 30, 1, 120.0),
               rec("hybrid BCauto", "hybrid", "auto", 1, 165.0), rec("pld BC10", "pld", 10, 1, 999.0, cat="code"),
               rec("pld BC10", "pld", 10, 16, 400.0), rec("hybrid BCauto", "hybrid", "auto", 16, 300.0),
               rec("code", "code", "auto", 1, 1.0, cat="code")]
    records[-1]["setting"] = "esp k1 static BCauto"  # a per-category record of an auto setting: left alone
    records.insert(4, dict(rec("dmtd tau3", "dmtd", 3, 1, 500.0), lossless=False))  # not lossless: no rival
    rounds = {"pld BC10": [{"code": 1.0, "verse": 1.0}, {"code": 2.0, "verse": 2.0}, {"code": 1.0, "verse": 1.1}],
              "hybrid BCauto": [{"code": 1.0, "verse": 0.8}, {"code": 1.0, "verse": 1.0}, {"code": 1.0, "verse": 1.0}]}
    against_fastest_fixed(records, rounds)
    b1, b16 = records[5], records[8]
    assert b1["fastest_fixed"] == "pld BC10" and b1["vs_fastest_fixed"] == pytest.approx(1.1)
    # per round: 2.0 / 1.8, 4.0 / 2.0, 2.1 / 2.0 -> median 1.111, quartiles 1.078 and 1.556
    assert b1["vs_fastest_fixed_paired"] == pytest.approx(2.0 / 1.8)
    assert b1["vs_fastest_fixed_paired_q1"] == pytest.approx((2.1 / 2.0 + 2.0 / 1.8) / 2)
    assert b1["vs_fastest_fixed_paired_q3"] == pytest.approx((2.0 / 1.8 + 2.0) / 2)
    assert b16["fastest_fixed"] == "pld BC10" and b16["vs_fastest_fixed"] == pytest.approx(0.75)
    assert "fastest_fixed" not in records[-1] and "fastest_fixed" not in records[2]
    assert paired_cell(b1, "vs_fastest_fixed_paired") == "1.11 [1.08-1.56]"
    assert paired_cell({"x": 1.0}, "x") == "1.00"


@pytest.mark.slow
def test_warmup_rounds_run_every_setting_untimed_first(tmp_path, monkeypatch):
    """bench.warmup_rounds=1: one untimed round of every setting over every prompt before the timed repeats."""
    import jobs.bench.runner as bench

    calls = []
    run_setting = bench.run_setting

    def counted(loaded, base, s, *a, **kw):
        calls.append(s.label)
        return run_setting(loaded, base, s, *a, **kw)

    monkeypatch.setattr(bench, "run_setting", counted)
    data = prompts(tmp_path, ["a b a b", "c d c"])
    out = tmp_path / "out"
    code = main([f"data.path={data}", f"output.dir={out}", "generation.max_new_tokens=4", "bench.settings=[pld:10]",
                 "bench.warmup=0", "bench.cost_curve=false", "bench.hf_baseline=false", "bench.repeats=2",
                 "bench.warmup_rounds=1"])
    assert code == 0
    assert calls == ["pld BC10", "ar", "ar", "pld BC10", "pld BC10", "ar"]  # rounds -1, 0, 1 (rotated)
    records = json.loads((out / "bench.json").read_text())
    assert all(len(r["time_s_rounds"]) == 2 for r in records)  # only the timed rounds are reported


def test_rounds_start_one_setting_further_on():
    from jobs.bench.runner import rotated

    assert [rotated(["ar", "hf", "pld"], r) for r in range(4)] == [
        ["ar", "hf", "pld"], ["hf", "pld", "ar"], ["pld", "ar", "hf"], ["ar", "hf", "pld"]]
    assert rotated([], 3) == []


@pytest.mark.slow
def test_bench_profile_writes_op_tables(tmp_path):
    """bench.profile: one more run of the named settings under torch.profiler; the model's calls are marked."""
    data = prompts(tmp_path, ["the cat sat on the mat, the cat sat", "a b c a b c a b"])
    out = tmp_path / "out"
    code = main([f"data.path={data}", f"output.dir={out}", "generation.max_new_tokens=8", "bench.settings=[pld:auto]",
                 "bench.warmup=0", "bench.cost_curve=false", "bench.hf_baseline=false", "bench.profile=[pld:auto]"])
    assert code == 0
    assert sorted(p.name for p in out.glob("profile-*")) == ["profile-pld_BCauto-b1.txt"]
    text = (out / "profile-pld_BCauto-b1.txt").read_text()
    assert "row-passes" in text and "model.forward" in text and "model.logits" in text
    assert "grouped by input shape" in text
    from esp_worker.model.runner import ModelRunner

    assert ModelRunner.profile_marks is False  # off again after the profiled run


@pytest.mark.parametrize("spec,words", [("esp:30", "names none of this bench's settings"),
                                        ("nope:3", "must be ar, hf or METHOD:BC")])
def test_bench_rejects_a_profile_that_names_no_setting(tmp_path, monkeypatch, capsys, spec, words):
    monkeypatch.chdir(tmp_path)  # a default output.dir would land here, not in the checkout
    assert main(["bench.settings=[pld:30]", f"bench.profile=[{spec}]"]) == 2
    err = capsys.readouterr().err
    assert "bench.profile" in err and words in err and "Traceback" not in err


@pytest.mark.parametrize("history", ["stripped", "raw"])
def test_bench_runs_every_turn_of_a_multi_turn_row_as_a_job_does(tmp_path, history):
    """A `turns` row is benchmarked on all its turns, each later one prompted with the setting's own earlier
    answers: the same tokens and prompt lengths as the job's worker gives the row (hf generate's too)."""
    import torch

    from esp_worker import load_model
    from jobs.bench.config import load_bench_config
    from jobs.bench.runner import load_prompts, run_setting
    from jobs.bench.settings import Setting
    from jobs.config import engine_config, generation_defaults, model_config
    from jobs.io.output import OutputDir
    from jobs.io.sources import open_source
    from jobs.run.rows import RowNormalizer
    from jobs.run.runner import plan_schema, worker_spec
    from jobs.run.worker import ShardWorker
    from jobs_helpers import TINY_LLAMA, job_cfg, shared, write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "t", "category": "writing", "turns": ["Write a line.", "Another one.", "And a last one."]},
        {"id": "p", "category": "writing", "prompt": "def f(x):\n    return"},
    ])
    common = [f"data.path={data}", f"model.name_or_path={shared(TINY_LLAMA)}", "generation.max_new_tokens=8",
              f"data.turn_history={history}"]
    cfg = load_bench_config(None, common)
    loaded = load_model(model_config(cfg))
    prompts, _ = load_prompts(cfg, loaded.tokenizer)
    gen = generation_defaults(cfg)
    runs = {m: run_setting(loaded, engine_config(cfg), Setting(m, 1, 0, ""), 1, prompts, gen, 0) for m in ("ar", "hf")}

    job = job_cfg(tmp_path / "out", *common)
    source = open_source(job.data.path, job.data.format, job.data.split, job.data.limit)
    norm = RowNormalizer("id", "", "params", "category", [])
    threads = torch.get_num_threads()
    worker = ShardWorker(worker_spec(job, plan_schema(job, source), OutputDir(str(tmp_path / "out"))))
    torch.set_num_threads(threads)
    rows = {r["id"]: r for r in worker.run_shard(0, [norm(i, r) for i, r in enumerate(next(source.batches(10)))])
            .to_pylist()}
    assert len(rows["t"]["turn_generated_tokens"]) == 3
    for rid, row in rows.items():
        for m, run in runs.items():
            out = run.outputs[rid]
            assert out.token_ids == row["generated_token_ids"], (m, rid)
            assert out.stats.num_prompt_tokens == row["num_prompt_tokens"], (m, rid)


@pytest.mark.parametrize("args", [
    ["bench.settings=[pld:30]", "bench.profile=[esp:30]"],  # refused after the config is read
    ["bench.settings=[esp:3]", "bench.num_masks=[1]"],
    ["bench.methods=[ar,medusa]"],
])
def test_a_refused_bench_leaves_no_output_directory(tmp_path, monkeypatch, capsys, args):
    """A bench refused before it runs creates nothing (no empty outputs/bench-... in the working directory)."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2 and "Traceback" not in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_settings_at_one_batch_size_replay_one_graph_runner():
    """The bench's engines at one batch size share the first one's CUDA-graph runner (its graphs, its KV slab), as
    one long-lived job engine would; every setting still gives plain decoding's tokens."""
    from esp_worker import load_model
    from jobs.bench.config import load_bench_config
    from jobs.bench.runner import EngineShare, load_prompts, run_setting
    from jobs.bench.settings import Setting
    from jobs.config import engine_config, generation_defaults, model_config

    cfg = load_bench_config(None, ["model.name_or_path=tiny-random-llama", "generation.max_new_tokens=8",
                                   "engine.cuda_graphs=true", "data.limit=4"])
    loaded = load_model(model_config(cfg))
    prompts, _ = load_prompts(cfg, loaded.tokenizer)
    share, base, gen = EngineShare(), engine_config(cfg), generation_defaults(cfg)
    runs = [run_setting(loaded, base, s, 2, prompts, gen, 0, share) for s in (Setting("ar", 1, 0, ""),
                                                                             Setting("pld", 10, 0, ""),
                                                                             Setting("esp", 30, 1, "static"))]
    key = (2, False, "torch", "")  # batch size, compiled graphs, attention kernel, compile mode
    first = share.graphs[key]
    assert list(share.graphs) == [key]
    run_setting(loaded, base, Setting("hybrid", 30, 1, "static"), 2, prompts, gen, 0, share)
    assert share.graphs[key] is first
    tokens = [{i: o.token_ids for i, o in run.outputs.items()} for run in runs]
    assert all(t == tokens[0] for t in tokens[1:])
