"""What `python -m jobs.bench` runs: the settings of the grid (`Setting`, `grid`) and the prompts (`Prompt`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from omegaconf import DictConfig

from .config import AUTO_METHODS, HYBRID_HEADS

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
    compile_host: bool = False  # engine.compile_host for this setting ("METHOD:BC:compile_host")
    eager: bool = False  # engine.cuda_graphs=false for this setting ("METHOD:BC:eager"): passes run eagerly

    @property
    def label(self) -> str:
        return self._label + (" compile_host" if self.compile_host else "") + (" eager" if self.eager else "")

    @property
    def _label(self) -> str:
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
        if self.heads_path:
            return f"{'cp_heads' if self.method == 'cp_heads' else 'hybrid+heads'} {Path(self.heads_path).name}"
        if self.method != "esp":
            return self.method
        return f"esp k{self.num_masks} {self.tree if self.expansion == 'top1' else self.tree + '-' + self.expansion}"


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]
    params: dict[str, Any]


def grid(bench: DictConfig, accelerator: bool = False) -> list[Setting]:
    """The settings to run, ar first. esp settings whose BC leaves no draft node are skipped.

    Example: methods [ar, pld, esp], BCs [10, 30], num_masks [1], trees [static] ->
    ar, pld BC10, pld BC30, esp k1 static BC10, esp k1 static BC30.
    With `bench.settings` (e.g. [pld:30, esp:auto]) exactly those: ar, pld BC30, esp k1 static BCauto; an entry
    METHOD:BC:compile_host runs with engine.compile_host=true (ar:1:compile_host: ar so), METHOD:BC:eager with
    engine.cuda_graphs=false (ar:1:eager: the eager engine's ar beside the default's).
    `hf generate compiled` follows `hf generate` when bench.hf_compiled is true, or auto on an accelerator.
    """
    hf_compiled = bench.hf_compiled is True or (bench.hf_compiled == "auto" and accelerator)
    out = [Setting("ar", 1, 0, "")] + ([Setting("hf", 1, 0, "")] if bench.hf_baseline else []) \
        + ([Setting("hf_compiled", 1, 0, "")] if hf_compiled else [])
    if bench.get("settings"):  # explicit "method:BC" list instead of the grid
        for spec in bench.settings:
            m, _, rest = str(spec).partition(":")
            bc, _, opt = rest.partition(":")
            bc, ch, eager = (bc if bc == "auto" else int(bc)), opt == "compile_host", opt == "eager"
            if m in ("cp_heads", HYBRID_HEADS):
                out.extend(Setting(m.partition("+")[0], bc, 0, "", heads_path=h, compile_host=ch, eager=eager)
                           for h in bench.heads_paths)
            elif m == "esp":
                out.append(Setting(m, bc, bench.num_masks[0], bench.trees[0], bench.expansions[0], compile_host=ch,
                                   eager=eager))
            else:
                out.append(Setting(m, bc, 0, "", compile_host=ch, eager=eager))
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
