"""Choosing a tool-call format from a model's chat template (the most reliable signal) or its ``config.json``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken_agent.chat.formats import BLOCK_FORMATS
from freetoken_agent.chat.harmony import HarmonyParser
from freetoken_agent.chat.parser import BlockParser, ToolCallParser

FORMATS: tuple[str, ...] = (*BLOCK_FORMATS, "harmony")

# Markers that only one family's template writes, checked in order (more specific first).
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "harmony"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("tool▁calls▁begin", "deepseek"),
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
)

_MODEL_TYPES: dict[str, str] = {
    "gpt_oss": "harmony",
    "minimax_m2": "minimax_m2",
    "minimax": "minimax_m2",
    "kimi_k2": "kimi_k2",
    "deepseek_v3": "deepseek",
    "deepseek_v2": "deepseek",
    "glm4_moe": "glm45",
    "mixtral": "mistral",
    "mistral": "mistral",
    "qwen3_moe": "hermes",
    "qwen3": "hermes",
    "qwen2_moe": "hermes",
    "qwen2": "hermes",
}


def detect_format(chat_template: str | None = None, config: dict[str, Any] | None = None) -> str:
    """The tool-call format name for a model; ``hermes`` when nothing identifies one."""
    if chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template:
                return name
    model_type = str((config or {}).get("model_type", ""))
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    if model_type.startswith("qwen3") and "coder" in str((config or {}).get("_name_or_path", "")).lower():
        return "qwen3_coder"
    return "hermes"


def make_parser(fmt: str, tools: Sequence[dict[str, Any]] | None = None) -> ToolCallParser:
    """A fresh streaming parser for format ``fmt`` (one of :data:`FORMATS`); ``tools`` guide value decoding."""
    if fmt == "harmony":
        return HarmonyParser(tools)
    try:
        return BlockParser(BLOCK_FORMATS[fmt], tools)
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}") from None
