"""`python -m jobs.train_dmtd [CONFIG.yaml] [key=value ...]` (`esp-batch train-dmtd`): fine-tune a Llama, Qwen2, Qwen3
or Mistral model for Direct Multi-Token Decoding (docs/methods/dmtd.md) with the cyclical objective, on Ray Train.

The objective is the authors' (`modeling_mtpqwen3.py`, `sft.py`): next-token cross-entropy at every position of
`esp_worker.model.dmtd.cyclic_forward`, where the decoding layers (the last `dmtd.num_decoding_layers`) see the
thinking layers' output only at positions p % `dmtd.tau` == 0, so they learn to emit the tau tokens of a cycle
from one full pass. As the authors, the embeddings and the LM head stay frozen (`dmtd.train_embeddings`).
`dmtd.verified=true` instead freezes the whole model and trains a copy of its last D layers on the frozen trunk
(the drafter of `engine.method=dmtd_verified`, whose output the model verifies: lossless).

Data, schedule, checkpoints, resume after a kill, the time limit and the loss curve are train-heads' (the shared
keys of jobs/train/common.py): `data.*`, `train.*`, `ray.*`, `output.dir`, `fault.exit_at_step`.

Writes to `output.dir`: the fine-tuned model as a Hugging Face directory (config.json with the split in the
authors' fields `num_encoding_layers`, `num_thinking_layers`, `num_decoding_layers`, `mtp_horizon`, and the
training command under `dmtd_training`; model.safetensors; the tokenizer; a model card README.md), or with
dmtd.verified=true the trained copy (dmtd_draft.safetensors + dmtd_draft.json, `engine.dmtd_path` takes the
directory); loss_curve.csv / .png (NLL of the tokens full passes emit and of those decoding passes emit),
train_config.yaml, and Ray's run directory `ray/` with the checkpoints.

Exit codes: 0 done, 1 training failed (rerun to resume), 2 bad command line or config.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from esp_worker.config import ModelConfig

from .common import (FaultSection, OutputSection, RaySection, TextData, TrainLoop, TrainSection, cli_main,
                     fit, load_checked, load_tokens, tokenize_corpus, worker_model, write_loss_curve)

log = logging.getLogger("esp_batch.train_dmtd")


@dataclass
class DmtdSection:
    tau: int = 3  # mtp_horizon: tokens per cycle (a full pass, then tau - 1 decoding passes)
    num_decoding_layers: int = 2  # D: the last layers, run for every token
    num_encoding_layers: int = 0  # E: the first layers, run for every token (the authors' E0 by default)
    # true: the model frozen, a copy of its last D layers trained on its trunk (engine.method=dmtd_verified)
    verified: bool = False
    train_embeddings: bool = False  # the authors freeze the input embeddings and the LM head


@dataclass
class DmtdTrainSection(TrainSection):
    lr: float = 1e-4  # the authors' (AdamW, betas 0.9 / 0.95, cosine, gradient clip 1)


@dataclass
class DmtdOutputSection(OutputSection):
    dir: str = "outputs/dmtd"


@dataclass
class TrainDmtdConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: TextData = field(default_factory=TextData)
    dmtd: DmtdSection = field(default_factory=DmtdSection)
    train: DmtdTrainSection = field(default_factory=DmtdTrainSection)
    ray: RaySection = field(default_factory=RaySection)
    output: DmtdOutputSection = field(default_factory=DmtdOutputSection)
    fault: FaultSection = field(default_factory=FaultSection)


def load_train_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> DictConfig:
    def checks(cfg: DictConfig) -> list[tuple[bool, str]]:
        d, t = cfg.dmtd, cfg.train
        return [
            (d.tau >= 2, "dmtd.tau must be >= 2 (tau 1 is the model itself)"),
            (d.num_decoding_layers >= 1 and d.num_encoding_layers >= 0,
             "dmtd.num_decoding_layers must be >= 1 and dmtd.num_encoding_layers >= 0"),
            (t.seq_len > d.tau, "train.seq_len must exceed dmtd.tau"),
        ]

    return load_checked(TrainDmtdConfig, path, overrides, checks)


# ---- the training loop (runs in every Ray Train worker) -----------------------------------------------
def train_loop(config: dict) -> None:
    import ray.train.torch
    import torch

    from esp_worker.model.dmtd import CyclicLoss, DmtdConfig, new_draft_layers
    from esp_worker.model.load import sliding_window

    loop = TrainLoop(config)
    lm = worker_model(config)
    model = lm.model.train()
    d, t = config["dmtd"], config["train"]
    num_layers = model.config.get_text_config().num_hidden_layers
    cfg = DmtdConfig.split(num_layers, d["tau"], d["num_decoding_layers"], d["num_encoding_layers"])
    if d["verified"]:  # the model frozen; a copy of its last D layers trained on its trunk
        model.requires_grad_(False)
        trained = draft = new_draft_layers(model.get_decoder(), cfg).requires_grad_(True)
    else:  # the model, the embeddings and LM head frozen as the authors do
        model.requires_grad_(True)
        if not d["train_embeddings"]:
            model.get_input_embeddings().requires_grad_(False)
            model.get_output_embeddings().requires_grad_(False)
        trained, draft = model, None
    objective = CyclicLoss(model, cfg, draft, sliding_window(model.config)).to(lm.device)
    params = [p for p in trained.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"], betas=(0.9, 0.95))
    state = loop.resume(lm.device)
    if state is not None:
        trained.load_state_dict(state["weights"])
        opt.load_state_dict(state["optimizer"])
    # DDP syncs the trained parameters' gradients when the loss comes from its module's forward
    run = ray.train.torch.prepare_model(objective, move_to_device=False) if loop.world > 1 else objective
    tokens = load_tokens(config)
    while loop.running:
        t0 = time.perf_counter()
        win = loop.windows(tokens, config["bos"], lm.device)  # [W, L]
        loop.set_lr(opt)
        opt.zero_grad(set_to_none=True)
        res = run(win)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loop.add(nll=res.nll, nll_full=res.nll_full, nll_decoding=res.nll_decoding)
        loop.end_step(time.perf_counter() - t0, win.shape[0] * (win.shape[1] - 1),
                      lambda: {"weights": trained.state_dict(), "optimizer": opt.state_dict(), "dmtd": cfg.to_dict()})


# ---- driver ------------------------------------------------------------------------------------------
def run_training(cfg: DictConfig, command: str = "python -m jobs.train_dmtd") -> Path:
    """Train (or resume) and write the DMTD model (or dmtd_verified's copy) and the loss curve to output.dir.
    Raises TrainError (training), ValueError (a model or split DMTD cannot use: one line, before Ray starts)."""
    from esp_worker import load_model
    from esp_worker.model.dmtd import DmtdConfig, resolve

    out = Path(cfg.output.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text(OmegaConf.to_yaml(cfg))
    mc = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    lm = load_model(dataclasses.replace(mc, device="cpu"))
    d = cfg.dmtd
    num_layers = lm.model.config.get_text_config().num_hidden_layers
    split = DmtdConfig.split(num_layers, d.tau, d.num_decoding_layers, d.num_encoding_layers)  # DmtdConfigError
    resolve(lm.model.config, d.tau, d.num_decoding_layers)  # the architecture (one line for another)
    tokens = tokenize_corpus(cfg, lm.tokenizer, out, log)
    state = fit(cfg, train_loop, {"dmtd": OmegaConf.to_container(cfg.dmtd)}, tokens, lm.tokenizer.bos_token_id,
                out, log)
    history = state["history"]
    training = {"command": command, "base_model": cfg.model.name_or_path, "steps": state["step"],
                "train_minutes": round(state["elapsed_s"] / 60, 2), "final": history[-1] if history else {},
                "tokens_in_corpus": int(len(tokens)), "num_workers": cfg.ray.num_workers}
    if d.verified:
        write_verified(out, lm, split, state["weights"], training)
    else:
        write_model(out, lm, split, state["weights"], training)
    write_loss_curve(out, history, f"DMTD tau {d.tau}, D {d.num_decoding_layers} of {num_layers}"
                     + (" (verified copy)" if d.verified else ""),
                     [("nats / token", [("nll", "all tokens"), ("nll_full", "tokens of full passes"),
                                        ("nll_decoding", "tokens of decoding passes")])])
    log.info("DMTD %s written to %s (step %d, %.1f min of training)", "copy" if d.verified else "model", out,
             state["step"], state["elapsed_s"] / 60)
    return out


def write_model(out: Path, lm: Any, split: Any, weights: dict, training: dict) -> None:
    """The fine-tuned model as a Hugging Face directory whose config records the split in the authors' fields."""
    model = lm.model
    model.load_state_dict(weights)
    for k, v in split.to_dict().items():
        setattr(model.config, k, v)
    model.config.dmtd_training = training
    model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    (out / "README.md").write_text(model_card(split, training, verified=False))


def write_verified(out: Path, lm: Any, split: Any, weights: dict, training: dict) -> None:
    """dmtd_verified's trained copy of the last D layers, checked against its base model when loaded."""
    from esp_worker.model.dmtd import new_draft_layers, save_draft

    draft = new_draft_layers(lm.model.get_decoder(), split)
    draft.load_state_dict(weights)
    save_draft(out, draft, split, lm.model, training)
    (out / "README.md").write_text(model_card(split, training, verified=True))


def model_card(split: Any, training: dict, verified: bool) -> str:
    """README.md of the output: what it is, how it was trained (the exact command) and how to use it."""
    s = split
    layers = s.num_layers
    if verified:
        what = (f"A copy of the last {s.num_decoding_layers} of the {layers} layers of `{training['base_model']}`, "
                f"trained with DMTD's cyclical objective (tau = {s.tau}) on the frozen model: it drafts {s.tau - 1} "
                "tokens per pass and the model verifies them, so the output is exactly the model's own (lossless).")
        use = (f"esp-batch generate model.name_or_path={training['base_model']} engine.method=dmtd_verified "
               "engine.dmtd_path=THIS_DIR data.path=prompts.jsonl")
    else:
        what = (f"`{training['base_model']}` fine-tuned for Direct Multi-Token Decoding (arXiv 2510.11958): a full pass "
                f"and then {s.tau - 1} passes through the last {s.num_decoding_layers} of its {layers} layers emit "
                f"{s.tau} tokens per cycle. **Not lossless**: its output is this model's, not the base model's.")
        use = "esp-batch generate model.name_or_path=THIS_DIR engine.method=dmtd data.path=prompts.jsonl"
    final = training.get("final") or {}
    lines = [
        f"# DMTD{' (verified copy)' if verified else ''}: tau {s.tau}, D {s.num_decoding_layers} of {layers}", "",
        what, "",
        "| field | value |", "|---|---|",
        *(f"| `{k}` | {v} |" for k, v in s.to_dict().items()),
        f"| steps / minutes | {training['steps']} / {training['train_minutes']} |",
        f"| final NLL (all / full-pass tokens / decoding-pass tokens) | {_fmt(final.get('nll'))} / "
        f"{_fmt(final.get('nll_full'))} / {_fmt(final.get('nll_decoding'))} |", "",
        "Trained with:", "", "```bash", training["command"], "```", "",
        "Use:", "", "```bash", use, "```", "",
        "Loss curve: `loss_curve.csv` / `loss_curve.png`. See docs/methods/dmtd.md in esp-batch.", "",
    ]
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(argv, "esp-batch train-dmtd", __doc__, load_train_config, run_training, "jobs.train_dmtd")


if __name__ == "__main__":
    sys.exit(main())
