"""`python -m jobs.train_heads [CONFIG.yaml] [key=value ...]` (`esp-batch train-heads`): train rank-r CP multi-token
heads (esp_worker/cp_heads.py) on a frozen causal LM with Ray Train.

Data (any mix of the three): `data.path`, any input the job runner reads (the text of each row's prompt,
messages or turns, or of a `text` column); `data.text_dir`, a directory of text files (recursive); and
`data.file_list`, a list of `<kind> <relative path>` lines resolved under `data.roots.<kind>` (`stdlib` =
this interpreter's standard library). A file list's `# excluded <kind>: a b c` header lines name files that
must never be trained on: they are skipped wherever they turn up (text_dir included), and the log says so.
Documents are tokenized once (cached in `output.dir/tokens.npy`), joined with EOS, and cut into random
windows of `train.seq_len` tokens (BOS first).

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

import csv
import json
import logging
import os
import re
import shlex
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from esp_worker.config import ModelConfig

log = logging.getLogger("esp_batch.train_heads")
STATE = "state.pt"


@dataclass
class TextData:
    path: str = ""  # any input the job runner reads ("" = none)
    format: str = "auto"
    split: str = "train"
    text_column: str = "text"  # used when a row has it; otherwise the row's prompt / messages / turns
    text_dir: str = ""  # directory of text files, read recursively ("" = none)
    text_suffix: str = ""  # only files of text_dir whose name ends with this ("" = every file)
    file_list: str = ""  # "<kind> <relative path>" lines (# comments; "# excluded <kind>: a b" headers)
    roots: dict = field(default_factory=dict)  # kind -> directory for file_list ("stdlib" = this Python's)
    limit_docs: Optional[int] = None  # only the first N documents (tests)


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
class TrainSection:
    steps: int = 1000  # optimizer steps (global: every worker takes each one)
    time_limit_min: float = 0.0  # stop after this many minutes of training (0 = no limit; a resumed run counts
    # the time before the kill); the cosine schedule then follows elapsed time, so it anneals inside the limit
    seq_len: int = 512  # window length (BOS included)
    batch_windows: int = 2  # windows per worker per step
    micro_tokens: int = 512  # positions per forward/backward chunk of the heads (memory bound)
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of lr at train.steps
    balance_coef: float = 1.0  # weight of the load-balancing loss (0 = off; the paper: needed for r > 1)
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0


@dataclass
class RaySection:
    address: str = ""  # "" = RAY_ADDRESS, else a new local instance (never another job's running cluster)
    num_workers: int = 1  # data-parallel training workers
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    num_cpus: Optional[int] = None  # CPUs of a local instance this job starts (None = all)
    max_failures: int = 0  # worker-group restarts from the last checkpoint inside one run


@dataclass
class OutputSection:
    dir: str = "outputs/heads"


@dataclass
class FaultSection:
    exit_at_step: int = -1  # rank 0 calls os._exit(1) right after the checkpoint of this step (tests)


@dataclass
class TrainHeadsConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: TextData = field(default_factory=TextData)
    heads: HeadsSection = field(default_factory=HeadsSection)
    train: TrainSection = field(default_factory=TrainSection)
    ray: RaySection = field(default_factory=RaySection)
    output: OutputSection = field(default_factory=OutputSection)
    fault: FaultSection = field(default_factory=FaultSection)


class TrainError(RuntimeError):
    """Training failed; one-line message."""


def load_train_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> DictConfig:
    from ..config import ConfigError, merge_config

    cfg = merge_config(TrainHeadsConfig, path, overrides)
    d, h, t = cfg.data, cfg.heads, cfg.train
    checks = [
        (bool(d.path or d.text_dir or d.file_list), "give training text: data.path, data.text_dir and/or data.file_list"),
        (h.num_positions >= 2, "heads.num_positions must be >= 2 (position 1 is the token the model itself verifies)"),
        (h.rank >= 1 and h.head_hidden >= 1, "heads.rank and heads.head_hidden must be >= 1"),
        (t.steps >= 1 and t.batch_windows >= 1 and t.micro_tokens >= 1, "train.steps, batch_windows, micro_tokens must be >= 1"),
        (t.seq_len > h.num_positions + 1, "train.seq_len must exceed heads.num_positions + 1"),
        (t.balance_coef >= 0 and t.lr > 0, "train.balance_coef must be >= 0 and train.lr > 0"),
        (t.checkpoint_every >= 1 and t.log_every >= 1, "train.checkpoint_every and train.log_every must be >= 1"),
        (cfg.ray.num_workers >= 1, "ray.num_workers must be >= 1"),
        (bool(cfg.output.dir), "output.dir must be set"),
        (h.init_noise >= 0, "heads.init_noise must be >= 0"),
        (not h.init_from or (Path(h.init_from) / "heads.json").is_file(),
         f"heads.init_from={h.init_from!r} holds no heads.json: give a directory written by jobs.train_heads"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return cfg


# ---- documents ---------------------------------------------------------------------------------------
def resolve_root(root: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) if root == "stdlib" else Path(root)


def excluded_names(file_list: str) -> dict[str, set[str]]:
    """`# excluded <kind>: a b c` header lines of a file list -> {kind: {a, b, c}}."""
    out: dict[str, set[str]] = {}
    if not file_list:
        return out
    for line in Path(file_list).read_text().splitlines():
        m = re.match(r"#\s*excluded\s+(\w+)\s*:\s*(.*)", line)
        if m:
            out.setdefault(m.group(1), set()).update(m.group(2).split())
    return out


def _is_excluded(rel: str, excluded: dict[str, set[str]]) -> bool:
    names = set().union(*excluded.values()) if excluded else set()
    return rel in names or Path(rel).name in names


def iter_documents(d: DictConfig) -> Any:
    """Training documents (strings) from data.path, data.text_dir and data.file_list, in a fixed order."""
    excluded = excluded_names(d.file_list)
    skipped: list[str] = []
    count = 0

    def take(text: str):
        nonlocal count
        if text and text.strip() and (d.limit_docs is None or count < d.limit_docs):
            count += 1
            return True
        return False

    if d.file_list:
        roots = {k: resolve_root(v) for k, v in d.roots.items()}
        for line in Path(d.file_list).read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            kind, rel = line.split(None, 1)
            if kind not in roots:
                raise TrainError(f"data.file_list names kind {kind!r} but data.roots.{kind} is not set")
            if _is_excluded(rel, {kind: excluded.get(kind, set())}):
                skipped.append(rel)
                continue
            text = (roots[kind] / rel).read_text(encoding="utf-8", errors="replace")
            if take(text):
                yield text
    if d.text_dir:
        base = Path(d.text_dir)
        for f in sorted(p for p in base.rglob("*") if p.is_file() and p.name.endswith(d.text_suffix)):
            rel = str(f.relative_to(base))
            if _is_excluded(rel, excluded):
                skipped.append(rel)
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            if take(text):
                yield text
    if d.path:
        from ..io.sources import open_source

        for batch in open_source(d.path, d.format, d.split, None).batches(256):
            for row in batch:
                text = _row_text(row, d.text_column)
                if take(text):
                    yield text
    if skipped:
        log.info("skipped %d excluded file(s): %s", len(skipped), " ".join(sorted(skipped)[:20]))


def _row_text(row: dict, text_column: str) -> str:
    for key in (text_column, "prompt"):
        if isinstance(row.get(key), str):
            return row[key]
    msgs = row.get("messages")
    if isinstance(msgs, list):
        return "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
    turns = row.get("turns")
    if isinstance(turns, list):
        return "\n".join(str(t) for t in turns)
    return ""


def tokenize_corpus(cfg: DictConfig, tokenizer: Any, out_dir: Path) -> Any:
    """All documents as one int32 token stream (each document ends with EOS), cached in out_dir/tokens.npy."""
    import numpy as np

    cache = out_dir / "tokens.npy"
    if cache.is_file():
        return np.load(cache)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    parts, docs = [], 0
    for text in iter_documents(cfg.data):
        text = "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        parts.append(np.asarray(list(ids) + [eos], dtype=np.int32))
        docs += 1
    if not parts:
        raise TrainError("the training data holds no text")
    tokens = np.concatenate(parts)
    tmp = out_dir / "tokens.tmp.npy"
    np.save(tmp, tokens)
    tmp.replace(cache)
    log.info("tokenized %d documents: %d tokens", docs, len(tokens))
    return tokens


# ---- the training loop (runs in every Ray Train worker) -----------------------------------------------
def train_loop(config: dict) -> None:
    import math
    import random

    import numpy as np
    import ray
    import ray.train
    import ray.train.torch
    import torch

    from esp_worker.model.heads import CPHeads, CPHeadsConfig, heads_loss, new_heads
    from esp_worker import load_model

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config["torch_threads"])))
    mc = ModelConfig(**config["model"])
    if config["use_gpu"]:
        mc.device = str(ray.train.torch.get_device())
    lm = load_model(mc)
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
    if h["init_from"] and not config.get("resume_from") and ray.train.get_checkpoint() is None:
        from esp_worker.model.heads import load_heads, seed_experts

        seed_experts(heads, load_heads(h["init_from"], model), h["init_noise"], seed=t["seed"])
    heads.to(lm.device)
    opt = torch.optim.AdamW(heads.parameters(), lr=t["lr"], weight_decay=t["weight_decay"], betas=(0.9, 0.95))
    step, elapsed, history = 0, 0.0, []
    ckpt = ray.train.get_checkpoint()
    resume_dir = None
    if ckpt is not None:
        resume_dir = ckpt.to_directory()
    elif config.get("resume_from"):
        resume_dir = config["resume_from"]
    if resume_dir is not None:
        state = torch.load(Path(resume_dir) / STATE, map_location=lm.device, weights_only=False)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed_s"], state["history"]
    ddp = ray.train.torch.prepare_model(heads, move_to_device=False) if world > 1 else heads

    tokens = config["tokens"]
    tokens = ray.get(tokens) if isinstance(tokens, ray.ObjectRef) else tokens
    tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    bos = config["bos"]
    n, seq = h["num_positions"], t["seq_len"]
    body = seq - (1 if bos is not None else 0)
    if len(tokens) <= body + 1:
        raise TrainError(f"the corpus has {len(tokens)} tokens, fewer than one window of train.seq_len={seq}")
    total, warm, floor = t["steps"], t["warmup_steps"], t["min_lr_ratio"]

    limit_s = t["time_limit_min"] * 60 if t["time_limit_min"] > 0 else float("inf")

    def lr_at(s: int) -> float:
        """Warmup, then cosine decay over the steps or the time limit, whichever ends first."""
        if s < warm:
            return t["lr"] * (s + 1) / warm
        p = min(1.0, max((s - warm) / max(1, total - warm), elapsed / limit_s))
        return t["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))
    acc = {"joint": 0.0, "first": 0.0, "balance": 0.0, "share": 0.0, "n": 0}
    while step < total and elapsed < limit_s:
        t0 = time.perf_counter()
        rng = random.Random(hash((t["seed"], step, rank)) & 0xFFFFFFFF)
        starts = [rng.randrange(0, len(tokens) - body) for _ in range(t["batch_windows"])]
        win = torch.stack([tokens[s : s + body] for s in starts])  # [W, L]
        if bos is not None:
            win = torch.cat([torch.full((win.shape[0], 1), bos, dtype=torch.long), win], 1)
        win = win.to(lm.device)
        with torch.no_grad():
            hid = base(input_ids=win).last_hidden_state.float()  # [W, L, E] final (normed) hidden states
        m = win.shape[1] - n  # positions with n known next tokens
        e = hid[:, :m].reshape(-1, hid.shape[-1])  # [W*m, E]
        tgt = torch.stack([win[:, 1 + s : 1 + s + m] for s in range(n)], -1).reshape(-1, n)  # [W*m, n]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        chunks = list(range(0, e.shape[0], t["micro_tokens"]))
        for i, c0 in enumerate(chunks):
            ec, tc = e[c0 : c0 + t["micro_tokens"]], tgt[c0 : c0 + t["micro_tokens"]]
            frac = ec.shape[0] / e.shape[0]
            if world > 1 and i < len(chunks) - 1:
                with ddp.no_sync():
                    res = heads_loss(ddp, ec, tc, unembed, t["balance_coef"])
                    (res.loss * frac).backward()
            else:
                res = heads_loss(ddp, ec, tc, unembed, t["balance_coef"])
                (res.loss * frac).backward()
            acc["joint"] += float(res.joint_nll) * frac
            acc["first"] += float(res.first_nll) * frac
            acc["balance"] += float(res.balance) * frac
            acc["share"] += res.max_share * frac
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        acc["n"] += 1
        step += 1
        elapsed += time.perf_counter() - t0
        last = step >= total or elapsed >= limit_s
        metrics = {"step": step, "elapsed_s": round(elapsed, 2)}
        if step % t["log_every"] == 0 or last:
            k = max(1, acc["n"])
            row = {"step": step, "elapsed_s": round(elapsed, 1), "tokens": step * world * t["batch_windows"] * m,
                   "joint_nll": acc["joint"] / k, "first_nll": acc["first"] / k, "balance": acc["balance"] / k,
                   "top_expert_share": acc["share"] / k, "lr": lr_at(step - 1)}
            history.append(row)
            metrics.update(row)
            acc = {"joint": 0.0, "first": 0.0, "balance": 0.0, "share": 0.0, "n": 0}
        if step % t["checkpoint_every"] == 0 or last:
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = None
                if rank == 0:
                    torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                "elapsed_s": elapsed, "history": history, "heads_config": heads.cfg.__dict__},
                               Path(tmp) / STATE)
                    checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report(metrics, checkpoint=checkpoint)
            if rank == 0 and step == config["exit_at_step"]:
                os._exit(1)
        elif step % t["log_every"] == 0:
            ray.train.report(metrics)


# ---- driver ------------------------------------------------------------------------------------------
def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest checkpoint directory (highest step) under Ray's run directory, or None."""
    import torch

    best, best_step = None, -1
    for f in run_dir.glob("**/" + STATE):
        try:
            step = int(torch.load(f, map_location="cpu", weights_only=False)["step"])
        except Exception:  # a checkpoint cut off by a kill
            continue
        if step > best_step:
            best, best_step = f.parent, step
    return best


