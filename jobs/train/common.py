"""What every trainer on Ray Train shares (train-heads: heads.py, train-dmtd: dmtd.py): the training text and its
keys (`data.*`), the schedule, time limit and checkpoint keys (`train.*`), Ray's (`ray.*`), the output directory
and the fault injection of the tests; in the workers the bookkeeping of a step (`TrainLoop`: resume, windows,
learning rate, loss history, checkpoints); on the driver the run itself (`fit`: a TorchTrainer that resumes from
the newest checkpoint under `output.dir/ray`) and the loss curve (`write_loss_curve`).

Text: `data.path`, any input the job runner reads (the text of each row's prompt, messages or turns, or of a
`text` column); `data.text_dir`, a directory of text files (recursive); and `data.file_list`, a list of
`<kind> <relative path>` lines resolved under `data.roots.<kind>` (`stdlib` = this interpreter's standard
library). A file list's `# excluded <kind>: a b c` header lines name files that must never be trained on: they
are skipped wherever they turn up (text_dir included), and the log says so. Documents are tokenized once (cached
in `output.dir/tokens.npy`), joined with EOS, and cut into random windows of `train.seq_len` tokens (BOS first).
"""
from __future__ import annotations

import csv
import logging
import shlex
import sys
import math
import os
import random
import re
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from esp_worker.config import ModelConfig

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
class TrainSection:
    steps: int = 1000  # optimizer steps (global: every worker takes each one)
    time_limit_min: float = 0.0  # stop after this many minutes of training (0 = no limit; a resumed run counts
    # the time before the kill); the cosine schedule then follows elapsed time, so it anneals inside the limit
    seq_len: int = 512  # window length (BOS included)
    batch_windows: int = 2  # windows per worker per step
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of lr at train.steps
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


class TrainError(RuntimeError):
    """Training failed; one-line message."""


