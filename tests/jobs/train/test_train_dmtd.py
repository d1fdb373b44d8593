"""jobs.train_dmtd: a run of a few Ray Train steps on a tiny random model, killed mid-way, resumes from its
checkpoint and writes a DMTD model directory (the split in the authors' config fields, the training command, a model
card) that loads and decodes in cycles; dmtd.verified=true writes a copy of the last layers for dmtd_verified."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from engine_helpers import PROMPTS, run, tiny
from esp_worker import EngineConfig, GenerationParams, ModelConfig, load_model
from esp_worker.model.dmtd import DmtdConfig, DmtdConfigError, cyclic_forward, load_draft, resolve
from jobs.config import ConfigError
from jobs_helpers import killed_then_resumed, local_ray
from jobs.train.dmtd import load_train_config, main

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(3):
        (d / f"doc{i}.txt").write_text(TEXT * (20 + i))
    return d


def _args(corpus, out, steps, *extra):
    return ["model.name_or_path=tiny-random-llama", f"data.text_dir={corpus}", f"train.steps={steps}",
            "train.seq_len=32", "train.batch_windows=2", "train.checkpoint_every=2", "train.log_every=1",
            "train.warmup_steps=1", "train.lr=1e-3", "dmtd.tau=2", "dmtd.num_decoding_layers=1", "ray.num_cpus=2",
            f"output.dir={out}", *extra]


def _history(out):
    with open(out / "loss_curve.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_killed_run_resumes_then_writes_a_dmtd_model_that_decodes(corpus, tmp_path, caplog, capfd):
    out = tmp_path / "dmtd"
    with local_ray():
        killed_then_resumed(main, lambda *extra: _args(corpus, out, 4, *extra), out / "model.safetensors",
                            "esp_batch.train_dmtd", caplog)
    raw = json.loads((out / "config.json").read_text())
    assert {k: raw[k] for k in ("num_encoding_layers", "num_thinking_layers", "num_decoding_layers", "mtp_horizon")} \
        == {"num_encoding_layers": 0, "num_thinking_layers": 1, "num_decoding_layers": 1, "mtp_horizon": 2}
    assert raw["model_type"] == "llama" and raw["dmtd_training"]["steps"] == 4
    assert raw["dmtd_training"]["command"].startswith("python -m jobs.train_dmtd model.name_or_path=tiny-random-llama")
    card = (out / "README.md").read_text()
    assert raw["dmtd_training"]["command"] in card and "Not lossless" in card
    hist = _history(out)  # steps 1-2 from the killed run, 3-4 after resuming
    assert [int(r["step"]) for r in hist] == [1, 2, 3, 4] and all(float(r["nll_decoding"]) > 0 for r in hist)
    # the directory loads as a DMTD model and decodes in cycles; the weights changed from the base model's
    lm = load_model(ModelConfig(name_or_path=str(out)))
    cfg = resolve(lm.model.config)
    assert cfg == DmtdConfig(0, 1, 1, 2)
    base = tiny("llama").model.state_dict()
    trained = lm.model.state_dict()
    assert not torch.equal(trained["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(trained["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen
    outs = run(lm, EngineConfig(method="dmtd", max_batch_size=2), GenerationParams(max_new_tokens=12, ignore_eos=True))
    for o, p in zip(outs, PROMPTS):
        ids = lm.tokenizer(p)["input_ids"]
        with torch.no_grad():
            h = cyclic_forward(lm.model.get_decoder(), cfg, torch.tensor([ids + o.token_ids]))
        assert o.token_ids == lm.model.lm_head(h).argmax(-1)[0, len(ids) - 1: -1].tolist()
    # dmtd.verified=true: the model frozen, a copy of its last layer trained; it loads for that model only. This
    # run starts its own local Ray instance, as the command does on a machine without a cluster: that instance
    # serves the state API that Ray Train's placement-group cleaner polls (without it: a warning a second, and no
    # clean-up after a killed controller)
    copy = tmp_path / "copy"
    capfd.readouterr()
    assert main(_args(corpus, copy, 2, "dmtd.verified=true")) == 0
    logged = capfd.readouterr()
    assert "Failed to query Ray Train Controller" not in logged.out + logged.err
    layers, split = load_draft(copy, tiny("llama").model)
    assert split == DmtdConfig(0, 1, 1, 2) and len(layers) == 1
    assert json.loads((copy / "dmtd_draft.json").read_text())["training"]["steps"] == 2
    with pytest.raises(DmtdConfigError, match="another|not this model"):
        load_draft(copy, tiny("qwen2").model)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="training text"):
        load_train_config(None, [])
    with pytest.raises(ConfigError, match="dmtd.tau"):
        load_train_config(None, ["data.text_dir=x", "dmtd.tau=1"])
    for bad, key in (("train.min_lr_ratio=-1", "train.min_lr_ratio"), ("train.warmup_steps=-1", "train.warmup_steps"),
                     ("train.weight_decay=-0.1", "train.weight_decay"), ("train.time_limit_min=-1", "train.time_limit_min"),
                     ("ray.cpus_per_worker=-1", "ray.cpus_per_worker"), ("ray.max_failures=-2", "ray.max_failures"),
                     ("ray.address=bogus", "ray.address='bogus' is not an address")):
        with pytest.raises(ConfigError, match=key):  # the trainers' shared keys (train-heads checks them alike)
            load_train_config(None, ["data.text_dir=x", bad])
    # a split the model cannot have is one line (exit 2) before Ray starts
    assert main(["model.name_or_path=tiny-random-llama", f"data.text_dir={tmp_path}", "dmtd.num_decoding_layers=3",
                 f"output.dir={tmp_path / 'o'}"]) == 2
