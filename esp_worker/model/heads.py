"""Rank-r CP multi-token heads over a frozen causal LM (arXiv "Faster language models with better multi token
prediction using tensor decomposition"): the joint distribution of the next n tokens given the last hidden
state e_t is a mixture of r products of per-position distributions,

    P(x_{t+1..t+n} | e_t) = sum_a w_a(e_t) prod_s P_a^(s)(x_{t+s} | e_t).

Parametrisation (cheaper than the paper's full V x E matrix per expert and position): every expert a and
position s owns a residual bottleneck MLP on the model's final hidden state (after its final norm), and the
frozen model's own unembedding turns the result into logits:

    z_{a,s} = e_t + U_{a,s} silu(D_{a,s} e_t)        ([E] -> [M] -> [E], M = `hidden` per head)
    P_a^(s) = softmax(lm_head(z_{a,s}))
    w       = softmax(W_h e_t + b_h)                  ([E] -> [r])

U starts at zero, so at initialisation every factor equals the model's own next-token distribution and w is
uniform; D is random per (a, s), which breaks the experts' symmetry from the first gradient step. Parameters
per head: 2 E M + (E + 1) r, i.e. 3.2 MB in float32 for esp-tiny-llama at r = 4, n = 3, M = 128 (the paper's
form would be 12 x 4096 x 256 = 12.6M parameters, 50 MB). Sharing the unembedding keeps heads small and lets
them start from (and stay close to) what the model already knows.

Files: `<dir>/heads.safetensors` (the module's state dict) and `<dir>/heads.json` (CPHeadsConfig, including
the base model's name and a fingerprint of its unembedding); `load_heads` refuses another base model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

WEIGHTS = "heads.safetensors"
CONFIG = "heads.json"


class HeadsLoadError(ValueError):
    """Heads cannot be used with this model; one-line message."""


@dataclass
class CPHeadsConfig:
    base_model: str  # name_or_path of the model the heads were trained on (informational)
    base_fingerprint: str  # unembedding_fingerprint() of that model: loading checks it
    hidden_size: int  # E
    vocab_size: int  # V
    num_positions: int = 3  # n: tokens t+1 .. t+n predicted from e_t
    rank: int = 4  # r: experts (rank of the CP decomposition)
    head_hidden: int = 128  # M: bottleneck width of each expert/position MLP
    training: dict = dataclasses.field(default_factory=dict)  # how they were made (command, steps, losses)


def unembedding_fingerprint(model: Any) -> str:
    """A short hash of the model's output embedding (shape + rounded row sums of a few rows).

    Rounded so the same weights cast to bfloat16 or moved to a GPU still match; another model does not.
    """
    w = model.get_output_embeddings().weight.detach().float().cpu()  # [V, E]
    v, e = w.shape
    rows = torch.linspace(0, v - 1, steps=min(v, 64)).long()
    stats = torch.stack([w[rows].sum(1), w[rows].abs().sum(1)], 1)  # [64, 2]
    scaled = (stats / (stats.abs().max() + 1e-12) * 100).round().long()
    return hashlib.sha256(f"{v}x{e}:".encode() + scaled.numpy().tobytes()).hexdigest()[:16]


class CPHeads(nn.Module):
    """r experts x n positions of residual MLPs on e_t, plus the mixture weights w(e_t)."""

    def __init__(self, cfg: CPHeadsConfig):
        super().__init__()
        self.cfg = cfg
        r, n, e, m = cfg.rank, cfg.num_positions, cfg.hidden_size, cfg.head_hidden
        # [r, n, M, E] and [r, n, E, M]
        self.down = nn.Parameter(torch.randn(r, n, m, e) / math.sqrt(e))
        self.up = nn.Parameter(torch.zeros(r, n, e, m))
        self.gate = nn.Linear(e, r)
        nn.init.normal_(self.gate.weight, std=0.01)
        nn.init.zeros_(self.gate.bias)

    def hidden(self, e: torch.Tensor) -> torch.Tensor:
        # e: [T, E] -> z: [T, r, n, E]
        assert e.ndim == 2 and e.shape[1] == self.cfg.hidden_size
        e = e.to(self.down.dtype)
        a = torch.nn.functional.silu(torch.einsum("rnme,te->trnm", self.down, e))
        return e[:, None, None, :] + torch.einsum("rnem,trnm->trne", self.up, a)

    def log_weights(self, e: torch.Tensor) -> torch.Tensor:
        # e: [T, E] -> log w: [T, r]
        return torch.log_softmax(self.gate(e.to(self.gate.weight.dtype)).float(), -1)

    def logits(self, e: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """e [T, E] -> logits of every factor [T, r, n, V]; unembed maps [N, E] hidden states to [N, V] logits."""
        z = self.hidden(e)
        t, r, n, _ = z.shape
        # one contiguous [T*r*n, E] product: the einsum's strided 4-D output would make the unembedding a
        # batched matmul of T tiny products, ~3.5x slower
        return unembed(z.reshape(t * r * n, -1)).reshape(t, r, n, -1).float()

    def forward(self, e: torch.Tensor, unembed: Callable[[torch.Tensor], torch.Tensor],
                targets: Optional[torch.Tensor] = None):
        """(log w [T, r], log P_a^(s) [T, r, n, V]); with targets [T, n] the next n tokens:
        (log w, log P_a^(s)(x_{t+s}) [T, r, n]), without materialising the log-softmax (training's form)."""
        logits = self.logits(e, unembed)
        if targets is None:
            return self.log_weights(e), torch.log_softmax(logits, -1)
        t, r, n, v = logits.shape
        tgt = targets[:, None, :].expand(-1, r, -1).reshape(-1)
        c = -torch.nn.functional.cross_entropy(logits.reshape(-1, v), tgt, reduction="none")
        return self.log_weights(e), c.reshape(t, r, n)


# ---- losses -----------------------------------------------------------------------------------------
def cp_log_likelihood(log_w: torch.Tensor, log_p_targets: torch.Tensor) -> torch.Tensor:
    """Equation 9: log sum_a exp(log w_a + sum_s C_a^(s)), per token.

    log_w [T, r]; log_p_targets [T, r, n] = log P_a^(s)(x_{t+s}) of the true next tokens -> [T].
    """
    assert log_w.ndim == 2 and log_p_targets.ndim == 3 and log_p_targets.shape[:2] == log_w.shape
    return torch.logsumexp(log_w + log_p_targets.sum(-1), dim=-1)


def first_position_log_likelihood(log_w: torch.Tensor, log_p_targets: torch.Tensor) -> torch.Tensor:
    """Equation 11: log of the mixture's marginal of x_{t+1}, log sum_a w_a P_a^(1)(x_{t+1}) -> [T]."""
    return torch.logsumexp(log_w + log_p_targets[..., 0], dim=-1)


def balance_loss(log_w: torch.Tensor) -> torch.Tensor:
    """Equation 10 with soft counts: sum_a (mean_t w_a - 1/r)^2. Zero when w is uniform.

    The paper counts n_a = tokens whose largest weight is on expert a, which has no gradient; the mean
    weight is its differentiable relaxation (and equals n_a / N when each w is one-hot).
    """
    w = log_w.exp()  # [T, r]
    r = w.shape[-1]
    return ((w.mean(0) - 1.0 / r) ** 2).sum()


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar to minimise: joint NLL + coef * balance
    joint_nll: torch.Tensor  # scalar, per token (nats)
    first_nll: torch.Tensor  # scalar, first-position NLL of the mixture (nats)
    balance: torch.Tensor  # scalar
    max_share: float  # largest fraction of tokens whose top expert is one expert (paper's n_a / N)


def heads_loss(
    heads: CPHeads,
    e: torch.Tensor,
    targets: torch.Tensor,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    balance_coef: float,
) -> LossResult:
    """Loss on T positions: e [T, E] hidden states, targets [T, n] the next n tokens of each position.
    `heads` may be wrapped (DistributedDataParallel): it is only called."""
    assert targets.shape == (e.shape[0], getattr(heads, "module", heads).cfg.num_positions)
    log_w, c = heads(e, unembed, targets)  # [T, r], [T, r, n] = log P_a^(s)(x_{t+s})
    joint = -cp_log_likelihood(log_w, c).mean()
    first = -first_position_log_likelihood(log_w, c).mean()
    bal = balance_loss(log_w)
    share = torch.bincount(log_w.argmax(-1), minlength=log_w.shape[1]).max().item() / max(1, log_w.shape[0])
    return LossResult(joint + balance_coef * bal, joint.detach(), first.detach(), bal.detach(), share)


# ---- files ------------------------------------------------------------------------------------------
def save_heads(heads: CPHeads, path: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in heads.state_dict().items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(dataclasses.asdict(heads.cfg), indent=2) + "\n")
    return out


def read_heads_config(path: str | Path) -> CPHeadsConfig:
    p = Path(path)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise HeadsLoadError(f"engine.heads_path={str(path)!r} holds no {CONFIG} + {WEIGHTS} (train them with jobs.train_heads)")
    fields = {f.name for f in dataclasses.fields(CPHeadsConfig)}
    raw = json.loads((p / CONFIG).read_text())
    return CPHeadsConfig(**{k: v for k, v in raw.items() if k in fields})


def load_heads(path: str | Path, model: Any, device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32) -> CPHeads:
    """Heads from `path`, checked against `model`; raises HeadsLoadError (one line) for another base model."""
    from safetensors.torch import load_file

    cfg = read_heads_config(path)
    emb = model.get_output_embeddings().weight
    v, e = emb.shape
    fp = unembedding_fingerprint(model)
    if (cfg.vocab_size, cfg.hidden_size) != (v, e) or cfg.base_fingerprint != fp:
        raise HeadsLoadError(
            f"heads at {str(path)!r} were trained for base model {cfg.base_model!r} (vocab {cfg.vocab_size}, hidden "
            f"{cfg.hidden_size}, fingerprint {cfg.base_fingerprint}), not this model (vocab {v}, hidden {e}, "
            f"fingerprint {fp}); train heads for it with jobs.train_heads"
        )
    heads = CPHeads(cfg)
    heads.load_state_dict(load_file(str(Path(path) / WEIGHTS)))
    return heads.to(device=device or emb.device, dtype=dtype).eval().requires_grad_(False)


@torch.no_grad()
def seed_experts(heads: CPHeads, source: CPHeads, noise: float, seed: int = 0) -> None:
    """Start `heads` from trained `source` heads (same n and bottleneck width; any rank): expert a copies source
    expert a mod r', and every copy after the first is perturbed by `noise` x the source weights' standard
    deviation (identical experts get identical gradients and would never specialise). The gate keeps its own
    initialisation (near-uniform w), so at noise 0 a rank-1 source gives the same joint distribution as itself.
    This is the "rank-1 warm start": the per-position marginals first (3-4x cheaper per step at rank 1), then
    the mixture learns what they cannot (the correlations between positions)."""
    a, b = heads.cfg, source.cfg
    if (a.num_positions, a.head_hidden, a.hidden_size, a.vocab_size) != (b.num_positions, b.head_hidden, b.hidden_size, b.vocab_size):
        raise HeadsLoadError(
            f"heads.init_from has n={b.num_positions}, head_hidden={b.head_hidden} (hidden {b.hidden_size}, vocab "
            f"{b.vocab_size}); this run needs n={a.num_positions}, head_hidden={a.head_hidden} (hidden {a.hidden_size}, "
            f"vocab {a.vocab_size}): set heads.num_positions / heads.head_hidden to match or drop heads.init_from")
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name in ("down", "up"):
        src, dst = getattr(source, name).detach().float().cpu(), getattr(heads, name)
        std = float(src.std()) if src.numel() > 1 else 0.0
        for e in range(a.rank):
            w = src[e % b.rank].clone()
            if e >= b.rank and noise > 0:
                w += noise * std * torch.randn(w.shape, generator=g)
            dst[e].copy_(w.to(dst.dtype))


def new_heads(model: Any, base_model: str, num_positions: int, rank: int, head_hidden: int, seed: int = 0) -> CPHeads:
    emb = model.get_output_embeddings().weight
    cfg = CPHeadsConfig(
        base_model=base_model, base_fingerprint=unembedding_fingerprint(model), hidden_size=int(emb.shape[1]),
        vocab_size=int(emb.shape[0]), num_positions=num_positions, rank=rank, head_hidden=head_hidden,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return CPHeads(cfg)
