"""Turn a typed Python function into a pydantic argument model and a strict JSON Schema.

The description comes from the docstring text before its first section; parameter descriptions come from a
Google-style ``Args:`` section (``name: text`` or ``name (type): text``, continuation lines indented) or from
reST ``:param name: text`` fields. Parameters annotated ``ToolContext`` are excluded: the registry passes them.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from freetoken_agent.tools.context import ToolContext

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|Attributes|See Also)\s*:?\s*$",
    re.IGNORECASE,
)
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_REST_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


@dataclass(frozen=True)
class ParsedDoc:
    """A docstring split into the tool description and per-parameter descriptions."""

    description: str
    params: dict[str, str]


def parse_docstring(doc: str | None) -> ParsedDoc:
    """Split ``doc`` into a description (text before the first section) and parameter descriptions."""
    if not doc:
        return ParsedDoc("", {})
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for raw in lines:
        stripped = raw.strip()
        rest = _REST_PARAM.match(stripped)
        if rest:
            section, current = "rest", rest.group(1)
            params[current] = rest.group(2).strip()
            continue
        if stripped.startswith(":") and section in (None, "rest"):
            section, current = "rest-other", None  # :returns:, :raises: ...
            continue
        header = _SECTION.match(stripped)
        if header and not raw.startswith((" ", "\t")):
            name = header.group(1).lower()
            section = "args" if name in ("args", "arguments", "parameters", "params") else "other"
            current, arg_indent = None, None
            continue
        if section is None:
            description.append(stripped)
        elif section == "args":
            if not stripped:
                continue
            indent = len(raw) - len(raw.lstrip())
            match = _ARG_LINE.match(stripped)
            if match and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1)
                params[current] = match.group(2).strip()
            elif current is not None:
                params[current] = f"{params[current]} {stripped}".strip()
        elif section == "rest" and current is not None and stripped:
            params[current] = f"{params[current]} {stripped}".strip()
    text = "\n".join(description).strip()
    text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)  # unwrap paragraphs, keep blank-line breaks
    return ParsedDoc(text, params)


def _is_context(annotation: Any) -> bool:
    if annotation is ToolContext:
        return True
    origin = typing.get_origin(annotation)
    if origin is not None:
        return any(arg is ToolContext for arg in typing.get_args(annotation))
    return False


@dataclass(frozen=True)
class Signature:
    """What the registry needs to call a function: its argument model, schema and where the context goes."""

    model: type[pydantic.BaseModel]
    parameters: dict[str, Any]
    context_param: str | None
    description: str


def build_signature(fn: Callable[..., Any], name: str, description: str | None = None) -> Signature:
    """Build the argument model and JSON schema for ``fn``. Raises ``TypeError`` for unsupported signatures."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # unresolved forward references: report which function
        raise TypeError(f"tool {name!r}: cannot resolve type hints ({exc})") from exc
    doc = parse_docstring(inspect.getdoc(fn))
    fields: dict[str, Any] = {}
    context_param: str | None = None
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args/**kwargs parameters are not supported ({param.name})")
        if param.name in ("self", "cls") and param.annotation is inspect.Parameter.empty:
            continue
        annotation = hints.get(param.name, Any)
        if _is_context(annotation):
            context_param = param.name
            continue
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(f"tool {name!r}: positional-only parameter {param.name!r} is not supported")
        default = ... if param.default is inspect.Parameter.empty else param.default
        info = pydantic.Field(default=default, description=doc.params.get(param.name))
        fields[param.name] = (annotation, info)
    model_name = "".join(part.capitalize() for part in re.split(r"\W+|_", name) if part) + "Args"
    try:
        model = pydantic.create_model(  # type: ignore[call-overload]
            model_name or "ToolArgs", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        parameters = _clean_schema(model.model_json_schema())
    except pydantic.PydanticUserError as exc:  # a parameter type with no JSON form
        first = str(exc).splitlines()[0]
        raise TypeError(f"tool {name!r}: a parameter type cannot be expressed as JSON Schema ({first})") from exc
    text = description if description is not None else doc.description
    return Signature(model=model, parameters=parameters, context_param=context_param, description=text)


_KEY_ORDER = {key: rank for rank, key in enumerate(("type", "description", "enum", "items", "properties", "default"))}


def _merge_nullable(node: dict[str, Any]) -> None:
    """``anyOf: [{type: T, ...}, {type: null}]`` → ``type: [T, "null"]``: simpler for models and text-format parsers."""
    options = node.get("anyOf")
    if not isinstance(options, list) or len(options) != 2 or {"type": "null"} not in options:
        return
    other = options[0] if options[1] == {"type": "null"} else options[1]
    if not isinstance(other.get("type"), str) or other["type"] == "null" or {"enum", "const", "$ref"} & set(other):
        return
    del node["anyOf"]
    for key, value in other.items():
        node.setdefault(key, value)
    node["type"] = [other["type"], "null"]


def _clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's cosmetic ``title`` keys and make every object schema closed and explicit."""

    def walk(node: Any, in_properties: bool = False) -> Any:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for key, value in node.items():
                if key == "title" and not in_properties and isinstance(value, str):
                    continue
                out[key] = walk(value, in_properties=key in ("properties", "$defs"))
            if in_properties:  # keys are parameter names here: keep their order
                return out
            _merge_nullable(out)
            out = {key: out[key] for key in sorted(out, key=lambda k: _KEY_ORDER.get(k, len(_KEY_ORDER)))}
            if out.get("type") == "object" and "additionalProperties" not in out and "properties" in out:
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    cleaned = walk(schema)
    cleaned.setdefault("type", "object")
    cleaned.setdefault("properties", {})
    cleaned.setdefault("required", [])
    cleaned["additionalProperties"] = False
    return cleaned