def load_checked(schema: type, path: Optional[str], overrides: Sequence[str],
                 checks: Callable[[DictConfig], list[tuple[bool, str]]]) -> DictConfig:
    """A trainer's config (`schema` merged with the YAML at `path` and the overrides), checked: the keys every
    trainer shares, then `checks(cfg)`, its own (ok, message) pairs. Raises ConfigError on the first failure."""
    from ..config import ConfigError, merge_config
    from ..run.cluster import ADDRESS_FORMS, well_formed_address

    cfg = merge_config(schema, path, overrides)
    d, t = cfg.data, cfg.train
    shared = [
        (bool(d.path or d.text_dir or d.file_list), "give training text: data.path, data.text_dir and/or data.file_list"),
        (t.steps >= 1 and t.batch_windows >= 1, "train.steps and train.batch_windows must be >= 1"),
        (t.lr > 0, "train.lr must be > 0"),
        (t.checkpoint_every >= 1 and t.log_every >= 1, "train.checkpoint_every and train.log_every must be >= 1"),
        (t.weight_decay >= 0 and t.warmup_steps >= 0, "train.weight_decay and train.warmup_steps must be >= 0"),
        (0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1] (the cosine's floor, a fraction of train.lr)"),
        (t.time_limit_min >= 0, "train.time_limit_min must be >= 0 (0 = no limit)"),
        (cfg.ray.num_workers >= 1, "ray.num_workers must be >= 1"),
        (cfg.ray.cpus_per_worker >= 0, "ray.cpus_per_worker must be >= 0"),
        (cfg.ray.max_failures >= -1, "ray.max_failures must be >= 0, or -1 for no limit"),
        (well_formed_address(cfg.ray.address), f"ray.address={cfg.ray.address!r} is {ADDRESS_FORMS}"),
        (bool(cfg.output.dir), "output.dir must be set"),
    ]
    for ok, msg in shared + checks(cfg):
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


def iter_documents(d: DictConfig, log: logging.Logger = logging.getLogger("esp_batch.train")) -> Any:
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


def tokenize_corpus(cfg: DictConfig, tokenizer: Any, out_dir: Path, log: logging.Logger) -> Any:
    """All documents as one int32 token stream (each document ends with EOS), cached in out_dir/tokens.npy."""
    import numpy as np

    cache = out_dir / "tokens.npy"
    if cache.is_file():
        return np.load(cache)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    parts, docs = [], 0
    for text in iter_documents(cfg.data, log):
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


# ---- in every Ray Train worker -----------------------------------------------------------------------------
class TrainLoop:
    """A worker's bookkeeping around its steps: resume (Ray's checkpoint, or the newest one of an earlier run),
    the random windows, the learning rate (warmup, then cosine over the steps or the time limit, whichever ends
    first), the per-step metrics averaged over `train.log_every` steps into the loss history, and rank 0's
    checkpoints every `train.checkpoint_every` steps (and the fault injection right after one).

        loop = TrainLoop(config)
        state = loop.resume(device)            # the trainer's own entries of the last checkpoint, or None
        while loop.running:
            win = loop.windows(tokens, bos, device)
            loop.set_lr(opt)
            ... forward, backward, opt.step(); loop.add(nll=...)
            loop.end_step(seconds, positions, lambda: {"model": ..., "optimizer": ...})
    """

    def __init__(self, config: dict):
        import ray.train

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.t = config["train"]
        self.resume_from = config.get("resume_from") or ""
        self.exit_at_step = config.get("exit_at_step", -1)
        self.limit_s = self.t["time_limit_min"] * 60 if self.t["time_limit_min"] > 0 else float("inf")
        self.step, self.elapsed, self.history = 0, 0.0, []
        self._acc: dict[str, float] = {}
        self._acc_n = 0

    def resume(self, device: Any) -> Optional[dict]:
        """The last checkpoint's state (step, time and history restored here), or None for a fresh start."""
        import ray.train
        import torch

        ckpt = ray.train.get_checkpoint()
        where = ckpt.to_directory() if ckpt is not None else (self.resume_from or None)
        if where is None:
            return None
        state = torch.load(Path(where) / STATE, map_location=device, weights_only=False)
        self.step, self.elapsed, self.history = state["step"], state["elapsed_s"], state["history"]
        return state

    @property
    def fresh(self) -> bool:
        """No checkpoint to resume from (a warm start may apply)."""
        import ray.train

        return not self.resume_from and ray.train.get_checkpoint() is None

    @property
    def running(self) -> bool:
        return self.step < self.t["steps"] and self.elapsed < self.limit_s

    def lr(self, s: Optional[int] = None) -> float:
        """Warmup, then cosine decay over the steps or the time limit, whichever ends first."""
        t = self.t
        s = self.step if s is None else s
        warm, total, floor = t["warmup_steps"], t["steps"], t["min_lr_ratio"]
        if s < warm:
            return t["lr"] * (s + 1) / warm
        p = min(1.0, max((s - warm) / max(1, total - warm), self.elapsed / self.limit_s))
        return t["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))

    def set_lr(self, opt: Any) -> None:
        for g in opt.param_groups:
            g["lr"] = self.lr()

    def windows(self, tokens: Any, bos: Optional[int], device: Any) -> Any:
        """[W, seq_len] windows of this step and rank (a seeded draw: a resumed run draws what the killed one
        would have), BOS first when the tokenizer has one."""
        import torch

        t = self.t
        body = t["seq_len"] - (1 if bos is not None else 0)
        if len(tokens) <= body + 1:
            raise TrainError(f"the corpus has {len(tokens)} tokens, fewer than one window of train.seq_len={t['seq_len']}")
        rng = random.Random(hash((t["seed"], self.step, self.rank)) & 0xFFFFFFFF)
        starts = [rng.randrange(0, len(tokens) - body) for _ in range(t["batch_windows"])]
        win = torch.stack([tokens[s: s + body] for s in starts])  # [W, L]
        if bos is not None:
            win = torch.cat([torch.full((win.shape[0], 1), bos, dtype=torch.long), win], 1)
        return win.to(device)

    def add(self, weight: float = 1.0, **metrics: float) -> None:
        """Add this step's metrics (or a part of the step's, weighted by `weight`) to the running means."""
        for k, v in metrics.items():
            self._acc[k] = self._acc.get(k, 0.0) + float(v) * weight

    def end_step(self, seconds: float, positions: int, state: Callable[[], dict]) -> None:
        """Count the step (its seconds, `positions` trained per worker), log its means every log_every steps,
        and at checkpoints report `state()` (rank 0: the trainer's own entries) with step, time and history."""
        import ray.train
        import torch

        t = self.t
        self._acc_n += 1
        self.step += 1
        self.elapsed += seconds
        last = not self.running
        metrics: dict[str, Any] = {"step": self.step, "elapsed_s": round(self.elapsed, 2)}
        if self.step % t["log_every"] == 0 or last:
            k = max(1, self._acc_n)
            row = {"step": self.step, "elapsed_s": round(self.elapsed, 1), "tokens": self.step * self.world * positions,
                   **{name: v / k for name, v in self._acc.items()}, "lr": self.lr(self.step - 1)}
            self.history.append(row)
            metrics.update(row)
            self._acc, self._acc_n = {}, 0
        if self.step % t["checkpoint_every"] == 0 or last:
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = None
                if self.rank == 0:
                    torch.save({**state(), "step": self.step, "elapsed_s": self.elapsed, "history": self.history},
                               Path(tmp) / STATE)
                    checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report(metrics, checkpoint=checkpoint)
            if self.rank == 0 and self.step == self.exit_at_step:
                os._exit(1)
        elif self.step % t["log_every"] == 0:
            ray.train.report(metrics)


def load_tokens(config: dict) -> Any:
    """The corpus [N] (long) a worker trains on, from the object store."""
    import numpy as np
    import ray
    import torch

    tokens = config["tokens"]
    tokens = ray.get(tokens) if isinstance(tokens, ray.ObjectRef) else tokens
    return torch.from_numpy(np.asarray(tokens, dtype=np.int64))


def worker_model(config: dict) -> Any:
    """The worker's LoadedModel (model.*, on this worker's GPU under ray.use_gpu), torch threads set."""
    import ray.train.torch
    import torch

    from esp_worker import load_model

    torch.set_num_threads(max(1, int(config["torch_threads"])))
    mc = ModelConfig(**config["model"])
    if config["use_gpu"]:
        mc.device = str(ray.train.torch.get_device())
    return load_model(mc)


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


def model_section(cfg: DictConfig) -> dict:
    """cfg.model as a dict for the workers (a local model path made absolute: workers run in their own directory)."""
    section = OmegaConf.to_container(cfg.model, resolve=True)
    if Path(section["name_or_path"]).exists():
        section["name_or_path"] = str(Path(section["name_or_path"]).resolve())
    return section


def start_local_ray(num_cpus: Optional[int]) -> None:
    """Start a local Ray instance for training runs, with a dashboard its own processes can find.

    Ray Train's placement-group cleaner (a detached actor beside each run's controller) asks the dashboard's
    state API, every second, whether the controller still lives. It finds the dashboard through the address of
    the last `ray start --head` on this machine (<ray temp dir>/ray_current_cluster), which a local instance
    does not write. When that file names a dead head, each question waits 40 s, so every run ends 12 s late with
    a traceback in its log. When it names another live cluster, the cleaner finds no controller there, takes the
    run for dead and exits (or removes the run's placement group). So the dashboard listens on a port chosen
    here, and the job's processes are told it (RAY_API_SERVER_ADDRESS, which the state API reads first)."""
    import ray

    from ..run.cluster import free_port

    port = free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, log_to_driver=True,
             runtime_env={"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}})


def fit(cfg: DictConfig, loop: Callable[[dict], None], extra: dict, tokens: Any, bos: Optional[int], out: Path,
        log: logging.Logger) -> dict:
    """Run `loop` on Ray Train (resuming from the newest checkpoint under out/ray) and return that run's newest
    checkpoint state. `extra` joins the loop's config (the trainer's own keys). Raises TrainError."""
    import ray
    import torch
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run_dir = out / "ray"
    resume = latest_checkpoint(run_dir)
    if resume is not None:
        log.info("resuming from %s", resume)
    started_ray = False
    if not ray.is_initialized():
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or "local"
        if address == "local":
            start_local_ray(cfg.ray.num_cpus)
        else:
            from ..run.cluster import address_problem

            problem = address_problem(address)
            if problem:
                raise TrainError(f"cannot connect to Ray at {address!r}: {problem}")
            ray.init(address=address, log_to_driver=True)
        started_ray = True
    try:
        loop_config = {
            "model": model_section(cfg),
            "train": OmegaConf.to_container(cfg.train),
            "tokens": ray.put(tokens),
            "bos": bos,
            "use_gpu": cfg.ray.use_gpu,
            "torch_threads": max(1, int(cfg.ray.cpus_per_worker)),
            "resume_from": str(resume) if resume is not None else "",
            "exit_at_step": cfg.fault.exit_at_step,
            **extra,
        }
        trainer = TorchTrainer(
            loop,
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
    return torch.load(final / STATE, map_location="cpu", weights_only=False)


def write_loss_curve(out: Path, history: list[dict], title: str,
                     panels: list[tuple[str, list[tuple[str, str]]]]) -> None:
    """loss_curve.csv (the history) and loss_curve.png: one panel per (y label, [(history key, legend)])."""
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
    fig, ax = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    steps = [r["step"] for r in history]
    for i, (ylabel, series) in enumerate(panels):
        a = ax[0][i]
        for key, label in series:
            a.plot(steps, [r[key] for r in history], label=label)
        a.set_xlabel("step"), a.legend()
        if ylabel:
            a.set_ylabel(ylabel)
        if i == 0:
            a.set_title(title)
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=90)
    plt.close(fig)


def cli_main(argv: Optional[Sequence[str]], prog: str, doc: str, load: Callable[..., DictConfig],
             train: Callable[[DictConfig, str], Any], module: str) -> int:
    """A trainer's command line: `load(config path, overrides)` then `train(cfg, the command as typed)`.
    Exit codes: 0 done, 1 training failed (rerun to resume), 2 bad command line or config."""
    from ..config import ConfigError, parse_command_line

    ns = parse_command_line(argv, prog, doc.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="esp-batch %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load(ns.config, ns.overrides)
    except ConfigError as exc:
        print(f"esp-batch: error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        sys.stdout.write(OmegaConf.to_yaml(cfg))
        return 0
    command = f"python -m {module} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        train(cfg, command.strip())
    except TrainError as exc:
        print(f"esp-batch: training failed: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"esp-batch: error: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0
