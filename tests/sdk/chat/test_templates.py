"""Round trips: a family's chat template renders an assistant tool call; that family's parser reads it back.

The templates are the tool-call parts of each family's published chat template, reduced to what matters here
(the real ones are not available offline). They also check that ``detect_format`` picks the right parser.
"""

from __future__ import annotations

import json

import pytest

from freetoken_agent.backends.local import template_messages
from freetoken_agent.chat import collect, detect_format, make_parser
from freetoken_agent.runtime.tokenizer.chat import ChatTemplate

HERMES = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}"""

QWEN3_CODER = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}"""

GLM45 = """{%- for m in messages %}<|{{ m.role }}|>
{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{% endfor %}"""

DEEPSEEK_V3 = """{%- for m in messages %}<｜Assistant｜>{{ m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls %}{% if not loop.first %}
{% endif %}<｜tool▁call▁begin｜>{{ tc.type }}<｜tool▁sep｜>{{ tc.function.name }}
```json
{{ tc.function.arguments | tojson }}
```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{% endif %}{% endfor %}"""

DEEPSEEK_V31 = """{%- for m in messages %}<｜Assistant｜>{{ m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.function.name }}<｜tool▁sep｜>
{{- tc.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- endif %}{% endfor %}"""

KIMI_K2 = """{%- for m in messages %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}
{%- if m.tool_calls %}<|tool_calls_section_begin|>
{%- for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>
{{- tc.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>
{%- endif %}<|im_end|>{% endfor %}"""

MINIMAX_M2 = """{%- for m in messages %}]~b]ai
{{ m.content or '' }}
{%- if m.tool_calls %}
<minimax:tool_call>
{% for tc in m.tool_calls %}<invoke name="{{ tc.function.name }}">
{% for k, v in tc.function.arguments.items() %}<parameter name="{{ k }}">{{ v | tojson if v is not string else v }}</parameter>
{% endfor %}</invoke>
{% endfor %}</minimax:tool_call>{% endif %}[e~[
{% endfor %}"""

MISTRAL = """{%- for m in messages %}{{ m.content or '' }}
{%- if m.tool_calls %}[TOOL_CALLS]
{%- for tc in m.tool_calls %}{% if not loop.first %}[TOOL_CALLS]{% endif %}{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}
{%- endif %}</s>{% endfor %}"""

HARMONY = """{%- for m in messages %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }}
{{- ' ' }}<|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}{% endfor %}"""

CASES = [("hermes", HERMES), ("qwen3_coder", QWEN3_CODER), ("glm45", GLM45), ("deepseek", DEEPSEEK_V3),
         ("deepseek", DEEPSEEK_V31), ("kimi_k2", KIMI_K2), ("minimax_m2", MINIMAX_M2), ("mistral", MISTRAL),
         ("harmony", HARMONY)]

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "overwrite": {"type": "boolean"}, "tags": {"type": "array"}, "meta": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "run_shell", "parameters": {"type": "object", "properties": {
             "command": {"type": "string"}, "timeout": {"type": "number"}}}}}]
CALLS = [
    ("write_file", {"path": "pkg/mod.py", "content": 'def f(x):\n    return {"a": x < 3}\n', "mode": 420,
                    "overwrite": True, "tags": ["a", "b"], "meta": {"k": [1, 2]}}),
    ("run_shell", {"command": "pytest -q && echo 'ok <done>'", "timeout": 2.5}),
]


def _render(template: str) -> str:
    """Rendered the way LocalEngine renders: the runtime's chat template (Hugging Face semantics)."""
    message = {"role": "assistant", "content": "Writing the module.", "tool_calls": [
        {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(CALLS)]}
    # LocalEngine hands templates tool-call arguments as objects, as the agent loop stores them as JSON text
    return ChatTemplate(template).render(template_messages([message]), TOOLS, add_generation_prompt=False)


@pytest.mark.parametrize(("fmt", "template"), CASES, ids=[f"{f}-{i}" for i, (f, _t) in enumerate(CASES)])
def test_round_trip(fmt: str, template: str) -> None:
    assert detect_format(template) == fmt
    rendered = _render(template)
    parser = make_parser(fmt, TOOLS)
    out = collect([*parser.feed(rendered), *parser.finish()])
    assert out.errors == []
    assert [(c.name, c.arguments) for c in out.calls] == CALLS
    assert "Writing the module." in out.text


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "qwen3_moe"}, "hermes"), ({"model_type": "gpt_oss"}, "harmony"),
    ({"model_type": "deepseek_v3"}, "deepseek"), ({"model_type": "glm4_moe"}, "glm45"),
    ({"model_type": "minimax_m2"}, "minimax_m2"), ({"model_type": "mixtral"}, "mistral"), ({}, "hermes"),
])
def test_detect_from_config(config: dict, expected: str) -> None:
    assert detect_format(None, config) == expected


def test_template_beats_config() -> None:
    assert detect_format(QWEN3_CODER, {"model_type": "qwen3_moe"}) == "qwen3_coder"
