"""Grammars for constrained tool calls: the text a model family writes for a call, with each tool's JSON Schema
embedded, so a forced call (``tool_choice`` required or named) always parses and its arguments always validate.

Only formats whose calls are plain tags around one JSON object are covered (Hermes/Qwen ``<tool_call>``); a
request forcing a call on a model writing another format is refused by the server, not left unconstrained.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

CONSTRAINED_FORMATS = ("hermes",)
"""Tool-call formats a forced call can be constrained in."""


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool`` as the Hermes format writes it: ``{"name": ..., "arguments": ...}``."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_lark(fmt: str, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool,
                   token_of: Callable[[str], int | None], style: dict[str, Any]) -> str:
    """Lark text for one (or, with ``parallel``, several) calls to ``tools`` (only ``name`` when given) in ``fmt``.

    ``token_of`` maps a tag to its single token id when the tokenizer has it as one added token (the model was
    trained to write that token, so the grammar asks for it rather than for its spelling); ``style`` is the JSON
    layout options of the grammar engine.
    """
    if fmt not in CONSTRAINED_FORMATS:
        raise ValueError(f"forced tool calls cannot be constrained in the {fmt!r} format (only "
                         f"{', '.join(CONSTRAINED_FORMATS)})")
    chosen = [t for t in tools if name is None or t.get("function", t).get("name") == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools")
    schemas = [call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    def tag(text: str) -> str:
        token = token_of(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    call = f'{tag("<tool_call>")} "\\n" body "\\n" {tag("</tool_call>")}'
    start = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {start}\ncall: {call}\n"
            f"body: %json {json.dumps({**schema, 'x-guidance': style})}\n")
