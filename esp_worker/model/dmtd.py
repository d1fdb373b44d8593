"""Direct Multi-Token Decoding (DMTD, arXiv 2510.11958) on a Llama, Qwen2, Qwen3 or Mistral model.

The layers form three groups, in the authors' config fields (their `modeling_mtpqwen3.py`): the first
`num_encoding_layers` (E), the next `num_thinking_layers` (T) and the last `num_decoding_layers` (D), with
E + T + D = num_hidden_layers; `mtp_horizon` is the cycle length tau.

Training (`cyclic_forward`, teacher forced) runs every layer at every position p; the decoding layers' input is

    enc(p) + think(p)   where p % tau == 0   (a cycle start)
    enc(p)              elsewhere

with enc the encoding layers' output (the token embedding when E = 0) and think the thinking layers' output (the
residual stream, so it already holds enc(p): the authors add both). p is the position from the sequence start.
So the thinking layers' output reaches the decoding layers only at cycle starts, through the decoding layers'
keys and values there: the decoding layers learn to emit the tau tokens after a cycle start from it.

Inference (`CycleForward`) computes exactly what that forward computes at each position. The root (the last
committed token) at position t is fed once:
- t % tau == 0, a full pass: the encoding and decoding layers on the root, and the thinking layers on the
  *refill block*, positions t - tau + 1 .. t: their keys and values at the tau - 1 positions the last cycle
  skipped, and the root's own (the cyclical KV refill; with E > 0 the encoding layers recompute those positions
  to feed it and write the same keys again);
- otherwise a decoding pass: the encoding and decoding layers only (E + D of the L layers).
Every pass commits one token per row, so each row keeps its own phase in a batch: the thinking layers run over
the rows at a cycle start only. PLT (layers per token / L, `DmtdConfig.layers_run`) counts the layers each decode
pass ran for its root: L for a full pass, E + D for a decoding pass (the refill is extra tokens, not layers).

DMTD is a different model, not a speculative method: its output is not the base model's (not lossless).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..consts import steps
from ..grad import inference
from ..sampling import upload
from .attention import attention_bias
from .errors import ModelLoadError
from .layers import ModuleLayers

# the authors' config fields (MTPQwen3Config), in the order they split the layers
FIELDS = ("num_encoding_layers", "num_thinking_layers", "num_decoding_layers", "mtp_horizon")
# architectures whose layers the cyclic forward runs (the direct decoder's, model/decoder.py)
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class DmtdConfigError(ModelLoadError):
    """The model's DMTD fields do not describe a split of its layers; one line."""


