"""Decoding argument values written as text (XML-style formats), guided by the tool's JSON Schema when known."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any


def property_types(tools: Sequence[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """``{param: schema type}`` for tool ``name`` from OpenAI-style tool schemas; empty when unknown."""
    for tool in tools or ():
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {key: spec.get("type") for key, spec in props.items() if isinstance(spec, dict)}
    return {}


def _types(schema_type: Any) -> set[str]:
    if isinstance(schema_type, str):
        return {schema_type}
    if isinstance(schema_type, list):
        return {t for t in schema_type if isinstance(t, str)}
    return set()


def convert_value(raw: str, schema_type: Any = None) -> Any:
    """Turn the text of one argument into a value.

    A ``string`` parameter keeps its text exactly. Other declared types are read as JSON (falling back to a
    Python literal, as templates render ``True``/``None`` with ``|string``); the raw text is returned when that
    fails, so schema validation reports the problem to the model. Without a schema, JSON-looking text is decoded.
    """
    types = _types(schema_type)
    if types == {"string"}:
        return raw
    text = raw.strip()
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "null" in types and text.lower() in ("null", "none"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        if not types:
            return raw
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return raw
    if not types and isinstance(value, str):
        return raw
    if "string" in types and not isinstance(value, (dict, list)) and not ({"integer", "number"} & types):
        return raw
    return value
