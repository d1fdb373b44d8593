"""Job-level totals accumulated from output tables: rows, errors, tokens, tau (overall and per category).

Counters only; ratios are derived when reporting. tau = decode tokens / decode passes over all rows,
so long answers weigh more than short ones (as in the per-request definition).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from .schema import CATEGORY

COLUMNS = ["error", "num_prompt_tokens", "num_generated_tokens", "num_decode_tokens", "num_decode_passes", "plt"]


def _sum(table: pa.Table, name: str) -> int:
    """Sum of a counter column; 0 when a part lacks it (a part the job did not write)."""
    return int(pc.sum(table[name]).as_py() or 0) if name in table.column_names else 0


@dataclass
class Group:
    """Counters of one category (or all rows). Ratios are derived when reporting. The one counter record
    of the job's totals (`Totals`, `_summary.json`) and of the job report (`jobs.report.JobStats`)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0
    decode_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    ok_tokens: int = 0  # generated tokens of rows without error (tokens/s per request)
    ok_time_s: float = 0.0

    @property
    def tau(self) -> Optional[float]:
        return self.decode_tokens / self.decode_passes if self.decode_passes else None

    @property
    def request_tokens_per_s(self) -> Optional[float]:
        return self.ok_tokens / self.ok_time_s if self.ok_time_s else None


@dataclass
class Totals(Group):
    """Group counters over whole tables (vectorised), plus rows / decode tokens / passes per category."""

    per_category: dict[str, Group] = field(default_factory=dict)
    plt_tokens: float = 0.0  # dmtd: sum of plt x decode tokens (layers run / the model's layers) over rows with a plt
    plt_decode_tokens: int = 0  # their decode tokens

    @property
    def plt(self) -> Optional[float]:
        """dmtd: the job's layers per token / the model's layers (rows weighted by their decode tokens)."""
        return self.plt_tokens / self.plt_decode_tokens if self.plt_decode_tokens else None

    def add(self, table: pa.Table) -> None:
        """Add a table holding (some of) COLUMNS, and `category` when the job has one."""
        self.rows += table.num_rows
        if "error" in table.column_names:
            self.errors += table.num_rows - table["error"].null_count
        self.prompt_tokens += _sum(table, "num_prompt_tokens")
        self.generated_tokens += _sum(table, "num_generated_tokens")
        self.decode_tokens += _sum(table, "num_decode_tokens")
        self.decode_passes += _sum(table, "num_decode_passes")
        if {"plt", "num_decode_tokens"} <= set(table.column_names):
            for plt, tokens in zip(table["plt"].to_pylist(), table["num_decode_tokens"].to_pylist()):
                if plt is not None and tokens:
                    self.plt_tokens += plt * tokens
                    self.plt_decode_tokens += tokens
        if not {CATEGORY, "num_decode_tokens", "num_decode_passes"} <= set(table.column_names):
            return
        for cat, tokens, passes in zip(
            table[CATEGORY].to_pylist(), table["num_decode_tokens"].to_pylist(), table["num_decode_passes"].to_pylist()
        ):
            g = self.per_category.setdefault("(none)" if cat is None else cat, Group())
            g.decode_tokens += tokens or 0
            g.decode_passes += passes or 0
            g.rows += 1

    def tau_per_category(self) -> dict[str, dict[str, Any]]:
        """{category: rows, tau and its counts}: groups of categories (Spec-Bench's mt_bench) pool as
        sum(decode_tokens) / sum(decode_passes)."""
        return {cat: {"rows": g.rows, "tau": g.tau, "decode_tokens": g.decode_tokens, "decode_passes": g.decode_passes}
                for cat, g in sorted(self.per_category.items())}
