"""jobs.bench with DMTD: `dmtd:TAU` runs the DMTD models of bench.dmtd_paths trained with that tau (or the bench's
model split by engine.dmtd_decoding_layers), `dmtd_verified:TAU` each trained copy; records carry the cycle length,
PLT, the not-lossless mark and the retention against ar; the report has a DMTD table."""
from __future__ import annotations

import json

import pytest

from engine_helpers import tiny
from esp_worker.model.dmtd import DmtdConfig, new_draft_layers, save_draft
from jobs.bench.config import load_bench_config
from jobs.bench.retention import first_divergence
from jobs.bench.runner import main
from jobs.bench.settings import grid


def _dmtd_model(path, tau: int) -> str:
    """tiny-random-llama saved with a DMTD split (untrained: what matters here is the plumbing)."""
    lm = tiny("llama")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(DmtdConfig.split(2, tau, 1).to_dict())
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _copy(path, tau: int) -> str:
    lm = tiny("llama")
    split = DmtdConfig.split(2, tau, 1)
    save_draft(path, new_draft_layers(lm.model.get_decoder(), split), split, lm.model, {"base_model": "tiny-random-llama"})
    return str(path)


@pytest.fixture()
def dirs(tmp_path):
    return [_dmtd_model(tmp_path / "m2", 2), _dmtd_model(tmp_path / "m3", 3), _copy(tmp_path / "c3", 3)]


@pytest.mark.parametrize("a,b,expected", [([1, 2, 3], [1, 2, 4, 5], 2), ([1, 2], [1, 2, 3], 2), ([], [4], 0),
                                          ([7, 8], [7, 8], 2), ([5], [6], 0)])
def test_first_divergence_table(a, b, expected):
    assert first_divergence(a, b) == expected


def test_settings_pick_models_by_their_tau(dirs):
    m2, m3, c3 = dirs
    b = load_bench_config(None, [f"bench.dmtd_paths=[{m2},{m3},{c3}]", "bench.settings=[dmtd:2,dmtd:3,dmtd_verified:4]"]).bench
    got = [(s.method, s.dmtd_tau, s.dmtd_path) for s in grid(b)]
    assert got == [("ar", 0, ""), ("hf", 0, ""), ("dmtd", 2, m2), ("dmtd", 3, m3), ("dmtd_verified", 4, c3)]
    assert [s.label for s in grid(b)][2:] == ["dmtd m2 tau2", "dmtd m3 tau3", "dmtd_verified c3 tau4"]
    # no directories: dmtd runs the bench's own model, split by engine.dmtd_decoding_layers
    b = load_bench_config(None, ["bench.settings=[dmtd:3]"]).bench
    assert [(s.method, s.dmtd_tau, s.dmtd_path) for s in grid(b)][-1] == ("dmtd", 3, "")


@pytest.mark.parametrize("spec,paths,words", [
    ("dmtd:4", "m", "matches none"),  # no model trained with tau 4
    ("dmtd_verified:3", "m", "matches none"),  # no copy
    ("dmtd_verified:1", "c", "TAU an integer >= 2"),
    ("dmtd:x", "m", "TAU an integer"),
])
def test_bad_dmtd_settings(dirs, capsys, spec, paths, words):
    path = dirs[1] if paths == "m" else dirs[2]
    assert main([f"bench.settings=[{spec}]", f"bench.dmtd_paths=[{path}]"]) == 2
    assert words in capsys.readouterr().err
    assert main(["bench.settings=[dmtd:2]", "bench.dmtd_paths=[/nonexistent]"]) == 2
    assert "neither a DMTD model" in capsys.readouterr().err


def test_bench_records_and_report(dirs, tmp_path):
    m2, m3, c3 = dirs
    data = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "category": "code", "prompt": "def f(x):\n    return x\n\ndef f("},
            {"id": "b", "category": "verse", "prompt": "Once upon a time"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main([f"data.path={data}", f"output.dir={out}", "generation.max_new_tokens=12", "bench.hf_baseline=false",
                 "bench.cost_curve=false", "bench.warmup=0", f"bench.dmtd_paths=[{m3},{c3}]",
                 "bench.settings=[dmtd:3,dmtd_verified:3]", "bench.batch_sizes=[1,2]"]) == 0
    records = [r for r in json.loads((out / "bench.json").read_text()) if r["category"] == "all"]
    dmtd = [r for r in records if r["method"] == "dmtd"]
    verified = [r for r in records if r["method"] == "dmtd_verified"]
    assert len(dmtd) == len(verified) == 2  # batch 1 and 2
    for r in dmtd:
        assert r["lossless"] is False and r["dmtd_tau"] == 3 and 0.5 < r["plt"] < 1.0
        assert 0 <= r["token_agreement"] <= 1 and 0 <= r["first_divergence"] <= 12
        assert r["base_nll"] > 0 and r["base_nll_ar"] > 0 and r["tokens_per_s"] > 0
    for r in verified:
        assert r["lossless"] is True and r["exact_match_rate"] == 1.0 and r["dmtd_tau"] == 3 and r["plt"] is None
    assert all(r["lossless"] is True and r["plt"] is None for r in records if r["method"] == "ar")
    report = (out / "report.md").read_text()
    assert "## DMTD" in report and "| dmtd m3 tau3 (not lossless) | 1 |" in report
    assert "| dmtd_verified c3 tau3 | 2 | 3 |" in report