def run_training(cfg: DictConfig, command: str = "python -m jobs.train_heads") -> Path:
    """Train (or resume) and write the heads and the loss curve to output.dir. Raises TrainError."""
    import ray
    import torch
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

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
    tokens = tokenize_corpus(cfg, lm.tokenizer, out)
    bos = lm.tokenizer.bos_token_id
    run_dir = out / "ray"
    resume = latest_checkpoint(run_dir)
    if resume is not None:
        log.info("resuming from %s", resume)
    started_ray = False
    if not ray.is_initialized():
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"
        kw = {"num_cpus": cfg.ray.num_cpus} if address == "local" else {}
        # Ray Train's placement-group cleaner asks the state API (served by the dashboard) whether the
        # controller lives: without one it logs a warning every second and cannot clean up after a kill
        ray.init(address=address, include_dashboard=True, log_to_driver=True, **kw)
        started_ray = True
    try:
        model_section = OmegaConf.to_container(cfg.model, resolve=True)
        if Path(mc.name_or_path).exists():  # workers run in their own directory
            model_section["name_or_path"] = str(Path(mc.name_or_path).resolve())
        loop_config = {
            "model": model_section,
            "base_model": cfg.model.name_or_path,
            "heads": OmegaConf.to_container(cfg.heads),
            "train": OmegaConf.to_container(cfg.train),
            "tokens": ray.put(tokens),
            "bos": bos,
            "use_gpu": cfg.ray.use_gpu,
            "torch_threads": max(1, int(cfg.ray.cpus_per_worker)),
            "resume_from": str(resume) if resume is not None else "",
            "exit_at_step": cfg.fault.exit_at_step,
        }
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=loop_config,
            scaling_config=ScalingConfig(
                num_workers=cfg.ray.num_workers, use_gpu=cfg.ray.use_gpu,
                resources_per_worker={"CPU": cfg.ray.cpus_per_worker, **({"GPU": 1} if cfg.ray.use_gpu else {})},
            ),
            run_config=RunConfig(
                name=f"run-{int(time.time())}", storage_path=str(run_dir),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            ),
        )
        try:
            trainer.fit()
        except Exception as exc:  # Ray's TrainingFailedError wraps the worker's error
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise TrainError(f"training failed ({first[:200]}); rerun the same command to resume from the last checkpoint") from None
    finally:
        if started_ray:
            ray.shutdown()
    final = latest_checkpoint(run_dir)
    if final is None:
        raise TrainError("training wrote no checkpoint")
    state = torch.load(final / STATE, map_location="cpu", weights_only=False)
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
    write_loss_curve(out, history, f"rank {cfg.heads.rank}, n = {cfg.heads.num_positions}")
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


def write_loss_curve(out: Path, history: list[dict], title: str) -> None:
    if not history:
        return
    with open(out / "loss_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(history[0]))
        w.writeheader()
        w.writerows(history)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in history]
    ax[0].plot(steps, [r["joint_nll"] for r in history], label="joint NLL (eq. 9)")
    ax[0].plot(steps, [r["first_nll"] for r in history], label="first-position NLL")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("nats / position"), ax[0].legend(), ax[0].set_title(title)
    ax[1].plot(steps, [r["balance"] for r in history], label="balancing loss")
    ax[1].plot(steps, [r["top_expert_share"] for r in history], label="largest top-expert share")
    ax[1].set_xlabel("step"), ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=90)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..config import ConfigError, parse_command_line

    ns = parse_command_line(argv, "esp-batch train-heads", __doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="esp-batch %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load_train_config(ns.config, ns.overrides)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        sys.stdout.write(OmegaConf.to_yaml(cfg))
        return 0
    command = "python -m jobs.train_heads " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        run_training(cfg, command.strip())
    except TrainError as exc:
        print(f"esp-batch: training failed: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"esp-batch: error: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
