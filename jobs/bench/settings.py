"""What `python -m jobs.bench` runs: the settings of the grid (`Setting`, `grid`) and the prompts (`Prompt`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from omegaconf import DictConfig

from .config import ATTENTION_OPTIONS, AUTO_METHODS, DMTD_METHODS, HYBRID_HEADS, OPTIONS, options_of

if TYPE_CHECKING:
    from .turns import Conversation

ALL = "all"  # the category of a record over every prompt
HF_METHODS = ("hf", "hf_compiled")  # Hugging Face generate: eager, and with a static cache and compiled forward


@dataclass(frozen=True)
class Setting:
    method: str
    block_complexity: Union[int, str]  # 1 for ar; "auto" = chosen per pass (esp, pld)
    num_masks: int  # 0 unless esp
    tree: str  # "" unless esp
    expansion: str = "top1"  # esp dynamic trees
    heads_path: str = ""  # cp_heads and hybrid+heads: directory of the trained heads
    eager: bool = False  # engine.cuda_graphs=false for this setting ("METHOD:BC:eager"): passes run eagerly
    compiled_graphs: bool = False  # engine.cuda_graphs_compile=true ("METHOD:BC:compiled_graphs")
    # with compiled_graphs: engine.compile_mode=max-autotune-no-cudagraphs ("METHOD:BC:compiled_graphs+autotune"),
    # Inductor's matrix-product kernels chosen by timing its candidates at each shape
    autotune: bool = False
    run_ahead: bool = False  # engine.cuda_graphs_run_ahead=true ("ar:1:run_ahead")
    # engine.cuda_graphs_run_ahead=false ("ar:1:no_run_ahead", "esp:30:no_run_ahead": every pass read at once)
    no_run_ahead: bool = False
    host_probe: bool = False  # engine.cuda_graphs_probe=false ("esp:BC:host_probe", hybrid: the probe on the host)
    eager_admission: bool = False  # engine.admission=eager ("METHOD:BC:eager_admission"): requests join at once
    logprobs: bool = False  # generation.logprobs=true ("METHOD:BC:logprobs"): what the log-probabilities cost
    no_prefix_cache: bool = False  # engine.prefix_cache_tokens=0 ("METHOD:BC:no_prefix_cache"): prompts prefilled whole
    # engine.attention_backend=cudnn / efficient / math / flex ("METHOD:BC:attention_math"; flex with compiled_graphs)
    attention_cudnn: bool = False
    attention_efficient: bool = False
    attention_math: bool = False
    attention_flex: bool = False
    dmtd_tau: int = 0  # dmtd / dmtd_verified: tokens per cycle
    # dmtd: the DMTD model directory ("" = the bench's own model, split by engine.dmtd_decoding_layers);
    # dmtd_verified: the trained copy's directory
    dmtd_path: str = ""

    @property
    def label(self) -> str:
        return self._label + (" eager" if self.eager else "") \
            + (" compiled graphs" if self.compiled_graphs else "") + (" autotuned" if self.autotune else "") \
            + (" run ahead" if self.run_ahead else "") \
            + (" no run ahead" if self.no_run_ahead else "") \
            + (" host probe" if self.host_probe else "") \
            + (" eager admission" if self.eager_admission else "") + (" logprobs" if self.logprobs else "") \
            + (" no prefix cache" if self.no_prefix_cache else "") \
            + (f" {self.attention} attention" if self.attention else "")

    @property
    def attention(self) -> str:
        """The engine.attention_backend this setting names ("" = the bench's own)."""
        return next((o.removeprefix("attention_") for o in ATTENTION_OPTIONS if getattr(self, o)), "")

    @property
    def _label(self) -> str:
        if self.method in DMTD_METHODS:
            return f"{self.family} tau{self.dmtd_tau}"
        if self.method in ("ar", *HF_METHODS):
            return {"ar": "ar", "hf": "hf generate", "hf_compiled": "hf generate compiled"}[self.method]
        if self.method == "esp":
            tree = self.tree if self.expansion == "top1" else f"{self.tree}-{self.expansion}"
            return f"esp k{self.num_masks} {tree} BC{self.block_complexity}"
        if self.heads_path:  # cp_heads, or hybrid with the heads as a proposer
            return f"{self.family} BC{self.block_complexity}"
        return f"{self.method} BC{self.block_complexity}"

    @property
    def family(self) -> str:
        """The label without the block complexity (one line in the speedup-vs-BC plot)."""
        if self.method in DMTD_METHODS:
            return self.method + (f" {Path(self.dmtd_path).name}" if self.dmtd_path else "")
        if self.heads_path:
            return f"{'cp_heads' if self.method == 'cp_heads' else 'hybrid+heads'} {Path(self.heads_path).name}"
        if self.method != "esp":
            return self.method
        return f"esp k{self.num_masks} {self.tree if self.expansion == 'top1' else self.tree + '-' + self.expansion}"


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]  # the prompt (of a multi-turn row: its first turn)
    params: dict[str, Any]
    conversation: Optional["Conversation"] = None  # a multi-turn row's turns (jobs/bench/turns.py)


