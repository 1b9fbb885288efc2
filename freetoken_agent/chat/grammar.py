"""Grammars for constrained tool calls: the text a model family writes for a call, with each tool's JSON Schema
embedded, so a forced call (``tool_choice`` required or named, ``strict`` tools) always parses with that family's
own parser (:mod:`~freetoken_agent.chat.formats`, :mod:`~freetoken_agent.chat.harmony`) into a call to an allowed
tool whose arguments validate against the tool's schema.

Every format :func:`~freetoken_agent.chat.detect.detect_format` can return is covered (:data:`CONSTRAINED_FORMATS`):

* JSON-argument formats (hermes, deepseek V3 and V3.1, kimi_k2, mistral v0.3 and v11, harmony) embed the
  arguments' schema with llguidance's ``%json``.
* XML-ish formats (qwen3_coder ``<parameter=K>``, glm45 ``<arg_key>``/``<arg_value>``, minimax_m2
  ``<parameter name="K">``) write one element per parameter: names come from the schema's ``properties`` in their
  declared order (required ones always, optional ones may be left out, no others), and each value gets the grammar
  of its type *as the format's parser reads values* (:func:`~freetoken_agent.chat.values.convert_value`): a
  ``string`` is raw text (with ``minLength``/``maxLength``/``pattern``/``enum`` honored), ``boolean``/``null`` the
  words the parser takes, numbers, objects and arrays JSON per schema. A string in a union type (``["string",
  "null"]``, ``anyOf``) is raw text the parser cannot mistake for another type (not a number, keyword, quoted or
  bracketed text, no surrounding whitespace).

Text inside a call never contains a marker the parser would take for the end of the value, call or block (raw
values exclude them; JSON strings and keys carry a ``pattern`` that excludes them). Where a marker is one added
token in the tokenizer, the grammar asks for that token. A forced call starts at once: no text or reasoning before
it. What cannot be honored is refused with a ValueError naming the tool and field: a raw-text ``pattern`` with
anchors inside alternatives, an XML-format parameter whose name the format cannot write, object keywords an XML
format cannot express (``minProperties``, ``patternProperties``, ``if``...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from freetoken_agent.chat.values import convert_value

CONSTRAINED_FORMATS = ("hermes", "qwen3_coder", "glm45", "deepseek", "kimi_k2", "minimax_m2", "mistral", "harmony")
"""Tool-call formats a forced call can be constrained in (every format the parsers read)."""

END_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("</tool_call>",),
    "qwen3_coder": ("</parameter>", "</function>", "</tool_call>"),
    "glm45": ("</arg_value>", "</tool_call>"),
    "minimax_m2": ("</parameter>", "</invoke>", "</minimax:tool_call>"),
    "deepseek": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"),
    "mistral": (),  # its arguments are read with a JSON decoder: nothing inside a string can end them
    "harmony": ("<|start|>", "<|end|>", "<|call|>", "<|return|>"),
}
"""Per format, the texts that, written inside a value, would end it early in the parser (so values never do)."""

_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "format", "deprecated", "readOnly",
                          "writeOnly", "$comment", "contentMediaType", "contentEncoding", "$schema", "$id",
                          "$anchor", "nullable"})
_STRING_KEYS = frozenset({"minLength", "maxLength", "pattern"})
_OBJECT_REFUSED = ("minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
                   "patternProperties", "propertyNames", "if", "then", "else", "allOf", "anyOf", "oneOf", "not",
                   "unevaluatedProperties")
_ALL_TYPES = ("null", "boolean", "integer", "number", "string", "object", "array")


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool`` as the Hermes format writes it: ``{"name": ..., "arguments": ...}``."""
    fn = tool.get("function", tool)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": _object(fn)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _object(fn: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema, always an object (every parser needs the arguments to be one)."""
    params = fn.get("parameters")
    params = dict(params) if isinstance(params, dict) else {}
    if "type" not in params:
        params["type"] = "object"
    return params


# ------------------------------------------------------------------------------------------------ regexes
def _esc(char: str) -> str:
    return "\\" + char if char in "\\.+*?()|[]{}^$-" else char


