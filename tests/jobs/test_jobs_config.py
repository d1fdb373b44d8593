"""Config loading, validation, hashing, presets, and the command line (no Ray needed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobs_helpers import REPO, run_cli
from jobs import cli
from jobs.config import ConfigError, config_hash, engine_config, load_config, to_yaml

PRESETS = sorted(p for p in (REPO / "configs").glob("*.yaml") if p.name != "default.yaml")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.bogus=1"], "unknown config key 'data.bogus'"),
        (["nosuchsection.x=1"], "unknown config key 'nosuchsection'"),
        (["engine.block_complexty=30"], "unknown config key 'engine.block_complexty'"),
        (["engine.compile_host=true"], "engine.compile_host was removed"),  # a removed key says so
        (["ray.num_actors=two"], "config key 'ray.num_actors'"),
        (["generation.max_new_tokens=1.5"], "config key 'generation.max_new_tokens'"),
        (["engine.method=beam"], "engine.method='beam' is unknown"),
        (["engine.tree=bushy"], "engine.tree"),
        (["data.format=xml"], "data.format='xml' is unknown"),
        (["data.chat_template=maybe"], "data.chat_template"),
        (["generation.top_p=0"], "generation.top_p"),
        (["ray.num_actors=0"], "ray.num_actors=0"),
        (["data.shard_size=0"], "data.shard_size=0"),
        (["engine.block_complexity=3", "engine.num_masks=2"], "engine.block_complexity=3"),
        # the drafters' own limits, checked by the driver before Ray starts (an actor would find them after)
        (["engine.method=lade", "engine.block_complexity=3"], "too small for lade"),
        (["engine.method=lade", "engine.block_complexity=10", "engine.lade_ngram=2"], "engine.lade_ngram >= 3"),
        (["engine.method=lade", "engine.block_complexity=10", "engine.lade_pool_size=2"], "engine.lade_pool_size=2"),
        (["engine.method=lade", "engine.block_complexity=10", "engine.lade_guess=2000"], "verified per pass (2000)"),
        (["engine.method=stand", "engine.block_complexity=10", "engine.stand_min_ngram=4"], "engine.stand_min_ngram"),
        (["engine.stand_topk=0"], "engine.stand_topk"),
        (["engine.stand_max_ngram=65"], "engine.stand_max_ngram=65"),
        (["engine.method=esp", "engine.tree=static", "engine.branches=[4,2]"], "deeper than engine.num_masks=1"),
        (["engine.method=esp", "engine.num_masks=2", "engine.auto_max_block=5"], "engine.auto_max_block=5"),
        (["engine.prefill_batch_tokens=-1"], "engine.prefill_batch_tokens=-1"),
        (["engine.auto_probe_interval=0"], "engine.auto_probe_interval=0"),
        (["generation.temperature=inf"], "must be a finite number"),
        (["generation.n=4"], "generation.n=4 needs temperature > 0"),
        (["generation.n=0", "generation.temperature=1"], "generation.n=0 must be an integer in 1 .. 1024"),
        (["engine.method"], "not key=value"),
        (["output.compression=bogus"], "output.compression='bogus' is unknown"),
        (["ray.address=bogus"], "ray.address='bogus' is not an address"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  paht: x.jsonl\n")
    with pytest.raises(ConfigError, match="unknown config key 'data.paht'"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_default_yaml_is_the_embedded_default():
    assert load_config(str(REPO / "configs" / "default.yaml")) == load_config(None)


def _flat(tree: dict) -> dict:
    """{"data": {"path": ""}} -> {"data.path": ""} (sections, then their keys)."""
    return {f"{section}.{key}": value for section, keys in tree.items() for key, value in keys.items()}


def test_default_yaml_lists_every_key_of_the_dataclasses_with_its_default():
    """configs/default.yaml against JobConfig's defaults (EngineConfig's and ModelConfig's included), key for key."""
    from omegaconf import OmegaConf

    from jobs.config import DEFAULT_YAML, JobConfig, default_yaml

    expected = _flat(OmegaConf.to_container(OmegaConf.structured(JobConfig)))
    text = DEFAULT_YAML.read_text()
    got = _flat(yaml.safe_load(text))
    hint = "configs/default.yaml is out of date with the dataclasses: rewrite it with python -m jobs.config --write-default"
    assert sorted(got) == sorted(expected), f"{hint}; missing {sorted(set(expected) - set(got))}, extra {sorted(set(got) - set(expected))}"
    wrong = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k] or type(got[k]) is not type(expected[k])}
    assert not wrong, f"{hint}; (file, default): {wrong}"
    assert len(expected) > 80  # every engine key, not the six the file used to list
    # and each key says what it is: a comment on its line or right above it
    lines = text.splitlines()
    bare = [line.strip() for i, line in enumerate(lines) if line.startswith("  ") and not line.strip().startswith("#")
            and "#" not in line and not lines[i - 1].strip().startswith("#")]
    assert not bare, f"keys without a comment: {bare}"
    assert text == default_yaml(), f"{hint} (its comments are the dataclasses' comments)"


