"""Normalise raw input rows into JobRows: id, input kind and value, per-row params, category, carried columns.

Problems with a row's content (null, wrong type, empty, invalid UTF-8, bad params) are recorded in
`JobRow.error` so the row still gets an output row; nothing here raises on row content.

Duplicate ids: the first row with an id is kept, later rows with the same id are dropped (counted in
the summary as `duplicates_dropped`), so the output has every id exactly once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from esp_worker import GenerationParams

from ..io.sources import ERROR_KEY

INPUT_COLUMNS = ("prompt", "messages", "turns")  # detected in this order when data.prompt_column is ""
PARAM_KEYS = frozenset(f.name for f in fields(GenerationParams))


@dataclass
class JobRow:
    id: str
    kind: Optional[str]  # prompt | messages | turns; None when error is set
    # prompt: str; messages: [{"role", "content"}, ...]; turns: [str, ...]
    input: Any
    params: dict[str, Any] = field(default_factory=dict)  # per-row overrides of generation.*
    category: Optional[str] = None
    carry: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def derived_id(position: int, value: Any) -> str:
    """Deterministic id for a row without one: its input position and a hash of its input.

    >>> derived_id(3, "hi")
    'row-000003-1e639e49'
    """
    blob = json.dumps(value, sort_keys=True, ensure_ascii=True, default=repr)
    return f"row-{position:06d}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _clean_id(value: Any) -> Optional[str]:
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = value if isinstance(value, str) else str(value)
    # A lone surrogate cannot be written to Parquet: escape it (deterministically) instead.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def input_problem(value: Any) -> tuple[Optional[str], Optional[str]]:
    """(kind, error) of an input value: a prompt string, chat messages, or turns."""
    if value is None:
        return None, "input is null"
    if isinstance(value, str):
        if not _utf8_ok(value):
            return None, "input text is not valid UTF-8 (lone surrogate or undecodable bytes)"
        return ("prompt", None) if value.strip() else (None, "empty prompt")
    if isinstance(value, (list, tuple)):
        if not value:
            return None, "input is an empty list"
        if all(isinstance(t, str) for t in value):
            if not all(_utf8_ok(t) for t in value):
                return None, "a turn is not valid UTF-8 (lone surrogate or undecodable bytes)"
            if not all(t.strip() for t in value):
                return None, "a turn is empty"
            return "turns", None
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
            if not all(_utf8_ok(m["content"]) and _utf8_ok(m["role"]) for m in value):
                return None, "a message is not valid UTF-8 (lone surrogate or undecodable bytes)"
            return "messages", None
        return None, "input list must hold only strings (turns) or only {role, content} messages"
    return None, f"input has type {type(value).__name__}; expected a string, chat messages or a list of turns"


def parse_params(value: Any) -> tuple[dict[str, Any], Optional[str]]:
    """Per-row generation overrides from a dict (or a JSON object string, e.g. from CSV)."""
    if value is None or value == "":
        return {}, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}, "params is not a JSON object"
    if not isinstance(value, dict):
        return {}, f"params has type {type(value).__name__}; expected an object"
    params = {k: v for k, v in value.items() if v is not None}  # parquet structs give None for unset fields
    # one string is one stop string (not its characters); one id is one stop id
    if isinstance(params.get("stop_strings"), str):
        params["stop_strings"] = [params["stop_strings"]]
    if isinstance(params.get("stop_token_ids"), int):
        params["stop_token_ids"] = [params["stop_token_ids"]]
    unknown = sorted(set(params) - PARAM_KEYS)
    if unknown:
        return {}, f"unknown params key(s) {', '.join(unknown)}; known: {', '.join(sorted(PARAM_KEYS))}"
    return params, None


class RowNormalizer:
    """Turns raw rows (in input order) into JobRows; keeps the set of ids seen to drop duplicates."""

    def __init__(self, id_column: str, prompt_column: str, params_column: str, category_column: str,
                 carry_columns: list[str]):
        self.id_column = id_column
        self.prompt_column = prompt_column
        self.params_column = params_column
        self.category_column = category_column
        self.carry_columns = list(carry_columns)
        self.seen: set[str] = set()
        self.duplicates_dropped = 0
        # Python types of the input's ids (int, str, ...; "derived" for rows without one): the output's id column
        # is a string, and an exporter gives ids back their input type (Spec-Bench's question_id is an int)
        self.id_types: set[str] = set()

    def input_value(self, raw: dict[str, Any]) -> tuple[Any, Optional[str]]:
        """(value, error) of the row's input column."""
        if self.prompt_column:
            if self.prompt_column not in raw:
                return None, f"input column {self.prompt_column!r} is missing"
            return raw[self.prompt_column], None
        present = [c for c in INPUT_COLUMNS if c in raw]
        if not present:
            return None, f"no input column: expected one of {', '.join(INPUT_COLUMNS)} (or set data.prompt_column)"
        for c in present:
            if raw[c] is not None:
                return raw[c], None
        return None, None

    def __call__(self, position: int, raw: dict[str, Any]) -> Optional[JobRow]:
        """The JobRow for the row at `position`, or None when its id was seen before (dropped)."""
        value, error = (None, raw[ERROR_KEY]) if ERROR_KEY in raw else self.input_value(raw)
        given = _clean_id(raw.get(self.id_column))
        row_id = given or derived_id(position, value)
        if row_id in self.seen:
            self.duplicates_dropped += 1
            return None
        self.seen.add(row_id)
        self.id_types.add(type(raw[self.id_column]).__name__ if given else "derived")
        kind = None
        if error is None:
            kind, error = input_problem(value)
        params, params_error = parse_params(raw.get(self.params_column))
        category = raw.get(self.category_column)
        return JobRow(
            id=row_id,
            kind=kind if error is None and params_error is None else None,
            input=value if error is None else None,
            params=params,
            category=None if category is None else str(category),
            carry={c: raw.get(c) for c in self.carry_columns},
            error=error or params_error,
        )


def shard_fingerprint(rows: list[JobRow]) -> str:
    """sha256 (16 hex) of a shard's normalised rows (ids, inputs, params, categories, carried values, row
    errors), in order: equal fingerprints mean the shard's part would be generated from the same input."""
    h = hashlib.sha256()
    for r in rows:
        blob = [r.id, r.kind, r.input, r.params, r.category, r.carry, r.error]
        h.update(json.dumps(blob, sort_keys=True, ensure_ascii=True, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]