def avoiding(words: Sequence[str]) -> str:
    """A regex (no anchors, no look-around, so both llguidance and JSON Schema ``pattern`` read it) matching
    exactly the strings that contain none of ``words``. Every word must start with the same character, which
    appears nowhere else in any word (true of every tool-call marker: ``<``)."""
    words = sorted({w for w in words if not any(v != w and v in w for v in words)})
    if not words:
        return "(?:[\\s\\S])*"
    first = words[0][0]
    if any(not w or w[0] != first or first in w[1:] for w in words):
        raise ValueError(f"markers {words!r} do not all start with one character found nowhere else in them")
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word[1:]:
            node = node.setdefault(char, {})
        node["$end"] = True

    def partial(node: dict[str, Any]) -> str:  # any proper prefix of a word's tail
        alts = [_esc(c) + partial(child) for c, child in node.items() if c != "$end" and "$end" not in child]
        return f"(?:{'|'.join(alts)})?" if alts else ""

    def broken(node: dict[str, Any]) -> str:  # a proper prefix, then a character that leaves every word
        chars = "".join(_esc(c) for c in [first, *node] if c != "$end")
        alts = [f"[^{chars}]"] + [_esc(c) + broken(child) for c, child in node.items()
                                   if c != "$end" and "$end" not in child]
        return f"(?:{'|'.join(alts)})"

    f = _esc(first)
    return f"(?:[^{f}]|(?:{f}+{partial(trie)})*{f}+{broken(trie)})*(?:{f}+{partial(trie)})*"


def _lark_re(regex: str) -> str:
    """``regex`` as a Lark regex literal."""
    return "/" + re.sub(r"(?<!\\)/", r"\\/", regex) + "/"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# --------------------------------------------------------------------------------------------- schemas
def guard_strings(schema: Any, avoid: str) -> Any:
    """``schema`` with every string it allows (values and object keys) also matching ``avoid`` (a regex), so no
    string in the JSON can hold a marker that would end the call early. ``pattern`` constrains strings only, so it
    is added to every subschema (except under ``not``, where it would invert)."""
    if schema is True or schema == {}:
        return {"pattern": f"^{avoid}$"}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {k: guard_strings(v, avoid) for k, v in out[key].items()}
    for key in ("additionalProperties", "items", "contains", "if", "then", "else", "unevaluatedProperties",
                "unevaluatedItems", "additionalItems"):
        if isinstance(out.get(key), dict) or out.get(key) is True:
            out[key] = guard_strings(out[key], avoid)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        if isinstance(out.get(key), list):
            out[key] = [guard_strings(v, avoid) for v in out[key]]
    if "pattern" in out:
        out["allOf"] = [*out.get("allOf", []), {"pattern": f"^{avoid}$"}]
    else:
        out["pattern"] = f"^{avoid}$"
    extra = out.get("additionalProperties", True)
    types = _types(out)
    if extra is not False and "patternProperties" not in out and (not types or "object" in types) \
            and (extra is True or extra == {"pattern": f"^{avoid}$"}):
        # free keys: only keys without a marker (an undeclared key must match the guard; values stay free)
        out["patternProperties"] = {f"^{avoid}$": {"pattern": f"^{avoid}$"}}
        out["additionalProperties"] = False
    return out


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _resolve(schema: Any, root: dict[str, Any], where: str) -> dict[str, Any]:
    """``schema`` with a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) and one-item ``allOf`` merged in."""
    for _ in range(32):
        if schema is True:
            return {}
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: the schema must be an object, got {schema!r:.80}")
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#/"):
                raise ValueError(f"{where}: only local references (#/$defs/...) can be constrained, got {ref!r}")
            target: Any = root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise ValueError(f"{where}: the reference {ref!r} points nowhere")
                target = target[part]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**_resolve(target, root, where), **rest}
            continue
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            schema = {**_resolve(schema["allOf"][0], root, where), **rest}
            continue
        return schema
    raise ValueError(f"{where}: the schema's references go too deep")


# ------------------------------------------------------------------------------------------- raw values
_SPACE = "\\s\\x1c-\\x1f\\x85"
_SAFE_RAW = (f"[^{_SPACE}\\-+.0-9(\\[{{\"'](?:[\\s\\S]*[^{_SPACE}])?", "(?i:true|false|null|none|nan|infinity)",
             "[bBrRuUfF]{1,2}['\"][\\s\\S]*")