@dataclass(frozen=True)
class DmtdConfig:
    num_encoding_layers: int  # E: run for every token
    num_thinking_layers: int  # T: run at cycle starts (over the refill block)
    num_decoding_layers: int  # D: run for every token
    mtp_horizon: int  # tau: tokens per cycle

    @property
    def tau(self) -> int:
        return self.mtp_horizon

    @property
    def num_layers(self) -> int:
        return self.num_encoding_layers + self.num_thinking_layers + self.num_decoding_layers

    @property
    def thinking_end(self) -> int:
        """Index of the first decoding layer."""
        return self.num_encoding_layers + self.num_thinking_layers

    @classmethod
    def split(cls, num_layers: int, tau: int, num_decoding_layers: int, num_encoding_layers: int = 0) -> "DmtdConfig":
        """The split of `num_layers` with D decoding and E encoding layers (the rest think)."""
        cfg = cls(num_encoding_layers, num_layers - num_encoding_layers - num_decoding_layers, num_decoding_layers, tau)
        cfg.check(num_layers)
        return cfg

    def check(self, num_layers: int) -> None:
        """Raise DmtdConfigError unless this is a split of `num_layers` layers with tau >= 1."""
        e, t, d = self.num_encoding_layers, self.num_thinking_layers, self.num_decoding_layers
        if min(e, t) < 0 or d < 1 or self.mtp_horizon < 1:
            raise DmtdConfigError(f"DMTD split E={e} T={t} D={d} tau={self.mtp_horizon}: need E, T >= 0, D >= 1, tau >= 1")
        if e + t + d != num_layers:
            raise DmtdConfigError(f"DMTD split E={e} + T={t} + D={d} = {e + t + d} layers, but the model has {num_layers}")

    @classmethod
    def of_model(cls, config: Any) -> Optional["DmtdConfig"]:
        """The split a model config records (the authors' fields), None when it records none. Raises
        DmtdConfigError when the fields are partial or do not add up to the model's layers."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        values = {f: getattr(text, f, None) for f in FIELDS}
        if all(v is None for v in values.values()):
            return None
        missing = [f for f, v in values.items() if v is None]
        if missing:
            raise DmtdConfigError(f"the model config has DMTD fields but lacks {', '.join(missing)}")
        cfg = cls(**{f: int(v) for f, v in values.items()})
        cfg.check(int(text.num_hidden_layers))
        return cfg

    def with_overrides(self, tau: int = 0, num_decoding_layers: int = 0) -> "DmtdConfig":
        """This split with another tau and/or D (0 = keep); the thinking layers take up the difference."""
        d = num_decoding_layers or self.num_decoding_layers
        return DmtdConfig.split(self.num_layers, tau or self.mtp_horizon, d, self.num_encoding_layers)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def layers_run(self, prompt_len: int, num_generated: int) -> int:
        """Layers run for the roots of a row's decode passes (PLT's numerator): the roots sit at positions
        prompt_len .. prompt_len + num_generated - 2 (the prefill commits the first token); a root at a cycle
        start runs all L layers, any other E + D.

        Example: tau 3, L 6, E 0, D 2, prompt 4, 6 tokens: roots at 4..8, starts 6 -> 6 + 4 * 2 = 14 (PLT 14/30)."""
        n = max(num_generated - 1, 0)
        if n == 0:
            return 0
        first, last = prompt_len, prompt_len + n - 1
        starts = last // self.tau - (first - 1) // self.tau
        return starts * self.num_layers + (n - starts) * (self.num_encoding_layers + self.num_decoding_layers)


def resolve(model_config: Any, tau: int = 0, num_decoding_layers: int = 0) -> DmtdConfig:
    """The split DMTD runs: the model's (its config's fields), with engine.dmtd_tau / engine.dmtd_decoding_layers
    when given; a model without the fields needs dmtd_decoding_layers (an untrained split: for speed only)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "model_type", None) not in ARCHS:
        raise DmtdConfigError(f"DMTD supports {', '.join(ARCHS)} models, not {getattr(text, 'model_type', None)!r}")
    own = DmtdConfig.of_model(text)
    if own is not None:
        return own.with_overrides(tau, num_decoding_layers)
    if num_decoding_layers < 1:
        raise DmtdConfigError(
            "engine.method=dmtd needs a DMTD model (a config.json with num_encoding_layers, num_thinking_layers, "
            "num_decoding_layers and mtp_horizon: esp-batch train-dmtd writes one) or engine.dmtd_decoding_layers "
            "(and engine.dmtd_tau) to split an untrained model, for speed measurements only")
    return DmtdConfig.split(int(text.num_hidden_layers), tau or 2, num_decoding_layers)


# ---- the authors' checkpoint format ----------------------------------------------------------------------
def base_model_type(raw: dict) -> Optional[str]:
    """The transformers model type to load a DMTD config.json as: its own where transformers knows it (our
    directories: `llama`, `qwen3`, ... plus the DMTD fields), the architecture under an `mtp` prefix otherwise
    (the authors' `mtpqwen3`, whose modeling code is remote); None for a config without DMTD fields."""
    if not any(f in raw for f in FIELDS):
        return None
    from transformers import CONFIG_MAPPING

    model_type = str(raw.get("model_type", ""))
    if model_type in CONFIG_MAPPING:
        return model_type
    base = model_type.lower()
    if base.startswith("mtp"):
        base = base[3:].lstrip("_-")
    if base in ARCHS:
        return base
    raise DmtdConfigError(f"DMTD config.json has model_type {model_type!r}; expected one of {', '.join(ARCHS)} "
                          "or the same with an mtp prefix (the authors' mtpqwen3)")


def hf_config(raw: dict) -> Optional[Any]:
    """A transformers config of the base architecture for a DMTD config.json dict (the DMTD fields kept as
    attributes), or None when the dict needs no translation (no DMTD fields, or a model type transformers
    knows). The weights keep the base architecture's names (`model.layers.N...`, `lm_head`)."""
    base = base_model_type(raw)
    if base is None or base == raw.get("model_type"):
        return None
    from transformers import AutoConfig

    rest = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map") and not k.startswith("_")}
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[base]
    return AutoConfig.for_model(base, architectures=[arch], **rest)