def grid(bench: DictConfig, accelerator: bool = False) -> list[Setting]:
    """The settings to run, ar first. esp settings whose BC leaves no draft node are skipped.

    Example: methods [ar, pld, esp], BCs [10, 30], num_masks [1], trees [static] ->
    ar, pld BC10, pld BC30, esp k1 static BC10, esp k1 static BC30.
    With `bench.settings` (e.g. [pld:30, esp:auto]) exactly those: ar, pld BC30, esp k1 static BCauto; an entry
    METHOD:BC:eager runs with engine.cuda_graphs=false (ar:1:eager: the eager engine's ar beside the default's),
    METHOD:BC:compiled_graphs with engine.cuda_graphs_compile=true (METHOD:BC:compiled_graphs+autotune: and
    engine.compile_mode=max-autotune-no-cudagraphs), ar:1:run_ahead with engine.cuda_graphs_run_ahead=true, esp:BC:host_probe
    (hybrid:BC:host_probe) with engine.cuda_graphs_probe=false, METHOD:BC:eager_admission with engine.admission=eager,
    METHOD:BC:logprobs with every request asking for its tokens' log-probabilities, METHOD:BC:no_prefix_cache with
    engine.prefix_cache_tokens=0 (options join with
    "+": ar:1:compiled_graphs+run_ahead). dmtd:TAU runs
    each DMTD model of `bench.dmtd_paths` trained with that tau (none given: the bench's model, split by
    engine.dmtd_decoding_layers); dmtd_verified:TAU each trained copy there, drafting TAU - 1 tokens per pass.
    `hf generate compiled` follows `hf generate` when bench.hf_compiled is true, or auto on an accelerator.
    """
    hf_compiled = bench.hf_compiled is True or (bench.hf_compiled == "auto" and accelerator)
    out = [Setting("ar", 1, 0, "")] + ([Setting("hf", 1, 0, "")] if bench.hf_baseline else []) \
        + ([Setting("hf_compiled", 1, 0, "")] if hf_compiled else [])
    if bench.get("settings"):  # explicit "method:BC" list instead of the grid
        for spec in bench.settings:
            m, _, rest = str(spec).partition(":")
            bc, _, opt = rest.partition(":")
            bc = bc if bc == "auto" else int(bc)
            opts = {name: name in options_of(opt) for name in OPTIONS}
            if m in DMTD_METHODS:
                out.extend(dmtd_settings(m, int(bc), list(bench.get("dmtd_paths") or [])))
            elif m in ("cp_heads", HYBRID_HEADS):
                out.extend(Setting(m.partition("+")[0], bc, 0, "", heads_path=h, **opts) for h in bench.heads_paths)
            elif m == "esp":
                out.append(Setting(m, bc, bench.num_masks[0], bench.trees[0], bench.expansions[0], **opts))
            else:
                out.append(Setting(m, bc, 0, "", **opts))
        return out
    for m in bench.methods:
        if m == "ar":
            continue
        for bc in bench.block_complexities:
            if bc == "auto" and m not in AUTO_METHODS:
                continue  # auto sizing needs the drafter's own acceptance estimate
            if m == "cp_heads":
                out.extend(Setting(m, bc, 0, "", heads_path=h) for h in bench.heads_paths)
                continue
            if m != "esp":
                out.append(Setting(m, bc, 0, ""))
                continue
            for k in bench.num_masks:
                for tree in bench.trees:
                    if bc != "auto" and bc < 2 * (k + 1):
                        continue
                    # expansion only matters for dynamic trees with k >= 2 (with k = 1 every node is a root child)
                    for exp in (bench.expansions if tree == "dynamic" and k >= 2 else ["top1"]):
                        out.append(Setting(m, bc, k, tree, exp))
    return out


def dmtd_kind(path: str) -> str:
    """What a `bench.dmtd_paths` directory holds: "dmtd_verified" (a trained copy, dmtd_draft.json), "dmtd" (a DMTD
    model, its config.json with mtp_horizon), or "" (neither)."""
    import json

    p = Path(path)
    if (p / "dmtd_draft.json").is_file():
        return "dmtd_verified"
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return "dmtd" if "mtp_horizon" in raw else ""


def trained_tau(path: str) -> int:
    """The cycle length a DMTD model directory (or copy) was trained with (0 when unknown)."""
    import json

    p = Path(path)
    for name in ("dmtd_draft.json", "config.json"):
        try:
            return int(json.loads((p / name).read_text()).get("mtp_horizon") or 0)
        except (OSError, ValueError):
            continue
    return 0


def dmtd_settings(method: str, tau: int, paths: list[str]) -> list[Setting]:
    """dmtd:TAU -> the DMTD models of `paths` trained with tau TAU (none given: the bench's own model);
    dmtd_verified:TAU -> every trained copy of `paths`, at TAU."""
    mine = [p for p in paths if dmtd_kind(p) == method]
    if method == "dmtd":
        if not paths:
            return [Setting(method, tau, 0, "", dmtd_tau=tau)]
        mine = [p for p in mine if trained_tau(p) == tau]
    return [Setting(method, tau, 0, "", dmtd_tau=tau, dmtd_path=p) for p in mine]


def check_dmtd_paths(b: DictConfig) -> None:
    """The directories of bench.dmtd_paths and what the dmtd settings find there (read when the bench starts, before
    the model loads; the config alone names no file). Raises ConfigError."""
    from ..config import ConfigError

    for p in b.dmtd_paths:
        if not dmtd_kind(p):
            raise ConfigError(f"bench.dmtd_paths: {p!r} is neither a DMTD model (config.json with mtp_horizon) nor a "
                              "trained copy (dmtd_draft.json); give directories written by esp-batch train-dmtd")
    for spec in b.settings:
        method, _, tau = str(spec).partition(":")
        if method in DMTD_METHODS and not dmtd_settings(method, int(tau), list(b.dmtd_paths)):
            raise ConfigError(f"bench.settings: {spec!r} matches none of bench.dmtd_paths (dmtd: DMTD models trained "
                              "with that tau; dmtd_verified: trained copies)")