"""Raw text that :func:`convert_value` keeps as text whatever the declared types: no surrounding whitespace, not
starting like a number, a quoted or bracketed literal, not a JSON/Python keyword (first regex; the others are
excluded)."""


def _pattern_regex(pattern: str, where: str) -> str:
    """A JSON Schema ``pattern`` (unanchored search) as a whole-text regex."""
    if not isinstance(pattern, str):
        raise ValueError(f"{where}: 'pattern' must be a string")
    anchored_start, anchored_end = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    inner = pattern[1 if anchored_start else 0: len(pattern) - (1 if anchored_end else 0)]
    if (anchored_start or anchored_end) and "|" in inner or re.search(r"(?<!\\)[\^$]", inner.replace("[^", "[")):
        raise ValueError(f"{where}: the pattern {pattern!r} cannot be constrained as raw text (anchors inside "
                         "alternatives)")
    return ("" if anchored_start else "[\\s\\S]*") + f"(?:{inner})" + ("" if anchored_end else "[\\s\\S]*")


@dataclass
class _Rules:
    """Lark rules being written (terminals and rules need unique names)."""

    lines: list[str]
    count: int = 0

    def add(self, body: str, terminal: bool = False) -> str:
        self.count += 1
        name = f"{'T' if terminal else 'r'}{self.count}"
        self.lines.append(f"{name}: {body}")
        return name


@dataclass
class _Xml:
    """How an XML-ish format writes one parameter value: text before, the closing tag (text or token) after."""

    fmt: str
    before: str  # text between the opening tag and the value
    after: str  # text between the value and the closing tag
    close: str  # the closing tag's text
    close_token: int | None
    avoid: tuple[str, ...]
    style: dict[str, Any]


