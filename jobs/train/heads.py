"""`python -m jobs.train_heads [CONFIG.yaml] [key=value ...]` (`esp-batch train-heads`): train rank-r CP multi-token
heads (esp_worker/cp_heads.py) on a frozen causal LM with Ray Train.

Data: the shared `data.*` keys (jobs/train/common.py): `data.path`, `data.text_dir` and/or `data.file_list`,
tokenized once and cut into random windows of `train.seq_len` tokens.

Training: a `TorchTrainer` with `ray.num_workers` data-parallel workers (CPU here, `ray.use_gpu=true` on a
cluster); each worker holds the frozen model and a DDP copy of the heads, draws its own windows, runs the
model without gradients to get the final hidden states, and minimises equation 9's joint NLL of the next
`heads.num_positions` tokens + `train.balance_coef` x the balancing loss (equation 10, soft counts).
Every `train.checkpoint_every` steps rank 0 reports a checkpoint (heads, optimizer, step, loss history);
a rerun of the same command resumes from the newest one (also after a kill: `fault.exit_at_step` makes a
worker die there, for tests). The run stops at `train.steps` or `train.time_limit_min`, whichever first.

Writes to `output.dir`: heads.safetensors + heads.json (the heads; `engine.heads_path` takes this
directory), loss_curve.csv and loss_curve.png (joint and first-position NLL, balancing loss, top-expert
share), train_config.yaml, and Ray's run directory `ray/` with the checkpoints.

Exit codes: 0 done, 1 training failed (rerun to resume), 2 bad command line or config.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from esp_worker.config import ModelConfig

from .common import (FaultSection, OutputSection, RaySection, TextData, TrainError, TrainLoop, TrainSection,
                     cli_main, fit, iter_documents, load_checked, load_tokens, resolve_root, tokenize_corpus, worker_model,
                     write_loss_curve)

log = logging.getLogger("esp_batch.train_heads")
# shared with train-dmtd (common.py); named here as the tests and scripts import them
__all__ = ["TextData", "TrainError", "iter_documents", "resolve_root", "load_train_config", "run_training", "main"]


@dataclass
class HeadsSection:
    num_positions: int = 3  # n: tokens predicted per position (drafts are n - 1 deep)
    rank: int = 4  # r: experts of the CP decomposition
    head_hidden: int = 128  # bottleneck width of each expert/position MLP
    # trained heads of the same base model, n and head_hidden (e.g. rank 1) to start from ("" = a fresh start):
    # expert a copies their expert a mod r, the copies perturbed by init_noise (cp_heads.seed_experts). Their
    # training time is the run's too: heads.json records it under training.init_train_minutes
    init_from: str = ""
    init_noise: float = 0.1


@dataclass
class HeadsTrainSection(TrainSection):
    micro_tokens: int = 512  # positions per forward/backward chunk of the heads (memory bound)
    balance_coef: float = 1.0  # weight of the load-balancing loss (0 = off; the paper: needed for r > 1)


@dataclass
class TrainHeadsConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: TextData = field(default_factory=TextData)
    heads: HeadsSection = field(default_factory=HeadsSection)
    train: HeadsTrainSection = field(default_factory=HeadsTrainSection)
    ray: RaySection = field(default_factory=RaySection)
    output: OutputSection = field(default_factory=OutputSection)
    fault: FaultSection = field(default_factory=FaultSection)


def load_train_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> DictConfig:
    def checks(cfg: DictConfig) -> list[tuple[bool, str]]:
        h, t = cfg.heads, cfg.train
        return [
            (h.num_positions >= 2, "heads.num_positions must be >= 2 (position 1 is the token the model itself verifies)"),
            (h.rank >= 1 and h.head_hidden >= 1, "heads.rank and heads.head_hidden must be >= 1"),
            (t.micro_tokens >= 1, "train.micro_tokens must be >= 1"),
            (t.seq_len > h.num_positions + 1, "train.seq_len must exceed heads.num_positions + 1"),
            (t.balance_coef >= 0, "train.balance_coef must be >= 0"),
            (h.init_noise >= 0, "heads.init_noise must be >= 0"),
            (not h.init_from or (Path(h.init_from) / "heads.json").is_file(),
             f"heads.init_from={h.init_from!r} holds no heads.json: give a directory written by jobs.train_heads"),
        ]

    return load_checked(TrainHeadsConfig, path, overrides, checks)


# ---- the training loop (runs in every Ray Train worker) -----------------------------------------------
def train_loop(config: dict) -> None:
    import ray.train.torch
    import torch

    from esp_worker.model.heads import heads_loss, new_heads

    loop = TrainLoop(config)
    lm = worker_model(config)
    model = lm.model.requires_grad_(False)
    base = model.get_decoder()
    lm_head = model.get_output_embeddings()
    scale = getattr(model.config, "logit_scale", None)
    softcap = getattr(model.config, "final_logit_softcapping", None)

    def unembed(z: torch.Tensor) -> torch.Tensor:
        logits = lm_head(z.to(lm.dtype)).float()
        if scale is not None:
            logits = logits * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    h, t = config["heads"], config["train"]
    heads = new_heads(model, config["base_model"], h["num_positions"], h["rank"], h["head_hidden"], seed=t["seed"])
    if h["init_from"] and loop.fresh:
        from esp_worker.model.heads import load_heads, seed_experts

        seed_experts(heads, load_heads(h["init_from"], model), h["init_noise"], seed=t["seed"])
    heads.to(lm.device)
    opt = torch.optim.AdamW(heads.parameters(), lr=t["lr"], weight_decay=t["weight_decay"], betas=(0.9, 0.95))
    state = loop.resume(lm.device)
    if state is not None:
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
    ddp = ray.train.torch.prepare_model(heads, move_to_device=False) if loop.world > 1 else heads

    tokens = load_tokens(config)
    n = h["num_positions"]
    while loop.running:
        t0 = time.perf_counter()
        win = loop.windows(tokens, config["bos"], lm.device)  # [W, L]
        with torch.no_grad():
            hid = base(input_ids=win).last_hidden_state.float()  # [W, L, E] final (normed) hidden states
        m = win.shape[1] - n  # positions with n known next tokens
        e = hid[:, :m].reshape(-1, hid.shape[-1])  # [W*m, E]
        tgt = torch.stack([win[:, 1 + s : 1 + s + m] for s in range(n)], -1).reshape(-1, n)  # [W*m, n]
        loop.set_lr(opt)
        opt.zero_grad(set_to_none=True)
        chunks = list(range(0, e.shape[0], t["micro_tokens"]))
        for i, c0 in enumerate(chunks):
            ec, tc = e[c0 : c0 + t["micro_tokens"]], tgt[c0 : c0 + t["micro_tokens"]]
            frac = ec.shape[0] / e.shape[0]
            if loop.world > 1 and i < len(chunks) - 1:
                with ddp.no_sync():
                    res = heads_loss(ddp, ec, tc, unembed, t["balance_coef"])
                    (res.loss * frac).backward()
            else:
                res = heads_loss(ddp, ec, tc, unembed, t["balance_coef"])
                (res.loss * frac).backward()
            loop.add(frac, joint_nll=res.joint_nll, first_nll=res.first_nll, balance=res.balance,
                     top_expert_share=res.max_share)
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        loop.end_step(time.perf_counter() - t0, win.shape[0] * m,
                      lambda: {"heads": heads.state_dict(), "optimizer": opt.state_dict(),
                               "heads_config": heads.cfg.__dict__})


# ---- driver ------------------------------------------------------------------------------------------
def run_training(cfg: DictConfig, command: str = "python -m jobs.train_heads") -> Path:
    """Train (or resume) and write the heads and the loss curve to output.dir. Raises TrainError."""
    from esp_worker.model.heads import CPHeadsConfig, CPHeads, save_heads, unembedding_fingerprint
    from esp_worker import load_model

    out = Path(cfg.output.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text(OmegaConf.to_yaml(cfg))
    mc = ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    lm = load_model(dataclasses_replace(mc, device="cpu"))
    init_minutes = None
    if cfg.heads.init_from:  # checked here, before the corpus and Ray start: another model's heads are one line
        from esp_worker.model.heads import load_heads, read_heads_config, seed_experts

        # HeadsLoadError (a ValueError, exit 2) for another base model or shape
        seed_experts(new_heads_for(cfg, lm.model), load_heads(cfg.heads.init_from, lm.model), 0.0)
        init_minutes = read_heads_config(cfg.heads.init_from).training.get("train_minutes")
        init_given = cfg.heads.init_from  # recorded as given (no machine path in heads.json)
        cfg.heads.init_from = str(Path(init_given).resolve())  # workers run in their own directory
    tokens = tokenize_corpus(cfg, lm.tokenizer, out, log)
    extra = {"base_model": cfg.model.name_or_path, "heads": OmegaConf.to_container(cfg.heads)}
    state = fit(cfg, train_loop, extra, tokens, lm.tokenizer.bos_token_id, out, log)
    heads = CPHeads(CPHeadsConfig(**state["heads_config"]))
    heads.load_state_dict(state["heads"])
    assert heads.cfg.base_fingerprint == unembedding_fingerprint(lm.model)
    history = state["history"]
    heads.cfg.training = {
        "command": command, "steps": state["step"], "train_minutes": round(state["elapsed_s"] / 60, 2),
        "balance_coef": cfg.train.balance_coef, "final": history[-1] if history else {},
        "tokens_in_corpus": int(len(tokens)), "num_workers": cfg.ray.num_workers,
    }
    if cfg.heads.init_from:
        heads.cfg.training.update(init_from=init_given, init_train_minutes=init_minutes)
    save_heads(heads, out)
    write_loss_curve(out, history, f"rank {cfg.heads.rank}, n = {cfg.heads.num_positions}",
                     [("nats / position", [("joint_nll", "joint NLL (eq. 9)"), ("first_nll", "first-position NLL")]),
                      ("", [("balance", "balancing loss"), ("top_expert_share", "largest top-expert share")])])
    log.info("heads written to %s (step %d, %.1f min of training)", out, state["step"], state["elapsed_s"] / 60)
    return out


def new_heads_for(cfg: DictConfig, model: Any) -> Any:
    """Fresh heads of this config's shape for `model` (used to check heads.init_from before training starts)."""
    from esp_worker.model.heads import new_heads

    h = cfg.heads
    return new_heads(model, cfg.model.name_or_path, h.num_positions, h.rank, h.head_hidden)


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(argv, "esp-batch train-heads", __doc__, load_train_config, run_training, "jobs.train_heads")


if __name__ == "__main__":
    sys.exit(main())
