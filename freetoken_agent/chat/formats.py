"""Block-shaped tool-call formats, one small class per model family.

Each class reads calls out of a block body (see :class:`~freetoken_agent.chat.parser.BlockFormat`); the
streaming, hold-back and event logic lives once in :class:`~freetoken_agent.chat.parser.BlockParser`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from freetoken_agent.chat.parser import CallDraft
from freetoken_agent.chat.values import convert_value, property_types

Tools = Sequence[dict[str, Any]] | None

_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_DECODER = json.JSONDecoder()


def _json_name(text: str) -> str | None:
    match = _JSON_NAME.search(text)
    if not match:
        return None
    try:
        return json.loads(f'"{match.group(1)}"')
    except ValueError:
        return match.group(1)


def _json_error(exc: json.JSONDecodeError, text: str) -> str:
    return f"the tool call arguments are not valid JSON ({exc.msg} at char {exc.pos}): {text[:200]!r}"


def _json_object(text: str, name: str | None, raw: str) -> CallDraft:
    """A finished draft from JSON arguments text (an empty text means no arguments)."""
    text = text.strip()
    if not text:
        return CallDraft(name, True, {}, None, raw)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return CallDraft(name, True, None, _json_error(exc, text), raw)
    if not isinstance(value, dict):
        return CallDraft(name, True, None, f"the tool call arguments must be a JSON object, got: {text[:200]!r}", raw)
    return CallDraft(name, True, value, None, raw)


def _call_from_object(obj: Any, raw: str) -> CallDraft:
    """``{"name": ..., "arguments": {...} | "<json>"}`` (Hermes, Mistral v0.3)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallDraft(None, True, None, f'a tool call must be a JSON object with a "name": {raw[:200]!r}', raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return _json_object(args, obj["name"], raw)
    if not isinstance(args, dict):
        return CallDraft(obj["name"], True, None, "the tool call arguments must be a JSON object", raw)
    return CallDraft(obj["name"], True, args, None, raw)


def _segments(body: str, begin: str, end: str) -> list[tuple[str, bool]]:
    """Pieces of ``body`` opened by ``begin``, each with whether its ``end`` marker was seen."""
    out: list[tuple[str, bool]] = []
    for piece in body.split(begin)[1:]:
        at = piece.find(end)
        out.append((piece[:at], True) if at >= 0 else (piece, False))
    return out


class Hermes:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    A body in Qwen3-Coder XML (``<function=...>``) is read too: the families share the markers and models mix them.
    """

    name = "hermes"
    start = "<tool_call>"
    end: str | None = "</tool_call>"
    single_call = True
    triggers = '">'

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        if body.lstrip().startswith("<function="):
            return Qwen3Coder().scan(body, complete, tools)
        if not complete:
            name = _json_name(body)
            return [CallDraft(name)] if name else []
        text = body.strip()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            return [CallDraft(_json_name(text), True, None, f"the tool call is not valid JSON ({exc.msg} at char "
                                                           f"{exc.pos}): {text[:200]!r}", body)]
        return [_call_from_object(obj, body)]


_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _strip_one_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


class Qwen3Coder:
    """Qwen3-Coder XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>``."""

    name = "qwen3_coder"
    start = "<tool_call>"
    end: str | None = "</tool_call>"
    single_call = True
    triggers = ">"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        if complete and not _FUNCTION.search(body) and body.lstrip().startswith("{"):
            return Hermes().scan(body, complete, tools)
        drafts: list[CallDraft] = []
        for match in _FUNCTION.finditer(body):
            name = match.group(1).strip()
            rest = body[match.end():]
            closed = rest.find("</function>")
            if closed < 0 and not complete:
                drafts.append(CallDraft(name))
                break
            inner = rest if closed < 0 else rest[:closed]
            types = property_types(tools, name)
            args = {key.strip(): convert_value(_strip_one_newline(value), types.get(key.strip()))
                    for key, value in _PARAMETER.findall(inner)}
            drafts.append(CallDraft(name, True, args, None, match.group(0) + inner))
        return drafts


_ARG_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45:
    """GLM-4.5/4.6: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``."""

    name = "glm45"
    start = "<tool_call>"
    end: str | None = "</tool_call>"
    single_call = True
    triggers = "\n<"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        head = re.split(r"<arg_key>|\n", body, maxsplit=1)
        if len(head) == 1 and not complete:
            return []
        name = head[0].strip()
        if not complete:
            return [CallDraft(name)] if name else []
        if not name:
            return [CallDraft(None, True, None, f"the tool call has no tool name: {body[:200]!r}", body)]
        types = property_types(tools, name)
        args = {key.strip(): convert_value(value, types.get(key.strip())) for key, value in _ARG_PAIR.findall(body)}
        return [CallDraft(name, True, args, None, body)]


class DeepSeek:
    """DeepSeek-V3 (``function<｜tool▁sep｜>NAME``, then fenced JSON) and V3.1 (``NAME<｜tool▁sep｜>{json}``)."""

    name = "deepseek"
    start = "<｜tool▁calls▁begin｜>"
    end: str | None = "<｜tool▁calls▁end｜>"
    single_call = False
    triggers = "｜\n"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        drafts: list[CallDraft] = []
        for piece, closed in _segments(body, self.call_begin, self.call_end):
            done = closed or complete
            head, has_sep, rest = piece.partition(self.sep)
            if not has_sep:
                drafts.append(CallDraft(None, done, None, f"the tool call has no separator: {piece[:200]!r}"
                                        if done else None, piece))
                break
            if head.strip() == "function":  # V3: type, then the name on its own line, then a ```json fence
                name_line, newline, args = rest.partition("\n")
                if not newline and not done:
                    drafts.append(CallDraft(None))
                    break
                name = name_line.strip()
                args = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", args)
            else:
                name, args = head.strip(), rest
            if not done:
                drafts.append(CallDraft(name))
                break
            drafts.append(_json_object(args, name, piece))
        return drafts


class KimiK2:
    """Kimi-K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``."""

    name = "kimi_k2"
    start = "<|tool_calls_section_begin|>"
    end: str | None = "<|tool_calls_section_end|>"
    single_call = False
    triggers = "|"
    call_begin, call_end, arg_begin = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        drafts: list[CallDraft] = []
        for piece, closed in _segments(body, self.call_begin, self.call_end):
            done = closed or complete
            call_id, has_args, args = piece.partition(self.arg_begin)
            if not has_args:
                drafts.append(CallDraft(None, done, None, f"the tool call has no arguments marker: {piece[:200]!r}"
                                        if done else None, piece))
                break
            match = re.fullmatch(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*", call_id)
            name = match.group(1) if match else call_id.strip()
            if not done:
                drafts.append(CallDraft(name))
                break
            drafts.append(_json_object(args, name, piece))
        return drafts


_INVOKE = re.compile(r'<invoke name="([^"]*)">')
_MM_PARAMETER = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


class MiniMaxM2:
    """MiniMax-M2: ``<minimax:tool_call><invoke name="F"><parameter name="K">V</parameter></invoke>...``."""

    name = "minimax_m2"
    start = "<minimax:tool_call>"
    end: str | None = "</minimax:tool_call>"
    single_call = False
    triggers = ">"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        drafts: list[CallDraft] = []
        for match in _INVOKE.finditer(body):
            name = match.group(1).strip()
            rest = body[match.end():]
            closed = rest.find("</invoke>")
            if closed < 0 and not complete:
                drafts.append(CallDraft(name))
                break
            inner = rest if closed < 0 else rest[:closed]
            types = property_types(tools, name)
            args = {key: convert_value(value, types.get(key)) for key, value in _MM_PARAMETER.findall(inner)}
            drafts.append(CallDraft(name, True, args, None, match.group(0) + inner))
        return drafts


class Mistral:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (v0.3) or ``[TOOL_CALLS]NAME[ARGS]{json}`` (v11+).

    The block has no closing marker: it runs to the end of the output.
    """

    name = "mistral"
    start = "[TOOL_CALLS]"
    end: str | None = None
    single_call = False
    triggers = "]}"

    def scan(self, body: str, complete: bool, tools: Tools) -> list[CallDraft]:
        if body.lstrip().startswith("["):
            return self._scan_list(body, complete)
        drafts: list[CallDraft] = []
        rest = body
        while True:  # NAME[ARGS]{json}, repeated (with or without a [TOOL_CALLS] before each)
            rest = rest.lstrip()
            if rest.startswith(self.start):
                rest = rest[len(self.start):].lstrip()
            if not rest and drafts:
                return drafts
            name, has_args, args = rest.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            if not has_args:
                if complete and not drafts:  # text after a finished call (an end-of-text token) is not a call
                    drafts.append(CallDraft(None, True, None, f"the tool call has no [ARGS]: {rest[:200]!r}", rest))
                return drafts
            try:
                value, end = _DECODER.raw_decode(args.lstrip())
            except json.JSONDecodeError as exc:
                drafts.append(CallDraft(name, True, None, _json_error(exc, args.strip()), rest) if complete
                              else CallDraft(name))
                return drafts
            drafts.append(_json_object(json.dumps(value), name, rest))
            rest = args.lstrip()[end:]

    @staticmethod
    def _scan_list(body: str, complete: bool) -> list[CallDraft]:
        """``[{...}, {...}]``, read item by item so each call is known as soon as its object closes."""
        text = body.strip()
        drafts: list[CallDraft] = []
        pos = 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                if complete and pos >= len(text) and not drafts:
                    drafts.append(CallDraft(None, True, None, f"the tool call list is empty or cut: {text[:200]!r}"))
                return drafts
            try:
                item, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                name = _json_name(text[pos:])
                if complete:
                    drafts.append(CallDraft(name, True, None, f"the tool call list is not valid JSON ({exc.msg} at "
                                                              f"char {exc.pos}): {text[:200]!r}", text[pos:]))
                elif name:
                    drafts.append(CallDraft(name))
                return drafts
            drafts.append(_call_from_object(item, text[pos:end]))
            pos = end


BLOCK_FORMATS = {fmt.name: fmt for fmt in (Hermes(), Qwen3Coder(), Glm45(), DeepSeek(), KimiK2(), MiniMaxM2(),
                                           Mistral())}