def _value(spec: Any, root: dict[str, Any], x: _Xml, rules: _Rules, where: str, declared: Any = None,
           top: bool = True) -> str:
    """Lark expression for one parameter value, its closing tag included (see :class:`_Xml`). ``declared`` is the
    property's top-level ``type``: the parser converts the text by it (:func:`convert_value`), whatever branch of
    an ``anyOf`` the value comes from."""
    spec = _resolve(spec, root, where)
    if top:
        declared = spec.get("type")
    regime = _types({"type": declared})
    close = f"<[{x.close_token}]>" if x.close_token is not None else None
    tail = x.after + ("" if close else x.close)
    anything = "[\\s\\S]*"
    excluded = anything + "(?:" + "|".join(re.escape(w) for w in x.avoid) + ")" + anything
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}

    def raw(parts: list[str], negated: Sequence[str] = ()) -> str:  # a raw text lexeme (+ closing tag)
        conj = [_lark_re(anything), "~" + _lark_re(excluded), *(_lark_re(p) for p in parts),
                *("~" + _lark_re(n) for n in negated)]
        inner = rules.add(" & ".join(conj), terminal=True)
        seq = ([_lit(x.before)] if x.before else []) + [inner] + ([_lit(tail)] if tail else [])
        return rules.add(" ".join(seq), terminal=True) + (f" {close}" if close else "")

    def literal(text: str) -> str:
        return _lit(x.before + text + tail) + (f" {close}" if close else "")

    def writes(text: str, value: Any) -> bool:  # the parser reads `text` back as `value`, valid under spec
        if any(w in text for w in x.avoid):
            return False
        got = convert_value(text, declared)
        try:
            jsonschema.validate(got, {**spec, **defs})
        except (jsonschema.ValidationError, jsonschema.SchemaError):
            return False
        return json.dumps(got, sort_keys=True) == json.dumps(value, sort_keys=True) and type(got) is type(value)

    alts: list[str] = []
    if "enum" in spec or "const" in spec:
        values = [spec["const"]] if "const" in spec else list(spec["enum"] or [])
        for value in values:
            texts = [value] if isinstance(value, str) else [json.dumps(value, ensure_ascii=False)]
            if value is True or value is False or value is None:
                texts.append(str(value))
            alts += [literal(t) for t in dict.fromkeys(texts) if writes(t, value)]
        if not alts:
            raise ValueError(f"{where}: none of the allowed values can be written in the {x.fmt} format")
        return "(" + " | ".join(alts) + ")"
    if regime == {"string"}:
        _string_keys_only(spec, where)
        return raw(_string_parts(spec, where))
    branches = [k for k in ("anyOf", "oneOf") if isinstance(spec.get(k), list)]
    if branches:
        siblings = {k: v for k, v in spec.items() if k not in ("anyOf", "oneOf")}
        for key in branches:
            for branch in spec[key]:
                merged = {**siblings, **_resolve(branch, root, where)}
                try:
                    alts.append(_value(merged, root, x, rules, where, declared, top=False))
                except ValueError:
                    if len(spec[key]) == 1:
                        raise
        if not alts:
            raise ValueError(f"{where}: no branch of this schema can be written in the {x.fmt} format")
        return "(" + " | ".join(alts) + ")"
    for key in ("allOf", "not", "if"):
        if key in spec:
            raise ValueError(f"{where}: {key!r} cannot be constrained in the {x.fmt} format (values are raw text)")
    own = _types(spec) or set(_ALL_TYPES)
    if "boolean" in own and (not regime or "boolean" in regime):
        words = ("true", "false", "True", "False") if "boolean" in regime else ("true", "false")
        alts.append("(" + " | ".join(literal(w) for w in words) + ")")
    if "null" in own and (not regime or "null" in regime):
        alts.append("(" + " | ".join(literal(w) for w in (("null", "None") if "null" in regime else ("null",)))
                    + ")")
    numeric = not regime or "string" not in regime or bool({"integer", "number"} & regime)
    json_types = sorted(t for t in own & {"integer", "number", "object", "array"}
                        if not regime or t in regime or (t == "integer" and "number" in regime))
    json_types = [t for t in json_types if t in ("object", "array") or numeric]
    if json_types:
        guard = avoiding(x.avoid)
        schema = guard_strings({**spec, "type": json_types}, guard)
        schema.update({k: guard_strings(v, guard) for k, v in defs.items()})
        seq = ([_lit(x.before)] if x.before else []) + [
            f"%json {json.dumps({**schema, 'x-guidance': x.style}, ensure_ascii=False)}"]
        seq += ([_lit(tail)] if tail else []) + ([close] if close else [])
        alts.append(" ".join(seq))
    if "string" in own and (not regime or "string" in regime):
        alts.append(raw([_SAFE_RAW[0], *_string_parts(spec, where)], _SAFE_RAW[1:]))
    if not alts:
        raise ValueError(f"{where}: no value of this schema can be written in the {x.fmt} format")
    return "(" + " | ".join(alts) + ")"


def _string_keys_only(spec: dict[str, Any], where: str) -> None:
    for key in spec:
        if key not in _ANNOTATIONS and key not in _STRING_KEYS and key != "type" and not key.startswith("x-"):
            raise ValueError(f"{where}: {key!r} on a string cannot be constrained in a format that writes strings "
                             "as raw text")


def _string_parts(spec: dict[str, Any], where: str) -> list[str]:
    """Regexes a raw string must match (all of them) for ``minLength``/``maxLength``/``pattern``."""
    parts = []
    low, high = spec.get("minLength", 0), spec.get("maxLength")
    if low or high is not None:
        parts.append(f"[\\s\\S]{{{int(low)},{'' if high is None else int(high)}}}")
    if "pattern" in spec:
        parts.append(_pattern_regex(spec["pattern"], where))
    return parts


# ------------------------------------------------------------------------------------------------- formats
@dataclass
class _Tool:
    name: str
    params: dict[str, Any]
    tool: dict[str, Any]