def test_generation_defaults_are_the_engines():
    """One max_new_tokens (and sampling) default: a job's generation.* defaults are GenerationParams'."""
    from esp_worker import GenerationParams

    from jobs.config import generation_defaults

    assert GenerationParams(**generation_defaults(load_config(None))) == GenerationParams()


def test_presets_are_valid_and_carry_the_paper_settings():
    """One preset per model; the block complexity comes from the command line (the paper's 10, 30, 60)."""
    assert {p.stem for p in PRESETS} == {"llama-3.2-3b-instruct", "llama-3.1-8b-instruct", "qwen3-8b", "qwen3-32b"}
    for path in PRESETS:
        assert "block_complexity" not in path.read_text().split("engine:")[1].split("generation:")[0]
        for bc in (10, 30, 60):
            cfg = load_config(str(path), [f"engine.block_complexity={bc}"])
            assert cfg.engine.block_complexity == bc and cfg.engine.method == "esp" and cfg.engine.num_masks == 1
            assert cfg.model.device == "cuda" and cfg.ray.num_gpus_per_actor == 1
            assert cfg.generation.max_new_tokens == 100 and cfg.generation.temperature == 0.0
            engine_config(cfg).validate()
        assert load_config(str(path)).engine.block_complexity == "auto"  # none given: chosen per pass


def test_hash_covers_output_determining_keys_only():
    base = config_hash(load_config(None))
    assert config_hash(load_config(None, ["engine.block_complexity=10"])) != base
    assert config_hash(load_config(None, ["generation.seed=1"])) != base
    assert config_hash(load_config(None, ["ray.num_actors=4", "output.dir=/x", "fault.kill_shard=2"])) == base


def test_generation_seed_is_the_engine_seed():
    assert engine_config(load_config(None, ["generation.seed=7"])).seed == 7


def test_cli_help_and_print_config(capsys):
    assert cli.main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert cli.main(["generate", "--print-config", "engine.block_complexity=60"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["engine"]["block_complexity"] == 60 and printed["model"]["name_or_path"] == "tiny-random-llama"
    assert cli.main(["frobnicate"]) == 2
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0 and "key=value" in capsys.readouterr().out


def test_generate_help_lists_every_config_section():
    """`esp-batch generate --help` names every section of the job config (storage.* included)."""
    from jobs.config import JobConfig
    import dataclasses

    res = subprocess.run([sys.executable, "-m", "jobs.cli", "generate", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    sections = res.stdout.split("config sections")[1]
    missing = [f.name for f in dataclasses.fields(JobConfig) if f"{f.name}.*" not in sections]
    assert not missing, (missing, sections)


def test_module_entry_points_exit_codes(tmp_path):
    res = run_cli("data.bogus=1")
    assert res.returncode == 2 and "data.bogus" in res.stderr and "Traceback" not in res.stderr
    res = run_cli(f"data.path={tmp_path / 'missing.jsonl'}", f"output.dir={tmp_path / 'o'}")
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "jobs.cli", "generate", "--print-config", "ray.num_actors=3"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "num_actors: 3" in res.stdout


@pytest.mark.parametrize("module, args, expect", [
    ("jobs.generate", ["--print-config", "engine.block_complexity=30"], "block_complexity: 30"),
    ("jobs.bench", ["--print-config", "bench.repeats=2"], "repeats: 2"),
    ("jobs.train_heads", ["--print-config", "data.text_dir=docs"], "text_dir: docs"),
    ("jobs.train_dmtd", ["--print-config", "data.text_dir=docs", "dmtd.tau=4"], "tau: 4"),
    ("jobs.job_bench", ["--help"], "--shard-sizes"),
    ("jobs.memory_bench", ["--help"], "--prompt-tokens"),
    ("jobs.loss_plot", ["--help"], "--smooth"),
    ("jobs.config", ["--help"], "--write-default"),
])
def test_python_m_entry_points_still_run(module, args, expect):
    """The `python -m jobs.X` commands that scripts and the README use, from before jobs/ had rooms."""
    res = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and expect in res.stdout, res.stderr[-2000:]


def test_one_command_line_parser_for_every_config_command():
    from jobs.config import parse_command_line

    ns = parse_command_line(["my.yaml", "a.b=1", "--print-config", "c=2"], "x", "")
    assert (ns.config, ns.overrides, ns.print_config) == ("my.yaml", ["a.b=1", "c=2"], True)
    ns = parse_command_line(["a.b=1"], "x", "")
    assert (ns.config, ns.overrides, ns.print_config) == (None, ["a.b=1"], False)


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["data.carry_columns=[a,b]", "data.chat_template_kwargs.enable_thinking=false"])
    path = Path(tmp_path / "c.yaml")
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg
