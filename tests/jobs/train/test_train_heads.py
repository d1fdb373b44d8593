"""jobs.train_heads: a run of a few Ray Train steps on a tiny random model, killed mid-way, resumes from its
checkpoint and writes heads that load and draft; the training documents honour a file list's exclusions."""
from __future__ import annotations

import csv
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from engine_helpers import PROMPTS, reference, run, tiny
from esp_worker import EngineConfig, GenerationParams
from esp_worker.model.heads import load_heads
from jobs.config import ConfigError
from jobs_helpers import killed_then_resumed, local_ray
from jobs.train.heads import iter_documents, load_train_config, main

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    for i in range(3):
        (d / f"doc{i}.txt").write_text(TEXT * (20 + i))
    (d / "sub" / "more.txt").write_text("Once upon a time there was a fox.\n" * 40)
    return d


def _args(corpus, out, steps, *extra):
    return [
        "model.name_or_path=tiny-random-llama", f"data.text_dir={corpus}", f"train.steps={steps}", "train.seq_len=48",
        "train.batch_windows=2", "train.checkpoint_every=2", "train.log_every=1", "train.warmup_steps=1",
        "heads.rank=2", "heads.num_positions=3", "heads.head_hidden=8", "ray.num_cpus=2", f"output.dir={out}", *extra,
    ]


def _history(out):
    with open(out / "loss_curve.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture()
def stale_ray_address(monkeypatch):
    """Ray's temporary directory naming a head that is gone, as `ray stop` or a killed head leaves it (Ray's
    processes fall back on that address to find the dashboard). Short: Ray's socket paths live below it."""
    d = Path(tempfile.mkdtemp(prefix="rt"))
    (d / "ray").mkdir()
    (d / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("RAY_TMPDIR", str(d))
    yield
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_killed_run_resumes_then_writes_heads_that_load_and_draft(corpus, tmp_path, caplog, capfd, stale_ray_address):
    out = tmp_path / "heads"
    warm = tmp_path / "warm"
    with local_ray():  # three runs on one instance
        killed_then_resumed(main, lambda *extra: _args(corpus, out, 4, *extra), out / "heads.safetensors",
                            "esp_batch.train_heads", caplog)
        # a rank-3 run started from these rank-2 heads (heads.init_from): expert 0 and 1 begin as theirs
        assert main(_args(corpus, warm, 1, "heads.rank=3", f"heads.init_from={out}")) == 0
    info = json.loads((out / "heads.json").read_text())
    assert info["rank"] == 2 and info["base_model"] == "tiny-random-llama" and info["training"]["steps"] == 4
    hist = _history(out)
    assert [int(r["step"]) for r in hist] == [1, 2, 3, 4]  # steps 1-2 from the killed run, 3-4 after resuming
    assert all(float(r["joint_nll"]) > float(r["first_nll"]) > 0 for r in hist)
    lm = tiny("llama")
    load_heads(out, lm.model)
    outs = run(lm, EngineConfig(method="cp_heads", heads_path=str(out), block_complexity=10, max_batch_size=4),
               GenerationParams(max_new_tokens=64))
    assert [tuple(o.token_ids) for o in outs] == list(reference("llama", "sdpa"))
    with pytest.raises(ValueError, match="base model"):
        load_heads(out, tiny("qwen2").model)
    info = json.loads((warm / "heads.json").read_text())
    assert info["rank"] == 3 and info["training"]["init_from"] == str(out)
    assert info["training"]["init_train_minutes"] == json.loads((out / "heads.json").read_text())["training"]["train_minutes"]
    # heads of another n are refused in one line, before training starts
    assert main(_args(corpus, tmp_path / "bad", 1, "heads.num_positions=2", f"heads.init_from={out}")) == 2
    # Ray Train's placement-group cleaner found this instance's dashboard, not the stale address
    assert "PlacementGroupCleaner" not in capfd.readouterr().err


def test_file_list_exclusions_are_never_read(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    for name in ("keep.py", "argparse.py"):
        (root / name).write_text(f"# {name}\n")
    verse = tmp_path / "verse"
    verse.mkdir()
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "hamlet_gut_f.txt"):
        (verse / name).write_text(f"{name}\n")
    lst = tmp_path / "files.txt"
    lst.write_text("# excluded code: argparse.py difflib.py\n# excluded verse: macbeth_gut.txt\ncode keep.py\ncode argparse.py\n")
    cfg = load_train_config(None, [f"data.file_list={lst}", f"data.roots.code={root}", f"data.text_dir={verse}",
                                   "data.text_suffix=_gut.txt"])
    assert list(iter_documents(cfg.data)) == ["# keep.py\n", "hamlet_gut.txt\n"]


def test_stdlib_root_and_config_errors():
    from jobs.train.heads import resolve_root
    import sysconfig

    assert str(resolve_root("stdlib")) == sysconfig.get_paths()["stdlib"]
    with pytest.raises(ConfigError, match="training text"):
        load_train_config(None, [])
    with pytest.raises(ConfigError, match="num_positions"):
        load_train_config(None, ["data.text_dir=x", "heads.num_positions=1"])
    with pytest.raises(ConfigError, match="heads.init_from='nowhere' holds no heads.json"):
        load_train_config(None, ["data.text_dir=x", "heads.init_from=nowhere"])
