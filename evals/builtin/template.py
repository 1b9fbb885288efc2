"""The Hermes/Qwen-style chat template and special tokens of the built-in model.

The template follows Hugging Face chat-template semantics (``messages``, ``tools``, ``add_generation_prompt``;
the ``tojson`` filter) and the Qwen2.5 layout: ``<|im_start|>role\\n...<|im_end|>\\n`` turns, tools listed in the
system turn inside ``<tools></tools>``, assistant tool calls as ``<tool_call>{json}</tool_call>`` after the text,
and consecutive tool results grouped in one ``user`` turn as ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import functools
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

# Special tokens (never split, skipped by decode(skip_special_tokens=True)).
SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that are part of the visible text (kept by decode, like Qwen's).
MARKUP_TOKENS: list[str] = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# The one shell tool the training sessions use (mini-swe-agent runs one bash command per step).
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run one bash command in the repository and return its exit status and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command line to run."}},
            "required": ["command"],
        },
    },
}

CHAT_TEMPLATE = (
    # No "{%-" whitespace control: under HF's trim_blocks a newline right after a tag would vanish, so every
    # newline that follows a tag is written as {{ '\n' }}.
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>{{ '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for tool_call in message.get('tool_calls') or [] %}"
    "{% set call = tool_call['function'] if tool_call.get('function') else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise ValueError(message)


@functools.cache
def _compiled():  # -> jinja2.Template; compiled once (rendering thousands of training conversations)
    import json

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env.from_string(CHAT_TEMPLATE)


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False) -> str:
    """Render ``messages`` with :data:`CHAT_TEMPLATE` the way ``transformers``' ``apply_chat_template`` does."""
    return _compiled().render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
