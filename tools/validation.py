"""Turn jsonschema and pydantic validation errors into short messages a model can act on."""

from __future__ import annotations

import difflib
import math
from typing import Any

import jsonschema
import pydantic

MAX_ERRORS = 5


def _where(path: Any) -> str:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else "(top level)"


def jsonschema_errors(validator: jsonschema.Draft202012Validator, args: dict[str, Any]) -> list[str]:
    """All schema violations of ``args`` (at most ``MAX_ERRORS``), each naming the offending field."""
    messages: list[str] = []
    for error in sorted(validator.iter_errors(args), key=lambda e: (list(map(str, e.path)), e.message)):
        if error.validator == "additionalProperties":
            known = list(error.schema.get("properties", {}))
            extra = sorted(set(error.instance) - set(known))
            allowed = ", ".join(known) or "(none)"
            hints = [f"'{key}' to '{close[0]}'" for key in extra if (close := _close(key, known))]
            hint = f"; rename {', '.join(hints)}" if hints else ""
            messages.append(f"unexpected field(s) {', '.join(map(repr, extra))} (allowed: {allowed}){hint}")
        elif error.validator == "required":
            messages.append(f"missing required field {error.message.split(' is a required')[0]}")
        else:
            messages.append(f"field '{_where(error.absolute_path)}': {_short(error.message)}")
        if len(messages) >= MAX_ERRORS:
            break
    return messages


def non_finite_errors(args: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Numbers in ``args`` that are NaN or infinite (Python's JSON reader accepts ``NaN`` and ``Infinity``, and a
    NaN passes every ``minimum``/``maximum`` check: ``min(nan, cap)`` is NaN). At most ``MAX_ERRORS``."""
    found: list[str] = []
    if isinstance(args, float) and not math.isfinite(args):
        found.append(f"field '{_where(path)}': {args!r} is not a finite number")
    elif isinstance(args, dict):
        for key, value in args.items():
            found += non_finite_errors(value, (*path, str(key)))
    elif isinstance(args, list):
        for index, value in enumerate(args):
            found += non_finite_errors(value, (*path, str(index)))
    return found[:MAX_ERRORS]


def _close(key: str, known: list[str]) -> list[str]:
    """A known name close to ``key``: spelling (difflib) or containment (``file_path`` → ``path``)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close
    return [name for name in known if name in key or key in name][:1]


def pydantic_errors(exc: pydantic.ValidationError) -> list[str]:
    """Pydantic errors (constraints the JSON schema could not express) as ``field 'x': message`` strings."""
    return [f"field '{_where(err['loc'])}': {err['msg']}" for err in exc.errors()[:MAX_ERRORS]]


def _short(message: str, limit: int = 200) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _type_of(schema: dict[str, Any]) -> str:
    if "type" in schema:
        kind = schema["type"]
        if kind == "array" and isinstance(schema.get("items"), dict):
            return f"array of {_type_of(schema['items'])}"
        return " or ".join(kind) if isinstance(kind, list) else str(kind)
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type_of(option) for option in schema[key])
    if "$ref" in schema:
        return "object"
    return "any"


def describe_parameters(parameters: dict[str, Any]) -> str:
    """One line listing the expected parameters, e.g. ``Expected: path (string, required), start_line (integer)``."""
    props: dict[str, Any] = parameters.get("properties", {})
    if not props:
        return "This tool takes no arguments: send {}."
    required = set(parameters.get("required", []))
    items = [f"{key} ({_type_of(value)}{', required' if key in required else ''})" for key, value in props.items()]
    return "Expected: " + ", ".join(items) + "."
