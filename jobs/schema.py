"""The output Parquet schema and building a part's Arrow table from per-row records."""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

# Required columns, in file order. Counters of a multi-turn row are sums over its turns.
BASE_FIELDS = [
    pa.field("id", pa.string(), nullable=False),
    pa.field("generated_text", pa.string()),  # turns input: the last answer
    pa.field("generated_turns", pa.list_(pa.string())),  # turns input: every answer; null otherwise
    pa.field("generated_token_ids", pa.list_(pa.int32())),  # turns input: all answers' tokens, concatenated
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_generated_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),  # stop | length | context; null on error
    pa.field("method", pa.string()),
    pa.field("num_decode_passes", pa.int64()),
    pa.field("num_decode_tokens", pa.int64()),  # tokens committed by decode passes (tau's numerator)
    pa.field("num_drafted_tokens", pa.int64()),
    pa.field("num_accepted_drafts", pa.int64()),
    pa.field("accepted_per_depth", pa.list_(pa.int32())),  # [depth] passes whose accepted path reached depth+1
    pa.field("tau", pa.float64()),  # mean tokens committed per decode pass; null without decode passes
    pa.field("time_s", pa.float64()),  # seconds from the request's admission to its finish
    pa.field("error", pa.string()),  # null when fine
]
CATEGORY = "category"


def carry_types(names: list[str], schema: Optional[pa.Schema], sample: list[dict[str, Any]]) -> dict[str, pa.DataType]:
    """Arrow type of each carried column: from the input schema when it has one, else inferred from
    `sample` rows (string when every sampled value is null or the values do not share a type)."""
    types: dict[str, pa.DataType] = {}
    for name in names:
        if schema is not None and name in schema.names:
            types[name] = schema.field(name).type
            continue
        try:
            inferred = pa.array([row.get(name) for row in sample]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            inferred = pa.string()
        types[name] = pa.string() if pa.types.is_null(inferred) else inferred
    return types


def output_schema(has_category: bool, carry: dict[str, pa.DataType]) -> pa.Schema:
    extra = [pa.field(CATEGORY, pa.string())] if has_category else []
    extra += [pa.field(name, typ) for name, typ in carry.items() if name not in (CATEGORY, *(f.name for f in BASE_FIELDS))]
    return pa.schema(BASE_FIELDS + extra)


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
    """Values as `typ`; a value that does not convert (wrong type, invalid UTF-8) becomes null."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
        out = []
        for v in values:
            try:
                pa.array([v], type=typ)
                out.append(v)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
                out.append(None)
        return pa.array(out, type=typ)


def to_table(records: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Records (dicts keyed by column name; missing keys are null) as a table with exactly `schema`."""
    columns = [_column([r.get(f.name) for r in records], f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)