def tool_call_lark(fmt: str, tools: Sequence[dict[str, Any]], name: str | None, parallel: bool,
                   token_of: Callable[[str], int | None], style: dict[str, Any]) -> str:
    """Lark text for one (or, with ``parallel``, several) calls to ``tools`` (only ``name`` when given) in ``fmt``.

    ``token_of`` maps a tag to its single token id when the tokenizer has it as one added token (the model was
    trained to write that token, so the grammar asks for it rather than for its spelling); ``style`` is the JSON
    layout options of the grammar engine. Raises ValueError for what cannot be constrained (naming the field).
    """
    if fmt not in CONSTRAINED_FORMATS:
        raise ValueError(f"forced tool calls cannot be constrained in the {fmt!r} format (only "
                         f"{', '.join(CONSTRAINED_FORMATS)})")
    chosen = [t for t in tools if name is None or t.get("function", t).get("name") == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools")
    calls = [_Tool(t.get("function", t)["name"], _object(t.get("function", t)), t) for t in chosen]
    calls = [c for c in calls if _name_ok(fmt, c.name)]
    if not calls:
        raise ValueError(f"the {fmt} format cannot write a call to "
                         f"{', '.join(repr(t.get('function', t).get('name')) for t in chosen)} (the name holds "
                         "characters the format uses as delimiters)")

    def tag(text: str) -> str:
        token = token_of(text)
        return f"<[{token}]>" if token is not None else _lit(text)

    rules = _Rules([])
    avoid = avoiding(END_MARKERS[fmt]) if END_MARKERS[fmt] else None

    def args_json(tool: _Tool) -> str:
        schema = guard_strings(tool.params, avoid) if avoid else tool.params
        return f"%json {json.dumps({**schema, 'x-guidance': style}, ensure_ascii=False)}"

    def alt(parts: Sequence[str]) -> str:
        return rules.add(" | ".join(f"({p})" for p in parts))

    if fmt in ("qwen3_coder", "glm45", "minimax_m2"):
        start = _xml_format(fmt, calls, parallel, tag, token_of, rules, style)
    elif fmt == "hermes":
        schemas = [guard_strings(call_schema(c.tool), avoid) for c in calls]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        body = f"%json {json.dumps({**schema, 'x-guidance': style}, ensure_ascii=False)}"
        call = rules.add(f'{tag("<tool_call>")} "\\n" {body} "\\n" {tag("</tool_call>")}')
        start = f'{call} ("\\n"? {call})*' if parallel else call
    elif fmt == "deepseek":
        begin, end, sep = tag("<｜tool▁call▁begin｜>"), tag("<｜tool▁call▁end｜>"), tag("<｜tool▁sep｜>")
        one = []
        for c in calls:
            one.append(f'{begin} "function" {sep} {_lit(c.name + chr(10) + "```json" + chr(10))} {args_json(c)} '
                       f'"\\n```" {end}')  # V3
            if c.name != "function":
                one.append(f"{begin} {_lit(c.name)} {sep} {args_json(c)} {end}")  # V3.1
        call = alt(one)
        calls_rule = f'{call} ("\\n"? {call})*' if parallel else call
        start = f'{tag("<｜tool▁calls▁begin｜>")} {calls_rule} {tag("<｜tool▁calls▁end｜>")}'
    elif fmt == "kimi_k2":
        call = alt([f'{tag("<|tool_call_begin|>")} {_lit("functions." + c.name + ":")} /[0-9]{{1,6}}/ '
                    f'{tag("<|tool_call_argument_begin|>")} {args_json(c)} {tag("<|tool_call_end|>")}'
                    for c in calls])
        start = (f'{tag("<|tool_calls_section_begin|>")} {call}{" " + call + "*" if parallel else ""} '
                 f'{tag("<|tool_calls_section_end|>")}')
    elif fmt == "mistral":
        if token_of("[ARGS]") is not None:  # v11+: NAME[ARGS]{json}, one [TOOL_CALLS] before each call
            call_id = token_of("[CALL_ID]")
            idpart = f" ({tag('[CALL_ID]')} /[A-Za-z0-9]{{9}}/)?" if call_id is not None else ""
            call = alt([f"{_lit(c.name)}{idpart} {tag('[ARGS]')} {args_json(c)}" for c in calls])
            one = f"{tag('[TOOL_CALLS]')} {call}"
            start = f"{one} ({one})*" if parallel else one
        else:  # v0.3: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
            schemas = [call_schema(c.tool) for c in calls]
            item = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
            array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            body = json.dumps({**array, "x-guidance": style}, ensure_ascii=False)
            start = f"{tag('[TOOL_CALLS]')} \" \"? %json {body}"
    else:  # harmony: generation starts inside the header, after <|start|>assistant
        call = alt([f'{tag("<|channel|>")} {_lit("commentary to=functions." + c.name + " ")} {tag("<|constrain|>")} '
                    f'"json" {tag("<|message|>")} {args_json(c)} {tag("<|call|>")}' for c in calls])
        start = f'{call} ({tag("<|start|>")} "assistant" {call})*' if parallel else call
    return "\n".join([f"start: {start}", *rules.lines]) + "\n"


def _name_ok(fmt: str, name: str) -> bool:
    """Whether ``fmt``'s parser reads ``name`` back from where the format writes it."""
    if not isinstance(name, str) or not name or name != name.strip() or "\n" in name:
        return False
    if any(m in name for m in END_MARKERS[fmt]):
        return False
    bad = {"qwen3_coder": ">", "glm45": "<", "minimax_m2": '"', "deepseek": "｜", "kimi_k2": "<",
           "mistral": "[", "harmony": "< \t"}.get(fmt, "")
    if any(c in name for c in bad):
        return False
    if fmt == "kimi_k2" and re.search(r":\d+$", name):
        return False
    return True


def _xml_format(fmt: str, calls: list[_Tool], parallel: bool, tag: Callable[[str], str],
                token_of: Callable[[str], int | None], rules: _Rules, style: dict[str, Any]) -> str:
    """The start rule for qwen3_coder, glm45 or minimax_m2 (parameters in the schema's order)."""
    avoid = END_MARKERS[fmt]
    if fmt == "qwen3_coder":
        x = _Xml(fmt, "\n", "\n", "</parameter>", None, avoid, style)
    elif fmt == "glm45":
        x = _Xml(fmt, "", "", "</arg_value>", token_of("</arg_value>"), avoid, style)
    else:
        x = _Xml(fmt, "", "", "</parameter>", None, avoid, style)
    invokes = []
    for c in calls:
        params = c.params
        where = f"tool {c.name!r}"
        refused = [k for k in _OBJECT_REFUSED if k in params]
        if refused:
            raise ValueError(f"{where}: {refused[0]!r} on the parameters cannot be constrained in the {fmt} format "
                             "(it writes one element per parameter)")
        props = params.get("properties") or {}
        required = list(params.get("required") or [])
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"{where}: the required parameter {missing[0]!r} has no schema in 'properties'")
        parts = []
        for key, spec in props.items():
            ok = key == key.strip() and key and not any(m in key for m in avoid) and not (
                fmt == "qwen3_coder" and (">" in key or "\n" in key)) and not (
                fmt == "glm45" and "</arg_key>" in key) and not (fmt == "minimax_m2" and '"' in key)
            if not ok:
                if key in required:
                    raise ValueError(f"{where}: the parameter name {key!r} cannot be written in the {fmt} format")
                continue
            value = _value(spec, params, x, rules, f"{where}, parameter {key!r}")
            if fmt == "qwen3_coder":
                item = _lit("<parameter=" + key + ">") + f" {value} " + '"\\n"'
            elif fmt == "glm45":
                item = (f"{tag('<arg_key>')} {_lit(key)} {tag('</arg_key>')} \"\\n\" {tag('<arg_value>')} "
                        f"{value} \"\\n\"")
            else:
                item = _lit('<parameter name="' + key + '">') + f" {value} " + '"\\n"'
            rule = rules.add(item)
            parts.append(rule if key in required else f"{rule}?")
        body = " ".join(parts)
        if fmt == "qwen3_coder":
            invokes.append(f'{tag("<tool_call>")} {_lit(f"{chr(10)}<function={c.name}>{chr(10)}")} {body} '
                           f'"</function>\\n" {tag("</tool_call>")}')
        elif fmt == "glm45":
            invokes.append(f'{tag("<tool_call>")} {_lit(c.name + chr(10))} {body} {tag("</tool_call>")}')
        else:
            invokes.append(_lit('<invoke name="' + c.name + '">\n') + f' {body} "</invoke>\\n"')
    one = rules.add(" | ".join(f"({i})" for i in invokes))
    if fmt == "minimax_m2":
        many = f"{one}+" if parallel else one
        return f'{tag("<minimax:tool_call>")} "\\n" {many} {tag("</minimax:tool_call>")}'
    sep = '"\\n"?' if fmt == "qwen3_coder" else ""
    return f"{one} ({sep} {one})*" if parallel else one