def read_config_json(name: str, revision: Optional[str] = None) -> Optional[dict]:
    """config.json of a local directory or (when reachable) a hub id, as a dict; None when there is none."""
    from pathlib import Path

    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(name, "config.json", revision=revision))
        except Exception:  # not a hub id, or no network: the model load reports it
            return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- the training-time forward ---------------------------------------------------------------------------
def causal_bias(position_ids: torch.Tensor, dtype: torch.dtype, window: Optional[int] = None) -> torch.Tensor:
    """[B, 1, S, S] additive causal bias (finfo.min where hidden; eager attention needs finite values)."""
    s = position_ids.shape[1]
    i = steps(s, position_ids.device)
    return attention_bias((i[:, None] >= i[None, :])[None], None, position_ids, s, dtype, window)


def cyclic_forward(base: Any, cfg: DmtdConfig, input_ids: torch.Tensor, decoding_layers: Any = None,
                   window: Optional[int] = None, starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The training-time forward: final hidden states [B, S, D] (after the model's final norm) of windows
    input_ids [B, S] that start at position 0, every layer at every position, the decoding layers fed
    enc + think * [p % tau == 0]. Differentiable (the model's own modules). `decoding_layers`: other modules in
    the decoding layers' place (dmtd_verified's trained copy; the trunk then runs without gradients).
    `starts` [B, S] bool: other cycle starts than every tau-th position (dmtd_verified's, in its tests)."""
    assert input_ids.ndim == 2
    b, s = input_ids.shape
    pos = steps(s, input_ids.device)[None].expand(b, s)
    h = base.embed_tokens(input_ids)
    trunk = ModuleLayers(base)
    rope = trunk.rope(h, pos)
    bias = causal_bias(pos, h.dtype, window)
    e, t = cfg.num_encoding_layers, cfg.thinking_end
    with torch.set_grad_enabled(torch.is_grad_enabled() and decoding_layers is None):
        enc = trunk.run(h, 0, e, rope, bias, None)
        think = trunk.run(enc, e, t, rope, bias, None)
    start = ((pos % cfg.tau == 0) if starts is None else starts)[..., None].to(h.dtype)  # [B, S, 1]
    h = enc + think * start
    if decoding_layers is None:
        h = trunk.run(h, t, cfg.num_layers, rope, bias, None)
    else:
        h = ModuleLayers(base, decoding_layers).run(h, 0, len(decoding_layers), rope, bias, None)
    return base.norm(h)


@dataclass
class CyclicLossResult:
    loss: torch.Tensor  # scalar to minimise: mean next-token NLL over every position
    nll: float  # the same, detached
    nll_full: float  # NLL of the tokens a full pass emits (predicted at cycle starts)
    nll_decoding: float  # NLL of the tokens decoding passes emit (the other positions)


class CyclicLoss(torch.nn.Module):
    """The cyclical objective of train-dmtd (a module, so that DDP syncs what it trains): next-token cross-entropy
    at every position of `cyclic_forward` over windows [W, L] that start at position 0. `draft`: dmtd_verified's
    trained copy in the decoding layers' place (the model frozen)."""

    def __init__(self, model: Any, cfg: DmtdConfig, draft: Any = None, window: Optional[int] = None):
        super().__init__()
        self.model, self.draft = model, draft
        self.cfg, self.window = cfg, window

    def forward(self, windows: torch.Tensor) -> CyclicLossResult:
        h = cyclic_forward(self.model.get_decoder(), self.cfg, windows, self.draft, self.window)
        logits = self.model.get_output_embeddings()(h[:, :-1]).float()  # [W, L-1, V]: position p predicts p + 1
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
        nll = nll.view(windows.shape[0], -1)  # [W, L-1]
        full = steps(nll.shape[1], nll.device) % self.cfg.tau == 0  # [L-1] the roots of full passes
        loss = nll.mean()
        return CyclicLossResult(loss, float(loss.detach()), float(nll[:, full].mean().detach()),
                                float(nll[:, ~full].mean().detach()))


# ---- dmtd_verified's draft layers ---------------------------------------------------------------------------
DRAFT_WEIGHTS = "dmtd_draft.safetensors"
DRAFT_CONFIG = "dmtd_draft.json"


def new_draft_layers(base: Any, cfg: DmtdConfig) -> torch.nn.ModuleList:
    """A trainable copy of the model's last D layers (dmtd_verified's drafter starts as the model's own)."""
    import copy

    return torch.nn.ModuleList(copy.deepcopy(layer) for layer in base.layers[cfg.thinking_end:])


def save_draft(path: Any, layers: torch.nn.ModuleList, cfg: DmtdConfig, model: Any, training: dict) -> None:
    """The copy's weights and a config (the split in the authors' fields, the base model and a fingerprint of its
    unembedding, how it was trained)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from .heads import unembedding_fingerprint

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in layers.state_dict().items()}, str(out / DRAFT_WEIGHTS))
    info = {**cfg.to_dict(), "base_model": training.get("base_model", ""),
            "base_fingerprint": unembedding_fingerprint(model), "training": training}
    (out / DRAFT_CONFIG).write_text(json.dumps(info, indent=2) + "\n")


def load_draft(path: Any, model: Any) -> tuple[torch.nn.ModuleList, DmtdConfig]:
    """(the trained copy on the model's device and dtype, its split); DmtdConfigError (one line) when the files are
    missing or were trained for another model."""
    from pathlib import Path

    from safetensors.torch import load_file

    from .heads import unembedding_fingerprint

    p = Path(path)
    if not (p / DRAFT_CONFIG).is_file() or not (p / DRAFT_WEIGHTS).is_file():
        raise DmtdConfigError(f"engine.dmtd_path={str(path)!r} holds no {DRAFT_CONFIG} + {DRAFT_WEIGHTS} (train them "
                              "with esp-batch train-dmtd dmtd.verified=true)")
    info = json.loads((p / DRAFT_CONFIG).read_text())
    cfg = DmtdConfig(**{f: int(info[f]) for f in FIELDS})
    base = model.get_decoder()
    cfg.check(len(base.layers))
    if info.get("base_fingerprint") != unembedding_fingerprint(model):
        raise DmtdConfigError(f"engine.dmtd_path={str(path)!r} was trained for base model {info.get('base_model')!r}, "
                              "not this model; train a copy for it with esp-batch train-dmtd dmtd.verified=true")
    layers = new_draft_layers(base, cfg)
    layers.load_state_dict(load_file(str(p / DRAFT_WEIGHTS)))
    w = base.layers[0].self_attn.q_proj.weight
    return layers.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False), cfg


# ---- inference ------------------------------------------------------------------------------------------
@dataclass
class CycleStarts:
    """The rows whose root is at a cycle start in this pass, and their refill blocks (positions t - tau + 1 .. t
    for a root at position t)."""

    rows: list[int]  # host: the rows, ascending
    row0: Optional[int]  # the rows are row0 .. row0 + R - 1 (their cache rows are a slice); None: gathered
    # [R] their row indices on the device
    index: torch.Tensor
    # [R, tau] the refill block's tokens (the root last)
    tokens: torch.Tensor
    # [R|1, tau] their positions
    position_ids: torch.Tensor
    # [R] slots before each row's refill block (t - tau + 1)
    slot0: torch.Tensor
    uniform: Optional[int]  # slot0 of every such row when they share it (host-known), else None
    view_len: int  # slots the thinking layers see: the longest such row's t + 1

    @classmethod
    def of(cls, lens: list[int], hist: torch.Tensor, hist_len: torch.Tensor, tau: int) -> Optional["CycleStarts"]:
        """From the host lengths (a row of length n has its root at position n - 1) and the history [B, C]
        (its root at hist_len - 1): no device read. None when no row is at a cycle start.

        Example: tau 3, lens [7, 5, 10]: roots at 6, 4, 9 -> rows [0, 2] refill positions 4..6 and 7..9."""
        rows = [r for r, n in enumerate(lens) if (n - 1) % tau == 0]
        if not rows:
            return None
        dev = hist.device
        r = len(rows)
        if rows == list(range(rows[0], rows[0] + r)):  # one range of rows (always at batch 1)
            row0, index = rows[0], steps(r, dev, rows[0])
            h, n = hist.narrow(0, row0, r), hist_len.narrow(0, row0, r)
        else:
            row0, index = None, upload(torch.tensor(rows, dtype=torch.long), dev)
            h, n = hist.index_select(0, index), hist_len.index_select(0, index)
        first = [lens[i] - tau for i in rows]
        slot0 = n - tau  # [R]
        uniform = first[0] if min(first) == max(first) else None
        if uniform is not None:  # one length: positions and tokens from host-known offsets
            pos = steps(tau, dev, uniform)[None]  # [1, tau]
            tokens = h.narrow(1, uniform, tau)
        else:
            pos = slot0[:, None] + steps(tau, dev)[None]  # [R, tau]
            tokens = h.gather(1, pos)
        return cls(rows, row0, index, tokens, pos, slot0, uniform, max(lens[i] for i in rows))


class CycleForward:
    """DMTD's two forwards over the runner's layers (the direct loop, or the model's modules): the prefill
    (`prefill`, the training forward's arithmetic over the prompt) and a decode pass (`step`)."""

    def __init__(self, runner: Any, cfg: DmtdConfig):
        cfg.check(len(runner.base.layers))
        self.runner, self.cfg = runner, cfg
        self.layers = runner.layers
        # the refill's products are over a few rows (tau per row at a cycle start): where the layers have a
        # faster product for those (the CPU's direct loop), the refill takes it; DMTD is lossy by design
        self.refill_layers = runner.layers.few_rows()

    @inference
    def prefill(self, embeds: torch.Tensor, bias: Optional[torch.Tensor], position_ids: torch.Tensor, cache: Any,
                max_position: Optional[int] = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states [B, K, D] at `keep` (or [B, Q, D]) of prompts embeds [B, Q, D] at position_ids [B, Q]
        (left-aligned, padding past each prompt), writing every layer's keys and values."""
        cfg, layers = self.cfg, self.layers
        with self.runner.timing():
            rope = layers.rope(embeds, position_ids, max_position)
            enc = layers.run(embeds, 0, cfg.num_encoding_layers, rope, bias, cache)
            think = layers.run(enc, cfg.num_encoding_layers, cfg.thinking_end, rope, bias, cache)
            start = (position_ids % cfg.tau == 0)[..., None].to(enc.dtype)  # [B, Q, 1] cycle starts
            h = layers.run(enc + think * start, cfg.thinking_end, cfg.num_layers, rope, bias, cache, keep)
            h = layers.norm(h)
        return h if keep is None else h[:, : keep.shape[1]]

    @inference
    def step(self, embeds: torch.Tensor, bias: Optional[torch.Tensor], position_ids: torch.Tensor, cache: Any,
             max_position: Optional[int], starts: Optional[CycleStarts]) -> torch.Tensor:
        """Hidden states [B, 1, D] of the roots embeds [B, 1, D] at position_ids [B, 1]; the cache planned for
        the roots (every row, one slot each). The rows in `starts` also run the thinking layers over their
        refill blocks (their own plan), whose last output joins their decoding layers' input."""
        cfg, layers = self.cfg, self.layers
        e, t = cfg.num_encoding_layers, cfg.thinking_end
        with self.runner.timing():
            rope = layers.rope(embeds, position_ids, max_position)
            h = layers.run(embeds, 0, e, rope, bias, cache)  # [B, 1, D]
            if starts is not None:
                h = h.index_add(0, starts.index, self._refill(starts, cache, max_position))  # + think at starts
            h = layers.norm(layers.run(h, t, cfg.num_layers, rope, bias, cache))
        return h

    def _refill(self, starts: CycleStarts, cache: Any, max_position: Optional[int]) -> torch.Tensor:
        """The encoding and thinking layers over the refill blocks; [R, 1, D] the roots' thinking output. The
        cache plan of the pass is restored afterwards."""
        cfg, runner = self.cfg, self.runner
        plan = cache.plan_
        r, tau = len(starts.rows), cfg.tau
        x = runner.embed_ids(starts.tokens)  # [R, tau, D]
        pos = starts.position_ids.expand(r, tau)
        causal = steps(tau, x.device)
        in_block = (causal[:, None] >= causal[None, :])[None]  # [1, tau, tau]
        window = runner.sliding_window
        uniform = starts.uniform if tau > 1 and window is None else None
        bias = attention_bias(in_block, None if uniform is not None else starts.slot0, pos, starts.view_len,
                              runner.dtype, window, uniform_len=uniform)
        write_at = starts.uniform if starts.uniform is not None else starts.slot0
        if starts.row0 is not None:
            cache.plan(starts.row0, r, starts.view_len, write_at)
        else:
            cache.plan(0, r, starts.view_len, write_at, rows=starts.index)
        try:
            rope = self.layers.rope(x, pos, max_position)
            x = self.refill_layers.run(x, 0, cfg.thinking_end, rope, bias, cache)
        finally:
            cache.plan_ = plan
        return x[:, -1:]
