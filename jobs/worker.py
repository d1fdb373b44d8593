"""The shard worker: holds one engine and turns a shard of JobRows into an output table.

A plain class (testable without Ray); `jobs.runner` wraps it with `ray.remote`. Heavy imports (torch,
transformers, the engine) happen in `__init__`, inside the actor process.

Multi-turn rows are answered turn by turn: round r sends turn r of every row still going, with the
row's earlier turns and answers in context, so a shard of Spec-Bench rows needs max(turns) rounds.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from .rows import JobRow
from .schema import CATEGORY, to_table


@dataclass
class WorkerSpec:
    """Everything an actor needs, picklable."""

    model: dict[str, Any]  # ModelConfig fields
    engine: dict[str, Any]  # EngineConfig fields
    generation: dict[str, Any]  # GenerationParams defaults from generation.*
    chat_template: str  # auto | always | never
    chat_template_kwargs: dict[str, Any]
    schema: pa.Schema
    torch_threads: int
    fault_dir: str  # where fault-injection attempt markers live
    kill_shard: int = -1
    kill_attempts: int = 0


@dataclass
class _RowState:
    row: JobRow
    history: list[dict[str, str]] = field(default_factory=list)  # messages so far (turns input)
    answers: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    stats: Any = None  # RequestStats merged over turns
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    def next_turn(self) -> Optional[int]:
        """Index of the next turn to answer, or None when done."""
        if self.error is not None:
            return None
        needed = len(self.row.input) if self.row.kind == "turns" else 1
        return len(self.answers) if len(self.answers) < needed else None


class ShardWorker:
    def __init__(self, spec: WorkerSpec):
        import torch

        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.load_error: Optional[str] = None
        try:
            from esp_worker import Engine, EngineConfig, ModelConfig

            from .prompts import PromptBuilder

            self.engine = Engine.from_config(ModelConfig(**spec.model), EngineConfig(**spec.engine))
            self.prompts = PromptBuilder(self.engine.tokenizer, spec.chat_template, spec.chat_template_kwargs)
        except Exception as exc:  # reported by info(): the driver prints it as one line and stops
            text = str(exc).strip()
            self.load_error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

    def info(self) -> dict[str, Any]:
        """Load status and where this actor runs."""
        if self.load_error is not None:
            return {"error": self.load_error}
        return {
            "error": None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "max_context": self.engine.loaded.max_context,
            "chat_template": self.prompts.use_template,
        }

    def run_shard(self, shard_index: int, rows: list[JobRow]) -> pa.Table:
        """One output row per input row, in input order."""
        from esp_worker import RequestStats

        states = [_RowState(row=r, stats=RequestStats(), error=r.error) for r in rows]
        first_round = True
        while True:
            pending = {s.row.id: s for s in states if s.next_turn() is not None}
            if not pending:
                break
            requests = [req for s in pending.values() if (req := self._request(s)) is not None]
            for n, out in enumerate(self.engine.generate_iter(requests)):
                if first_round and n == 0:
                    self._maybe_die(shard_index)
                self._absorb(pending[out.id], out)
            first_round = False
        return to_table([self._record(s) for s in states], self.spec.schema)

    def _request(self, s: _RowState) -> Any:
        """The engine request for the row's next turn; None (with s.error set) if it cannot be built."""
        from esp_worker import GenerationParams, Request

        row = s.row
        try:
            if row.kind == "prompt":
                ids = self.prompts.prompt_ids(row.input)
            elif row.kind == "messages":
                ids = self.prompts.chat_ids(list(row.input))
            else:
                s.history.append({"role": "user", "content": row.input[len(s.answers)]})
                ids = self.prompts.chat_ids(s.history)
            params = GenerationParams(**{**self.spec.generation, **row.params})
        except Exception as exc:  # tokenizer or template failure on this row's content
            s.error = f"cannot build the prompt: {type(exc).__name__}: {str(exc).strip()[:200]}"
            return None
        s.num_prompt_tokens += len(ids)
        return Request(id=row.id, prompt_ids=ids, params=params)

    def _absorb(self, s: _RowState, out: Any) -> None:
        s.stats = s.stats.merge(out.stats)
        if out.error is not None:
            s.error = out.error
            return
        s.answers.append(out.text)
        s.token_ids.extend(out.token_ids)
        s.finish_reason = out.finish_reason
        if s.row.kind == "turns":
            s.history.append({"role": "assistant", "content": out.text})

    def _record(self, s: _RowState) -> dict[str, Any]:
        st = s.stats
        tau = st.tau
        rec = {
            "id": s.row.id,
            "generated_text": s.answers[-1] if s.answers else None,
            "generated_turns": s.answers if s.row.kind == "turns" else None,
            "generated_token_ids": s.token_ids if s.answers else None,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_generated_tokens": len(s.token_ids),
            "finish_reason": s.finish_reason if s.error is None else None,
            "method": self.spec.engine["method"],
            "num_decode_passes": st.num_decode_passes,
            "num_decode_tokens": st.num_decode_tokens,
            "num_drafted_tokens": st.num_drafted_tokens,
            "num_accepted_drafts": st.num_accepted_drafts,
            "accepted_per_depth": list(st.accepted_per_depth),
            "tau": tau if tau is not None and math.isfinite(tau) else None,
            "time_s": st.time_s,
            "error": s.error,
            CATEGORY: s.row.category,
        }
        rec.update({k: v for k, v in s.row.carry.items() if k not in rec})
        return rec

    def _maybe_die(self, shard_index: int) -> None:
        """Fault injection: exit the process mid-shard on the first `kill_attempts` attempts."""
        if shard_index != self.spec.kill_shard:
            return
        markers = Path(self.spec.fault_dir)
        markers.mkdir(parents=True, exist_ok=True)
        attempt = len(list(markers.glob(f"shard-{shard_index}.attempt-*"))) + 1
        if attempt <= self.spec.kill_attempts:
            (markers / f"shard-{shard_index}.attempt-{attempt}").touch()
            os._exit(1)

