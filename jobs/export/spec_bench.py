"""A job's rows as a Spec-Bench answer file (github hemingkx/Spec-Bench, `data/spec_bench/model_answer/*.jsonl`).

One JSON line per answered question, as Spec-Bench's `evaluation/eval.py` writes them and its `speed.py` and
`equal.py` read them:

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "...", "tstamp": 1.7e9,
     "choices": [{"index": 0, "turns": [answer, ...], "decoding_steps": [...], "new_tokens": [...],
                  "wall_time": [...], "accept_lengths": [...]}]}

turns, decoding_steps, new_tokens and wall_time hold one entry per turn; accept_lengths one per decode pass over
all turns. A row with generation.n > 1 samples gives one choice per sample, in order (FastChat's num_choices).
Our terms: decoding_steps = decode passes (the prefill, which gives each turn's first token, is not one),
accept_lengths = tokens each decode pass committed (bonus included), so their mean is the job's tau;
wall_time = the turn's seconds from admission to finish. Answers are stripped of surrounding whitespace, as
Spec-Bench's eval.py writes them. Rows with an error are left out (counted by the caller); lines are sorted by
question_id, restored to the input's id type when every input id was an int (`input_id_types` in _summary.json).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

# the output columns an answer is made of
COLUMNS = ["id", "category", "generated_text", "generated_turns", "turn_generated_tokens", "turn_time_s",
           "turn_decode_passes", "committed_per_pass", "error", "samples"]
PER_TURN = ("turn_generated_tokens", "turn_time_s", "turn_decode_passes", "committed_per_pass")
NO_CATEGORY = "(none)"


@dataclass
class Answers:
    """Answer records built from output rows; error rows are counted, not written."""

    model_id: str
    int_ids: bool  # every input id was an int: question_id goes back to int
    tstamp: float
    salt: str = ""  # the job's config hash: answer ids differ between jobs, not between exports of one job
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # ids of error rows

    def add(self, row: dict[str, Any]) -> None:
        if row.get("error") is not None:
            self.skipped.append(row["id"])
            return
        samples = row.get("samples") or [{"text": row.get("generated_text"), "turns": row.get("generated_turns"),
                                          **{k: row[k] for k in PER_TURN}}]
        self.records.append({
            "question_id": self.question_id(row["id"]),
            "category": row.get("category") if row.get("category") is not None else NO_CATEGORY,
            "answer_id": hashlib.sha1(f"{self.salt}:{row['id']}".encode()).hexdigest()[:22],
            "model_id": self.model_id,
            "choices": [{
                "index": i,
                "turns": [a.strip() for a in sample.get("turns") or [sample.get("text") or ""]],
                "decoding_steps": list(sample["turn_decode_passes"]),
                "new_tokens": list(sample["turn_generated_tokens"]),
                "wall_time": list(sample["turn_time_s"]),
                "accept_lengths": list(sample["committed_per_pass"]),
            } for i, sample in enumerate(samples)],
            "tstamp": self.tstamp,
        })

    def question_id(self, rid: str) -> Union[int, str]:
        return int(rid) if self.int_ids else rid

    def sorted(self) -> list[dict[str, Any]]:
        """The records in question_id order (numeric for int ids)."""
        return sorted(self.records, key=lambda r: r["question_id"])


def missing_columns(names: Iterable[str]) -> list[str]:
    """The per-turn columns an answer needs that a part lacks (written before esp-batch kept them)."""
    have = set(names)
    return [c for c in PER_TURN if c not in have]


def default_model_id(summary: Optional[dict[str, Any]]) -> str:
    """<model directory or hub name>-<method>, e.g. esp-tiny-llama-esp (Spec-Bench's model_id names a method too)."""
    if not summary:
        return "esp-batch"
    model = str(summary.get("model") or "model").rstrip("/").rsplit("/", 1)[-1]
    return f"{model}-{summary.get('method') or 'unknown'}"


def int_ids(summary: Optional[dict[str, Any]]) -> bool:
    return bool(summary) and summary.get("input_id_types") == ["int"]
